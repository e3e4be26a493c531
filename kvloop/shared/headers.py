"""The HTTP header names kvloop says a turn in: the router's ``x-kvloop-*`` reply headers (what the turn did,
beside the OpenAI body) and the session hint a client sends. Spelled here only: the router writes them
(``router/server.py``); the demo, the benchmarks' clients and the tests read them by these names.

A DECODE_LOCAL stream's measured figures arrive again at its end, in an SSE comment (:func:`kvloop.shared.http.
sse_measured`) keyed by each header's :func:`field`: its name without :data:`PREFIX`. Names are lower case; HTTP
compares them case-insensitively (aiohttp's reply headers do too, a plain ``dict`` of them does not).
"""

from __future__ import annotations

from collections.abc import Mapping

PREFIX = "x-kvloop-"
"""The start of every reply header the router adds."""

SESSION_ID = "x-session-id"
"""Request: the client's session id, a hint to the broker (else the body's ``session_id`` or ``user``)."""
SESSION_PAUSE = "x-session-pause-s"
"""Request: seconds until the session's next turn (a tool call), kvloop.router.sessions."""
SESSION_END = "x-session-end"
"""Request: ``true``: the session ends with this turn."""
SESSION_PRIORITY = "x-session-priority"
"""Request: ``low``, ``normal`` or ``high``: the order the session's KV is evicted in."""
SESSION_KEEP_GENERATED = "x-session-keep-generated"
"""Request: ``false``: the next turn will not repeat this turn's answer."""

DECISION = "x-kvloop-decision"
"""The path the turn took by the engines' own accounts (a :class:`~kvloop.shared.vocabulary.Path`)."""
PLANNED = "x-kvloop-planned"
"""The path the plan chose (the broker's, or RECOMPUTE without a usable plan)."""
REASON = "x-kvloop-reason"
"""Why the plan took its path (a :class:`~kvloop.shared.vocabulary.Reason`) or the fallback's cause without one."""
DECODE_LOCAL_VETO = "x-kvloop-decode-local-veto"
"""Why DECODE_LOCAL was not taken though the decode engine held the prefix (a ``Veto``; empty when taken)."""
PLAN_OUTCOME = "x-kvloop-plan-outcome"
"""The actual path and reuse against the plan (a :class:`~kvloop.shared.vocabulary.PlanOutcome`)."""
MEASURED = "x-kvloop-measured"
"""``true`` when the figures are the engine's own account; ``false``: the plan's (a DECODE_LOCAL stream's come
at its end)."""
PREFILL_ENGINE = "x-kvloop-prefill-engine"
"""The engine that computed the prompt (the decode engine on DECODE_LOCAL)."""
DECODE_ENGINE = "x-kvloop-decode-engine"
"""The engine that streamed the answer."""
TIMING = "x-kvloop-timing"
"""Where the time to the first token went, ``step=ms`` pairs joined by commas."""
PROMPT_TOKENS = "x-kvloop-prompt-tokens"
"""The prompt's length in tokens."""
AVAILABLE_TOKENS = "x-kvloop-available-tokens"
"""The longest prefix any engine held: the reuse this turn could have had."""
MATCHED_TOKENS = "x-kvloop-matched-tokens"
"""The prefix the plan matched."""
PULLED_TOKENS = "x-kvloop-pulled-tokens"
"""Tokens the prefill engine pulled from another engine."""
LOCAL_TOKENS = "x-kvloop-local-tokens"
"""Tokens the serving engine found in its own cache."""
COMPUTED_TOKENS = "x-kvloop-computed-tokens"
"""Tokens the serving engine computed."""
PULL_MS = "x-kvloop-pull-ms"
"""Milliseconds the pull took (0 until measured)."""
ENGINE_REQUEST = "x-kvloop-engine-request"
"""How the engines were asked: ``tokens`` (the router's token ids, one rendering) or ``chat``/``completion`` (the
client's request as it came)."""


def field(header: str) -> str:
    """A reply header's name without :data:`PREFIX` (any case): its key in the measured comment and in the
    benchmarks' turn details."""
    return header.lower().removeprefix(PREFIX)


def header(key: str) -> str:
    """The reply header of a measured comment's key (``pulled-tokens`` -> :data:`PULLED_TOKENS`)."""
    return PREFIX + key


def of_reply(headers: Mapping[str, str]) -> dict[str, str]:
    """The kvloop reply headers among ``headers``, by :func:`field` (``{"decision": "TRANSFER", ...}``)."""
    return {field(k): v for k, v in headers.items() if k.lower().startswith(PREFIX)}
