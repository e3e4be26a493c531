"""The KVBroker gRPC service end to end: a real ``kvloop broker serve`` process on the memory store.

One broker serves the whole module (each test uses its own engine ids and layout fingerprint, so
their blocks never match across tests); tests that need other flags or kill the process start their own.
"""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvloop.shared.client import PlacementStream, wait_serving
from kvloop.v1 import broker_pb2 as pb
from tests.integration.conftest import ModuleBrokerFactory
from tests.integration.helpers import (
    BS,
    SERVICE,
    Broker,
    StreamReader,
    engine,
    engine_ids,
    lease_by_id,
    log_event,
    place_request,
    poll,
    publish_request,
    tokens,
)

pytestmark = pytest.mark.slow

THRESHOLD = 256  # two blocks of 128: one matched block is below the threshold, two are not


@pytest.fixture(scope="module")
async def broker(start_module_broker: ModuleBrokerFactory) -> AsyncIterator[Broker]:
    proc = start_module_broker("svc", "--threshold-tokens", str(THRESHOLD))
    await wait_serving(proc.extra["address"], SERVICE, timeout_s=20)
    b = Broker(proc.extra["address"], proc)
    yield b
    await b.close()


async def register_cluster(b: Broker, prefix: str, fp: str, *, decode_budget: int = 1000) -> None:
    """Two prefill engines and one decode engine sharing block size and fingerprint."""
    for eid, role, budget in ((f"{prefix}-p1", pb.ENGINE_ROLE_PREFILL, 1000),
                              (f"{prefix}-p2", pb.ENGINE_ROLE_PREFILL, 1000),
                              (f"{prefix}-d", pb.ENGINE_ROLE_DECODE, decode_budget)):
        reply = await b.stub.RegisterEngine(pb.RegisterEngineRequest(engine=engine(eid, role, fp, budget=budget)),
                                            timeout=5)
        assert reply.last_eviction_seq == 0 and list(reply.live_lease_ids) == []
        assert reply.keepalive_interval_s == 3.0 and reply.engine_ttl_s == 10.0


def watch(b: Broker, engine_id: str, after_seq: int = 0) -> StreamReader:
    return StreamReader(b.stub.WatchEvictions(pb.WatchEvictionsRequest(engine_id=engine_id, after_seq=after_seq),
                                              timeout=60))


# ------------------------------------------------------------------------------------------ placement


async def test_register_publish_and_place(broker: Broker) -> None:
    fp, pre = "fp-place", "place"
    await register_cluster(broker, pre, fp)
    reply = await broker.inspect()
    assert {f"{pre}-p1", f"{pre}-p2", f"{pre}-d"} <= engine_ids(reply)

    published = tokens(4 * BS + 10)  # four full blocks and a partial one
    pub = await broker.stub.PublishLease(publish_request(f"{pre}-d", published, fp, first_block_id=100,
                                                         session="s1"), timeout=5)
    lease = pub.lease
    assert lease.lease_id and lease.engine_id == f"{pre}-d" and lease.session_id == "s1"
    assert len(lease.block_keys) == 4 and list(lease.block_ids) == [100, 101, 102, 103]
    assert lease.num_tokens == 4 * BS + 10 and lease.ttl_s == 480.0 and lease.pins == 0
    assert list(pub.evictions) == []

    # A new turn extends the published prompt: the four full blocks are pulled, the rest computed.
    prompt = published + tokens(300, start=50_000)
    plan = await broker.stub.Place(place_request(prompt, fp, session="s1"), timeout=5)
    assert plan.error == ""
    assert plan.decision == pb.DECISION_TRANSFER and plan.reason == "transfer_cheaper"
    assert plan.source_engine_id == f"{pre}-d" and plan.source_lease_id == lease.lease_id
    assert plan.source_addresses.nixl == f"{pre}-d.nixl:2"
    assert list(plan.source_block_ids) == [100, 101, 102, 103]
    assert plan.matched_blocks == 4 and plan.matched_tokens == 4 * BS
    assert plan.recompute_tokens == len(prompt) - 4 * BS and plan.prompt_blocks == len(prompt) // BS
    assert plan.threshold_tokens == THRESHOLD and plan.candidates == 1
    assert plan.prefill_engine_id in {f"{pre}-p1", f"{pre}-p2"}
    assert plan.decode_engine_id == f"{pre}-d" and plan.decode_sticky
    assert plan.cost.transfer_s < plan.cost.recompute_s and not plan.cost.measured

    # Exactly the published blocks: the block holding the last prompt token is always recomputed.
    plan = await broker.stub.Place(place_request(published[: 4 * BS], fp), timeout=5)
    assert plan.decision == pb.DECISION_TRANSFER
    assert plan.matched_blocks == 3 and list(plan.source_block_ids) == [100, 101, 102]

    # One shared block (128 tokens) is below the 256-token threshold.
    plan = await broker.stub.Place(place_request(published[:BS] + tokens(200, start=90_000), fp), timeout=5)
    assert plan.decision == pb.DECISION_RECOMPUTE and plan.reason == "below_threshold"
    assert plan.matched_blocks == 1 and plan.recompute_tokens == BS + 200

    # Nothing shared.
    plan = await broker.stub.Place(place_request(tokens(600, start=70_000), fp), timeout=5)
    assert plan.decision == pb.DECISION_RECOMPUTE and plan.reason == "no_match"
    assert plan.matched_blocks == 0 and plan.source_engine_id == "" and plan.source_lease_id == ""
    assert plan.recompute_tokens == 600

    # The same prompt under another layout fingerprint matches nothing (and no engine serves it).
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await broker.stub.Place(place_request(prompt, "fp-unknown"), timeout=5)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "layout_fingerprint" in (exc.value.details() or "")


