"""The whole analysis of one record set, pure: records and options in, an :class:`Analysis` out."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvloop.app.analyze import costs, retention, shape
from kvloop.app.analyze.costs import CostModel, Interconnect, ModelCheck
from kvloop.app.analyze.retention import Fleet, Hits, Replay, Setting
from kvloop.app.analyze.verdict import Verdict, starting_setting, verdict
from kvloop.router.records import TurnRecord
from kvloop.shared.vocabulary import Path

DEFAULT_TTLS = (10.0, 30.0, 60.0, 120.0, 300.0, 480.0, 900.0, 1800.0)


@dataclass(frozen=True)
class Options:
    ttls: tuple[float, ...] = DEFAULT_TTLS
    budgets: tuple[int, ...] = ()
    """Blocks per decode engine; empty: an eighth, a quarter, a half and all of the ideal replay's peak."""
    decode_engines: int = 0
    """0: as many as the records name (at least 1)."""
    prefill_engines: int = 0
    given: dict[str, float] = field(default_factory=dict)
    """CostModel figures given on the command line (they win over fitted ones)."""
    eviction_policy: str = "lru"
    decode_local: bool = True


@dataclass
class Analysis:
    records: list[TurnRecord]
    sessions: dict[str, list[TurnRecord]]
    shares: list[shape.TurnShare]
    curve: list[shape.CurvePoint]
    gaps: list[float]
    rate: float
    span_s: float
    block_size: int
    model: CostModel
    check: ModelCheck | None
    holdout: ModelCheck | None
    fleet: Fleet
    ideal: Replay
    ideal_hits: Hits
    grid: list[Hits]
    chosen: Replay
    interconnect: Interconnect
    with_return: dict[str, dict[str, float]]
    without_return: dict[str, dict[str, float]]
    reuse_share: float
    verdict: Verdict
    generous: tuple[Setting, dict[str, float]] | None = None
    """The replay's predicted TTFT (all turns) at the grid's most generous setting, with that setting."""


def default_budgets(peak_per_engine: int) -> tuple[int, ...]:
    return tuple(sorted({max(1, math.ceil(peak_per_engine * f)) for f in (0.125, 0.25, 0.5, 1.0)}))


def engines_named(records: Sequence[TurnRecord], role: str) -> int:
    decode = {r.decode_engine for r in records if r.decode_engine}
    if role == "decode":
        return max(1, len(decode))
    return max(1, len({r.prefill_engine for r in records if r.prefill_engine} - decode))


def analyze(records: list[TurnRecord], options: Options) -> Analysis:
    by_session = shape.sessions(records)
    shares = shape.prefix_shares(by_session)
    rate, span = shape.turn_rate(records)
    bs = retention.block_size_of(records)
    model = costs.fit(records, options.given)
    fleet = Fleet(decode_engines=options.decode_engines or engines_named(records, "decode"),
                  prefill_engines=options.prefill_engines or engines_named(records, "prefill"),
                  prefill_tokens_per_s=model.prefill_tokens_per_s, bandwidth_bytes_per_s=model.bandwidth_bytes_per_s,
                  bytes_per_block=model.bytes_per_block, pd_hop_s=model.hop_s, decode_local=options.decode_local,
                  eviction_policy=options.eviction_policy)
    ideal = retention.ideal(records, fleet)
    ideal_hits = retention.hits(ideal, ideal, bs)
    budgets = options.budgets or default_budgets(-(-ideal_hits.peak_blocks // fleet.decode_engines))
    grid = [retention.hits(retention.replay(records, Setting(ttl, budget), fleet), ideal, bs)
            for budget in budgets for ttl in options.ttls]
    reuse = ideal_hits.tokens_ideal / max(1, sum(r.prompt_tokens for r in records))
    # Predictions at the starting setting; when none finds enough, at the most generous one in the grid.
    # The grid's most generous setting: the fallback when no setting finds enough, and nearest to a run whose
    # engines never ran short of retention (a bench run), so the replay's own prediction can be held against it.
    roomiest = max((h.setting for h in grid), key=lambda s: (s.budget_blocks, s.ttl_s))
    setting = starting_setting(grid) or roomiest
    chosen = retention.replay(records, setting, fleet)
    link = costs.interconnect([o.matched_blocks for o in chosen.outcomes], model, span)
    with_return = _predicted(chosen, model, bs)
    generous = (roomiest, with_return["all"] if setting == roomiest
                else _predicted(retention.replay(records, roomiest, fleet), model, bs)["all"])
    without = costs.predicted_ttft_ms([(Path.RECOMPUTE, r.prompt_tokens, 0) for r in records], model)
    w, wo = with_return.get("all", {}), without.get("all", {})
    final = verdict(reuse, grid, w.get("p50", 0.0), wo.get("p50", 0.0), w.get("p95", 0.0), wo.get("p95", 0.0),
                    link.utilisation)
    return Analysis(records, by_session, shares, shape.share_curve(shares), shape.gaps(by_session), rate, span, bs,
                    model, costs.check(records, model), costs.holdout_check(records, options.given), fleet, ideal,
                    ideal_hits, grid, chosen, link, with_return, without, reuse, final, generous)


def _predicted(run: Replay, model: CostModel, block_size: int) -> dict[str, dict[str, float]]:
    return costs.predicted_ttft_ms([(o.decision, o.recompute_tokens, o.pull_tokens // max(block_size, 1)
                                     * model.bytes_per_block) for o in run.outcomes], model)
