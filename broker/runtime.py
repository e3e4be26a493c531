"""The broker's runtime: the core state while this replica leads, write-through to the store, expiry
ticks, and wake-ups for eviction streams. gRPC-free, so the service and the benchmark share it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

import structlog

from broker.config import BrokerConfig
from broker.core import BrokerState, EvictionCommand, make_policy
from broker.metrics import BrokerMetrics
from broker.store import Election, Store
from kvloop.errors import Unavailable

log = structlog.get_logger("kvloop.broker")
T = TypeVar("T")


class BrokerRuntime:
    def __init__(self, config: BrokerConfig, store: Store, election: Election, metrics: BrokerMetrics,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.store = store
        self.election = election
        self.metrics = metrics
        self.clock = clock
        self.state: BrokerState | None = None
        self._lock = asyncio.Lock()
        self._wakeups: dict[str, set[asyncio.Event]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.leader_changed = asyncio.Event()

    # ------------------------------------------------------------------ leadership
    def new_state(self) -> BrokerState:
        return BrokerState(
            make_policy(self.config.eviction_policy, self.config.recency_half_life_s),
            self.config.placement(),
            self.config.limits(),
        )

    async def _on_elected(self) -> None:
        snapshot = await self.store.load()
        state = self.new_state()
        now = self.clock()
        # Engines get a full keep-alive period to find the new leader before they count as gone.
        for rec in snapshot.engines:
            rec.last_seen = max(rec.last_seen, now)
        state.load(snapshot.engines, snapshot.leases, snapshot.pins)
        async with self._lock:
            self.state = state
        log.info("broker.leader", engines=len(snapshot.engines), leases=len(snapshot.leases),
                 pins=len(snapshot.pins), store=self.store.kind)
        self.metrics.set_state(state, leader=True)
        self._wake_all()
        self.leader_changed.set()

    async def _on_deposed(self) -> None:
        async with self._lock:
            self.state = None
        self.metrics.set_state(None, leader=False)
        self._wake_all()
        self.leader_changed.set()

    @property
    def is_leader(self) -> bool:
        return self.state is not None

    def require_state(self) -> BrokerState:
        if self.state is None:
            leader = self.election.leader()
            raise Unavailable(f"this broker replica is not the leader; leader: {leader or 'unknown'}")
        return self.state

    # ------------------------------------------------------------------ operations
    def read(self, fn: Callable[[BrokerState, float], T]) -> T:
        """A read-only operation on the state (placement, inspection, stream replay)."""
        return fn(self.require_state(), self.clock())

    async def mutate(self, fn: Callable[[BrokerState, float], T]) -> T:
        """Run ``fn`` on the state and persist what it changed before returning. Mutations are
        serialised so the store sees them in order; if the store refuses, this replica steps down
        to reload rather than serve state the store does not have."""
        async with self._lock:
            state = self.require_state()
            now = self.clock()
            try:
                result = fn(state, now)
            finally:
                changes = state.take_changes()
            if changes:
                try:
                    await self.store.apply(changes, state.hold_until, now)
                except Unavailable:
                    log.error("broker.store_write_failed", store=self.store.kind)
                    self.state = None
                    self.metrics.set_state(None, leader=False)
                    self._schedule_reload()
                    raise
                self._publish(changes.commands)
            return result

    def _publish(self, commands: list[EvictionCommand]) -> None:
        for cmd in commands:
            self.metrics.evictions.labels(reason=cmd.reason.value).inc()
            for event in self._wakeups.get(cmd.engine_id, ()):
                event.set()

    def subscribe(self, engine_id: str) -> asyncio.Event:
        """An event set whenever a command for ``engine_id`` is issued or leadership changes."""
        event = asyncio.Event()
        self._wakeups.setdefault(engine_id, set()).add(event)
        return event

    def unsubscribe(self, engine_id: str, event: asyncio.Event) -> None:
        events = self._wakeups.get(engine_id)
        if events is not None:
            events.discard(event)
            if not events:
                del self._wakeups[engine_id]

    def _wake_all(self) -> None:
        for events in self._wakeups.values():
            for event in events:
                event.set()

    def _schedule_reload(self) -> None:
        async def reload() -> None:
            # The store rejected a write: reload from it if we still lead, else wait for the election.
            with contextlib.suppress(Exception):
                await self._on_elected()

        self._tasks.append(asyncio.create_task(reload()))

    # ------------------------------------------------------------------ background
    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_interval_s)
            if self.state is None:
                continue
            try:
                await self.mutate(lambda state, now: state.tick(now))
            except Unavailable:
                continue
            except Exception:  # keep ticking: one bad tick must not stop expiry forever
                log.exception("broker.tick_failed")

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self.election.run(self._on_elected, self._on_deposed)))
        self._tasks.append(asyncio.create_task(self._tick_loop()))

    async def stop(self) -> None:
        await self.election.resign()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.state = None
        self._wake_all()
        await self.store.close()
