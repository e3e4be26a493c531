"""The words services say to each other about a turn: its path, the plan's reason, the DECODE_LOCAL veto and the
router's fallbacks. Stdlib only; every service, benchmark and ``kvloop analyze`` names them from here.

They are ``StrEnum``: each member is its wire and metric-label string (``Reason.LOCAL_PREFIX == "local_prefix"``),
so plans, headers, span attributes and turn records carry the same text, and a reader that receives one compares
it with a member, never with a literal. ``tests/unit/test_vocabulary.py`` checks that each value is documented
in docs/architecture.md and that the proto's ``Decision`` names the same paths.
"""

from __future__ import annotations

from enum import StrEnum


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
