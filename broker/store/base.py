"""The store and election interfaces."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvloop.broker.core import Changes, EngineRecord, Lease, Pin


@dataclass
class Snapshot:
    engines: list[EngineRecord] = field(default_factory=list)
    leases: list[Lease] = field(default_factory=list)
    pins: list[Pin] = field(default_factory=list)


class Store(Protocol):
    kind: str
    durable: bool
    """False when ``apply`` keeps nothing (the runtime then skips it)."""

    async def load(self) -> Snapshot:
        """Everything persisted, for a broker that starts or becomes leader."""
        ...

    async def apply(self, changes: Changes, hold_until: Callable[[Lease], float], now: float) -> None:
        """Persist one batch of changes atomically. ``hold_until(lease)`` is the latest time the store
        may drop a lease by itself (its expiry, or later while pinned). Raises ``Unavailable`` when the
        write did not happen (store down, or this replica is no longer the leader)."""
        ...

    async def close(self) -> None: ...


class Election(Protocol):
    """Leadership among broker replicas. ``run`` calls ``on_elected`` when this replica becomes leader
    and ``on_deposed`` when it stops being one, until ``resign``."""

    async def run(
        self, on_elected: Callable[[], Awaitable[None]], on_deposed: Callable[[], Awaitable[None]]
    ) -> None: ...

    async def resign(self) -> None: ...

    def leader(self) -> str:
        """The current leader's advertised address, or "" when unknown."""
        ...

    async def still_leader(self) -> bool:
        """Does the store still name this replica the leader (checked now, not remembered)?"""
        ...