async def test_place_stream_matches_place(broker: Broker) -> None:
    fp, pre = "fp-stream", "stream"
    await register_cluster(broker, pre, fp)
    published = tokens(6 * BS + 1)
    await broker.stub.PublishLease(publish_request(f"{pre}-d", published, fp), timeout=5)
    requests = [
        place_request(published + tokens(50, start=1_000_000), fp, session="a"),
        place_request(published[: 2 * BS] + tokens(BS + 3, start=2_000_000), fp),
        place_request(published[:BS] + tokens(10, start=3_000_000), fp),
        place_request(tokens(400, start=4_000_000), fp),
        place_request([], fp),
    ]
    expected = [await broker.stub.Place(r, timeout=5) for r in requests]
    assert [p.decision for p in expected] == [pb.DECISION_TRANSFER, pb.DECISION_TRANSFER, pb.DECISION_RECOMPUTE,
                                              pb.DECISION_RECOMPUTE, pb.DECISION_RECOMPUTE]

    stream = PlacementStream(broker.stub)
    try:
        sequential = [await stream.place(r) for r in requests]
        concurrent = await asyncio.gather(*(stream.place(r) for r in requests))
        assert sequential == expected and list(concurrent) == expected

        # A refused request gets a Plan carrying the error; the stream goes on.
        bad = place_request(published, fp)
        bad.block_size = 0
        refused = await stream.place(bad)
        assert refused.decision == pb.DECISION_UNSPECIFIED
        assert refused.error.startswith("INVALID_ARGUMENT: block_size"), refused.error
        unknown = await stream.place(place_request(published, "fp-nobody"))
        assert unknown.error.startswith("FAILED_PRECONDITION: layout_fingerprint"), unknown.error
        assert await stream.place(requests[0]) == expected[0]
    finally:
        await stream.close()


async def test_the_places_of_one_burst_spread_over_the_prefill_engines(broker: Broker) -> None:
    """Four fresh prompts in one PlaceStream batch, each with the router's same snapshot (nothing in flight): each
    placement counts on its engine until the router's counts hold it, so they alternate between the two prefill
    engines instead of all going to the one that was least loaded before the burst."""
    fp, pre = "fp-burst", "burst"
    await register_cluster(broker, pre, fp)
    requests = [place_request(tokens(1000, start=5_000_000 + i * 10_000), fp) for i in range(4)]
    for r in requests:
        r.counts_in_flight, r.router_id = True, "burst-router"
    stream = PlacementStream(broker.stub)
    try:
        plans = await asyncio.gather(*(stream.place(r) for r in requests))
    finally:
        await stream.close()
    assert all(p.decision == pb.DECISION_RECOMPUTE for p in plans), plans
    assert sorted(p.prefill_engine_id for p in plans) == [f"{pre}-p1", f"{pre}-p1", f"{pre}-p2", f"{pre}-p2"]


