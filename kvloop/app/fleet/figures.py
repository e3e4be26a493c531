"""A modelled load point's figures in the shape of a ``kvloop bench load`` point: the turns become the records
AIPerf would have written (:class:`kvloop.app.benchmarks.aiperf.Request`) and go through the load bench's own
arithmetic (:func:`kvloop.app.benchmarks.load_stats.point_figures`), so goodput, SLO attainment and percentiles
mean the same on both sides; a p90 is added beside them, with the same rule for too few samples."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from kvloop.app.benchmarks.aiperf import Request, Slo
from kvloop.app.benchmarks.load_stats import point_figures
from kvloop.app.benchmarks.stats import percentile
from kvloop.shared.engine_model import Account
from kvloop.shared.vocabulary import Path


@dataclass(slots=True)
class TurnResult:
    session: str
    index: int
    prompt_tokens: int
    arrived: float
    planned: Path
    actual: Path
    first_token: float
    finished: float
    generated: int
    max_gap_s: float
    local_tokens: int
    pulled_tokens: int
    computed_tokens: int
    transfer_bytes: int
    """Bytes a prefill engine pulled from a lease holder (TRANSFER)."""
    hop_bytes: int
    """Bytes the decode engine pulled from the prefill engine (the P/D hand-off)."""
    prefill_engine: str
    decode_engine: str

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.arrived

    @property
    def itl_s(self) -> float | None:
        """AIPerf's inter-token latency: the time after the first token over the tokens after it."""
        if self.generated < 2:
            return None
        return (self.finished - self.first_token) / (self.generated - 1)


def actual_path(planned: Path, computing: Account) -> Path:
    """The path by the account of the engine that computed the prompt, as the router names it
    (``kvloop.router.truth.actual_path``)."""
    if planned is Path.DECODE_LOCAL:
        return Path.DECODE_LOCAL
    if computing.pulled_tokens > 0:
        return Path.TRANSFER
    return Path.PREFILL_LOCAL if computing.local_tokens > 0 else Path.RECOMPUTE


def as_request(turn: TurnResult) -> Request:
    itl = turn.itl_s
    return Request(session=turn.session, turn=turn.index, start_ns=round(turn.arrived * 1e9),
                   end_ns=round(turn.finished * 1e9), ttft_ms=turn.ttft_s * 1e3,
                   itl_ms=None if itl is None else itl * 1e3, e2e_ms=(turn.finished - turn.arrived) * 1e3,
                   output_tokens=turn.generated, prompt_tokens=turn.prompt_tokens,
                   cached_tokens=turn.local_tokens + turn.pulled_tokens)


def p90_ms(values_s: Sequence[float]) -> float | None:
    value = percentile(values_s, 0.90)
    return None if value is None else round(value * 1e3, 1)


def point(turns: Sequence[TurnResult], slo: Slo, held: Sequence[tuple[float, int]],
          evictions: Mapping[str, int]) -> dict[str, Any]:
    """One modelled load point: the load bench's figures, then what only a model can count exactly."""
    figures = point_figures([as_request(t) for t in turns], slo)
    itls = [i for t in turns if (i := t.itl_s) is not None]
    for name, values in (("ttft_ms", [t.ttft_s for t in turns]), ("itl_ms", itls),
                         ("e2e_ms", [t.finished - t.arrived for t in turns])):
        figures[name]["p90"] = p90_ms(values)
    figures["max_gap_ms"] = {"p90": p90_ms([t.max_gap_s for t in turns]), "n": len(turns)}
    figures["paths"] = dict(sorted(Counter(t.actual.value for t in turns).items()))
    figures["planned_paths"] = dict(sorted(Counter(t.planned.value for t in turns).items()))
    figures["tokens"] = {"local": sum(t.local_tokens for t in turns), "pulled": sum(t.pulled_tokens for t in turns),
                         "computed": sum(t.computed_tokens for t in turns)}
    figures["bytes_moved"] = {"transfer": sum(t.transfer_bytes for t in turns),
                              "hop": sum(t.hop_bytes for t in turns)}
    figures["blocks_retained"] = {"peak": max((n for _, n in held), default=0),
                                  "mean": round(_time_mean(held), 1), "at_end": held[-1][1] if held else 0}
    figures["evictions"] = dict(sorted(evictions.items()))
    figures["predicted"] = True
    return figures


def _time_mean(held: Sequence[tuple[float, int]]) -> float:
    """The time-weighted mean of a step function given as (time, value) from each time on."""
    if len(held) < 2:
        return float(held[0][1]) if held else 0.0
    span = held[-1][0] - held[0][0]
    if span <= 0:
        return float(held[-1][1])
    return sum(v * (t1 - t0) for (t0, v), (t1, _) in pairwise(held)) / span
