"""ReportCacheEvents over real gRPC: the soft index of an engine's prefix cache, its resets, Inspect and metrics.
(Refusals naming their field are in test_broker_bad_input.py with the other RPCs'.)"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator

import pytest

from kvloop.shared.client import wait_serving
from kvloop.v1 import broker_pb2 as pb
from tests.integration.conftest import ModuleBrokerFactory
from tests.integration.helpers import BS, SERVICE, Broker, engine, keys_for, log_event, tokens

pytestmark = pytest.mark.slow
FP = "fp-cache-events"
KEYS = keys_for(tokens(6 * BS), FP)


@pytest.fixture(scope="module")
async def broker(start_module_broker: ModuleBrokerFactory) -> AsyncIterator[Broker]:
    proc = start_module_broker("cache-events", "--soft-index-max-blocks", "4")
    await wait_serving(proc.extra["address"], SERVICE, timeout_s=20)
    b = Broker(proc.extra["address"], proc)
    yield b
    await b.close()


async def register(broker: Broker, eid: str, incarnation: str = "inc-1") -> None:
    await broker.stub.RegisterEngine(pb.RegisterEngineRequest(
        engine=engine(eid, pb.ENGINE_ROLE_PREFILL, FP, incarnation=incarnation)), timeout=5)


async def report(broker: Broker, eid: str, seq: int, stored: list[bytes] | None = None,
                 removed: list[bytes] | None = None, *, reset: bool = False, cleared: bool = False,
                 incarnation: str = "inc-1") -> pb.CacheEventAck:
    return await broker.stub.ReportCacheEvents(pb.CacheEventBatch(
        engine_id=eid, incarnation=incarnation, seq=seq, reset=reset, cleared=cleared, stored_keys=stored or [],
        removed_keys=removed or []), timeout=5)


async def status(broker: Broker, eid: str) -> pb.EngineStatus:
    return next(e for e in (await broker.inspect()).engines if e.engine.engine_id == eid)


async def test_batches_in_sequence_build_the_index(broker: Broker) -> None:
    await register(broker, "happy")
    ack = await report(broker, "happy", 1, KEYS[:3], reset=True)  # a sidecar's first batch asks for a reset
    assert (ack.reset, ack.cached_blocks, ack.expected_seq) == (True, 3, 2)
    ack = await report(broker, "happy", 2, KEYS[3:4], removed=KEYS[2:3])
    assert (ack.reset, ack.cached_blocks, ack.expected_seq) == (False, 3, 3)
    ack = await report(broker, "happy", 3, KEYS[4:6])  # over the cap of 4: the oldest-stored key goes
    assert ack.cached_blocks == 4
    st = await status(broker, "happy")
    assert (st.cached_blocks, st.cache_resets) == (4, 0)  # the stream's opening reset discarded nothing
    ack = await report(broker, "happy", 4, cleared=True)
    assert (ack.reset, ack.cached_blocks) == (False, 0)


async def test_a_gap_resets_and_the_engine_going_drops_the_index(broker: Broker) -> None:
    await register(broker, "gappy")
    await report(broker, "gappy", 1, KEYS[:2])
    ack = await report(broker, "gappy", 3, KEYS[2:3])  # batch 2 was lost
    assert (ack.reset, ack.cached_blocks, ack.expected_seq) == (True, 1, 4)
    st = await status(broker, "gappy")
    assert (st.cached_blocks, st.cache_resets) == (1, 1)
    ack = await report(broker, "gappy", 4, KEYS[:2], reset=True)  # the sidecar re-sends its mirror
    assert (ack.reset, ack.cached_blocks) == (True, 2)
    assert (await status(broker, "gappy")).cache_resets == 2

    await register(broker, "gappy", incarnation="inc-2")  # the engine restarted: its cache is new
    st = await status(broker, "gappy")
    assert (st.cached_blocks, st.cache_resets) == (0, 0)
    ack = await report(broker, "gappy", 1, KEYS[:1], incarnation="inc-2")
    assert (ack.reset, ack.cached_blocks) == (False, 1)


async def test_metrics_count_events_and_resets(broker: Broker) -> None:
    await register(broker, "counted")
    await report(broker, "counted", 1, KEYS[:2], removed=[KEYS[5]])  # removing what is not there counts nothing
    await report(broker, "counted", 7, KEYS[:1])
    assert broker.proc is not None
    port = log_event(broker.proc, "broker.listening")["metrics_port"]

    def scrape() -> list[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return str(reply.read().decode()).splitlines()

    lines = await asyncio.to_thread(scrape)
    assert 'kvloop_broker_cached_blocks{engine="counted"} 1.0' in lines
    assert any(line.startswith('kvloop_broker_cache_resets_total{reason="gap"}') for line in lines), lines
    stored = next(line for line in lines if line.startswith('kvloop_broker_cache_events_total{kind="stored"}'))
    assert float(stored.split()[-1]) >= 3
