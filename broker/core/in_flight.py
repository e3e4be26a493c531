"""Requests in flight per engine, as the routers count them: the load placement sees at the moment it places.

An engine's sidecar reports its load on its keep-alive (every few seconds), so a report can be older than the
previous turn: a decode engine still counted as busy (or idle) after its request ended (or began). Routers know
exactly what they have in flight, at the moment they ask. Each ``Place`` may carry its router's counts; this
book keeps every router's latest counts and sums them per engine.

Contract:
- ``report(router, counts, now, tokens)`` replaces that router's counts: requests in flight per engine, and the
  prompt tokens of those the engine has not computed yet (an engine it leaves out has none).
- ``totals(now)`` sums, per engine id, the counts of the routers that reported within ``ttl_s``; ``None`` when
  no router has (then placement falls back to the sidecars' reports, e.g. a caller of ``Place`` that counts
  nothing, such as the benchmarks' drivers). ``token_totals(now)`` does the same for the tokens.
- A router that stops placing stops counting after ``ttl_s``: its last counts can only be as stale as that.
- ``placed(engine_id, tokens, now)`` counts a placement the broker just made (a request, and the prompt tokens it
  sends the engine to compute) for ``placed_s``, summed into both totals while any router counts: the routers'
  counts do not hold it until the router has sent the request, and the Places of one burst, arriving in one
  PlaceStream batch, each carry the same snapshot taken before any of them was placed, so without it they all went
  to the engine that was least loaded before the burst. Until it lapses a placement the router has sent counts
  twice, which only leans the next placements towards other engines.

In memory only, never persisted (a new leader starts empty and learns from the next ``Place`` of each router).
Tested in ``tests/unit/test_in_flight.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class _Report:
    seen: float
    counts: dict[str, int]
    tokens: dict[str, int]


@dataclass
class InFlight:
    ttl_s: float = 10.0
    max_routers: int = 1024
    """Most routers kept; the one reported longest ago goes first (bounds memory against a flood of ids)."""
    placed_s: float = 0.2
    max_placed: int = 65536
    """Most recent placements kept (bounds memory however fast Places come)."""
    _routers: dict[str, _Report] = field(default_factory=dict)
    _placed: deque[tuple[float, str, int]] = field(default_factory=deque)

    def report(self, router: str, counts: Mapping[str, int], now: float,
               tokens: Mapping[str, int] | None = None) -> None:
        self._routers.pop(router, None)
        self._routers[router] = _Report(now, {e: int(n) for e, n in counts.items() if n > 0},
                                        {e: int(n) for e, n in (tokens or {}).items() if n > 0})
        while len(self._routers) > self.max_routers:
            del self._routers[next(iter(self._routers))]

    def placed(self, engine_id: str, tokens: int, now: float) -> None:
        self._placed.append((now, engine_id, max(0, int(tokens))))
        while len(self._placed) > self.max_placed:
            self._placed.popleft()

    def _sum(self, now: float, which: Callable[[_Report], dict[str, int]],
             placed: Callable[[int], int]) -> dict[str, int] | None:
        fresh = [which(r) for r in self._routers.values() if now - r.seen <= self.ttl_s]
        if not fresh:
            return None
        totals: dict[str, int] = {}
        for counts in fresh:
            for engine_id, n in counts.items():
                totals[engine_id] = totals.get(engine_id, 0) + n
        while self._placed and now - self._placed[0][0] > self.placed_s:
            self._placed.popleft()
        for _, engine_id, tokens in self._placed:
            n = placed(tokens)
            if n:
                totals[engine_id] = totals.get(engine_id, 0) + n
        return totals

    def totals(self, now: float) -> dict[str, int] | None:
        return self._sum(now, lambda r: r.counts, lambda tokens: 1)

    def token_totals(self, now: float) -> dict[str, int] | None:
        return self._sum(now, lambda r: r.tokens, lambda tokens: tokens)

    def routers(self, now: float) -> int:
        return sum(1 for r in self._routers.values() if now - r.seen <= self.ttl_s)
