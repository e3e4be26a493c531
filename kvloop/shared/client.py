"""A thin broker client over the ``kvloop.v1`` stubs: one channel per replica address, fail over to the
next replica when one answers UNAVAILABLE (not the leader, or down). Used by the CLI, the benchmark,
the router and the engine sidecars."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Any

import grpc

from kvloop.shared.protocol import PrefillReport, pull_params
from kvloop.shared.tls import TlsFiles, insecure_or_secure_channel
from kvloop.v1 import broker_pb2, broker_pb2_grpc


class BrokerClient:
    """``tls``: the client's :class:`kvloop.shared.tls.TlsFiles` (CA of the broker, the client's own certificate and
    key); None or nothing set = plaintext channels. ``token``: the caller's bearer token, sent on every call
    (:mod:`kvloop.shared.auth`)."""

    def __init__(self, addresses: Sequence[str] | str, *, timeout_s: float = 5.0,
                 options: Sequence[tuple[str, Any]] = (), tls: TlsFiles | None = None,
                 token: str | None = None) -> None:
        if isinstance(addresses, str):
            addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        if not addresses:
            raise ValueError("broker address list is empty")
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
        self._channels = [insecure_or_secure_channel(a, tls, options, token) for a in self.addresses]
        self._stubs = [broker_pb2_grpc.KVBrokerStub(c) for c in self._channels]
        self._current = 0

    @property
    def stub(self) -> broker_pb2_grpc.KVBrokerStub:
        return self._stubs[self._current]

    def rotate(self) -> None:
        """Make the next replica the current one (a stream found the current one is not the leader, or lost it)."""
        self._current = (self._current + 1) % len(self._stubs)

    async def call(self, method: str, request: Any, *, timeout_s: float | None = None,
                   from_leader: bool = False) -> Any:
        """Unary call with failover: tries each replica once, starting with the last good one.

        ``from_leader``: for a call a follower answers too, with its own empty view (``Inspect``: ``leader`` false, no
        engines), such an answer counts as a miss and the next replica is asked; when no replica says it leads, the
        last answer is returned."""
        last: grpc.aio.AioRpcError | None = None
        follower_answer: Any = None
        for attempt in range(len(self._stubs)):
            index = (self._current + attempt) % len(self._stubs)
            try:
                response = await getattr(self._stubs[index], method)(request, timeout=timeout_s or self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                last = exc
                continue
            if from_leader and not getattr(response, "leader", True):
                follower_answer = response
                continue
            self._current = index
            return response
        if follower_answer is not None:
            return follower_answer
        assert last is not None
        raise last

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> BrokerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def wait_serving(address: str, service: str = "", *, timeout_s: float = 30.0,
                       tls: TlsFiles | None = None) -> None:
    """Poll grpc.health.v1 until ``service`` on ``address`` is SERVING; raise TimeoutError otherwise."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = "no answer"
    async with insecure_or_secure_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while loop.time() < deadline:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as exc:
                last = exc.code().name
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{address} service {service!r} not SERVING after {timeout_s}s (last: {last})")


class PlacementStream:
    """Placements over one long-lived ``PlaceStream`` call. Callers ``await place(request)``
    concurrently; a writer sends what queued up while its previous write was in flight as one batch
    (gRPC allows one outstanding write per call, and one message per batch amortises its cost), and
    a reader resolves replies in order. When the stream breaks, every waiting caller gets the error
    and the next ``place`` opens a new stream."""

    MAX_BATCH = 256

    def __init__(self, broker: broker_pb2_grpc.KVBrokerStub | BrokerClient) -> None:
        """``broker``: one replica's stub, or a :class:`BrokerClient`, whose current replica each new stream opens
        on (:meth:`fail_over` moves to the next)."""
        self._broker = broker
        self.generation = 0
        """Bumped at each fail-over: which stream a caller's placement went out on."""
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._call: Any = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def replicas(self) -> int:
        return len(self._broker.addresses) if isinstance(self._broker, BrokerClient) else 1

    def fail_over(self, generation: int) -> None:
        """Drop this stream (its waiters get an error) and open the next on the next replica: the broker answered
        that it is not the leader, or the stream broke. ``generation``: the :attr:`generation` the caller placed
        on; a caller whose stream was already moved (by another caller's failure) moves nothing."""
        if generation != self.generation:
            return
        self.generation += 1
        self._fail(ConnectionError("placement stream moved to another broker replica"))
        if isinstance(self._broker, BrokerClient):
            self._broker.rotate()

    def _open(self) -> None:
        stub = self._broker.stub if isinstance(self._broker, BrokerClient) else self._broker
        self._call = stub.PlaceStream()
        self._tasks = [asyncio.create_task(self._write_loop(self._call)),
                       asyncio.create_task(self._read_loop(self._call))]

    async def _write_loop(self, call: Any) -> None:
        from kvloop.v1 import broker_pb2 as pb

        try:
            while True:
                batch = [await self._queue.get()]
                while len(batch) < self.MAX_BATCH and not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                await call.write(pb.PlaceBatch(requests=batch))
        except Exception as exc:  # the call failed: fail the waiters (the reader sees it too)
            self._fail(exc)

    async def _read_loop(self, call: Any) -> None:
        try:
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise ConnectionError("broker closed the placement stream")
                for plan in reply.plans:
                    future = self._waiting.popleft()
                    if not future.done():  # a caller that timed out leaves a cancelled future
                        future.set_result(plan)
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self._call is None:
            return
        self._call.cancel()
        self._call = None
        for task in self._tasks:
            task.cancel()
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(exc)
        self._queue = asyncio.Queue()

    async def place(self, request: Any, timeout_s: float = 5.0) -> Any:
        """The request's Plan (check ``plan.error``); raises the stream's error if it broke."""
        if self._call is None:
            self._open()
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        self._queue.put_nowait(request)
        return await asyncio.wait_for(future, timeout_s)

    async def close(self) -> None:
        if self._call is not None:
            call, self._call = self._call, None
            for task in self._tasks:
                task.cancel()
            call.cancel()


