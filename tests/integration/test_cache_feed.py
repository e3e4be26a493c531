"""The sidecar's KV-events feed against vLLM 0.32's own ``ZmqEventPublisher`` (in this process, no engine) and a
real broker: the wire format, a late subscriber caught up by the replay endpoint, a gap the replay cannot cover,
and re-sending the mirror when the broker lost its index."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvloop.engines.sidecar.cache_feed import CacheFeed
from kvloop.engines.sidecar.config import SidecarConfig
from kvloop.engines.sidecar.metrics import SidecarMetrics
from kvloop.shared.client import BrokerClient
from kvloop.shared.hashing import ExtraKeys, block_keys
from kvloop.shared.procs import free_port
from kvloop.shared.protocol import KV_EVENTS_TOPIC
from kvloop.v1 import broker_pb2 as pb
from tests.integration.conftest import ModuleBrokerFactory
from tests.integration.helpers import Broker, engine, poll
from tests.support.sidecar_fakes import FakeConnector, hello, running_sidecar

kv_events = pytest.importorskip("vllm.distributed.kv_events")  # seconds to import: vLLM's config comes with it
pytestmark = pytest.mark.slow
FP = "fp-feed"


class Publisher:
    """vLLM's publisher, as an EngineCore runs it, on ipc:// sockets, with a fake prefix cache's hashes."""

    def __init__(self, buffer_steps: int = 10_000) -> None:
        base = f"/tmp/kvloop-test-{uuid.uuid4().hex[:12]}"
        self.endpoint, self.replay_endpoint = f"ipc://{base}.pub", f"ipc://{base}.replay"
        self.pub = kv_events.ZmqEventPublisher(0, endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
                                               buffer_steps=buffer_steps, topic=KV_EVENTS_TOPIC)

    def store(self, tokens: list[int], block_size: int, parent_blocks: int = 0) -> list[bytes]:
        """BlockStored for the full blocks of ``tokens`` after the first ``parent_blocks`` (already stored)."""
        n = len(tokens) // block_size
        hashes = [f"vllm:{tokens[: (i + 1) * block_size]}".encode() for i in range(n)]
        self.publish(kv_events.BlockStored(
            block_hashes=hashes[parent_blocks:], parent_block_hash=hashes[parent_blocks - 1] if parent_blocks else None,
            token_ids=tokens[parent_blocks * block_size: n * block_size], block_size=block_size, lora_id=None,
            medium="GPU", lora_name=None))
        return hashes

    def publish(self, *events: Any) -> None:
        self.pub.publish(kv_events.KVEventBatch(ts=time.time(), events=list(events)))

    def sent(self) -> None:
        """Wait until every batch published so far has left the PUB socket: vLLM's publisher thread marks a
        queued batch done only after sending it."""
        self.pub._event_queue.join()

    def close(self) -> None:
        self.pub.shutdown()
        for endpoint in (self.endpoint, self.replay_endpoint):  # ZMQ leaves ipc:// socket files behind
            Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    p = Publisher()
    yield p
    p.close()


@pytest.fixture(scope="module")
def broker_address(start_module_broker: ModuleBrokerFactory) -> str:
    return start_module_broker("feed-broker", "--keepalive-interval-s", "0.5", "--engine-ttl-s", "3").extra["address"]


def sidecar_config(broker: str, engine_id: str, pub: Publisher, **overrides: Any) -> SidecarConfig:
    values: dict[str, Any] = dict(engine_id=engine_id, role="prefill", broker=broker, socket=Path("/tmp/unused.sock"),
                                  engine_url="http://127.0.0.1:9", layout_fingerprint=FP, log_format="console",
                                  kv_events_endpoint=pub.endpoint, kv_events_replay_endpoint=pub.replay_endpoint)
    values.update(overrides)
    config = SidecarConfig(**values)
    config.validate()
    return config


async def cached(broker: Broker, engine_id: str) -> tuple[int, int] | None:
    status = next((e for e in (await broker.inspect()).engines if e.engine.engine_id == engine_id), None)
    return (status.cached_blocks, status.cache_resets) if status is not None else None


async def keep_alive(broker: Broker, engine_id: str) -> None:
    while True:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await broker.stub.KeepAlive(pb.KeepAliveRequest(engine_id=engine_id), timeout=5)
        await asyncio.sleep(0.5)  # the keep-alive period, as a sidecar keeps it


def scrape(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode()).splitlines()


async def heartbeat_until(pub: Publisher, ok: Any, what: str, timeout_s: float = 20.0) -> None:
    """Publish empty steps until ``ok()``: a subscriber that joined late learns of the gap from the next batch."""
    async def step() -> bool:
        pub.publish()
        return bool(await ok())

    await poll(step, bool, timeout_s=timeout_s, what=what, interval_s=0.1)


async def test_late_subscriber_catches_up_and_keys_match(broker_address: str, publisher: Publisher) -> None:
    bs, eid = 16, "feed-a"
    broker = Broker(broker_address)
    client = BrokerClient(broker_address)
    prompt = list(range(1000, 1000 + 5 * bs + 3))
    metrics = SidecarMetrics()
    feed: CacheFeed | None = None
    alive = asyncio.create_task(keep_alive(broker, eid))  # the broker's engine TTL is short
    try:
        await broker.stub.RegisterEngine(pb.RegisterEngineRequest(
            engine=engine(eid, pb.ENGINE_ROLE_PREFILL, FP, bs=bs, incarnation="inc-a")), timeout=5)
        publisher.store(prompt[: 3 * bs], bs)  # before anyone listens: only the replay endpoint has it
        publisher.sent()  # else the publisher thread could still be sending it when the feed subscribes
        feed = CacheFeed(sidecar_config(broker_address, eid, publisher), client, metrics, "inc-a", bs)
        feed.on_registered()
        await heartbeat_until(publisher, lambda: asyncio.sleep(0, len(feed.mirror) == 3), "the replayed blocks")
        publisher.store(prompt, bs, parent_blocks=3)
        expected = block_keys(prompt, bs, ExtraKeys(FP))
        await poll(lambda: asyncio.sleep(0, feed.mirror.keys()), lambda k: k == expected, timeout_s=10,
                   what="the mirror naming the prompt's keys")
        await poll(lambda: cached(broker, eid), lambda c: c == (5, 0), timeout_s=10, what="5 blocks at the broker")
        assert (metrics.registry.get_sample_value("kvloop_sidecar_cache_replays_total", {"outcome": "covered"})
                or 0) >= 1

        # The broker loses its index (as a new leader would): the next batch shows it, and the mirror goes again.
        await broker.stub.DeregisterEngine(pb.DeregisterEngineRequest(engine_id=eid), timeout=5)
        await broker.stub.RegisterEngine(pb.RegisterEngineRequest(
            engine=engine(eid, pb.ENGINE_ROLE_PREFILL, FP, bs=bs, incarnation="inc-a")), timeout=5)
        publisher.store([*prompt[: 5 * bs], *range(9000, 9000 + bs)], bs, parent_blocks=5)
        await poll(lambda: cached(broker, eid), lambda c: c is not None and c[0] == 6, timeout_s=10,
                   what="the whole mirror re-sent after the broker's reset")
    finally:
        alive.cancel()
        if feed is not None:
            await feed.close()
        await client.close()
        await broker.close()


async def test_through_the_sidecar_with_a_gap_the_replay_cannot_cover(tmp_path: Path, broker_address: str) -> None:
    pub = Publisher(buffer_steps=2)
    broker = Broker(broker_address)
    connector = FakeConnector(tmp_path / "s.sock")
    bs, eid = 128, "feed-b"  # test_sidecar's hello: block size 128
    try:
        for i in range(4):  # seqs 0..3; the replay buffer keeps only the last two
            pub.store(list(range(i * 1000, i * 1000 + bs)), bs)
        metrics_port = free_port()
        async with running_sidecar(tmp_path, broker_address, eid, role="prefill", kv_events_endpoint=pub.endpoint,
                                   kv_events_replay_endpoint=pub.replay_endpoint,
                                   metrics_listen=f"127.0.0.1:{metrics_port}"):
            await connector.attach(hello(eid))
            await poll(lambda: cached(broker, eid), lambda c: c is not None, timeout_s=10, what="registered")
            # The first batch it hears starts past seq 0, and the replay no longer has 0 and 1: the mirror cannot know
            # what the engine holds, so it starts over empty (the engine really holds 4 blocks).
            missed = 'kvloop_sidecar_cache_replays_total{outcome="missed"} 1.0'
            await heartbeat_until(pub, lambda: asyncio.to_thread(lambda: missed in scrape(metrics_port)),
                                  "the sidecar to find the gap and the replay short of it")
            assert (await cached(broker, eid) or (-1, 0))[0] == 0
            pub.store(list(range(7000, 7000 + 2 * bs)), bs)
            await poll(lambda: cached(broker, eid), lambda c: c is not None and c[0] == 2, timeout_s=10,
                       what="a new prompt named after the reset")
            # An operator drops the engine: its sidecar registers it again and re-sends what it knows.
            await broker.stub.DeregisterEngine(pb.DeregisterEngineRequest(engine_id=eid), timeout=5)
            await poll(lambda: cached(broker, eid), lambda c: c is not None and c[0] == 2, timeout_s=10,
                       what="the mirror re-sent after re-registration")
    finally:
        await connector.close()
        await broker.close()
        pub.close()
