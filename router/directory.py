"""The engines a router can use, per served model: from the broker's ``Inspect`` (refreshed), else the configured
URLs. Pure bookkeeping: no I/O here.

Every request names a model. An engine that registered with one (``Engine.model``, its ``--served-model-name``)
serves only that model; one that did not say serves any. A request is placed with the KV layout of the engines that
serve its model, so two models behind one router each route by their own block keys, and an engine of another
model (or a bogus registration) never lends its layout to a request it cannot serve.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvloop.router.config import RouterConfig
from kvloop.shared.vocabulary import Role
from kvloop.v1 import broker_pb2 as pb

ROLES = {pb.ENGINE_ROLE_PREFILL: Role.PREFILL, pb.ENGINE_ROLE_DECODE: Role.DECODE, pb.ENGINE_ROLE_BOTH: Role.BOTH}
"""The wire's roles (``EngineRole``); an engine of a role this router does not know counts as ``both``."""


@dataclass(frozen=True)
class EngineInfo:
    engine_id: str
    role: Role
    http: str
    nixl: str = ""
    block_size: int = 0
    fingerprint: str = ""
    model: str = ""
    """The model the engine serves; "" when it did not say (a configured URL, an older sidecar): any."""

    def serves(self, model: str) -> bool:
        return not model or not self.model or self.model == model


class Directory:
    def __init__(self, config: RouterConfig) -> None:
        self.engines: dict[str, EngineInfo] = {}
        self.static = {
            Role.PREFILL: [EngineInfo(f"prefill@{u}", Role.PREFILL, u) for u in config.urls("prefill_urls")],
            Role.DECODE: [EngineInfo(f"decode@{u}", Role.DECODE, u) for u in config.urls("decode_urls")],
        }
        self.unlisted: dict[str, tuple[EngineInfo, float]] = {}
        """Engines the broker listed before and lists no more, with when they went (:meth:`last_resort`)."""
        self.unlisted_grace_s = config.unlisted_grace_s
        self._rr: dict[Role, itertools.count[int]] = {}
        """One round-robin counter per role: with one shared, a turn that picks a prefill then a decode engine
        lands on the same decode engine of two every time
        (``test_directory_prefers_the_broker_list_and_round_robins``)."""

    def update(self, reply: pb.InspectResponse, now: float) -> None:
        listed = {e.engine.engine_id: EngineInfo(e.engine.engine_id, ROLES.get(e.engine.role, Role.BOTH),
                                                 e.engine.addresses.http.rstrip("/"), e.engine.addresses.nixl,
                                                 e.engine.block_size, e.engine.layout_fingerprint, e.engine.model)
                  for e in reply.engines}
        for engine_id, info in self.engines.items():
            if engine_id not in listed:
                self.unlisted[engine_id] = (info, now)
        self.unlisted = {k: (info, since) for k, (info, since) in self.unlisted.items()
                         if k not in listed and now - since < self.unlisted_grace_s}
        self.engines = listed

    def last_resort(self, role: Role, model: str = "") -> list[EngineInfo]:
        """Engines of ``role`` serving ``model`` that the broker stopped listing less than ``unlisted_grace_s``
        ago (as of the last refresh), the latest to go first; each is worth one try when the listed engines of a
        role have all failed a turn, or none is listed.

        Why: the broker lists an engine while its sidecar keeps it alive, so a sidecar restart hides an engine that
        still serves, and a stream may have nowhere else to resume (a sidecar restart on one decode engine and a
        kill of the other). A dead engine refuses the connection at once, so the try is cheap; an engine whose
        sidecar restarts drops after one that died with its engine, hence the order
        (``test_an_engine_the_broker_stops_listing_stays_a_last_resort_for_a_while``)."""
        recent = sorted(self.unlisted.values(), key=lambda item: -item[1])
        return [info for info, _ in recent if info.role in (role, Role.BOTH) and info.http and info.serves(model)]

    def of_role(self, role: Role, model: str = "") -> list[EngineInfo]:
        """Engines of ``role`` that serve ``model``; the configured URLs only while the broker lists none of the
        role at all (not when it lists some, all of another model)."""
        live = [e for e in self.engines.values() if e.role in (role, Role.BOTH) and e.http]
        if not live:
            return self.static[role]
        return [e for e in live if e.serves(model)]

    def pick(self, role: Role, model: str = "", exclude: frozenset[str] | set[str] = frozenset()) -> EngineInfo | None:
        """A listed engine, round-robin; with none left, the first :meth:`last_resort`."""
        candidates = [e for e in self.of_role(role, model) if e.engine_id not in exclude]
        if not candidates:
            return next((e for e in self.last_resort(role, model) if e.engine_id not in exclude), None)
        counter = self._rr.setdefault(role, itertools.count())
        return candidates[next(counter) % len(candidates)]

    def models(self) -> set[str]:
        """The model names engines registered with."""
        return {e.model for e in self.engines.values() if e.model}

    def knows(self, model: str) -> bool:
        """False only when every listed engine says what it serves and none serves ``model``."""
        return not self.engines or any(e.serves(model) for e in self.engines.values())

    def layout(self, model: str = "") -> tuple[str, int] | None:
        """The KV layout (fingerprint, block size) of the engines serving ``model``; None when none registered one.
        Engines that named ``model`` are preferred to those that named nothing."""
        serving = sorted((e for e in self.engines.values() if e.serves(model) and e.fingerprint and e.block_size),
                         key=lambda e: (e.model != model, e.engine_id))
        return (serving[0].fingerprint, serving[0].block_size) if serving else None
