"""BrokerRuntime's write path, with fakes for the store and the election (named as such)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from kvloop.broker.config import BrokerConfig
from kvloop.broker.core import Addresses, Changes, EngineInfo, EngineLoad, EvictionCommand, Lease, Role
from kvloop.broker.metrics import BrokerMetrics
from kvloop.broker.runtime import BrokerRuntime
from kvloop.broker.store import Snapshot
from kvloop.shared.errors import Unavailable


class FakeStore:
    """Durable in name: records each batch; fails the next ``fail`` writes with Unavailable."""

    kind = "fake"
    durable = True

    def __init__(self) -> None:
        self.batches: list[Changes] = []
        self.fail = 0
        self.loads = 0

    async def load(self) -> Snapshot:
        self.loads += 1
        return Snapshot()

    async def apply(self, changes: Changes, hold_until: Callable[[Lease], float], now: float) -> None:
        await asyncio.sleep(0)  # a real write yields to the loop: let concurrent mutations pile up
        if self.fail:
            self.fail -= 1
            raise Unavailable("fake store: write refused")
        self.batches.append(changes)

    async def close(self) -> None:
        return None


class FakeElection:
    def __init__(self) -> None:
        self.leading = True
        self._stop = asyncio.Event()

    async def run(self, on_elected: Callable[[], Awaitable[None]], on_deposed: Callable[[], Awaitable[None]]) -> None:
        await on_elected()
        await self._stop.wait()

    async def resign(self) -> None:
        self._stop.set()

    def leader(self) -> str:
        return "fake:1"

    async def still_leader(self) -> bool:
        return self.leading


def engine(eid: str) -> EngineInfo:
    return EngineInfo(eid, Role.DECODE, 128, "fp", 100, Addresses(), "i")


async def started() -> tuple[BrokerRuntime, FakeStore, FakeElection]:
    store, election = FakeStore(), FakeElection()
    runtime = BrokerRuntime(BrokerConfig.load({}, env={}), store, election, BrokerMetrics())
    await runtime.start()
    for _ in range(100):
        if runtime.is_leader:
            break
        await asyncio.sleep(0.01)
    assert runtime.is_leader
    return runtime, store, election


async def test_concurrent_mutations_share_writes() -> None:
    runtime, store, _ = await started()
    try:
        await asyncio.gather(*(runtime.mutate(lambda s, now, i=i: s.register(engine(f"e{i}"), now))
                               for i in range(20)))
        written = {eid for batch in store.batches for eid in batch.engines}
        assert written == {f"e{i}" for i in range(20)}
        assert len(store.batches) < 20  # group commit: fewer writes than mutations
    finally:
        await runtime.stop()


async def test_refused_write_steps_down_then_reloads_while_still_leader() -> None:
    runtime, store, _ = await started()
    try:
        store.fail = 1
        with pytest.raises(Unavailable):
            await runtime.mutate(lambda s, now: s.register(engine("e1"), now))
        for _ in range(300):
            if runtime.is_leader and store.loads >= 2:
                break
            await asyncio.sleep(0.01)
        assert runtime.is_leader and store.loads == 2
    finally:
        await runtime.stop()


async def test_refused_write_stays_down_when_no_longer_leader() -> None:
    runtime, store, election = await started()
    try:
        election.leading = False
        store.fail = 1
        with pytest.raises(Unavailable):
            await runtime.mutate(lambda s, now: s.register(engine("e1"), now))
        with pytest.raises(Unavailable, match="not the leader"):
            runtime.read(lambda s, now: s.engines)
        reload_task = runtime._tasks[-1]
        await asyncio.wait_for(reload_task, 5)  # it asks the election, hears "not leader", and ends
        assert not runtime.is_leader and store.loads == 1
    finally:
        await runtime.stop()


async def test_cache_events_are_volatile_and_never_written() -> None:
    runtime, store, _ = await started()
    try:
        await runtime.mutate(lambda s, now: s.register(engine("e1"), now))
        writes = len(store.batches)
        key = bytes(32)
        ack = runtime.volatile(lambda s, now: s.report_cache_events("e1", "i", 1, reset=False, cleared=False,
                                                                    stored=[key], removed=[]))
        assert ack.cached_blocks == 1 and len(store.batches) == writes
        await runtime.mutate(lambda s, now: s.tick(now))  # a later write carries nothing of it either
        assert all(not batch.engines and not batch.leases for batch in store.batches[writes:])
        assert runtime.read(lambda s, now: s.soft.cached_blocks("e1")) == 1
    finally:
        await runtime.stop()



async def test_an_eviction_reaches_the_stream_only_once_its_write_is_durable() -> None:
    """An engine frees blocks on a command; a new leader loads the store. A command whose write the store never got
    would leave the new leader offering freed blocks, so the stream's read withholds it until the write lands."""
    runtime, store, _ = await started()
    try:
        await runtime.mutate(lambda s, now: s.register(engine("e1"), now))
        keys = [bytes([i]) * 32 for i in range(2)]
        lease, _ = await runtime.mutate(lambda s, now: s.publish("e1", "s", keys, [0, 1], 2 * 128, 0, now))

        def stream_read() -> list[EvictionCommand]:
            durable = runtime.durable_seq("e1")
            return runtime.read(lambda s, now: s.commands_after("e1", 0, durable))

        gate = asyncio.Event()
        real_apply = store.apply

        async def held_apply(changes: Changes, hold_until: Callable[[Lease], float], now: float) -> None:
            await gate.wait()
            await real_apply(changes, hold_until, now)

        store.apply = held_apply  # type: ignore[method-assign]
        pressure = EngineLoad(memory_pressure=True, pressure_free_blocks=2)
        evict = asyncio.create_task(runtime.mutate(lambda s, now: s.keepalive("e1", pressure, now)))
        for _ in range(100):
            if runtime.read(lambda s, now: s.engines["e1"].eviction_seq) == 1:
                break
            await asyncio.sleep(0.01)
        assert runtime.read(lambda s, now: s.engines["e1"].eviction_seq) == 1  # issued in the state ...
        assert stream_read() == []  # ... and withheld while its write is in flight
        gate.set()
        await evict
        assert [c.lease_id for c in stream_read()] == [lease.lease_id]
    finally:
        await runtime.stop()
