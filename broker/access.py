"""Who may call what on a broker with mutual TLS (part of the gRPC shell; the core knows nothing of callers).

With ``tls_cert``, ``tls_key`` and ``tls_ca`` set, gRPC has already refused every caller without a
certificate signed by ``tls_ca`` before a handler runs. What is left is authorization, by the names the
caller's certificate carries (its subject CN and every SAN, :func:`kvloop.shared.tls.peer_names`):

- **Engine RPCs** act for one engine: ``RegisterEngine`` (``engine.engine_id``), ``KeepAlive``,
  ``DeregisterEngine``, ``PublishLease``, ``WatchEvictions``, ``ReportCacheEvents`` (``engine_id``), and
  ``RenewLease`` / ``ReleaseLease`` (for the engine that owns ``lease_id``). The caller must carry the name
  ``engine_identity`` with ``{engine_id}`` replaced (by default the engine id itself, as CN or SAN), and,
  when ``allowed_engines`` is set, the engine id must be on that list (engines not registered with the
  operator are refused even with a valid certificate). So a sidecar can register, publish and release only
  for its own engine, and nobody else can release its leases or read its eviction stream.
- **Client RPCs** (the router and operators): ``Place``, ``PlaceStream``, ``PinBlocks``,
  ``CompleteTransfer``, ``Inspect``. Allowed to any certificate signed by ``tls_ca`` unless
  ``client_identities`` lists the names allowed.
- ``admin_identities`` may call everything, for any engine (``kvloop broker status``, benchmarks, repairs).

Refusals are ``PERMISSION_DENIED`` with a message naming the field and both identities. An RPC missing
from these tables is refused (fail closed); a unit test checks the tables cover the service.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvloop.broker.config import BrokerConfig
from kvloop.shared.errors import PermissionDenied
from kvloop.shared.tls import peer_names

ENGINE_RPCS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "RegisterEngine": ("engine.engine_id", lambda r: r.engine.engine_id),
    "KeepAlive": ("engine_id", lambda r: r.engine_id),
    "DeregisterEngine": ("engine_id", lambda r: r.engine_id),
    "PublishLease": ("engine_id", lambda r: r.engine_id),
    "WatchEvictions": ("engine_id", lambda r: r.engine_id),
    "ReportCacheEvents": ("engine_id", lambda r: r.engine_id),
}
LEASE_RPCS: dict[str, Callable[[Any], str]] = {
    "RenewLease": lambda r: r.lease_id,
    "ReleaseLease": lambda r: r.lease_id,
}
CLIENT_RPCS = frozenset({"Place", "PlaceStream", "PinBlocks", "CompleteTransfer", "Inspect"})


def _names(text: str) -> frozenset[str]:
    return frozenset(n.strip() for n in text.split(",") if n.strip())


class Access:
    """The broker's authorization check; a no-op unless mutual TLS is on."""

    def __init__(self, config: BrokerConfig) -> None:
        self.enabled = config.mutual_tls
        self.engine_identity = config.engine_identity
        self.allowed_engines = _names(config.allowed_engines)
        self.clients = _names(config.client_identities)
        self.admins = _names(config.admin_identities)

    def check(self, method: str, request: Any, context: Any, lease_owner: Callable[[str], str | None]) -> None:
        """Raise ``PermissionDenied`` unless the caller of ``method`` may make this call.
        ``lease_owner(lease_id)`` is the engine that holds a lease (None when unknown: the core answers)."""
        if not self.enabled:
            return
        names = peer_names(context)
        if names & self.admins:
            return
        if method in ENGINE_RPCS:
            field, engine_of = ENGINE_RPCS[method]
            self._engine(method, names, field, engine_of(request))
        elif method in LEASE_RPCS:
            lease_id = LEASE_RPCS[method](request)
            owner = lease_owner(lease_id)
            if owner is not None:
                self._engine(method, names, "lease_id", owner, lease_id=lease_id)
        elif method in CLIENT_RPCS:
            if self.clients and not names & self.clients:
                raise PermissionDenied(f"caller: {method} is not allowed for certificate names {sorted(names)} "
                                       f"(client_identities: {sorted(self.clients)})")
        else:
            raise PermissionDenied(f"caller: {method} is not open to any certificate")

    def _engine(self, method: str, names: frozenset[str], field: str, engine_id: str, lease_id: str = "") -> None:
        what = f"lease {lease_id!r} of engine {engine_id!r}" if lease_id else f"engine {engine_id!r}"
        if self.allowed_engines and engine_id not in self.allowed_engines:
            raise PermissionDenied(f"{field}: {method} for {what} refused: {engine_id!r} is not in allowed_engines")
        wanted = self.engine_identity.replace("{engine_id}", engine_id)
        if wanted not in names:
            raise PermissionDenied(f"{field}: {method} for {what} refused: the caller's certificate names "
                                   f"{sorted(names)}, not {wanted!r}")
