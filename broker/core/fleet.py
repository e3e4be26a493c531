"""The fleet as placement reads it: the live engines grouped by KV layout, each group's engines of each role kept in
load order as their loads change, and each group's reported prefill rates kept sorted. Pure: no I/O, no clock.

Placement prices the engines that hold a prompt's prefix, plus a few of the least loaded of each role; this book
finds those few without a walk over the fleet. A keep-alive moves its engine in four orders (O(log n) to find
the place, and a list insertion whose memmove is a few microseconds at 10,000 engines).

Two load orders, because placement reads load two ways (see ``BrokerState.engines_as_placed``):
- ``by_score``: the sidecars' reports (running + waiting + KV usage), where no router counts its requests;
- ``by_kv``: KV usage alone, for the engines no router has a request on when routers count (their placed score is
  their KV usage; the engines with requests in flight are priced one by one, as the routers name them).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvloop.broker.core.model import EngineRecord

Layout = tuple[str, int]
"""(layout fingerprint, block size): engines of one layout can serve and pull each other's blocks."""


def layout_of(rec: EngineRecord) -> Layout:
    return rec.info.layout_fingerprint, rec.info.block_size


class Ranking:
    """Engine ids in order of a float key, then id. Kept ordered: ``set`` moves one engine."""

    def __init__(self) -> None:
        self._order: list[tuple[float, str]] = []
        self._key: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._order)

    def set(self, engine_id: str, key: float) -> None:
        old = self._key.get(engine_id)
        if old == key:
            return
        if old is not None:
            del self._order[bisect.bisect_left(self._order, (old, engine_id))]
        self._key[engine_id] = key
        bisect.insort(self._order, (key, engine_id))

    def discard(self, engine_id: str) -> None:
        old = self._key.pop(engine_id, None)
        if old is not None:
            del self._order[bisect.bisect_left(self._order, (old, engine_id))]

    def nth(self, i: int) -> float:
        """The ``i``-th least key."""
        return self._order[i][0]

    def ids(self) -> Iterator[str]:
        """Least key first."""
        return (engine_id for _, engine_id in self._order)

    def first(self, k: int, skip: Callable[[str], bool]) -> list[str]:
        """The ``k`` first ids that ``skip`` does not reject: O(k + skipped)."""
        out: list[str] = []
        if k <= 0:
            return out
        for _, engine_id in self._order:
            if not skip(engine_id):
                out.append(engine_id)
                if len(out) == k:
                    break
        return out


@dataclass
class _Group:
    by_score: dict[str, Ranking] = field(default_factory=lambda: {"prefill": Ranking(), "decode": Ranking()})
    by_kv: dict[str, Ranking] = field(default_factory=lambda: {"prefill": Ranking(), "decode": Ranking()})
    rates: Ranking = field(default_factory=Ranking)
    """The prefill rates the group's engines reported (those that reported one)."""
    members: set[str] = field(default_factory=set)


class Fleet:
    def __init__(self) -> None:
        self._groups: dict[Layout, _Group] = {}
        self._layout: dict[str, Layout] = {}

    def update(self, rec: EngineRecord) -> None:
        """A registration or a new load report: the engine's place in its group's orders."""
        engine_id, layout = rec.info.engine_id, layout_of(rec)
        if self._layout.get(engine_id, layout) != layout:
            self.remove(engine_id)
        self._layout[engine_id] = layout
        group = self._groups.setdefault(layout, _Group())
        group.members.add(engine_id)
        load, role = rec.load, rec.info.role
        for name, can in (("prefill", role.can_prefill), ("decode", role.can_decode)):
            if can:
                group.by_score[name].set(engine_id, load.score)
                group.by_kv[name].set(engine_id, load.kv_usage)
        if load.prefill_tokens_per_s > 0:
            group.rates.set(engine_id, load.prefill_tokens_per_s)
        else:
            group.rates.discard(engine_id)

    def remove(self, engine_id: str) -> None:
        layout = self._layout.pop(engine_id, None)
        if layout is None:
            return
        group = self._groups[layout]
        for ranking in (*group.by_score.values(), *group.by_kv.values(), group.rates):
            ranking.discard(engine_id)
        group.members.discard(engine_id)
        if not group.members:
            del self._groups[layout]

    def members(self, layout: Layout) -> set[str]:
        group = self._groups.get(layout)
        return group.members if group is not None else set()

    def median_rate(self, layout: Layout) -> float:
        """The median of the group's reported prefill rates (the upper one of an even count); 0 when none."""
        group = self._groups.get(layout)
        if group is None or not len(group.rates):
            return 0.0
        return group.rates.nth(len(group.rates) // 2)

    def least_loaded(self, layout: Layout, role: str, k: int, skip: Callable[[str], bool], *,
                     by_kv: bool = False) -> list[str]:
        """The ``k`` least loaded engines of ``role`` ("prefill" or "decode") in the group, ``skip`` aside."""
        group = self._groups.get(layout)
        if group is None:
            return []
        return (group.by_kv if by_kv else group.by_score)[role].first(k, skip)
