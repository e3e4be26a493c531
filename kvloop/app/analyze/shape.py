"""The workload's shape: sessions, the share of each turn's prompt that repeats the previous turn's, gaps.

The previous turn's *prompt* is what the records hold keys of; the decode engine also retains the answer's
blocks, which have no keys here, so every share is a lower bound by about one answer's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvloop.app.analyze.stats import quantile
from kvloop.router.records import TurnRecord
from kvloop.shared.hashing import common_prefix_blocks


@dataclass(frozen=True, slots=True)
class TurnShare:
    session: str
    index: int
    """The turn's index in its session (the first turn is 0 and has no previous turn)."""
    shared_tokens: int
    """Tokens of whole blocks the prompt shares from its start with the previous turn's prompt."""
    share: float


def sessions(records: Sequence[TurnRecord]) -> dict[str, list[TurnRecord]]:
    """Turns by session, in arrival order. A record without a session hint is a session of its own."""
    out: dict[str, list[TurnRecord]] = {}
    for n, rec in enumerate(sorted(records, key=lambda r: r.t)):
        out.setdefault(rec.session or f"(none)-{n}", []).append(rec)
    return out


def prefix_shares(by_session: dict[str, list[TurnRecord]]) -> list[TurnShare]:
    out = []
    for session, turns in by_session.items():
        for index in range(1, len(turns)):
            prev, cur = turns[index - 1], turns[index]
            shared = common_prefix_blocks(prev.keys, cur.keys) * cur.block_size
            out.append(TurnShare(session, index, shared, shared / cur.prompt_tokens if cur.prompt_tokens else 0.0))
    return out


@dataclass(frozen=True, slots=True)
class CurvePoint:
    index: int
    turns: int
    p10: float
    p50: float
    p90: float


def share_curve(shares: Sequence[TurnShare]) -> list[CurvePoint]:
    """Per turn index, the p10, median and p90 of the shares."""
    by_index: dict[int, list[float]] = {}
    for s in shares:
        by_index.setdefault(s.index, []).append(s.share)
    return [CurvePoint(i, len(v), quantile(v, 0.10), quantile(v, 0.50), quantile(v, 0.90))
            for i, v in sorted(by_index.items())]


def gaps(by_session: dict[str, list[TurnRecord]]) -> list[float]:
    """Seconds from each turn's end to its session's next turn (think time, tool runs); 0 when they overlap."""
    return [max(0.0, turns[i].t - turns[i - 1].t_end) for turns in by_session.values() for i in range(1, len(turns))]


def turn_rate(records: Sequence[TurnRecord]) -> tuple[float, float]:
    """(turns per second, the span in seconds) from the first arrival to the last end."""
    if not records:
        return 0.0, 0.0
    span = max(r.t_end for r in records) - min(r.t for r in records)
    return (len(records) / span if span > 0 else 0.0), span
