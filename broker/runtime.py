"""The broker's runtime: the core state while this replica leads, write-through to the store, expiry
ticks, and wake-ups for eviction streams. gRPC-free, so the service and the benchmark share it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

import structlog

from kvloop.broker.config import BrokerConfig
from kvloop.broker.core import BrokerState, Changes, EvictionCommand, make_policy
from kvloop.broker.metrics import BrokerMetrics
from kvloop.broker.store import Election, Store
from kvloop.shared.errors import Unavailable

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
        self._batch: tuple[Changes, asyncio.Future[None]] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._wakeups: dict[str, set[asyncio.Event]] = {}
        self._durable_seq: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.leader_changed = asyncio.Event()
        self.draining = False

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
        self._durable_seq = {rec.info.engine_id: rec.eviction_seq for rec in snapshot.engines}
        self.state = state
        log.info("broker.leader", engines=len(snapshot.engines), leases=len(snapshot.leases),
                 pins=len(snapshot.pins), store=self.store.kind)
        self.metrics.set_state(state, leader=True)
        self._wake_all()
        self.leader_changed.set()

    async def _on_deposed(self) -> None:
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

    def volatile(self, fn: Callable[[BrokerState, float], T]) -> T:
        """An operation that changes only what the state keeps in memory and never persists (the soft index of
        the engines' prefix caches): it writes nothing to the store, so it costs no etcd round trip, and after a
        fail-over or restart that part of the state starts empty."""
        return fn(self.require_state(), self.clock())

    async def mutate(self, fn: Callable[[BrokerState, float], T]) -> T:
        """Run ``fn`` on the state and return once what it changed is durable in the store.

        ``fn`` is synchronous, so mutations are atomic on the event loop and the store sees them in
        order. If the store refuses a write, this replica steps down and reloads rather than serve
        state the store does not have."""
        state = self.require_state()
        now = self.clock()
        try:
            result = fn(state, now)
        finally:
            changes = state.take_changes()
        if changes:
            if self.store.durable:
                await self._persist(changes)
            else:
                self._publish(changes.commands)
        return result

    async def _persist(self, changes: Changes) -> None:
        """Group commit: changes made while a write is in flight go out together in the next one, so
        concurrent RPCs share etcd round trips; each caller returns when its own changes are written."""
        if self._batch is None:
            self._batch = (Changes(), asyncio.get_running_loop().create_future())
        batch, written = self._batch
        batch.merge(changes)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        await asyncio.shield(written)

    async def _flush(self) -> None:
        while self._batch is not None:
            (batch, written), self._batch = self._batch, None
            try:
                state = self.require_state()
                await self.store.apply(batch, state.hold_until, self.clock())
            except Unavailable as exc:
                written.set_exception(exc)
                if self.state is not None:
                    log.error("broker.store_write_failed", store=self.store.kind, error=exc.message)
                    self.state = None
                    self.metrics.set_state(None, leader=False)
                    self._wake_all()
                    self._schedule_reload()
            else:
                self._publish(batch.commands)
                written.set_result(None)

    def durable_seq(self, engine_id: str) -> int | None:
        """The engine's last eviction command whose change the store holds; None for a store that keeps nothing
        (there every command is as durable as it gets). The eviction stream sends nothing past it."""
        return self._durable_seq.get(engine_id, 0) if self.store.durable else None

    def _publish(self, commands: list[EvictionCommand]) -> None:
        for cmd in commands:
            self._durable_seq[cmd.engine_id] = max(self._durable_seq.get(cmd.engine_id, 0), cmd.seq)
            self.metrics.evictions.labels(reason=cmd.reason.value).inc()
            if cmd.demote_to:
                self.metrics.demotions.labels(outcome="commanded").inc()
            if cmd.promote_pin:
                self.metrics.prefetches.labels(outcome="commanded").inc()
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

    def drain(self) -> None:
        """Shutting down: end the eviction streams (their engines reconnect to another replica) so
        that they do not hold the graceful drain open for the whole grace period."""
        self.draining = True
        self._wake_all()

    def _wake_all(self) -> None:
        for events in self._wakeups.values():
            for event in events:
                event.set()

    def _schedule_reload(self) -> None:
        async def reload() -> None:
            # The store refused a write. If the election still names us, etcd was briefly unreachable:
            # reload the state from it and serve again. If not, the fencing did its job: stay down and
            # let the election (which will notice the lost key) decide.
            delay = 0.2
            while not self.draining:
                try:
                    if not await self.election.still_leader():
                        return
                    await self._on_elected()
                    return
                except Exception as exc:
                    log.warning("broker.reload_failed", error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

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