# ------------------------------------------------------------------------------------------ leases and pins


async def test_decode_local_and_place_and_pin(broker: Broker) -> None:
    """Through the service: a short tail on the decode engine holding the prefix is DECODE_LOCAL; a request
    asking for strict P/D gets TRANSFER, with its pin taken in the same call (PlaceRequest.pin); a TRANSFER
    whose lease is gone by the time of the pin turns into RECOMPUTE (pin_refused)."""
    fp, pre = "fp-paths", "paths"
    await register_cluster(broker, pre, fp)
    published = tokens(4 * BS + 10)
    lease = (await broker.stub.PublishLease(publish_request(f"{pre}-d", published, fp, first_block_id=40),
                                            timeout=5)).lease
    prompt = published + tokens(100, start=60_000)
    plan = await broker.stub.Place(place_request(prompt, fp, decode_local=True, pin=True), timeout=5)
    assert (plan.decision, plan.reason) == (pb.DECISION_DECODE_LOCAL, "short_tail_on_decode")
    assert plan.decode_engine_id == plan.prefill_engine_id == f"{pre}-d" and not plan.HasField("pin")
    assert plan.local_tokens == 4 * BS and plan.pull_tokens == 0 and plan.recompute_tokens == len(prompt) - 4 * BS
    assert 0 < plan.cost.decode_local_s < plan.cost.transfer_path_s < plan.cost.recompute_path_s

    plan = await broker.stub.Place(place_request(prompt, fp, pin=True), timeout=5)
    assert plan.decision == pb.DECISION_TRANSFER and plan.decode_local_veto == "disabled"
    assert plan.pin.pin_id and list(plan.pin.block_ids) == [40, 41, 42, 43] and plan.pull_tokens == 4 * BS
    reply = await broker.inspect()
    assert [(p.lease_id, p.reader_engine_id) for p in reply.pins if p.pin_id == plan.pin.pin_id] == [
        (lease.lease_id, plan.prefill_engine_id)]
    await broker.stub.CompleteTransfer(pb.CompleteTransferRequest(pin_id=plan.pin.pin_id, success=True), timeout=5)

    await broker.stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.lease_id), timeout=5)
    plan = await broker.stub.Place(place_request(prompt, fp, pin=True), timeout=5)
    assert plan.decision == pb.DECISION_RECOMPUTE and plan.reason == "no_match" and not plan.HasField("pin")


async def test_pin_and_complete_transfer_renews_the_lease(broker: Broker) -> None:
    fp, pre = "fp-pin", "pin"
    await register_cluster(broker, pre, fp)
    lease = (await broker.stub.PublishLease(publish_request(f"{pre}-d", tokens(3 * BS), fp, first_block_id=7,
                                                            ttl_s=60), timeout=5)).lease
    pin = await broker.stub.PinBlocks(pb.PinBlocksRequest(reader_engine_id=f"{pre}-p1", lease_id=lease.lease_id,
                                                          num_blocks=2, timeout_s=30), timeout=5)
    assert pin.pin_id and list(pin.block_ids) == [7, 8]
    assert pin.lease_expires_at_unix == pytest.approx(lease.expires_at_unix)
    assert pin.expires_at_unix > time.time()

    reply = await broker.inspect()
    assert lease_by_id(reply, lease.lease_id).pins == 1  # type: ignore[union-attr]
    pins = [p for p in reply.pins if p.pin_id == pin.pin_id]
    assert len(pins) == 1 and pins[0].lease_id == lease.lease_id and pins[0].reader_engine_id == f"{pre}-p1"
    assert pins[0].num_blocks == 2

    await asyncio.sleep(0.02)  # let the wall clock move so the renewal is visible
    done = await broker.stub.CompleteTransfer(pb.CompleteTransferRequest(pin_id=pin.pin_id, success=True,
                                                                         bytes=2 << 20, duration_s=0.002), timeout=5)
    assert done.lease_expires_at_unix > lease.expires_at_unix
    reply = await broker.inspect()
    after = lease_by_id(reply, lease.lease_id)
    assert after is not None and after.pins == 0 and after.expires_at_unix == done.lease_expires_at_unix
    assert all(p.pin_id != pin.pin_id for p in reply.pins)

    # The pin is gone: completing it again is NOT_FOUND.
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await broker.stub.CompleteTransfer(pb.CompleteTransferRequest(pin_id=pin.pin_id, success=True), timeout=5)
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "pin_id" in (exc.value.details() or "")


