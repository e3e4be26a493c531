"""The client side of ``kvloop bench broker-scale``: the router's and a decode engine's calls of each measured turn,
over gRPC, from a process of its own (on its own core where the machine has two), so that what a turn costs the
client (its event loop, protobuf encoding) neither shares the broker's core nor queues behind the broker's work.

A turn is ``Place`` (strict P/D, pinned: a TRANSFER of the session's lease), ``CompleteTransfer`` and
``PublishLease`` of the session grown by one block. The turns are played twice, on different sessions: once
with unary ``Place`` and once over ``PlaceStream`` through :class:`kvloop.shared.client.PlacementStream`, the
router's own placement client (the router places every turn that way).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Session = tuple[str, str, list[bytes], list[int]]
"""A lease to grow: (engine id, session id, its block keys, its block ids)."""


@dataclass
class ClientWork:
    port: int
    unary: list[Session]
    stream: list[Session]
    next_id: dict[str, int]
    """Each engine's next free block id (the grown block's)."""
    concurrency: int
    block_size: int
    fingerprint: str
    seed: int
    cpus: set[int] | None = None


@dataclass
class ClientResult:
    place_ms: list[float] = field(default_factory=list)
    """Unary ``Place``, each call's wall time as the client sees it."""
    place_stream_ms: list[float] = field(default_factory=list)
    """``Place`` over ``PlaceStream`` (the router's path)."""
    turn_ms: list[float] = field(default_factory=list)
    decisions: dict[str, int] = field(default_factory=dict)
    errors: int = 0


def drive(work: ClientWork, conn: Any) -> None:
    """A spawned process's entry: play ``work``'s turns, send the :class:`ClientResult` over ``conn``."""
    from kvloop.shared.serving import run_async

    answer(conn, work.cpus, lambda: run_async(_play(work)))


def answer(conn: Any, cpus: set[int] | None, work: Callable[[], Any]) -> None:
    """A spawned process's side of :func:`in_a_process`: pinned to ``cpus`` (None: left as it is), send what
    ``work()`` returns, or the error it raised, over ``conn``."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        conn.send(work())
    except BaseException as exc:
        conn.send(exc)
        raise
    finally:
        conn.close()


def in_a_process(target: Callable[..., None], args: tuple[Any, ...], name: str) -> Any:
    """Run ``target(*args, conn)`` in a spawned process (a fresh interpreter: its memory and event loop its own) and
    return what it sent over ``conn`` through :func:`answer`; raise what it raised, or that it died."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe(duplex=False)
    process = context.Process(target=target, args=(*args, theirs), name=name)
    process.start()
    theirs.close()
    try:
        reply = mine.recv()
    except EOFError:
        reply = RuntimeError(f"{name} died (exit code {process.exitcode})")
    process.join(60)
    if isinstance(reply, BaseException):
        raise RuntimeError(f"{name} failed: {reply!r}") from reply
    return reply


async def _play(work: ClientWork) -> ClientResult:
    import asyncio

    import grpc

    from kvloop.shared.client import PlacementStream
    from kvloop.v1 import broker_pb2 as pb
    from kvloop.v1 import broker_pb2_grpc

    rng = random.Random(work.seed)
    result = ClientResult()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{work.port}")
    stub = broker_pb2_grpc.KVBrokerStub(channel)
    stream = PlacementStream(stub)

    async def turn(session: Session, over_stream: bool) -> None:
        eid, session_id, keys, ids = session
        grown = [*keys, rng.randbytes(32)]
        request = pb.PlaceRequest(session_id=session_id, block_keys=grown, num_tokens=len(grown) * work.block_size + 1,
                                  layout_fingerprint=work.fingerprint, block_size=work.block_size, pin=True,
                                  no_decode_local=True)
        t0 = time.perf_counter()
        try:
            if over_stream:
                plan = await stream.place(request, timeout_s=30)
                if plan.error:
                    raise RuntimeError(plan.error)
                result.place_stream_ms.append((time.perf_counter() - t0) * 1e3)
            else:
                plan = await stub.Place(request, timeout=30)
                result.place_ms.append((time.perf_counter() - t0) * 1e3)
            name = pb.Decision.Name(plan.decision).removeprefix("DECISION_")
            result.decisions[name] = result.decisions.get(name, 0) + 1
            if plan.HasField("pin"):
                await stub.CompleteTransfer(pb.CompleteTransferRequest(
                    pin_id=plan.pin.pin_id, success=True, bytes=len(keys) * 65536, duration_s=0.01), timeout=30)
            new_ids = [*ids, work.next_id[eid]]
            work.next_id[eid] += 1
            await stub.PublishLease(pb.PublishLeaseRequest(
                engine_id=eid, session_id=session_id, block_keys=grown, block_ids=new_ids,
                num_tokens=len(grown) * work.block_size), timeout=30)
            result.turn_ms.append((time.perf_counter() - t0) * 1e3)
        except (grpc.aio.AioRpcError, RuntimeError, ConnectionError, TimeoutError):
            result.errors += 1

    async def client(mine: list[Session], over_stream: bool) -> None:
        for session in mine:
            await turn(session, over_stream)

    try:
        for sessions, over_stream in ((work.unary, False), (work.stream, True)):
            await asyncio.gather(*(client(sessions[c::work.concurrency], over_stream)
                                   for c in range(work.concurrency)))
    finally:
        await stream.close()
        await channel.close()
    return result
