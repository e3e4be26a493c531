"""The embedded store: state lives only in the broker process."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kvloop.broker.core import Changes, Lease
from kvloop.broker.store.base import Snapshot


class MemoryStore:
    kind = "memory"
    durable = False

    async def load(self) -> Snapshot:
        return Snapshot()

    async def apply(self, changes: Changes, hold_until: Callable[[Lease], float], now: float) -> None:
        return None

    async def close(self) -> None:
        return None


class SoloElection:
    """A single replica is always the leader."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._stop = asyncio.Event()

    async def run(
        self, on_elected: Callable[[], Awaitable[None]], on_deposed: Callable[[], Awaitable[None]]
    ) -> None:
        await on_elected()
        await self._stop.wait()

    async def resign(self) -> None:
        self._stop.set()

    def leader(self) -> str:
        return self._address

    async def still_leader(self) -> bool:
        return not self._stop.is_set()
