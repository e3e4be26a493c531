"""The verdict in one paragraph: pays, pays only above a TTL or budget, or does not pay; and the settings to start
with. Pure: every figure comes in as an argument."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvloop.app.analyze.retention import Hits, Setting

ENOUGH_HITS = 0.9
"""A setting is enough when it finds this share of the turns the ideal replay finds."""
WORTH_P50 = 0.9
"""The return path pays when it brings predicted p50 TTFT to at most this share of one-way P/D's ..."""
MIN_REUSE = 0.1
"""... and at least this share of prompt tokens is reusable at all."""


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: str
    """``pays``, ``pays_above`` or ``does_not_pay``."""
    start: Setting | None
    text: str


def starting_setting(grid: Sequence[Hits]) -> Setting | None:
    """The cheapest setting (smallest budget, then TTL) that finds ``ENOUGH_HITS`` of the ideal's turns."""
    good = [h.setting for h in grid if h.turns_needing and h.turn_share >= ENOUGH_HITS]
    return min(good, key=lambda s: (s.budget_blocks, s.ttl_s), default=None)


def verdict(reuse_share: float, grid: Sequence[Hits], p50_with_ms: float, p50_without_ms: float,
            p95_with_ms: float, p95_without_ms: float, utilisation: float) -> Verdict:
    start = starting_setting(grid)
    link = (f" The interconnect would run at {utilisation:.0%} of the bandwidth assumed, which it cannot carry."
            if utilisation > 1 else f" The interconnect would run at {utilisation:.1%} of the bandwidth assumed.")
    if reuse_share < MIN_REUSE or start is None or p50_with_ms > WORTH_P50 * p50_without_ms:
        why = (f"only {reuse_share:.0%} of prompt tokens repeat an earlier turn" if reuse_share < MIN_REUSE
               else "no retention setting in the grid keeps enough prefixes" if start is None
               else f"predicted p50 TTFT goes from {p50_without_ms:.0f} to only {p50_with_ms:.0f} ms")
        return Verdict("does_not_pay", None, f"**Does not pay** on these records: {why}. Keep one-way P/D.{link}")
    smallest = min(grid, key=lambda h: (h.setting.budget_blocks, h.setting.ttl_s))
    kind = "pays" if smallest.turn_share >= ENOUGH_HITS else "pays_above"
    head = ("**Pays**" if kind == "pays" else
            f"**Pays only above a TTL of {start.ttl_s:g} s and a budget of {start.budget_blocks} blocks per decode "
            "engine**")
    text = (f"{head}: {reuse_share:.0%} of prompt tokens repeat an earlier turn; predicted TTFT p50 "
            f"{p50_without_ms:.0f} -> {p50_with_ms:.0f} ms and p95 {p95_without_ms:.0f} -> {p95_with_ms:.0f} ms "
            f"against one-way P/D. Start with the decode engines' `lease_ttl_s: {start.ttl_s:g}` and a retention "
            f"budget of {start.budget_blocks} blocks per decode engine (`retention_fraction` of its KV blocks), "
            "which find "
            f"{ENOUGH_HITS:.0%} or more of the prefixes an unbounded cache would.{link}")
    return Verdict(kind, start, text)
