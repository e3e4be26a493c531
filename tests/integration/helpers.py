"""Shared helpers for the integration tests: engines and keys, bounded polling, stream reads, log parsing.

Every wait here has a deadline; readiness is polled, never slept for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvloop.shared import procs
from kvloop.shared.hashing import ExtraKeys, block_keys
from kvloop.v1 import broker_pb2 as pb
from kvloop.v1 import broker_pb2_grpc

BS = 128
SERVICE = "kvloop.v1.KVBroker"
T = TypeVar("T")


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def keys_for(toks: Sequence[int], fp: str, bs: int = BS) -> list[bytes]:
    return block_keys(list(toks), bs, ExtraKeys(fp))


def engine(eid: str, role: Any, fp: str, *, budget: int = 1000, bs: int = BS, incarnation: str = "inc-1") -> pb.Engine:
    return pb.Engine(
        engine_id=eid, role=role, block_size=bs, layout_fingerprint=fp, retention_budget_blocks=budget,
        incarnation=incarnation,
        addresses=pb.EngineAddresses(grpc=f"{eid}.grpc:1", http=f"http://{eid}:8000", nixl=f"{eid}.nixl:2"),
    )


def publish_request(eid: str, toks: Sequence[int], fp: str, *, first_block_id: int = 0, ttl_s: float = 0.0,
                    session: str = "", bs: int = BS) -> pb.PublishLeaseRequest:
    keys = keys_for(toks, fp, bs)
    return pb.PublishLeaseRequest(engine_id=eid, session_id=session, block_keys=keys,
                                  block_ids=list(range(first_block_id, first_block_id + len(keys))),
                                  num_tokens=len(toks), ttl_s=ttl_s)


def place_request(toks: Sequence[int], fp: str, *, session: str = "", bs: int = BS, decode_local: bool = False,
                  pin: bool = False) -> pb.PlaceRequest:
    """A placement request; strict P/D unless ``decode_local`` (these tests are about the P/D paths' bookkeeping;
    tests/integration/test_broker_service.py::test_decode_local_and_place_and_pin covers the rest)."""
    return pb.PlaceRequest(session_id=session, block_keys=keys_for(toks, fp, bs), num_tokens=len(toks),
                           layout_fingerprint=fp, block_size=bs, no_decode_local=not decode_local, pin=pin)


class Broker:
    """An async channel to one broker replica with its KVBroker and health stubs."""

    def __init__(self, address: str, proc: procs.Proc | None = None) -> None:
        self.address = address
        self.proc = proc
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = broker_pb2_grpc.KVBrokerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def inspect(self) -> pb.InspectResponse:
        return await self.stub.Inspect(pb.InspectRequest(), timeout=5)

    async def health_status(self, service: str) -> int:
        reply = await self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(reply.status)

    async def close(self) -> None:
        await self.channel.close()


async def poll(fn: Callable[[], Awaitable[T]], ok: Callable[[T], bool], *, timeout_s: float, what: str,
               interval_s: float = 0.05) -> T:
    """Call ``fn`` until ``ok(result)``; fail with the last result (or error) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = "no result"
    while True:
        try:
            result = await fn()
            if ok(result):
                return result
            last = result
        except grpc.aio.AioRpcError as exc:
            last = f"{exc.code().name}: {exc.details()}"
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last: {last}")
        await asyncio.sleep(interval_s)


class StreamReader:
    """Reads a server stream in the background, so waiting for a message with a deadline never cancels
    the call itself. ``next()`` raises the call's error (an ``AioRpcError``) once it ends that way."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        try:
            async for msg in self.call:
                self._queue.put_nowait(msg)
            self._queue.put_nowait(grpc.aio.EOF)
        except grpc.aio.AioRpcError as exc:
            self._queue.put_nowait(exc)
        except asyncio.CancelledError:
            self._queue.put_nowait(asyncio.CancelledError())
            raise

    async def next(self, timeout_s: float = 10.0) -> Any:
        item = await asyncio.wait_for(self._queue.get(), timeout_s)
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)  # later reads see the same end
            raise item
        if item is grpc.aio.EOF:
            self._queue.put_nowait(item)
            raise AssertionError("the stream ended")
        return item

    async def take(self, n: int, timeout_s: float = 10.0) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        return [await self.next(max(0.01, deadline - time.monotonic())) for _ in range(n)]

    async def expect_quiet(self, seconds: float) -> None:
        """Assert that nothing arrives within ``seconds`` (the call stays open)."""
        try:
            item = await asyncio.wait_for(self._queue.get(), seconds)
        except TimeoutError:
            return
        raise AssertionError(f"unexpected item on the stream: {item}")

    async def close(self) -> None:
        self.call.cancel()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def __aenter__(self) -> StreamReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def log_event(proc: procs.Proc, event: str, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """The first JSON log line of ``proc`` whose ``event`` is ``event``."""
    deadline = time.monotonic() + timeout_s
    while True:
        for line in proc.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("event") == event:
                    return dict(record)
        if time.monotonic() >= deadline:
            raise AssertionError(f"no {event!r} log line from {proc.name}:\n{proc.log_tail()}")
        time.sleep(0.05)


def lease_by_id(reply: pb.InspectResponse, lease_id: str) -> pb.Lease | None:
    return next((x for x in reply.leases if x.lease_id == lease_id), None)


def engine_ids(reply: pb.InspectResponse) -> set[str]:
    return {e.engine.engine_id for e in reply.engines}
