"""Agents' session hints on the router's OpenAI endpoints: what a client may say of its session, where it may say it,
and the checks that hold it. Pure: the server reads a request with :func:`session_call`, the runner sends the hints
to the broker after the turn (``HintSession``), and ``/v1/sessions/{id}`` reads and ends a session by REST.

A client names its session, and may hint, in any of three places; the first that says a thing wins:

=====================  ==============================  =========================================================
what                   header                          body (``metadata`` holds strings, as OpenAI's does)
=====================  ==============================  =========================================================
session id             ``x-session-id``                ``metadata.session_id``, then ``session_id``, then ``user``
pause (s to next turn) ``x-session-pause-s``           ``metadata.session_pause_s``
end                    ``x-session-end: true``         ``metadata.session_end``
priority               ``x-session-priority``          ``metadata.session_priority`` (``low``/``normal``/``high``)
keep generated         ``x-session-keep-generated``    ``metadata.session_keep_generated``
=====================  ==============================  =========================================================

OpenAI's SDKs send all of them without a custom client (``extra_headers``, or ``metadata=`` which the chat API
takes). The router removes the ``session_*`` keys from ``metadata`` before the engines see the request (vLLM
ignores ``metadata``; an empty one is dropped). Hints on a turn act when the turn ends: a pause counts from the
answer's last token, an end frees the session's KV, and the turn's own lease (published just after) with it.

A session belongs to the caller's tenant: the API key it came with (or the tenant the key file names for it). The
router scopes every session id by its tenant before the broker sees it, so one tenant's ``agent-1`` is not
another's: another tenant can neither hint, read, end nor share the placement of a session it does not own. Without
API keys (development) every caller is one tenant, ``""``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvloop.router.errors import TurnError
from kvloop.shared import headers as hdr

MAX_SESSION_ID = 200
"""A client's session id, at most (the broker's ids are 256 with the tenant's scope)."""
MAX_PAUSE_S = 86400.0
"""A pause the router passes on; the broker grants at most its own bound (``max_session_pause_s``) of it."""
PRIORITIES = ("low", "normal", "high")
METADATA_KEYS = {"session_id": "session_id", "pause_s": "session_pause_s", "end": "session_end",
                 "priority": "session_priority", "keep_generated": "session_keep_generated"}
HEADERS = {"pause_s": hdr.SESSION_PAUSE, "end": hdr.SESSION_END, "priority": hdr.SESSION_PRIORITY,
           "keep_generated": hdr.SESSION_KEEP_GENERATED}


class SessionError(ValueError):
    """A session field the router cannot take: ``field`` names it as the client sent it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field

    def turn_error(self) -> TurnError:
        """The client's answer: a 400 naming the field."""
        return TurnError(400, str(self), "invalid_request_error", self.field)


@dataclass(frozen=True, slots=True)
class SessionHints:
    """What a client said of its session; None: nothing."""

    pause_s: float | None = None
    end: bool = False
    priority: str | None = None
    keep_generated: bool | None = None

    @property
    def said(self) -> dict[str, Any]:
        """The hints given, by name (the turn's record and trace)."""
        return {name: value for name, value in (("pause_s", self.pause_s), ("end", self.end or None),
                                                ("priority", self.priority), ("keep_generated", self.keep_generated))
                if value is not None}


@dataclass(frozen=True, slots=True)
class SessionCall:
    session_id: str
    """As the client named it ("" when it named none)."""
    scoped_id: str
    """As the broker holds it: scoped by the tenant."""
    owner: str
    hints: SessionHints | None


def scoped(tenant: str, session_id: str) -> str:
    return f"{tenant}/{session_id}" if tenant and session_id else session_id


def check_session_id(value: Any, field: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_SESSION_ID or not value.isprintable():
        raise SessionError(f"{field}: a session id is printable text of at most {MAX_SESSION_ID} characters", field)
    return value


def parse_pause(value: Any, field: str) -> float:
    try:
        pause = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        pause = math.nan
    if not (math.isfinite(pause) and 0 <= pause <= MAX_PAUSE_S):
        raise SessionError(f"{field}: a pause is seconds within 0..{MAX_PAUSE_S:g}, got {str(value)[:40]!r}", field)
    return pause


def parse_bool(value: Any, field: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise SessionError(f"{field}: expected true or false, got {str(value)[:40]!r}", field)


def parse_priority(value: Any, field: str) -> str:
    text = str(value).strip().lower()
    if text not in PRIORITIES:
        raise SessionError(f"{field}: expected one of {', '.join(PRIORITIES)}, got {str(value)[:40]!r}", field)
    return text


PARSERS = {"pause_s": parse_pause, "end": parse_bool, "priority": parse_priority, "keep_generated": parse_bool}


def hints_from(values: Mapping[str, tuple[Any, str]]) -> SessionHints | None:
    """Hints from ``name -> (value, field it came in)``; None when none was given."""
    if not values:
        return None

    def given(name: str) -> Any:
        return PARSERS[name](*values[name]) if name in values else None

    hints = SessionHints(pause_s=given("pause_s"), end=bool(given("end")), priority=given("priority"),
                         keep_generated=given("keep_generated"))
    if hints.end and (hints.pause_s is not None or hints.priority is not None):
        raise SessionError("end: a session that ends takes no pause or priority",
                           values["end"][1])
    return hints


def session_call(headers: Mapping[str, str], body: dict[str, Any], tenant: str) -> SessionCall:
    """The request's session and hints (headers first, then ``metadata``, then the body's own fields); removes the
    session keys from ``body['metadata']``. Raises :class:`SessionError` naming the field."""
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise SessionError("metadata: expected an object of strings", "metadata")
    metadata = metadata or {}
    values: dict[str, tuple[Any, str]] = {}
    for name, key in METADATA_KEYS.items():
        header = HEADERS.get(name) if name != "session_id" else hdr.SESSION_ID
        if header and headers.get(header) is not None:
            values[name] = (headers[header], header)
        elif key in metadata:
            values[name] = (metadata[key], f"metadata.{key}")
    for key in METADATA_KEYS.values():
        metadata.pop(key, None)
    if "metadata" in body and not metadata:
        del body["metadata"]
    sid_value, sid_field = values.pop("session_id", (None, ""))
    if sid_value is None:
        for key in ("session_id", "user"):
            if body.get(key):
                sid_value, sid_field = body[key], key
                break
    session_id = check_session_id(sid_value, sid_field) if sid_value is not None else ""
    hints = hints_from(values)
    if hints is not None and not session_id:
        raise SessionError(f"{next(iter(values.values()))[1]}: a session hint needs a session id "
                           f"({hdr.SESSION_ID}, metadata.session_id, session_id or user)", hdr.SESSION_ID)
    return SessionCall(session_id=session_id, scoped_id=scoped(tenant, session_id), owner=tenant, hints=hints)


def rest_hints(body: Any) -> SessionHints:
    """``POST /v1/sessions/{id}``'s body: ``{"pause_s": 40, "priority": "high", ...}`` (``end`` is ``DELETE``)."""
    if not isinstance(body, dict):
        raise SessionError("body: expected a JSON object of hints", "body")
    unknown = sorted(set(body) - set(PARSERS))
    if unknown:
        raise SessionError(f"{unknown[0]}: not a session hint (known: {', '.join(PARSERS)})", unknown[0])
    hints = hints_from({name: (value, name) for name, value in body.items()})
    if hints is None:
        raise SessionError(f"body: name at least one hint ({', '.join(PARSERS)})", "body")
    return hints
