"""The vetoes on DECODE_LOCAL: each a named rule on the prompt's :class:`~kvloop.broker.core.pricing.Tail`.

A rule says whether it keeps the tail off the decode engine; :data:`RULES` holds them in the order they are asked,
each with the :class:`~kvloop.shared.vocabulary.Veto` a plan names when it is the first to refuse. A tail no rule
refuses is priced against the P/D paths (:mod:`.choice` names ``costlier`` when it then loses). :func:`judge`
turns the first refusal into a :class:`Verdict`: a vetoed tail goes to another prefill engine or, where none can
take it, the decode engine (role both) computes it anyway, in one request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvloop.broker.core.pricing import Tail
from kvloop.shared.vocabulary import Veto

if TYPE_CHECKING:
    from kvloop.broker.core.placement import PlacementPolicy

Rule = Callable[[Tail, "PlacementPolicy"], bool]
"""True: the rule keeps this tail off the decode engine."""


def disabled(tail: Tail, policy: PlacementPolicy) -> bool:
    """Strict disaggregation: DECODE_LOCAL off in the policy (``decode_local``) or for this request."""
    return not tail.enabled


def tail_tokens(tail: Tail, policy: PlacementPolicy) -> bool:
    """The tail is longer than ``decode_local_max_tokens``, and prefill relief does not lift the length vetoes."""
    return not tail.relief and tail.tokens > policy.decode_local_max_tokens


def tail_share(tail: Tail, policy: PlacementPolicy) -> bool:
    """The tail is more than ``decode_local_max_share`` of the prompt, and prefill relief does not lift the length
    vetoes."""
    return not tail.relief and tail.tokens > policy.decode_local_max_share * tail.prompt_tokens


def decode_busy(tail: Tail, policy: PlacementPolicy) -> bool:
    """Requests wait on the decode engine, or the tail's compute time times the streams it holds up is over the
    stall budget: ``relief_stall_budget_s`` for a prompt only relief puts there, else
    ``decode_local_stall_budget_s``."""
    budget = policy.relief_stall_budget_s if tail.by_relief else policy.decode_local_stall_budget_s
    return tail.decode.load.waiting_requests > 0 or tail.streams * tail.seconds > budget


def step_full(tail: Tail, policy: PlacementPolicy) -> bool:
    """The decode engine's streams fill its whole step (``EngineInfo.step_tokens``): no room for a chunk."""
    return tail.chunk <= 0


def step_budget(tail: Tail, policy: PlacementPolicy) -> bool:
    """A prompt only relief puts on the decode engine needs a step reported and at most
    ``decode_local_max_tokens``, so that its chunks hold no step up longer than a short tail may."""
    return tail.by_relief and not 0 < tail.decode.info.step_tokens <= policy.decode_local_max_tokens


RULES: tuple[tuple[Veto, Rule], ...] = (
    (Veto.DISABLED, disabled),
    (Veto.TAIL_TOKENS, tail_tokens),
    (Veto.TAIL_SHARE, tail_share),
    (Veto.DECODE_BUSY, decode_busy),
    (Veto.STEP_FULL, step_full),
    (Veto.STEP_BUDGET, step_budget),
)


def first_veto(tail: Tail, policy: PlacementPolicy, rules: tuple[tuple[Veto, Rule], ...] = RULES) -> Veto | None:
    """The first rule that refuses the tail (None: none does)."""
    return next((veto for veto, refuses in rules if refuses(tail, policy)), None)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the vetoes made of DECODE_LOCAL for one prompt."""

    priced: bool
    """DECODE_LOCAL is an option, priced against the P/D paths."""
    veto: Veto | None
    """Why not, where the decode engine held the prefix (None: priced, or it held nothing)."""
    forced: bool = False
    """Vetoed, yet priced: the decode engine serves itself (role both) and no other prefill engine can take it."""
    relieved: bool = False
    """Priced only by prefill relief."""


NOT_POSSIBLE = Verdict(priced=False, veto=None)
"""The decode engine holds nothing, does not serve itself, and relief does not apply: nothing to judge."""


def judge(tail: Tail, policy: PlacementPolicy, others: bool) -> Verdict:
    """The verdict on DECODE_LOCAL; ``others``: some P/D option exists on another prefill engine."""
    if not tail.possible:
        return NOT_POSSIBLE
    blocked = first_veto(tail, policy)
    forced = blocked is not None and tail.self_serve and not others
    priced = blocked is None or forced
    return Verdict(priced=priced, veto=blocked if not priced and tail.own else None, forced=forced,
                   relieved=tail.by_relief and blocked is None)
