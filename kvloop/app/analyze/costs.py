"""Costs: the TTFT model fitted to the records (or given), the interconnect's bytes and bandwidth, and predicted
TTFT with and without the return path.

The model is the broker's own (``kvloop.broker.core.placement``), in the same terms:

- a P/D turn (RECOMPUTE, PREFILL_LOCAL, TRANSFER): ``hop_s + computed_tokens / prefill_tokens_per_s`` plus, on
  TRANSFER, ``pull_overhead_s + pulled_bytes / bandwidth``;
- DECODE_LOCAL: ``decode_local_s + computed_tokens / decode_tokens_per_s`` (no hop, no pull).

Fitted from kvloop records by least squares of TTFT (less the measured pull time) on computed tokens, per kind of
path, when at least ``MIN_FIT`` turns of that kind with different lengths are there; otherwise the given or
default figures stand, and the report says which is which.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvloop.app.analyze.stats import spread
from kvloop.router.records import TurnRecord
from kvloop.shared.vocabulary import Path

MIN_FIT = 3
PD_PATHS = (Path.RECOMPUTE, Path.PREFILL_LOCAL, Path.TRANSFER)


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_tokens_per_s: float = 5000.0
    hop_s: float = 0.08
    decode_tokens_per_s: float = 5000.0
    decode_local_s: float = 0.0
    bandwidth_bytes_per_s: float = 1e9
    bytes_per_block: int = 262144
    pull_overhead_s: float = 0.005
    sources: dict[str, str] = field(default_factory=dict)
    """Per figure, where it came from: ``fitted (n turns)``, ``measured``, ``given`` or ``default``."""

    def ttft_s(self, path: str, computed_tokens: int, pulled_bytes: int) -> float:
        if path == Path.DECODE_LOCAL:
            return self.decode_local_s + computed_tokens / self.decode_tokens_per_s
        pull = self.pull_overhead_s + pulled_bytes / self.bandwidth_bytes_per_s if pulled_bytes else 0.0
        return self.hop_s + computed_tokens / self.prefill_tokens_per_s + pull


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """(intercept, slope) of y on x, or None when the points cannot give a positive slope."""
    if len(points) < MIN_FIT or len({x for x, _ in points}) < 2:
        return None
    slope, intercept = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return (intercept, slope) if slope > 0 else None


def fit(records: Sequence[TurnRecord], given: dict[str, float]) -> CostModel:
    """The model from the records, then ``given`` (field name -> value) over it."""
    model, sources = CostModel(), {name: "default" for name in ("prefill_tokens_per_s", "hop_s",
                                                                  "decode_tokens_per_s", "decode_local_s",
                                                                  "bandwidth_bytes_per_s", "bytes_per_block",
                                                                  "pull_overhead_s")}
    timed = [r for r in records if r.ttft_ms is not None and not r.error]
    pd = _line([(r.computed_tokens, r.ttft_ms / 1e3 - r.pull_ms / 1e3) for r in timed  # type: ignore[operator]
                if r.path in PD_PATHS])
    n_pd = sum(1 for r in timed if r.path in PD_PATHS)
    if pd:
        model = replace(model, hop_s=max(0.0, pd[0]), prefill_tokens_per_s=1 / pd[1])
        sources |= {"hop_s": f"fitted ({n_pd} turns)", "prefill_tokens_per_s": f"fitted ({n_pd} turns)"}
    local = _line([(r.computed_tokens, r.ttft_ms / 1e3) for r in timed  # type: ignore[operator]
                   if r.path == Path.DECODE_LOCAL])
    n_local = sum(1 for r in timed if r.path == Path.DECODE_LOCAL)
    if local:
        model = replace(model, decode_local_s=max(0.0, local[0]), decode_tokens_per_s=1 / local[1])
        sources |= {k: f"fitted ({n_local} turns)" for k in ("decode_local_s", "decode_tokens_per_s")}
    else:
        model = replace(model, decode_tokens_per_s=model.prefill_tokens_per_s)
        sources["decode_tokens_per_s"] = "the prefill rate"
    pulls = [r for r in records if r.pulled_bytes > 0 and r.pull_ms > 0]
    if pulls:
        model = replace(model, bandwidth_bytes_per_s=sum(r.pulled_bytes for r in pulls)
                        / sum(r.pull_ms / 1e3 for r in pulls))
        sources["bandwidth_bytes_per_s"] = f"measured ({len(pulls)} pulls)"
    blocks = [r for r in records if r.pulled_bytes > 0 and r.pulled_blocks > 0]
    if blocks:
        model = replace(model, bytes_per_block=round(sum(r.pulled_bytes for r in blocks)
                                                     / sum(r.pulled_blocks for r in blocks)))
        sources["bytes_per_block"] = f"measured ({len(blocks)} pulls)"
    for name, value in given.items():
        model = replace(model, **{name: value})  # type: ignore[arg-type]
        sources[name] = "given"
    model = replace(model, bytes_per_block=int(model.bytes_per_block))
    return replace(model, sources=sources)


@dataclass(frozen=True, slots=True)
class ModelCheck:
    """The model against the records' own measured TTFT, each turn priced by the path and tokens it took."""

    turns: int
    predicted: dict[str, float]
    measured: dict[str, float]

    def worst_gap(self) -> float:
        """The largest relative difference of p50, p95 and p99."""
        return max((abs(self.predicted[q] - m) / m for q, m in self.measured.items() if m > 0), default=0.0)