async def test_renew_and_release(broker: Broker) -> None:
    fp, pre = "fp-renew", "renew"
    await register_cluster(broker, pre, fp)
    dec = f"{pre}-d"
    lease = (await broker.stub.PublishLease(publish_request(dec, tokens(2 * BS), fp, ttl_s=30), timeout=5)).lease
    assert lease.ttl_s == 30

    renewed = (await broker.stub.RenewLease(pb.RenewLeaseRequest(lease_id=lease.lease_id, ttl_s=120),
                                            timeout=5)).lease
    assert renewed.ttl_s == 120 and renewed.expires_at_unix == pytest.approx(time.time() + 120, abs=5)
    assert renewed.expires_at_unix > lease.expires_at_unix
    kept = (await broker.stub.RenewLease(pb.RenewLeaseRequest(lease_id=lease.lease_id), timeout=5)).lease
    assert kept.ttl_s == 120  # ttl 0 keeps the lease's own TTL

    released = await broker.stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.lease_id), timeout=5)
    assert not released.deferred
    reply = await broker.inspect()
    assert lease_by_id(reply, lease.lease_id) is None
    status = next(e for e in reply.engines if e.engine.engine_id == dec)
    assert status.retained_blocks == 0 and status.leases == 0

    # Releasing a pinned lease is deferred until the pin ends; then the engine gets a RELEASED command.
    call = watch(broker, dec)
    try:
        lease2 = (await broker.stub.PublishLease(publish_request(dec, tokens(2 * BS, start=500), fp, ttl_s=30),
                                                 timeout=5)).lease
        pin = await broker.stub.PinBlocks(pb.PinBlocksRequest(reader_engine_id=f"{pre}-p2", lease_id=lease2.lease_id,
                                                              num_blocks=1), timeout=5)
        assert (await broker.stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease2.lease_id), timeout=5)).deferred
        still = lease_by_id(await broker.inspect(), lease2.lease_id)
        assert still is not None and still.pending_eviction == pb.EVICTION_REASON_RELEASED
        done = await broker.stub.CompleteTransfer(pb.CompleteTransferRequest(pin_id=pin.pin_id, success=True),
                                                  timeout=5)
        assert done.lease_expires_at_unix == 0.0  # released: nothing is retained any more
        (cmd,) = await call.take(1)
        assert cmd.seq == 1 and cmd.reason == pb.EVICTION_REASON_RELEASED and cmd.lease_id == lease2.lease_id
        assert list(cmd.block_ids) == list(lease2.block_ids)
        assert lease_by_id(await broker.inspect(), lease2.lease_id) is None
    finally:
        await call.close()


async def test_ttl_expiry_evicts_and_notifies_the_engine(broker: Broker) -> None:
    fp, pre = "fp-ttl", "ttl"
    await register_cluster(broker, pre, fp)
    dec = f"{pre}-d"
    call = watch(broker, dec)
    try:
        lease = (await broker.stub.PublishLease(publish_request(dec, tokens(2 * BS), fp, first_block_id=40,
                                                                ttl_s=1.5), timeout=5)).lease
        assert lease.ttl_s == 1.5
        await poll(broker.inspect, lambda r: lease_by_id(r, lease.lease_id) is None, timeout_s=8,
                   what="the 1.5 s lease to expire")
        (cmd,) = await call.take(1)
        assert cmd.seq == 1 and cmd.engine_id == dec and cmd.lease_id == lease.lease_id
        assert cmd.reason == pb.EVICTION_REASON_TTL_EXPIRED and list(cmd.block_ids) == [40, 41]
        status = next(e for e in (await broker.inspect()).engines if e.engine.engine_id == dec)
        assert status.retained_blocks == 0 and status.last_eviction_seq == 1
    finally:
        await call.close()


