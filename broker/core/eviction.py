"""Eviction policies: which unpinned leases of one engine to free to release ``need`` blocks.

Blocks are counted by the engine's block id: two leases that share a physical block (vLLM's prefix
cache shares the blocks of a common system prompt) hold it once, and evicting one of them frees only
the blocks no other lease on that engine holds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from kvloop.broker.core.model import Lease


class Refcounts(Protocol):
    def __getitem__(self, block: int) -> int: ...


class BlockCounts(Refcounts, Protocol):
    """An engine's whole refcounts (a ``Counter``, or a host tier's slots): what a :class:`RefView` overlays."""

    def get(self, block: int, default: int, /) -> int: ...

    def __len__(self) -> int: ...


class RefView:
    """One engine's block refcounts plus a small overlay of tentative changes, so a publication or an
    eviction can be simulated without copying refcounts that may cover a million blocks."""

    def __init__(self, base: BlockCounts, overlay: Counter[int] | None = None) -> None:
        self._base = base
        self._overlay: Counter[int] = overlay if overlay is not None else Counter()

    def __getitem__(self, block: int) -> int:
        return self._base.get(block, 0) + self._overlay.get(block, 0)

    def hold(self, blocks: Iterable[int]) -> None:
        for block in set(blocks):
            self._overlay[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        for block in set(blocks):
            self._overlay[block] -= 1

    def copy(self) -> RefView:
        return RefView(self._base, Counter(self._overlay))

    def distinct(self) -> int:
        """Blocks with a positive count; assumes the base holds only positive counts."""
        n = len(self._base)
        for block, delta in self._overlay.items():
            base = self._base.get(block, 0)
            n += int(base + delta > 0) - int(base > 0)
        return n


def freed_blocks(lease: Lease, refcounts: Refcounts) -> int:
    """How many blocks evicting ``lease`` alone would free, given the engine's block refcounts."""
    return sum(1 for b in set(lease.block_ids) if refcounts[b] == 1)


class EvictionPolicy(Protocol):
    @property
    def name(self) -> str: ...

    def rank(self, candidates: Iterable[Lease], refcounts: Refcounts, now: float) -> list[Lease]:
        """Candidates in eviction order, first evicted first."""
        ...


@dataclass(frozen=True)
class LruPolicy:
    """Least recently used first."""

    name: str = "lru"

    def rank(self, candidates: Iterable[Lease], refcounts: Refcounts, now: float) -> list[Lease]:
        return sorted(candidates, key=lambda lease: (lease.last_used, lease.lease_id))


@dataclass(frozen=True)
class CostAwarePolicy:
    """Free first what is cheapest to recompute per block it holds.

    The value of keeping a lease is the prefill work its next turn would redo without it: its blocks
    that no other lease holds, each weighted by its position (a block deep in a long context costs
    more to recompute, since attention reads everything before it), discounted by how long ago the
    lease was last used (half-life ``recency_half_life_s``). Dividing by the blocks it frees makes
    long shared prefixes (which free little) and recently used sessions the last to go.
    """

    recency_half_life_s: float = 120.0
    attention_weight: float = 1 / 32
    """Extra recompute cost of a block per block of context before it (0 = linear prefill)."""
    name: str = "cost"

    def value_per_freed_block(self, lease: Lease, refcounts: Refcounts, now: float) -> float:
        seen: set[int] = set()
        work = 0.0
        freed = 0
        for position, block in enumerate(lease.block_ids):
            if block in seen or refcounts[block] != 1:
                continue
            seen.add(block)
            freed += 1
            work += 1.0 + self.attention_weight * position
        if freed == 0:
            return math.inf  # evicting it frees nothing
        age = max(0.0, now - lease.last_used)
        recency = 0.5 ** (age / self.recency_half_life_s)
        return work * recency / freed

    def rank(self, candidates: Iterable[Lease], refcounts: Refcounts, now: float) -> list[Lease]:
        return sorted(
            candidates,
            key=lambda lease: (self.value_per_freed_block(lease, refcounts, now), lease.last_used, lease.lease_id),
        )


POLICIES = ("cost", "lru")


def make_policy(name: str, recency_half_life_s: float = CostAwarePolicy.recency_half_life_s) -> EvictionPolicy:
    if name == "lru":
        return LruPolicy()
    if name == "cost":
        return CostAwarePolicy(recency_half_life_s=recency_half_life_s)
    raise ValueError(f"unknown eviction policy {name!r}; known: {POLICIES}")


def choose_victims(
    policy: EvictionPolicy, candidates: Iterable[Lease], refcounts: BlockCounts | RefView, need: int,
    now: float,
) -> tuple[list[Lease], int]:
    """Victims in policy order until ``need`` blocks are freed; returns (victims, blocks freed).

    Freed blocks are simulated on a copy of the refcounts, so two victims that share a block free it
    once both are gone. Victims that would free nothing are skipped.
    """
    if need <= 0:
        return [], 0
    counts = refcounts.copy() if isinstance(refcounts, RefView) else RefView(refcounts)
    victims: list[Lease] = []
    freed = 0
    remaining = policy.rank(candidates, refcounts, now)
    progress = True
    # A lease whose blocks are all shared frees nothing until its sharers go, so a later pass
    # may take it; passes stop when one frees nothing.
    while freed < need and remaining and progress:
        progress = False
        skipped: list[Lease] = []
        for lease in remaining:
            if freed >= need:
                skipped.append(lease)
                continue
            gain = freed_blocks(lease, counts)
            if gain == 0:
                skipped.append(lease)
                continue
            counts.release(lease.block_ids)
            victims.append(lease)
            freed += gain
            progress = True
        remaining = skipped
        if not progress and freed < need:
            # Stuck: every remaining lease shares each of its blocks, but a block whose holders are all
            # remaining candidates still frees once they all go. Take the first (in policy order) that
            # holds such a block; its co-holders then free it in the next pass.
            holders = Counter(b for lease in remaining for b in set(lease.block_ids))
            for i, lease in enumerate(remaining):
                if any(counts[b] == holders[b] for b in set(lease.block_ids)):
                    counts.release(lease.block_ids)
                    victims.append(lease)
                    del remaining[i]
                    progress = True
                    break
    return victims, freed