def check(records: Sequence[TurnRecord], model: CostModel) -> ModelCheck | None:
    timed = [r for r in records if r.ttft_ms is not None and not r.error and r.path]
    if not timed:
        return None
    predicted = [model.ttft_s(r.path, r.computed_tokens, r.pulled_bytes) * 1e3 for r in timed]
    return ModelCheck(len(timed), spread(predicted), spread([r.ttft_ms for r in timed]))  # type: ignore[misc]


def holdout_check(records: Sequence[TurnRecord], given: dict[str, float]) -> ModelCheck | None:
    """The model fitted on every other session (by name) and checked on the rest: its error on turns it was not
    fitted to, which :func:`check` (fitted and checked on the same turns) cannot show."""
    names = sorted({r.session for r in records})
    fitted_on = set(names[::2])
    train = [r for r in records if r.session in fitted_on]
    test = [r for r in records if r.session not in fitted_on]
    return check(test, fit(train, given)) if train and test else None


@dataclass(frozen=True, slots=True)
class Interconnect:
    turns_pulling: int
    bytes_per_turn: dict[str, float]
    """p50, p95 and p99 over the turns that pull."""
    total_bytes: int
    needed_bytes_per_s: float
    """Total bytes over the records' span: the mean bandwidth the observed turn rate needs."""
    bandwidth_bytes_per_s: float
    pull_ms: dict[str, float]
    """Per pulling turn, its bytes at the bandwidth (p50, p95, p99)."""

    @property
    def utilisation(self) -> float:
        return self.needed_bytes_per_s / self.bandwidth_bytes_per_s if self.bandwidth_bytes_per_s else 0.0


def interconnect(reused_blocks: Sequence[int], model: CostModel, span_s: float) -> Interconnect:
    """``reused_blocks``: per turn, the blocks a prefill engine would pull (strict P/D: every reused block)."""
    moved = [b * model.bytes_per_block for b in reused_blocks if b > 0]
    total = sum(moved)
    return Interconnect(len(moved), spread(moved), total, total / span_s if span_s > 0 else 0.0,
                        model.bandwidth_bytes_per_s,
                        spread([m / model.bandwidth_bytes_per_s * 1e3 + model.pull_overhead_s * 1e3 for m in moved]))


def predicted_ttft_ms(paths: Sequence[tuple[str, int, int]], model: CostModel) -> dict[str, dict[str, float]]:
    """(path, computed tokens, pulled bytes) per turn -> per path and ``all``: turns, p50, p95, p99 in ms."""
    by_path: dict[str, list[float]] = {}
    for path, computed, pulled in paths:
        ms = model.ttft_s(path, computed, pulled) * 1e3
        by_path.setdefault(path, []).append(ms)
        by_path.setdefault("all", []).append(ms)
    return {path: {"turns": len(v), **spread(v)} for path, v in sorted(by_path.items())}