def transfer_params(plan: Any, pin: Any) -> dict[str, Any]:
    """The prefill's ``kv_transfer_params`` to pull the pinned prefix of ``plan``'s source lease
    (``plan``: a ``Plan``; ``pin``: a ``PinBlocksResponse``)."""
    return pull_params(source_engine_id=plan.source_engine_id, lease_id=plan.source_lease_id,
                       nixl_address=plan.source_addresses.nixl, block_ids=list(pin.block_ids),
                       matched_blocks=int(plan.matched_blocks), matched_tokens=int(plan.matched_tokens))


def complete_request(pin: Any, report: PrefillReport | None) -> Any:
    """``CompleteTransfer`` for a pin from the prefill's report (None: the pull did not happen). Only pulls of
    ``BANDWIDTH_SAMPLE_MIN_BYTES`` or more carry a duration to learn bandwidth from."""
    from kvloop.v1 import broker_pb2 as pb

    if report is None:
        return pb.CompleteTransferRequest(pin_id=pin.pin_id, success=False)
    nbytes, seconds = report.bandwidth_sample()
    return pb.CompleteTransferRequest(pin_id=pin.pin_id, success=not report.pull_failed, bytes=nbytes,
                                      duration_s=seconds)


def plan_attributes(plan: Any) -> dict[str, Any]:
    """A ``Plan``'s span attributes, the same on the router's ``kvloop.turn`` and the broker's placement span:
    the planned path (``kvloop.planned``), ``kvloop.plan.*`` (why, what it matched and would reuse, which engines)
    and each path's estimated cost (``kvloop.cost.*``). The reason and veto are the words as the broker said them
    (strings on the wire: :mod:`kvloop.shared.vocabulary`), so a trace shows a newer broker's word that the
    router's own ``kvloop.reason`` reports as ``unknown``."""
    cost = plan.cost
    return {"kvloop.planned": broker_pb2.Decision.Name(plan.decision).removeprefix("DECISION_"),
            "kvloop.plan.reason": plan.reason,
            "kvloop.plan.session": plan.session_id, "kvloop.plan.local_tokens": plan.local_tokens,
            "kvloop.plan.pull_tokens": plan.pull_tokens, "kvloop.plan.matched_tokens": plan.matched_tokens,
            "kvloop.plan.matched_blocks": plan.matched_blocks, "kvloop.plan.prompt_blocks": plan.prompt_blocks,
            "kvloop.plan.recompute_tokens": plan.recompute_tokens,
            "kvloop.plan.threshold_tokens": plan.threshold_tokens,
            "kvloop.plan.cached_tokens_seen": plan.cached_tokens_seen,
            "kvloop.plan.decode_local_veto": plan.decode_local_veto,
            "kvloop.plan.source_engine": plan.source_engine_id, "kvloop.plan.source_lease": plan.source_lease_id,
            "kvloop.plan.source_tier": broker_pb2.Tier.Name(plan.source_tier).removeprefix("TIER_").lower(),
            "kvloop.plan.prefill_engine": plan.prefill_engine_id, "kvloop.plan.decode_engine": plan.decode_engine_id,
            "kvloop.plan.decode_sticky": plan.decode_sticky, "kvloop.plan.candidates": plan.candidates,
            "kvloop.plan.prefetch": plan.prefetch,
            "kvloop.cost.transfer_s": cost.transfer_s, "kvloop.cost.recompute_s": cost.recompute_s,
            "kvloop.cost.measured": cost.measured, "kvloop.cost.decode_local_s": cost.decode_local_s,
            "kvloop.cost.prefill_local_s": cost.prefill_local_s, "kvloop.cost.transfer_path_s": cost.transfer_path_s,
            "kvloop.cost.recompute_path_s": cost.recompute_path_s,
            "kvloop.cost.prefill_queue_s": cost.prefill_queue_s, "kvloop.cost.decode_stall_s": cost.decode_stall_s,
            "kvloop.cost.pd_residual_s": cost.pd_residual_s,
            "kvloop.cost.decode_local_residual_s": cost.decode_local_residual_s}