async def test_pinned_lease_outlives_its_ttl_until_the_pin_ends(broker: Broker) -> None:
    fp, pre = "fp-pinttl", "pinttl"
    await register_cluster(broker, pre, fp)
    dec = f"{pre}-d"
    call = watch(broker, dec)
    try:
        lease = (await broker.stub.PublishLease(publish_request(dec, tokens(2 * BS), fp, ttl_s=1.0),
                                                timeout=5)).lease
        pin = await broker.stub.PinBlocks(pb.PinBlocksRequest(reader_engine_id=f"{pre}-p1", lease_id=lease.lease_id,
                                                              num_blocks=2, timeout_s=4.0), timeout=5)
        reply = await poll(
            broker.inspect,
            lambda r: (x := lease_by_id(r, lease.lease_id)) is not None
            and x.pending_eviction == pb.EVICTION_REASON_TTL_EXPIRED,
            timeout_s=3.0, what="the pinned lease to be marked TTL_EXPIRED")
        held = lease_by_id(reply, lease.lease_id)
        assert held is not None and held.pins == 1
        assert reply.now_unix > held.expires_at_unix  # past its TTL, still retained
        # A lease being evicted cannot be pinned again or renewed, and is no longer offered for placement.
        for rpc_call in (
            broker.stub.PinBlocks(pb.PinBlocksRequest(reader_engine_id=f"{pre}-p2", lease_id=lease.lease_id,
                                                      num_blocks=1), timeout=5),
            broker.stub.RenewLease(pb.RenewLeaseRequest(lease_id=lease.lease_id, ttl_s=10), timeout=5),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await rpc_call
            assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "lease_id" in (exc.value.details() or "")
        plan = await broker.stub.Place(place_request(tokens(3 * BS), fp), timeout=5)
        assert plan.decision == pb.DECISION_RECOMPUTE and plan.reason == "no_match"
        await call.expect_quiet(0.2)

        done = await broker.stub.CompleteTransfer(pb.CompleteTransferRequest(pin_id=pin.pin_id, success=True),
                                                  timeout=5)
        assert done.lease_expires_at_unix == 0.0
        assert lease_by_id(await broker.inspect(), lease.lease_id) is None
        (cmd,) = await call.take(1)
        assert cmd.seq == 1 and cmd.reason == pb.EVICTION_REASON_TTL_EXPIRED and cmd.lease_id == lease.lease_id
    finally:
        await call.close()


async def test_budget_eviction_and_supersession(broker: Broker) -> None:
    fp, pre = "fp-budget", "budget"
    await register_cluster(broker, pre, fp, decode_budget=4)
    dec = f"{pre}-d"
    call = watch(broker, dec)
    try:
        first = (await broker.stub.PublishLease(publish_request(dec, tokens(3 * BS), fp, first_block_id=0),
                                                timeout=5)).lease
        pub = await broker.stub.PublishLease(publish_request(dec, tokens(3 * BS, start=10_000), fp, first_block_id=10),
                                             timeout=5)
        second = pub.lease
        (evicted,) = pub.evictions
        assert evicted.seq == 1 and evicted.reason == pb.EVICTION_REASON_BUDGET
        assert evicted.lease_id == first.lease_id and list(evicted.block_ids) == [0, 1, 2]
        (streamed,) = await call.take(1)
        assert streamed == evicted

        # A lease that extends one on the same engine supersedes it (the shared blocks stay retained).
        ext = publish_request(dec, tokens(4 * BS, start=10_000), fp)
        ext.block_ids[:] = [10, 11, 12, 13]
        pub = await broker.stub.PublishLease(ext, timeout=5)
        (superseded,) = pub.evictions
        assert superseded.seq == 2 and superseded.reason == pb.EVICTION_REASON_SUPERSEDED
        assert superseded.lease_id == second.lease_id
        assert await call.take(1) == [superseded]

        reply = await broker.inspect()
        assert lease_by_id(reply, first.lease_id) is None and lease_by_id(reply, second.lease_id) is None
        assert lease_by_id(reply, pub.lease.lease_id) is not None
        status = next(e for e in reply.engines if e.engine.engine_id == dec)
        assert status.retained_blocks == 4 and status.leases == 1 and status.last_eviction_seq == 2

        # Over budget on its own: refused, nothing evicted.
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await broker.stub.PublishLease(publish_request(dec, tokens(5 * BS, start=20_000), fp, first_block_id=50),
                                           timeout=5)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "block_ids" in (exc.value.details() or "")
        assert lease_by_id(await broker.inspect(), pub.lease.lease_id) is not None
    finally:
        await call.close()


async def test_a_budget_eviction_demotes_to_the_host_tier_and_the_plan_pulls_from_it(broker: Broker) -> None:
    fp, pre = "fp-tier", "tier"
    await register_cluster(broker, pre, fp, decode_budget=4)
    dec = f"{pre}-d"
    with_tier = engine(dec, pb.ENGINE_ROLE_DECODE, fp, budget=4)
    with_tier.host_tier_blocks, with_tier.host_tier_first_id = 8, 64  # slots 64..71, after a 64-block pool
    await broker.stub.RegisterEngine(pb.RegisterEngineRequest(engine=with_tier), timeout=5)
    call = watch(broker, dec)
    try:
        history = tokens(3 * BS)
        first = (await broker.stub.PublishLease(publish_request(dec, history, fp, first_block_id=0, session="s"),
                                                timeout=5)).lease
        pub = await broker.stub.PublishLease(publish_request(dec, tokens(3 * BS, start=10_000), fp, first_block_id=10),
                                             timeout=5)
        (demote,) = pub.evictions
        assert demote.lease_id == first.lease_id and demote.reason == pb.EVICTION_REASON_BUDGET
        assert list(demote.block_ids) == [0, 1, 2] and demote.tier == pb.TIER_POOL
        assert list(demote.demote_to_block_ids) == [64, 65, 66]
        assert await call.take(1) == [demote]
        held = lease_by_id(await broker.inspect(), first.lease_id)
        assert held is not None and held.tier == pb.TIER_HOST and held.demoting

        with pytest.raises(grpc.aio.AioRpcError) as exc:  # another engine's lease
            await broker.stub.CompleteDemotion(pb.CompleteDemotionRequest(
                engine_id=f"{pre}-p1", lease_id=first.lease_id, success=True), timeout=5)
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "lease_id" in (exc.value.details() or "")
        done = await broker.stub.CompleteDemotion(pb.CompleteDemotionRequest(
            engine_id=dec, lease_id=first.lease_id, success=True), timeout=5)
        assert done.retained

        plan = await broker.stub.Place(place_request(history + tokens(BS, start=5_000), fp, session="s", pin=True),
                                       timeout=5)
        assert plan.decision == pb.DECISION_TRANSFER and plan.source_lease_id == first.lease_id
        assert plan.source_tier == pb.TIER_HOST and list(plan.source_block_ids) == [64, 65, 66]
        assert plan.pin.tier == pb.TIER_HOST and list(plan.pin.block_ids) == [64, 65, 66]
    finally:
        await call.close()


async def test_a_paused_sessions_host_lease_is_promoted_over_the_stream_and_the_report_ends_its_pin(
        broker: Broker) -> None:
    """Prefetch on the wire: a paused session's demoted lease gets a prefetch command before the stated resume,
    naming the pin that keeps its slots; the engine's report ends the pin, and a report that names another pin is
    refused naming ``pin_id``."""
    fp, pre = "fp-promote", "promote"
    await register_cluster(broker, pre, fp, decode_budget=4)
    dec = f"{pre}-d"
    with_tier = engine(dec, pb.ENGINE_ROLE_DECODE, fp, budget=4)
    with_tier.host_tier_blocks, with_tier.host_tier_first_id = 8, 64
    await broker.stub.RegisterEngine(pb.RegisterEngineRequest(engine=with_tier), timeout=5)
    call = watch(broker, dec)
    try:
        first = (await broker.stub.PublishLease(publish_request(dec, tokens(3 * BS), fp, first_block_id=0,
                                                                session="agent"), timeout=5)).lease
        # Resumes 6 s from now: the broker's prefetch lead (5 s) makes it due in about 1 s.
        await broker.stub.HintSession(pb.HintSessionRequest(session_id="agent", pause_s=6.0), timeout=5)
        pub = await broker.stub.PublishLease(publish_request(dec, tokens(3 * BS, start=10_000), fp, first_block_id=10),
                                             timeout=5)
        (demote,) = pub.evictions
        assert demote.lease_id == first.lease_id and list(demote.demote_to_block_ids) == [64, 65, 66]
        await broker.stub.CompleteDemotion(pb.CompleteDemotionRequest(engine_id=dec, lease_id=first.lease_id,
                                                                      success=True), timeout=5)
        assert await call.take(1) == [demote]
        started = time.monotonic()
        # The promotion takes the room of the other lease, which no pause holds: it is demoted first.
        room, promote = await call.take(2)
        assert time.monotonic() - started < 6.0
        assert (room.lease_id, room.reason) == (pub.lease.lease_id, pb.EVICTION_REASON_BUDGET)
        assert room.demote_to_block_ids
        assert promote.reason == pb.EVICTION_REASON_PREFETCH
        assert promote.lease_id == first.lease_id and list(promote.block_ids) == [64, 65, 66]
        assert promote.tier == pb.TIER_HOST and promote.promote_pin_id and promote.promote_within_s > 0
        held = lease_by_id(await broker.inspect(), first.lease_id)
        assert held is not None and held.pins == 1
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await broker.stub.CompletePromotion(pb.CompletePromotionRequest(
                engine_id=dec, lease_id=first.lease_id, pin_id="no-such-pin", success=True), timeout=5)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "pin_id" in (exc.value.details() or "")
        await broker.stub.CompletePromotion(pb.CompletePromotionRequest(
            engine_id=dec, lease_id=first.lease_id, pin_id=promote.promote_pin_id, success=False), timeout=5)
        held = lease_by_id(await broker.inspect(), first.lease_id)
        assert held is not None and held.pins == 0 and held.tier == pb.TIER_HOST  # a failed load: still on the tier
    finally:
        await call.close()


async def test_watch_evictions_replay_and_resync(broker: Broker) -> None:
    fp, pre = "fp-replay", "replay"
    await register_cluster(broker, pre, fp, decode_budget=2)
    dec = f"{pre}-d"
    issued = []
    leases = []
    for i in range(4):  # each two-block lease evicts the one before it
        pub = await broker.stub.PublishLease(publish_request(dec, tokens(2 * BS, start=1000 * i), fp,
                                                             first_block_id=10 * i), timeout=5)
        leases.append(pub.lease.lease_id)
        issued.extend(pub.evictions)
    assert [c.seq for c in issued] == [1, 2, 3]
    assert [c.lease_id for c in issued] == leases[:3]

    call = watch(broker, dec, after_seq=0)
    try:
        assert await call.take(3) == issued
        await call.expect_quiet(0.2)
    finally:
        await call.close()
    call = watch(broker, dec, after_seq=2)
    try:
        assert await call.take(1) == issued[2:]
    finally:
        await call.close()
    call = watch(broker, dec, after_seq=3)
    try:
        await call.expect_quiet(0.2)
    finally:
        await call.close()

    # The engine claims a seq the broker never issued: it gets a RESYNC with the leases it should keep.
    call = watch(broker, dec, after_seq=50)
    try:
        (resync,) = await call.take(1)
        assert resync.reason == pb.EVICTION_REASON_RESYNC and resync.seq == 3 and resync.engine_id == dec
        assert list(resync.live_lease_ids) == [leases[3]]
        # New commands follow on the same stream.
        pub = await broker.stub.PublishLease(publish_request(dec, tokens(2 * BS, start=9000), fp, first_block_id=90),
                                             timeout=5)
        (cmd,) = await call.take(1)
        assert cmd.seq == 4 and cmd.lease_id == leases[3] and list(pub.evictions) == [cmd]
    finally:
        await call.close()

    # An engine the broker does not know cannot watch.
    call = watch(broker, f"{pre}-nobody")
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call.take(1)
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "engine_id" in (exc.value.details() or "")


# ------------------------------------------------------------------------------------------ the process


async def test_health_and_reflection(broker: Broker) -> None:
    assert await broker.health_status("") == health_pb2.HealthCheckResponse.SERVING
    assert await broker.health_status(SERVICE) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await broker.health_status("no.such.Service")
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND

    stub = reflection_pb2_grpc.ServerReflectionStub(broker.channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    replies = [r async for r in call]
    assert len(replies) == 1
    services = {s.name for s in replies[0].list_services_response.service}
    assert {"kvloop.v1.KVBroker", "grpc.health.v1.Health"} <= services

    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvloop.v1.KVBroker")]), timeout=5)
    replies = [r async for r in call]
    assert replies[0].file_descriptor_response.file_descriptor_proto


async def test_metrics_endpoint(broker: Broker) -> None:
    fp, pre = "fp-metrics", "metrics"
    await register_cluster(broker, pre, fp)
    await broker.stub.PublishLease(publish_request(f"{pre}-d", tokens(3 * BS), fp), timeout=5)
    await broker.stub.Place(place_request(tokens(3 * BS + 5), fp), timeout=5)

    assert broker.proc is not None
    port = log_event(broker.proc, "broker.listening")["metrics_port"]
    assert isinstance(port, int) and port > 0

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return str(reply.read().decode())

    text = await asyncio.to_thread(scrape)
    lines = text.splitlines()
    assert f'kvloop_broker_retained_blocks{{engine="{pre}-d"}} 3.0' in lines
    assert any(line.startswith("kvloop_broker_placements_total{") and 'decision="TRANSFER"' in line
               for line in lines), text
    assert "kvloop_broker_leader 1.0" in lines
    assert any(line.startswith('kvloop_broker_placement_source_tier_total{tier="pool"}') for line in lines), text


async def test_engine_expires_when_keepalives_stop(start_broker: ModuleBrokerFactory) -> None:
    proc = start_broker("expiry", "--engine-ttl-s", "2", "--keepalive-interval-s", "0.5")
    await wait_serving(proc.extra["address"], SERVICE, timeout_s=20)
    b = Broker(proc.extra["address"])
    try:
        fp = "fp-expiry"
        reply = await b.stub.RegisterEngine(pb.RegisterEngineRequest(engine=engine("quiet", pb.ENGINE_ROLE_DECODE, fp)),
                                            timeout=5)
        assert reply.keepalive_interval_s == 0.5 and reply.engine_ttl_s == 2.0
        await b.stub.RegisterEngine(pb.RegisterEngineRequest(engine=engine("chatty", pb.ENGINE_ROLE_DECODE, fp)),
                                    timeout=5)
        quiet = (await b.stub.PublishLease(publish_request("quiet", tokens(2 * BS), fp), timeout=5)).lease
        chatty = (await b.stub.PublishLease(publish_request("chatty", tokens(2 * BS), fp), timeout=5)).lease
        assert {quiet.lease_id, chatty.lease_id} <= {x.lease_id for x in (await b.inspect()).leases}

        async def keepalive_then_inspect() -> pb.InspectResponse:
            await b.stub.KeepAlive(pb.KeepAliveRequest(engine_id="chatty", load=pb.EngineLoad(running_requests=1)),
                                   timeout=5)
            return await b.inspect()

        reply = await poll(keepalive_then_inspect, lambda r: "quiet" not in engine_ids(r), timeout_s=10,
                           what="the silent engine to expire", interval_s=0.2)
        assert lease_by_id(reply, quiet.lease_id) is None
        assert "chatty" in engine_ids(reply) and lease_by_id(reply, chatty.lease_id) is not None
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await b.stub.KeepAlive(pb.KeepAliveRequest(engine_id="quiet"), timeout=5)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "engine_id" in (exc.value.details() or "")
    finally:
        await b.close()


async def test_sigterm_shuts_down_gracefully(start_broker: ModuleBrokerFactory) -> None:
    grace = 4.0
    proc = start_broker("sigterm", "--shutdown-grace-s", str(grace))
    await wait_serving(proc.extra["address"], SERVICE, timeout_s=20)
    b = Broker(proc.extra["address"])
    try:
        await b.stub.RegisterEngine(pb.RegisterEngineRequest(engine=engine("d", pb.ENGINE_ROLE_DECODE, "fp")),
                                    timeout=5)
        # Engines hold eviction streams open all the time: they must not hold the drain open too.
        async with watch(b, "d", after_seq=7) as call:
            (resync,) = await call.take(1)
            assert resync.reason == pb.EVICTION_REASON_RESYNC
            start = time.monotonic()
            proc.popen.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call.next(timeout_s=grace)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value
            assert "shutting down" in (exc.value.details() or "")
        rc = await asyncio.to_thread(proc.popen.wait, grace + 5)
        elapsed = time.monotonic() - start
        assert rc == 0, proc.log_tail()
        assert elapsed < grace, f"took {elapsed:.1f}s to stop (grace {grace}s)"
        log_event(proc, "broker.stopped", timeout_s=1)
    finally:
        await b.close()
