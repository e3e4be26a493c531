"""A fake connector on a real sidecar's Unix socket, and the sidecar it talks to, for the sidecar's tests."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from kvloop.engines.sidecar import SidecarConfig, serve
from kvloop.v1 import engine_link_pb2 as lpb
from kvloop.v1 import engine_link_pb2_grpc
from tests.integration.helpers import poll

FP = "fp-sidecar-test"


class FakeConnector:
    """A connector stand-in (fake): an Attach stream fed from a queue, commands collected."""

    def __init__(self, socket_path: Path) -> None:
        self.channel = grpc.aio.insecure_channel(f"unix://{socket_path}")
        self.events: asyncio.Queue[lpb.ConnectorEvent | None] = asyncio.Queue()
        self.commands: list[lpb.ConnectorCommand] = []
        self.call: Any = None
        self.reader: asyncio.Task[None] | None = None

    async def _outgoing(self) -> AsyncIterator[lpb.ConnectorEvent]:
        while (event := await self.events.get()) is not None:
            yield event

    async def attach(self, hello: lpb.ConnectorHello) -> None:
        self.call = engine_link_pb2_grpc.EngineLinkStub(self.channel).Attach(self._outgoing(), wait_for_ready=True)
        self.events.put_nowait(lpb.ConnectorEvent(hello=hello))

        async def read() -> None:
            async for command in self.call:
                self.commands.append(command)

        self.reader = asyncio.create_task(read())

    def released(self) -> set[str]:
        return {rid for c in self.commands for rid in c.release_request_ids}

    def held(self) -> set[str]:
        return {rid for c in self.commands for rid in c.hold_request_ids}

    async def close(self) -> None:
        self.events.put_nowait(None)
        if self.reader is not None:
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await asyncio.wait_for(self.reader, 5)
        await self.channel.close()


@contextlib.asynccontextmanager
async def running_sidecar(tmp_path: Path, broker: str, engine_id: str, **overrides: Any
                          ) -> AsyncIterator[SidecarConfig]:
    values: dict[str, Any] = dict(engine_id=engine_id, role="decode", broker=broker, socket=tmp_path / "s.sock",
                                  engine_url="http://127.0.0.1:9", nixl_address="127.0.0.1:5600",
                                  layout_fingerprint=FP, retention_fraction=0.5, log_format="console")
    values.update(overrides)
    config = SidecarConfig(**values)
    config.validate()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(config, stop))
    await poll(lambda: asyncio.sleep(0, config.socket.exists()), bool, timeout_s=10, what="sidecar socket")  # type: ignore[union-attr]
    try:
        yield config
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def hello(engine_id: str, blocks: int = 100) -> lpb.ConnectorHello:
    return lpb.ConnectorHello(engine_id=engine_id, incarnation=f"inc-{time.monotonic_ns()}", block_size=128,
                              num_blocks=blocks, bytes_per_block=4096, kv_role_decode=True)


def retained(request_id: str, n_tokens: int, first_block: int = 0) -> lpb.ConnectorEvent:
    n_blocks = n_tokens // 128
    return lpb.ConnectorEvent(retained=lpb.Retained(
        request_id=request_id, token_ids=list(range(n_tokens)),
        block_ids=list(range(first_block, first_block + n_blocks)), session_id="sess", hold_s=60))
