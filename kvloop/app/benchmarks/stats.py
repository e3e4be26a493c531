"""The multi-turn benchmark's arithmetic, pure: percentiles that admit when they have too few samples, the
health check of a configuration, ratios over repeats, and the Markdown table. No I/O; unit-tested."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvloop.app.benchmarks.stalls import StallReport

QUANTILES = {"p50": 0.50, "p95": 0.95, "p99": 0.99}

HEALTH_FACTOR = 2.0
TURN_OVERHEAD_S = 0.25
"""A configuration is unhealthy when its turns' time to first token, summed, is more than ``HEALTH_FACTOR`` times
the prefill time its engines measured for them (vLLM's ``request_prefill_time``, over every engine of the
configuration) plus ``TURN_OVERHEAD_S`` per turn (HTTP hops, placement, an engine step: fixed costs that dominate
when a turn computes only a short tail). The rest is waiting the comparison is not about: queues behind held
blocks, dead connections, handshakes."""

STALL_S = 10.0
"""... or when any request waited in an engine's queue longer than this (vLLM's ``request_queue_time``)."""


def min_samples(q: float) -> int:
    """Samples a ``q`` percentile needs before it is more than the sample's extreme: ``1 / (1 - q)`` (p50: 2,
    p95: 20, p99: 100)."""
    return max(1, math.ceil(1 / (1 - q) - 1e-9)) if q < 1 else 1


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` percentile, or None when there are fewer than :func:`min_samples` values."""
    if len(values) < min_samples(q) or not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def percentiles_ms(values_s: Sequence[float]) -> dict[str, Any]:
    """p50/p95/p99 in milliseconds (None where the sample is too small) and ``n``."""
    out: dict[str, Any] = {"n": len(values_s)}
    for name, q in QUANTILES.items():
        value = percentile(values_s, q)
        out[name] = None if value is None else round(value * 1e3, 1)
    return out


def show(stats: Mapping[str, Any], key: str) -> str:
    """A percentile for a table: its value, or ``n/a (n=K)`` when the sample was too small for it."""
    value = stats.get(key)
    return f"{value:g}" if value is not None else f"n/a (n={stats.get('n', 0)})"


@dataclass(frozen=True)
class Health:
    healthy: bool
    reason: str
    ttft_over_prefill: float | None
    stalled_requests: int
    stalled_turns: int = 0
    """Turns that stalled beyond their queue and compute (:mod:`kvloop.app.benchmarks.stalls`)."""


def health(*, errors: int, turns: int, ttft_sum_s: float, prefill_sum_s: float, stalled_requests: int,
           factor: float = HEALTH_FACTOR, overhead_s: float = TURN_OVERHEAD_S,
           stalls: StallReport | None = None) -> Health:
    """Whether a configuration ran as designed, from its own figures (see :data:`HEALTH_FACTOR`, :data:`STALL_S`)
    and, given ``stalls``, its turns one by one (any stall makes it unhealthy)."""
    ratio = round(ttft_sum_s / prefill_sum_s, 2) if prefill_sum_s > 0 else None
    allowed = factor * prefill_sum_s + overhead_s * turns
    reasons = []
    if errors:
        reasons.append(f"{errors} request(s) failed")
    if stalled_requests:
        reasons.append(f"{stalled_requests} request(s) queued over {STALL_S:g} s in an engine")
    if stalls is not None and stalls.count:
        reasons.append(stalls.reason())
    if ratio is not None and ttft_sum_s > allowed:
        reasons.append(f"time to first token {ttft_sum_s:.1f} s over {turns} turns, more than {factor:g}x the "
                       f"engines' prefill time ({prefill_sum_s:.1f} s) + {overhead_s:g} s a turn")
    if ratio is None and not errors:
        reasons.append("no prefill time measured")
    return Health(not reasons, "; ".join(reasons) or f"time to first token {ratio}x the engines' prefill time",
                  ratio, stalled_requests, stalls.count if stalls is not None else 0)


def requests_above(samples: Mapping[str, float], histogram: str, threshold_s: float) -> int:
    """Requests a Prometheus histogram saw above the smallest bucket edge at or over ``threshold_s`` (a lower
    bound: it never counts a request at or under the threshold), summed over its label sets."""
    buckets: dict[str, dict[float, float]] = {}
    for key, value in samples.items():
        if not key.startswith(histogram + "_bucket{") or 'le="' not in key:
            continue
        le = key.split('le="', 1)[1].split('"', 1)[0]
        labels = key.replace(f'le="{le}"', "")
        buckets.setdefault(labels, {})[math.inf if le == "+Inf" else float(le)] = value
    total = 0
    for edges in buckets.values():
        at_or_over = [e for e in edges if e >= threshold_s]
        if math.inf not in edges or not at_or_over:
            continue
        total += int(edges[math.inf] - edges[min(at_or_over)])
    return total


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """A ratio over repeats: its median and range (None where a repeat had none)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(statistics.median(present), 2), "min": round(min(present), 2),
            "max": round(max(present), 2), "n": len(present)}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
