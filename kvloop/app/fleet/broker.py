"""The broker's real core (``BrokerState``) fed by modelled engines, as the broker's shell and the engines' sidecars
feed it: registrations, loads on keep-alive (with memory pressure), the prefix caches' events into the soft index,
the router's counts of its requests in flight, leases published when a decode engine finishes a turn, pins around
a pull, and eviction commands carried out on the engines. Time is an argument, as in the core.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvloop.app.analyze.retention import replay_state
from kvloop.app.fleet.sessions import FINGERPRINT
from kvloop.broker.core import (
    Addresses,
    EngineInfo,
    EngineLoad,
    PlaceInput,
    PlacementPolicy,
    Plan,
)
from kvloop.shared.engine_model import EngineSim
from kvloop.shared.errors import KvloopError, ResourceExhausted
from kvloop.shared.vocabulary import Role

ROUTER = "fleet-sim-router"
PIN_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    ttl_s: float = 600.0
    """Each lease's time to live."""
    retention_blocks: int = 0
    """Each decode engine's retention budget, in blocks (0: half its KV pool)."""
    eviction_policy: str = "lru"
    policy: PlacementPolicy = field(default_factory=PlacementPolicy)


def prefill_rate(engine: EngineSim) -> float:
    """Prompt tokens per second of a full step of one chunk from position 0: the rate an engine's sidecar reports."""
    p = engine.profile
    n = p.max_num_batched_tokens
    return n / p.step_seconds(n, n * n / 2, 0, 0)


class BrokerSide:
    def __init__(self, engines: Mapping[str, tuple[EngineSim, Role]], settings: BrokerSettings, now: float) -> None:
        self.state = replay_state(settings.eviction_policy, settings.policy)
        self.engines = engines
        self.settings = settings
        self.block_ids: dict[str, dict[bytes, int]] = {e: {} for e in engines}
        self._seq: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()
        self.refused = 0
        for engine_id, (engine, role) in engines.items():
            p = engine.profile
            budget = 0 if role is Role.PREFILL else settings.retention_blocks or p.kv_pool_blocks // 2
            self.state.register(EngineInfo(engine_id, role, p.block_size, FINGERPRINT, budget, Addresses(), "sim",
                                           step_tokens=p.max_num_batched_tokens), now)
        self.sync(now)

    def sync(self, now: float) -> None:
        """Every engine's keep-alive and cache events, then the evictions they caused carried out."""
        self.state.tick(now)
        for engine_id, (engine, _) in self.engines.items():
            p = engine.profile
            short = engine.blocks_short()
            self.state.keepalive(engine_id, EngineLoad(
                running_requests=len(engine.running), waiting_requests=engine.waiting_requests,
                kv_usage=1 - engine.free_blocks / p.kv_pool_blocks, memory_pressure=short > 0,
                pressure_free_blocks=short, prefill_tokens_per_s=prefill_rate(engine),
                transfer_bytes_per_s=p.pull_bytes_per_s, bytes_per_block=p.bytes_per_block), now)
            stored, removed = engine.take_cache_events()
            if stored or removed or not self._seq[engine_id]:
                self._seq[engine_id] += 1
                self.state.report_cache_events(engine_id, "sim", self._seq[engine_id],
                                               reset=self._seq[engine_id] == 1, cleared=False, stored=stored,
                                               removed=removed)
        self.apply_evictions()

    def apply_evictions(self) -> None:
        for command in self.state.take_changes().commands:
            self.evictions[command.reason.value] += 1
            self.engines[command.engine_id][0].release(command.lease_id)

    def place(self, request: PlaceInput, in_flight: Mapping[str, int], now: float) -> Plan:
        """The router's Place: its counts of requests in flight and the prompt tokens not computed yet, then the plan,
        counted on its engines until the router's own counts hold it."""
        self.sync(now)
        tokens = {e: engine.queued_prefill_tokens for e, (engine, _) in self.engines.items()}
        self.state.report_in_flight(ROUTER, in_flight, now, tokens)
        plan = self.state.place(request, now)
        self.state.count_placement(plan, now)
        return plan

    def publish(self, engine_id: str, session: str, keys: tuple[bytes, ...], now: float) -> int:
        """A decode engine retains a finished turn: what its cache holds of ``keys`` becomes a lease. Blocks held."""
        engine = self.engines[engine_id][0]
        held = keys[: engine.cached_prefix_tokens(keys) // engine.profile.block_size]
        if not held:
            return 0
        ids_of = self.block_ids[engine_id]
        blocks = [ids_of.setdefault(k, len(ids_of)) for k in held]
        try:
            lease, _ = self.state.publish(engine_id, session, held, blocks, len(held) * engine.profile.block_size,
                                          self.settings.ttl_s, now)
        except ResourceExhausted:
            self.refused += 1
            return 0
        engine.retain(lease.lease_id, held)
        self.apply_evictions()
        return len(held)

    def pin(self, reader: str, plan: Plan, now: float) -> str:
        """Pin a TRANSFER's source lease for the pull; "" when refused (the lease went meanwhile)."""
        try:
            return self.state.pin(reader, plan.source_lease_id, plan.matched_blocks, PIN_TIMEOUT_S, now).pin_id
        except KvloopError:
            return ""

    def complete(self, pin_id: str, nbytes: int, duration_s: float, now: float) -> None:
        try:
            self.state.complete(pin_id, True, nbytes, duration_s, now)
        except KvloopError:  # the pin expired meanwhile: nothing to end
            return
        self.apply_evictions()

    def retained_blocks(self) -> int:
        return sum(self.state.retained_blocks(e) for e in self.engines)
