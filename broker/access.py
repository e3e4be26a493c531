"""Who may call what on the broker: every RPC checked against the caller's role (part of the gRPC shell; the core
knows nothing of callers).

A caller proves who it is in one of two ways, and the broker starts only with at least one of them on (or with the
development switch ``dev_no_auth``, which it logs at start):

- a **token** (``auth_secret_file``): ``authorization: Bearer kvl1...`` metadata, signed with the cluster secret,
  naming a role and a subject (:mod:`kvloop.shared.auth`); works behind a mesh that terminates TLS, or on
  plaintext loopback;
- a **client certificate** (mutual TLS, ``tls_ca``): gRPC has already refused every caller without a certificate
  signed by ``tls_ca``; the caller's names are its subject CN and every SAN (:func:`kvloop.shared.tls.peer_names`).
  ``engine_identity`` (``{engine_id}`` replaced) names an engine, ``client_identities`` the routers ('' = any
  certificate), ``admin_identities`` the operators.

With both on, a token is used when the call carries one. What each role may call:

- **engine RPCs** act for one engine (a token's subject may name a pool instead, ``kvloop-prefill-*``: any engine id
  with that prefix, see :func:`subject_covers`): ``RegisterEngine`` (``engine.engine_id``), ``KeepAlive``,
  ``DeregisterEngine``, ``PublishLease``, ``WatchEvictions``, ``ReportCacheEvents``, ``CompleteDemotion``,
  ``CompletePromotion`` (``engine_id``), and
  ``RenewLease`` / ``ReleaseLease`` (for the engine that owns ``lease_id``): only an engine acting for that very
  engine id (and on ``allowed_engines`` when that is set);
- **router RPCs**: ``Place``, ``PlaceStream``, ``PinBlocks``, ``CompleteTransfer`` (kvloop's router, not the
  sidecar, reports a transfer's end), ``HintSession`` and ``GetSession`` (for the router's callers: the request's
  ``owner`` is the caller's tenant, which the core holds each session to): routers;
- ``Inspect``: operators (the whole view) and routers (engines only: no lease, block key, block id or pin);
- operators may call everything, for any engine (``kvloop broker status``, repairs).

A refusal is ``UNAUTHENTICATED`` (no credential, or one that does not verify) or ``PERMISSION_DENIED`` (a caller
that may not make this call), with a message naming what was missing; it is counted
(``kvloop_broker_auth_refusals_total``) and the handler never runs, so no state changes. An RPC missing from
these tables is refused (fail closed); a unit test checks the tables cover the service.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvloop.broker.config import BrokerConfig
from kvloop.shared.auth import Unauthenticated, bearer, read_secrets, verify
from kvloop.shared.errors import PermissionDenied
from kvloop.shared.tls import peer_names

ENGINE_RPCS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "RegisterEngine": ("engine.engine_id", lambda r: r.engine.engine_id),
    "KeepAlive": ("engine_id", lambda r: r.engine_id),
    "DeregisterEngine": ("engine_id", lambda r: r.engine_id),
    "PublishLease": ("engine_id", lambda r: r.engine_id),
    "WatchEvictions": ("engine_id", lambda r: r.engine_id),
    "ReportCacheEvents": ("engine_id", lambda r: r.engine_id),
    "CompleteDemotion": ("engine_id", lambda r: r.engine_id),
    "CompletePromotion": ("engine_id", lambda r: r.engine_id),
}
LEASE_RPCS: dict[str, Callable[[Any], str]] = {
    "RenewLease": lambda r: r.lease_id,
    "ReleaseLease": lambda r: r.lease_id,
}
ROUTER_RPCS = frozenset({"Place", "PlaceStream", "PinBlocks", "CompleteTransfer", "HintSession", "GetSession"})
INSPECT_RPCS = frozenset({"Inspect"})


@dataclass(frozen=True)
class Caller:
    """Who made a call. ``roles``: what it may act as (an engine's role is checked per call, against the engine
    id it names); ``subject``: the token's subject, or the certificate's names; ``how``: token, certificate or
    open (development, nothing checked)."""

    how: str
    roles: frozenset[str]
    subject: str
    names: frozenset[str] = frozenset()

    @property
    def full_view(self) -> bool:
        """Whether ``Inspect`` shows this caller leases, block ids and pins."""
        return self.how == "open" or "operator" in self.roles


OPEN = Caller("open", frozenset({"engine", "router", "operator"}), "")
CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("kvloop_broker_caller", default=OPEN)
"""The caller of the RPC being handled (set by the service's authorization, read by ``Inspect``)."""


def subject_covers(subject: str, engine_id: str) -> bool:
    """An engine token's subject is one engine id, or a pool's prefix ending in ``*`` (``kvloop-prefill-*``: the pods
    of one Kubernetes Deployment, whose names are not known when the token is minted)."""
    return subject == engine_id or (subject.endswith("*") and engine_id.startswith(subject[:-1]))


def _names(text: str) -> frozenset[str]:
    return frozenset(n.strip() for n in text.split(",") if n.strip())


class Access:
    """The broker's authentication and authorization of every call."""

    def __init__(self, config: BrokerConfig, clock: Callable[[], float] = time.time) -> None:
        self.secrets = read_secrets(config.auth_secret_file) if config.auth_secret_file is not None else []
        self.mutual_tls = config.mutual_tls
        self.enabled = bool(self.secrets) or self.mutual_tls
        """False only with ``dev_no_auth`` (config validation refuses a broker with no check and no switch)."""
        self.engine_identity = config.engine_identity
        self.allowed_engines = _names(config.allowed_engines)
        self.clients = _names(config.client_identities)
        self.admins = _names(config.admin_identities)
        self.clock = clock

    def identify(self, context: Any) -> Caller:
        """The caller of this call, from its token or its certificate; ``Unauthenticated`` when it has neither."""
        if not self.enabled:
            return OPEN
        token = bearer(context.invocation_metadata()) if self.secrets else None
        if token is not None:
            claims = verify(self.secrets, token, self.clock())
            return Caller("token", frozenset({claims.role}), claims.subject)
        if self.mutual_tls:
            names = peer_names(context)
            roles = {"engine"}
            if names & self.admins:
                roles.add("operator")
            if not self.clients or names & self.clients:
                roles.add("router")
            return Caller("certificate", frozenset(roles), ",".join(sorted(names)), names)
        raise Unauthenticated("authorization: no credential: this broker wants 'authorization: Bearer <token>' "
                              "metadata (a token minted with the cluster secret: kvloop auth token)")

    def check(self, method: str, request: Any, context: Any, lease_owner: Callable[[str], str | None]) -> Caller:
        """The caller, if it may make this call; raise ``Unauthenticated`` or ``PermissionDenied`` otherwise.
        ``lease_owner(lease_id)`` is the engine that holds a lease (None when unknown: the core answers)."""
        caller = self.identify(context)
        if not self.enabled or "operator" in caller.roles:
            return caller
        if method in ENGINE_RPCS:
            field, engine_of = ENGINE_RPCS[method]
            self._engine(caller, method, field, engine_of(request))
        elif method in LEASE_RPCS:
            lease_id = LEASE_RPCS[method](request)
            owner = lease_owner(lease_id)
            if owner is not None:
                self._engine(caller, method, "lease_id", owner, lease_id=lease_id)
        elif method in ROUTER_RPCS or method in INSPECT_RPCS:
            if "router" not in caller.roles:
                raise PermissionDenied(f"caller: {method} is for routers{' and operators' * (method == 'Inspect')}; "
                                       f"this caller is {self._who(caller)}")
        else:
            raise PermissionDenied(f"caller: {method} is not open to any caller")
        return caller

    def _who(self, caller: Caller) -> str:
        if caller.how == "token":
            return f"a token for {next(iter(caller.roles))} {caller.subject!r}"
        names = sorted(caller.names)
        routers = f" (client_identities: {sorted(self.clients)})" if self.clients else ""
        return f"a certificate naming {names}{routers}"

    def _engine(self, caller: Caller, method: str, field: str, engine_id: str, lease_id: str = "") -> None:
        what = f"lease {lease_id!r} of engine {engine_id!r}" if lease_id else f"engine {engine_id!r}"
        if self.allowed_engines and engine_id not in self.allowed_engines:
            raise PermissionDenied(f"{field}: {method} for {what} refused: {engine_id!r} is not in allowed_engines")
        if caller.how == "token":
            if "engine" not in caller.roles or not subject_covers(caller.subject, engine_id):
                raise PermissionDenied(f"{field}: {method} for {what} refused: the caller holds {self._who(caller)}, "
                                       f"not an engine token for {engine_id!r}")
            return
        wanted = self.engine_identity.replace("{engine_id}", engine_id)
        if wanted not in caller.names:
            raise PermissionDenied(f"{field}: {method} for {what} refused: the caller's certificate names "
                                   f"{sorted(caller.names)}, not {wanted!r}")
