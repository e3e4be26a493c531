"""Quantiles for the analysis: nearest rank, defined for any non-empty sample (the report says how many)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (``q`` in 0..1); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def spread(values: Sequence[float]) -> dict[str, float]:
    """p50, p95 and p99 (nearest rank)."""
    return {name: quantile(values, q) for name, q in (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))}
