"""Placement's choice: the cheapest priced option, and the reason and DECODE_LOCAL veto its plan gives.

Ties in price go to the path that moves least (DECODE_LOCAL, PREFILL_LOCAL, TRANSFER, RECOMPUTE), then to the less
loaded engine, then the lower engine id, so a placement is a pure function of its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvloop.broker.core.model import Decision
from kvloop.broker.core.pricing import Option, Tail
from kvloop.broker.core.vetoes import Verdict
from kvloop.shared.vocabulary import Reason, Veto

RANK = {Decision.DECODE_LOCAL: 0, Decision.PREFILL_LOCAL: 1, Decision.TRANSFER: 2, Decision.RECOMPUTE: 3}
"""The order of the paths at equal price."""


@dataclass(frozen=True, slots=True)
class Choice:
    best: Option
    reason: Reason
    veto: Veto | None
    """Why DECODE_LOCAL was not taken though the decode engine held the prefix (None: taken, or it held none)."""


def cheapest(options: Sequence[Option]) -> Option:
    return min(options, key=lambda o: (o.seconds, RANK[o.decision], o.prefill.load.score, o.prefill.info.engine_id))


def cheapest_s(options: Sequence[Option], decision: Decision) -> float:
    """The price of the cheapest option of that path (0: none was possible)."""
    return min((o.seconds for o in options if o.decision is decision), default=0.0)


def final_veto(verdict: Verdict, tail: Tail, best: Option) -> Veto | None:
    """The vetoes' own, or ``costlier``: the decode engine held the prefix, no rule refused, and another path won."""
    if verdict.veto is None and tail.own and best.decision is not Decision.DECODE_LOCAL:
        return Veto.COSTLIER
    return verdict.veto


def _nothing_reused(seen: int) -> Reason:
    return Reason.NO_MATCH if not seen else Reason.BELOW_THRESHOLD


def reason(best: Option, options: Sequence[Option], tail: Tail, verdict: Verdict, veto: Veto | None,
           seen: int) -> Reason:
    """Why ``best`` won; ``seen`` is the longest prefix any engine held (:attr:`Scene.seen`)."""
    if best.decision is Decision.DECODE_LOCAL:
        if verdict.relieved:
            return Reason.PREFILL_QUEUED
        if tail.own:
            return Reason.DECODE_ENGINE_COMPUTES if verdict.forced else Reason.SHORT_TAIL_ON_DECODE
        return _nothing_reused(seen)  # the whole prompt, on the decode engine (role both)
    if best.decision is Decision.PREFILL_LOCAL:
        return Reason.LOCAL_PREFIX
    if best.decision is Decision.TRANSFER:
        return Reason.TRANSFER_CHEAPER
    if len({o.decision for o in options}) > 1:
        return Reason.RECOMPUTE_CHEAPER  # a reuse path existed and cost more
    if veto is not None:
        return Reason.DECODE_LOCAL_VETOED  # only the decode engine held the prefix (the veto says why)
    return _nothing_reused(seen)


def choose(options: Sequence[Option], tail: Tail, verdict: Verdict, seen: int) -> Choice:
    """The cheapest option, with its reason and the veto."""
    best = cheapest(options)
    veto = final_veto(verdict, tail, best)
    return Choice(best, reason(best, options, tail, verdict, veto, seen), veto)
