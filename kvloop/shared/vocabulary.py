"""The words services say to each other about a turn: its path, the plan's reason, the DECODE_LOCAL veto, the
router's fallbacks and the plan's outcome; and the engines' roles. Stdlib only; every service, benchmark and
``kvloop analyze`` names them from here.

They are ``StrEnum``: each member is its wire and metric-label string (``Reason.LOCAL_PREFIX == "local_prefix"``),
so plans, headers, span attributes and turn records carry the same text, and a reader that receives one compares
it with a member, never with a literal. ``tests/unit/test_vocabulary.py`` checks that each value is documented
in docs/architecture.md and that the proto's ``Decision`` names the same paths.

On the wire, reasons and vetoes stay strings (``Plan.reason``, ``Plan.decode_local_veto`` in broker.proto), not
proto enums: a router and a broker of different versions (a rolling upgrade) still understand each other, and a
word one side adds reaches the other's logs as it was said instead of as a number it cannot name. A reader decodes
them once, where the plan arrives (:func:`reason_from_wire`, :func:`veto_from_wire`); a word it does not know
becomes ``UNKNOWN``, logged with the word.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal


class Role(StrEnum):
    """An engine's part in P/D: it prefills (and lends its KV), decodes (and retains KV), or does both. The engines'
    ``--role``, the router's directory and the broker's registrations (``EngineRole`` on the wire) say these."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    @property
    def can_prefill(self) -> bool:
        return self in (Role.PREFILL, Role.BOTH)

    @property
    def can_decode(self) -> bool:
        return self in (Role.DECODE, Role.BOTH)


class Path(StrEnum):
    """How a turn's prompt was served (the broker's ``Decision``; and the path the engines' accounts show)."""

    RECOMPUTE = "RECOMPUTE"
    TRANSFER = "TRANSFER"
    PREFILL_LOCAL = "PREFILL_LOCAL"
    DECODE_LOCAL = "DECODE_LOCAL"


class Reason(StrEnum):
    """Why the plan took its path: the broker's reasons, then the ones a fallback puts in their place."""

    SHORT_TAIL_ON_DECODE = "short_tail_on_decode"
    DECODE_ENGINE_COMPUTES = "decode_engine_computes"
    """DECODE_LOCAL on a decode engine of role both although its tail was vetoed: no other prefill engine could take
    it, and a prefill request to the engine that decodes would stall the same streams, plus a hop."""
    PREFILL_QUEUED = "prefill_queued"
    """DECODE_LOCAL for a prompt the length vetoes (or holding nothing) would send to a prefill engine: every other
    prefill engine's queue alone outlasts the decode engine's compute of it (``prefill_relief``)."""
    LOCAL_PREFIX = "local_prefix"
    TRANSFER_CHEAPER = "transfer_cheaper"
    RECOMPUTE_CHEAPER = "recompute_cheaper"
    DECODE_LOCAL_VETOED = "decode_local_vetoed"
    NO_MATCH = "no_match"
    BELOW_THRESHOLD = "below_threshold"
    PIN_REFUSED = "pin_refused"
    """TRANSFER planned, the source lease's pin refused (it went between plan and pin): recomputed."""
    PULL_FAILED_RECOMPUTED = "pull_failed_recomputed"
    DECODE_ENGINE_UNKNOWN = "decode_engine_unknown"
    """DECODE_LOCAL planned on an engine the router does not list (yet): recomputed through P/D."""
    SOURCE_IS_PREFILL = "source_is_prefill"
    """The benchmarks' P/D driver: the lease is on the prefill engine itself, nothing to pull."""
    UNKNOWN = "unknown"
    """A reason this reader does not know, from a newer broker (the wire carries the word as a string): the reader
    logs the word and carries this in its place (:func:`reason_from_wire`). No service sends it."""


class Veto(StrEnum):
    """Why DECODE_LOCAL was not taken although the decode engine held the prefix ("" when it was taken)."""

    DISABLED = "disabled"
    TAIL_TOKENS = "tail_tokens"
    TAIL_SHARE = "tail_share"
    DECODE_BUSY = "decode_busy"
    STEP_FULL = "step_full"
    """The decode engine's streams fill its whole step (``EngineInfo.step_tokens``): no room for a tail's chunk."""
    STEP_BUDGET = "step_budget"
    """A prompt only prefill relief would put on the decode engine, whose step is larger than
    ``decode_local_max_tokens`` (or unknown): a chunk of it would hold up a step of every stream longer than a short
    tail may."""
    COSTLIER = "costlier"
    UNKNOWN = "unknown"
    """A veto this reader does not know, from a newer broker: as :attr:`Reason.UNKNOWN`. No service sends it."""


class Fallback(StrEnum):
    """What the router did instead of the plan (``kvloop_router_fallbacks_total{cause}``). The first four also stand
    as the turn's reason when there was no plan at all."""

    NO_BROKER = "no_broker"
    NO_LAYOUT = "no_layout"
    BROKER_UNAVAILABLE = "broker_unavailable"
    PLACE_REFUSED = "place_refused"
    PREFILL_RETRY = "prefill_retry"
    DECODE_RETRY = "decode_retry"
    DECODE_RESUME = "decode_resume"
    DECODE_RESUME_DIVERGED = "decode_resume_diverged"


NO_PLAN = frozenset({Fallback.NO_BROKER, Fallback.NO_LAYOUT, Fallback.BROKER_UNAVAILABLE, Fallback.PLACE_REFUSED})
"""The fallbacks that leave a turn without a plan: its reason is the fallback's cause."""

UNKNOWN_WORDS = frozenset({Reason.UNKNOWN, Veto.UNKNOWN})
"""What a reader carries in place of a reason or veto it does not know (:func:`reason_from_wire`,
:func:`veto_from_wire`). No service sends them: the broker's rules and paths name every other word."""

TurnReason = Reason | Fallback
"""A turn's reason: the plan's (:class:`Reason`), or the fallback's cause when there was no plan (:data:`NO_PLAN`)."""

NoVeto = Literal[""]
"""The veto of a plan that took DECODE_LOCAL, or could not (no decode engine held the prefix)."""


class PlanOutcome(StrEnum):
    """How the path a turn took by the engines' own accounts compares with its plan (``router/truth.py``): the
    ``x-kvloop-plan-outcome`` header, span attribute ``kvloop.plan_vs_actual``,
    ``kvloop_router_plan_outcomes_total{outcome}``."""

    AS_PLANNED = "as_planned"
    OTHER_PATH = "other_path"
    """The actual path differs from the planned one."""
    LESS_REUSED = "less_reused"
    """The planned path, with fewer tokens reused than planned by more than one block."""


def reason_from_wire(word: str) -> Reason:
    """A plan's ``reason`` as said on the wire, as a :class:`Reason`; :attr:`Reason.UNKNOWN` for a word this reader
    does not know (the caller logs it: ``result != word``). See the module's note on the wire."""
    try:
        return Reason(word)
    except ValueError:
        return Reason.UNKNOWN


def veto_from_wire(word: str) -> Veto | NoVeto:
    """A plan's ``decode_local_veto`` as said on the wire: "" (none), a :class:`Veto`, or :attr:`Veto.UNKNOWN` for
    a word this reader does not know (the caller logs it: ``result != word``). See the module's note on the wire."""
    if not word:
        return ""
    try:
        return Veto(word)
    except ValueError:
        return Veto.UNKNOWN
