"""Bad input over real gRPC: every refusal has the right status code and a message naming the field,
and none of it disturbs the broker's state or its ability to answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from kvloop.shared.client import wait_serving
from kvloop.v1 import broker_pb2 as pb
from tests.integration.conftest import ModuleBrokerFactory
from tests.integration.helpers import (
    BS,
    SERVICE,
    Broker,
    StreamReader,
    engine,
    keys_for,
    place_request,
    publish_request,
    tokens,
)

pytestmark = pytest.mark.slow

FP = "fp-bad"
MAX_KEYS = 16
MAX_MESSAGE = 65536
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass
class World:
    broker: Broker
    lease: pb.Lease
    baseline: tuple[Any, ...]


def view(reply: pb.InspectResponse) -> tuple[Any, ...]:
    """Everything a refused request must leave alone (``last_seen`` moves with re-registration)."""
    engines = sorted((e.engine.SerializeToString(deterministic=True), e.retained_blocks, e.leases,
                      e.last_eviction_seq, e.load.SerializeToString(deterministic=True)) for e in reply.engines)
    return (engines, sorted(x.SerializeToString(deterministic=True) for x in reply.leases),
            sorted(p.SerializeToString(deterministic=True) for p in reply.pins))


@pytest.fixture(scope="module")
async def world(start_module_broker: ModuleBrokerFactory) -> AsyncIterator[World]:
    proc = start_module_broker("bad", "--max-block-keys", str(MAX_KEYS), "--max-message-bytes", str(MAX_MESSAGE),
                               "--max-cache-event-keys", str(MAX_KEYS))
    await wait_serving(proc.extra["address"], SERVICE, timeout_s=20)
    b = Broker(proc.extra["address"], proc)
    for eid, role, fp in (("p", pb.ENGINE_ROLE_PREFILL, FP), ("d", pb.ENGINE_ROLE_DECODE, FP),
                          ("q", pb.ENGINE_ROLE_PREFILL, "fp-other")):
        await b.stub.RegisterEngine(pb.RegisterEngineRequest(engine=engine(eid, role, fp)), timeout=5)
    lease = (await b.stub.PublishLease(publish_request("d", tokens(3 * BS), FP, first_block_id=5, ttl_s=600),
                                       timeout=5)).lease
    baseline = view(await b.inspect())
    yield World(b, lease, baseline)
    await b.close()


def keys(n: int) -> list[bytes]:
    return keys_for(tokens(n * BS, start=123_456), FP)


def publish(**overrides: Any) -> pb.PublishLeaseRequest:
    request = publish_request("d", tokens(2 * BS, start=9000), FP, first_block_id=100)
    for name, value in overrides.items():
        if isinstance(value, list):
            getattr(request, name)[:] = value
        elif isinstance(value, dict):
            getattr(request, name).update(value)
        else:
            setattr(request, name, value)
    return request


def place(**overrides: Any) -> pb.PlaceRequest:
    request = place_request(tokens(3 * BS + 1), FP)
    for name, value in overrides.items():
        if isinstance(value, list):
            getattr(request, name)[:] = value
        elif isinstance(value, dict):
            getattr(request, name).update(value)
        else:
            setattr(request, name, value)
    return request


LEASE = "<the valid lease>"  # replaced by the fixture's lease id


def pin(**overrides: Any) -> pb.PinBlocksRequest:
    fields: dict[str, Any] = {"reader_engine_id": "p", "lease_id": LEASE, "num_blocks": 1, "timeout_s": 5.0}
    fields.update(overrides)
    return pb.PinBlocksRequest(**fields)


def cache_events(**overrides: Any) -> pb.CacheEventBatch:
    fields: dict[str, Any] = {"engine_id": "d", "incarnation": "inc-1", "seq": 1, "stored_keys": keys(2)}
    fields.update(overrides)
    return pb.CacheEventBatch(**fields)


def register(eid: str = "d", role: int = pb.ENGINE_ROLE_DECODE, fp: str = FP, **overrides: Any
             ) -> pb.RegisterEngineRequest:
    msg = engine(eid, role, fp)
    for name, value in overrides.items():
        if isinstance(value, pb.EngineAddresses):
            getattr(msg, name).CopyFrom(value)
        else:
            setattr(msg, name, value)
    return pb.RegisterEngineRequest(engine=msg)


# (id, method, request, code, field)
CASES: list[tuple[str, str, Any, grpc.StatusCode, str]] = [
    # PublishLease
    ("publish-empty-keys", "PublishLease", publish(block_keys=[], block_ids=[], num_tokens=0), INVALID, "block_keys"),
    ("publish-too-many-keys", "PublishLease",
     publish(block_keys=keys(MAX_KEYS + 1), block_ids=list(range(MAX_KEYS + 1)), num_tokens=(MAX_KEYS + 1) * BS),
     EXHAUSTED, "block_keys"),
    ("publish-short-key", "PublishLease", publish(block_keys=[keys(1)[0], b"\x01" * 31]), INVALID, "block_keys"),
    ("publish-long-key", "PublishLease", publish(block_keys=[keys(1)[0] + b"\x00", keys(2)[1]]), INVALID,
     "block_keys"),
    ("publish-ids-mismatch", "PublishLease", publish(block_ids=[100]), INVALID, "block_ids"),
    ("publish-ids-duplicate", "PublishLease", publish(block_ids=[100, 100]), INVALID, "block_ids"),
    ("publish-ids-negative", "PublishLease", publish(block_ids=[-1, 100]), INVALID, "block_ids"),
    ("publish-num-tokens", "PublishLease", publish(num_tokens=5 * BS), INVALID, "num_tokens"),
    ("publish-unknown-engine", "PublishLease", publish(engine_id="ghost"), NOT_FOUND, "engine_id"),
    ("publish-ttl-negative", "PublishLease", publish(ttl_s=-5.0), INVALID, "ttl_s"),
    ("publish-ttl-tiny", "PublishLease", publish(ttl_s=0.001), INVALID, "ttl_s"),
    ("publish-ttl-absurd", "PublishLease", publish(ttl_s=1e12), INVALID, "ttl_s"),
    ("publish-ttl-inf", "PublishLease", publish(ttl_s=float("inf")), INVALID, "ttl_s"),
    ("publish-ttl-nan", "PublishLease", publish(ttl_s=float("nan")), INVALID, "ttl_s"),
    ("publish-session-too-long", "PublishLease", publish(session_id="s" * 300), INVALID, "session_id"),
    # Place
    ("place-too-many-keys", "Place", place(block_keys=keys(MAX_KEYS + 1), num_tokens=(MAX_KEYS + 1) * BS),
     EXHAUSTED, "block_keys"),
    ("place-bad-key", "Place", place(block_keys=[b"short"]), INVALID, "block_keys"),
    ("place-block-size", "Place", place(block_size=0), INVALID, "block_size"),
    ("place-num-tokens", "Place", place(num_tokens=5), INVALID, "num_tokens"),
    ("place-unknown-layout", "Place", place(layout_fingerprint="fp-none"), PRECONDITION, "layout_fingerprint"),
    ("place-nan-residual", "Place", place(pd_residual_s=float("nan")), INVALID, "pd_residual_s"),
    ("place-huge-residual", "Place", place(decode_local_residual_s=-1e9), INVALID, "decode_local_residual_s"),
    ("place-engine-residual", "Place", place(pd_residual_by_engine={"p0": float("inf")}), INVALID,
     "pd_residual_by_engine"),
    ("place-residual-no-engine", "Place", place(decode_local_residual_by_engine={"": 0.1}), INVALID,
     "decode_local_residual_by_engine"),
    # RenewLease / ReleaseLease
    ("renew-unknown", "RenewLease", pb.RenewLeaseRequest(lease_id="nope"), NOT_FOUND, "lease_id"),
    ("renew-ttl-negative", "RenewLease", pb.RenewLeaseRequest(lease_id=LEASE, ttl_s=-1), INVALID, "ttl_s"),
    ("renew-ttl-absurd", "RenewLease", pb.RenewLeaseRequest(lease_id=LEASE, ttl_s=1e15), INVALID, "ttl_s"),
    ("release-unknown", "ReleaseLease", pb.ReleaseLeaseRequest(lease_id="nope"), NOT_FOUND, "lease_id"),
    # PinBlocks / CompleteTransfer
    ("pin-unknown-lease", "PinBlocks", pin(lease_id="nope"), NOT_FOUND, "lease_id"),
    ("pin-unknown-reader", "PinBlocks", pin(reader_engine_id="ghost"), NOT_FOUND, "reader_engine_id"),
    ("pin-other-layout", "PinBlocks", pin(reader_engine_id="q"), PRECONDITION, "reader_engine_id"),
    ("pin-zero-blocks", "PinBlocks", pin(num_blocks=0), INVALID, "num_blocks"),
    ("pin-too-many-blocks", "PinBlocks", pin(num_blocks=4), INVALID, "num_blocks"),
    ("pin-timeout-negative", "PinBlocks", pin(timeout_s=-1.0), INVALID, "timeout_s"),
    ("pin-timeout-absurd", "PinBlocks", pin(timeout_s=1e9), INVALID, "timeout_s"),
    ("complete-unknown-pin", "CompleteTransfer", pb.CompleteTransferRequest(pin_id="nope", success=True), NOT_FOUND,
     "pin_id"),
    # KeepAlive / DeregisterEngine
    ("keepalive-unknown", "KeepAlive", pb.KeepAliveRequest(engine_id="ghost"), NOT_FOUND, "engine_id"),
    ("keepalive-kv-usage", "KeepAlive", pb.KeepAliveRequest(engine_id="d", load=pb.EngineLoad(kv_usage=1.5)),
     INVALID, "load.kv_usage"),
    ("keepalive-negative-rate", "KeepAlive",
     pb.KeepAliveRequest(engine_id="d", load=pb.EngineLoad(prefill_tokens_per_s=-3)), INVALID,
     "load.prefill_tokens_per_s"),
    ("keepalive-nan-rate", "KeepAlive",
     pb.KeepAliveRequest(engine_id="d", load=pb.EngineLoad(prefill_tokens_per_s=float("nan"))), INVALID,
     "load.prefill_tokens_per_s"),
    ("keepalive-inf-bandwidth", "KeepAlive",
     pb.KeepAliveRequest(engine_id="d", load=pb.EngineLoad(transfer_bytes_per_s=float("inf"))), INVALID,
     "load.transfer_bytes_per_s"),
    ("deregister-unknown", "DeregisterEngine", pb.DeregisterEngineRequest(engine_id="ghost"), NOT_FOUND,
     "engine_id"),
    # ReportCacheEvents
    ("cache-unknown-engine", "ReportCacheEvents", cache_events(engine_id="ghost"), NOT_FOUND, "engine_id"),
    ("cache-other-incarnation", "ReportCacheEvents", cache_events(incarnation="inc-0"), PRECONDITION, "incarnation"),
    ("cache-seq-zero", "ReportCacheEvents", cache_events(seq=0), INVALID, "seq"),
    ("cache-short-key", "ReportCacheEvents", cache_events(stored_keys=[keys(1)[0], b"\x01" * 31]), INVALID,
     "stored_keys"),
    ("cache-long-removed-key", "ReportCacheEvents", cache_events(removed_keys=[keys(1)[0] + b"\x00"]), INVALID,
     "removed_keys"),
    ("cache-too-many-stored", "ReportCacheEvents", cache_events(stored_keys=keys(MAX_KEYS + 1)), INVALID,
     "stored_keys"),
    ("cache-too-many-removed", "ReportCacheEvents", cache_events(removed_keys=keys(MAX_KEYS + 1)), INVALID,
     "removed_keys"),
    # RegisterEngine
    ("register-unspecified-role", "RegisterEngine", register("new", pb.ENGINE_ROLE_UNSPECIFIED), INVALID,
     "engine.role"),
    ("register-unknown-role", "RegisterEngine", register("new", 42), INVALID, "engine.role"),
    ("register-empty-id", "RegisterEngine", register(""), INVALID, "engine.engine_id"),
    ("register-long-id", "RegisterEngine", register("e" * 300), INVALID, "engine.engine_id"),
    ("register-block-size", "RegisterEngine", register("new", block_size=0), INVALID, "engine.block_size"),
    ("register-empty-fingerprint", "RegisterEngine", register("new", fp=""), INVALID, "engine.layout_fingerprint"),
    # Issue 13's registration, field by field: each alone was accepted before the bounds.
    ("register-huge-block-size", "RegisterEngine", register("new", block_size=4294967295), INVALID,
     "engine.block_size"),
    ("register-huge-budget", "RegisterEngine", register("new", retention_budget_blocks=2**63), INVALID,
     "engine.retention_budget_blocks"),
    ("register-huge-step", "RegisterEngine", register("new", step_tokens=2**32 - 1), INVALID, "engine.step_tokens"),
    ("register-odd-fingerprint", "RegisterEngine", register("new", fp="made up; DROP"), INVALID,
     "engine.layout_fingerprint"),
    ("register-bad-grpc-address", "RegisterEngine",
     register("new", addresses=pb.EngineAddresses(grpc="nohost")), INVALID, "engine.addresses.grpc"),
    ("reregister-other-fingerprint", "RegisterEngine", register("d", fp="fp-changed"), PRECONDITION,
     "engine.layout_fingerprint"),
    ("reregister-other-block-size", "RegisterEngine", register("d", block_size=64), PRECONDITION,
     "engine.block_size"),
    ("reregister-other-role", "RegisterEngine", register("d", pb.ENGINE_ROLE_BOTH), PRECONDITION, "engine.role"),
]


def _with_lease(request: Any, lease_id: str) -> Any:
    if getattr(request, "lease_id", None) == LEASE:
        request = type(request).FromString(request.SerializeToString())
        request.lease_id = lease_id
    return request


@pytest.mark.parametrize(("method", "request_msg", "code", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_refused_with_status_naming_the_field(world: World, method: str, request_msg: Any,
                                                   code: grpc.StatusCode, field: str) -> None:
    request = _with_lease(request_msg, world.lease.lease_id)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await getattr(world.broker.stub, method)(request, timeout=5)
    assert exc.value.code() == code, exc.value
    details = exc.value.details() or ""
    assert details.startswith(field), f"{details!r} does not name {field!r}"
    assert view(await world.broker.inspect()) == world.baseline


async def test_identical_reregistration_is_accepted(world: World) -> None:
    reply = await world.broker.stub.RegisterEngine(register("d"), timeout=5)
    assert list(reply.live_lease_ids) == [world.lease.lease_id] and reply.last_eviction_seq == 0
    assert view(await world.broker.inspect()) == world.baseline


async def test_watch_evictions_for_an_unknown_engine(world: World) -> None:
    stream = StreamReader(world.broker.stub.WatchEvictions(pb.WatchEvictionsRequest(engine_id="ghost"), timeout=10))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stream.next(timeout_s=5)
        assert exc.value.code() == NOT_FOUND and (exc.value.details() or "").startswith("engine_id")
    finally:
        await stream.close()


async def test_place_stream_reports_each_refusal_and_goes_on(world: World) -> None:
    call = world.broker.stub.PlaceStream(timeout=10)
    bad = [place(block_size=0), place(block_keys=keys(MAX_KEYS + 1), num_tokens=(MAX_KEYS + 1) * BS),
           place(layout_fingerprint="fp-none")]
    await call.write(pb.PlaceBatch(requests=bad))  # one batch with every refusal, then a good one alone
    await call.write(pb.PlaceBatch(requests=[place()]))
    await call.done_writing()
    replies = [r async for r in call]
    assert [len(r.plans) for r in replies] == [3, 1]
    plans = [p for r in replies for p in r.plans]
    assert [p.error.split(":")[0] for p in plans] == ["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED",
                                                      "FAILED_PRECONDITION", ""]
    assert [p.error.split(": ")[1] if p.error else "" for p in plans] == ["block_size", "block_keys",
                                                                          "layout_fingerprint", ""]
    assert plans[-1].decision == pb.DECISION_TRANSFER and plans[-1].source_lease_id == world.lease.lease_id


async def test_message_over_the_size_limit_is_refused_by_grpc(world: World) -> None:
    huge = place(session_id="x" * (MAX_MESSAGE + 1000))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await world.broker.stub.Place(huge, timeout=5)
    assert exc.value.code() == EXHAUSTED
    assert "larger than max" in (exc.value.details() or ""), exc.value.details()
    # Just under the limit, the broker itself answers (and names the field).
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await world.broker.stub.Place(place(session_id="x" * (MAX_MESSAGE - 2000)), timeout=5)
    assert exc.value.code() == INVALID and (exc.value.details() or "").startswith("session_id")


async def test_clients_that_vanish_mid_stream(world: World) -> None:
    # Eviction streams cancelled at once, after the initial replay, and with a RESYNC pending.
    for after_seq in (0, 0, 999):
        stream = StreamReader(world.broker.stub.WatchEvictions(
            pb.WatchEvictionsRequest(engine_id="d", after_seq=after_seq), timeout=30))
        if after_seq:
            await stream.next(timeout_s=5)
        else:
            await stream.expect_quiet(0.05)
        await stream.close()
    # A placement stream abandoned with requests in flight.
    call = world.broker.stub.PlaceStream(timeout=10)
    for _ in range(20):
        await call.write(pb.PlaceBatch(requests=[place()] * 3))
    call.cancel()
    # Many clients at once, all gone before the broker answers them.
    calls = [world.broker.stub.WatchEvictions(pb.WatchEvictionsRequest(engine_id="d"), timeout=30)
             for _ in range(20)]
    await asyncio.sleep(0)
    for c in calls:
        c.cancel()


async def test_state_is_intact_after_all_of_that(world: World) -> None:
    """Runs last in this module: the broker still answers and nothing it holds has changed."""
    reply = await world.broker.inspect()
    assert view(reply) == world.baseline
    assert [x.lease_id for x in reply.leases] == [world.lease.lease_id]
    assert sorted(e.engine.engine_id for e in reply.engines) == ["d", "p", "q"]
    assert list(reply.pins) == []
    plan = await world.broker.stub.Place(place(), timeout=5)
    assert plan.decision == pb.DECISION_TRANSFER and plan.source_lease_id == world.lease.lease_id
    assert list(plan.source_block_ids) == [5, 6, 7]
    # And it still takes valid writes.
    pin_reply = await world.broker.stub.PinBlocks(pb.PinBlocksRequest(reader_engine_id="p",
                                                                      lease_id=world.lease.lease_id, num_blocks=2),
                                                  timeout=5)
    await world.broker.stub.CompleteTransfer(pb.CompleteTransferRequest(pin_id=pin_reply.pin_id, success=False),
                                             timeout=5)
    assert world.broker.proc is not None and world.broker.proc.alive
    assert "Traceback" not in world.broker.proc.log_path.read_text(), world.broker.proc.log_tail()
