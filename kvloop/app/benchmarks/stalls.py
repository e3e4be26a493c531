"""The per-turn stall check of the benchmarks' health, pure: a turn whose time to first token (TTFT) or largest
gap between streamed tokens is longer than its engine's queue and compute explain, by more than ``BOUND_S``, is a
stall; a configuration with any stall is unhealthy (:func:`kvloop.app.benchmarks.stats.health`), so the benches
withhold its ratios. No I/O, no clock: every time is what the bench measured. Unit-tested in
``tests/unit/test_stalls.py``.

Why per turn: the configuration-wide checks (TTFT summed against the engines' prefill time; requests queued over
``STALL_S``) let ~5 s stalls through (vLLM's 5,000 ms shared-memory reader recheck: an inter-token gap of
5,018 ms, a TTFT of 5 s where the configuration's median was 200 ms). The router's own step timings are no
explanation (a stall inside an engine shows as a 5 s ``prefill`` or ``decode_first`` step), so what explains a
turn is computed from token counts and one measured rate:

- **Prefill rate** ``R``: the configuration's engines' computed prompt tokens over their summed prefill time
  (vLLM's ``prompt_tokens_by_source{source="local_compute"}`` over ``request_prefill_time_seconds``). Requests
  that share steps each count the shared time, so ``R`` is a lower bound of the rate: the check is lenient.
  A turn's prompt is being computed from when it is sent to its first token (an upper bound, lenient again).
- **Explained TTFT** = (the turn's computed tokens + the computed tokens of the turns queued ahead of it on its
  prefill engine + the tokens it pulled) / ``R`` + the hand-off (P/D: ``HAND_OFF_STEPS`` steps of its decode
  engine, each the most prompt tokens that engine was computing at once meanwhile, capped at its step budget,
  / ``R``, plus one decode step) + the router's deliberate waits
  (``publication_wait``) + ``TURN_OVERHEAD_S`` (HTTP hops, placement, the P/D hand-off). Queued ahead:
  sent before the turn and without a first token when it was sent, counted whole (an upper bound of what was
  left), and those sent while it waited up to one step's budget (continuous batching fills the turn's own step
  with them). An engine's queue is its cores' queue: engines bound to the same cores (the benches' two prefill
  engines share the first half of the machine) compute each other's turns' tokens, so every turn computing there
  while it waited counts (``cores``).
  A pull is explained up to what computing its tokens would cost (the router pulls only when that is cheaper).
- **Context**: a prompt token attends to every token before it, so one computed at 12,000 tokens of context costs
  more than one at 1,000; ``R`` is the run's average. Each turn's computed tokens are weighed by
  ``1 + context / CONTEXT_COST_TOKENS`` (its computed tokens' mean position), relative to the run's token-weighted
  mean weight, so the run's total time is what ``R`` says and long contexts get their larger share of it.
- **Explained gap** (the turn's largest) = one step of its decode engine: the most prompt tokens that engine was
  computing at once while the turn streamed, capped at its step budget, / ``R`` + one decode step (the
  configuration's median gap).

A turn is a stall when measured - explained > ``BOUND_S`` (1 s). Where inputs are missing, the report says so
and the check falls back: computed tokens unknown, the whole prompt counts as computed; the engine unknown,
every engine's turns count as its queue; no rate or no send times, a gap is held against ``FALLBACK_FACTOR`` (10)
times the configuration's median gap and a TTFT against the larger of its own compute and 10 times the
configuration's median TTFT (a gap then stalls above 1 s + 10 median gaps, ~1.08 s at the 8 ms measured).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvloop.app.benchmarks.stats import TURN_OVERHEAD_S

BOUND_S = 1.0
"""A turn is a stall when its TTFT or largest gap exceeds what explains it by more than this."""
CONTEXT_COST_TOKENS = 5900.0
"""The context at which a prompt token's attention costs as much as the rest of its compute: the tiny model on this
project's CPU machines (``kvloop bench profile`` at b78629f, docs/bench/fleet/profile-cpu-1core-avx2.json:
prefill_token_s 1.05 ms over attention_token_s 0.177 ms per 1,000 tokens of context)."""
DEFAULT_STEP_TOKENS = 2048
"""An engine's step budget where the bench does not know it: vLLM's ``max_num_batched_tokens`` for its OpenAI server
on most hardware (``vllm/engine/arg_utils.py``)."""
FALLBACK_FACTOR = 10.0
"""Without the inputs of the model: a gap is explained by this many median gaps, a TTFT by this many median TTFTs."""
HAND_OFF_STEPS = 3
"""Decode-engine steps a P/D hand-off waits at most before its first token: vLLM's decode engine takes a request
whose KV it must pull between steps (the one in progress when it arrives), reads the KV while its next step runs
and sees the read done only at that step's end, and computes the first token in the step after. Found on a
``private``-shape load run at 16 sessions (issue 49): hand-offs that reached the decode engine while its steps
computed 512-token DECODE_LOCAL chunks waited 1.4-1.8 s for their first token, three such steps, where one step
had been allowed."""


@dataclass(frozen=True)
class TurnTiming:
    """What a bench measured of one finished turn (seconds on any clock the configuration's turns share)."""

    name: str
    """How the report names the turn (``agent-3 turn 5``)."""
    ttft_s: float | None
    """None: not measured."""
    max_gap_s: float | None = None
    """The largest gap between streamed tokens; None: not streamed."""
    start_s: float | None = None
    """When the turn was sent; None: unknown (no queue can be worked out)."""
    end_s: float | None = None
    """When its last token came."""
    prompt_tokens: int = 0
    computed_tokens: int | None = None
    """The engines' own account of the tokens computed for the prompt; None: unknown (the whole prompt counts)."""
    pulled_tokens: int = 0
    wait_s: float = 0.0
    """The router's deliberate waits before the prefill (``publication_wait``)."""
    prefill_engine: str = ""
    """The engine that computed the prompt; "": unknown (any engine's queue counts)."""
    decode_engine: str = ""
    """The engine that streamed the answer; "": unknown."""

    @property
    def compute_tokens(self) -> int:
        return self.computed_tokens if self.computed_tokens is not None else self.prompt_tokens

    @property
    def first_s(self) -> float | None:
        return None if self.start_s is None or self.ttft_s is None else self.start_s + self.ttft_s


@dataclass(frozen=True)
class Stall:
    turn: str
    kind: str
    """``ttft`` or ``gap``."""
    measured_s: float
    explained_s: float
    rule: str
    """``model`` (queue and compute) or ``fallback`` (median multiples: inputs were missing)."""

    @property
    def excess_s(self) -> float:
        return self.measured_s - self.explained_s

    def describe(self) -> str:
        what = "time to first token" if self.kind == "ttft" else "inter-token gap"
        return (f"{self.turn}: {what} {self.measured_s:.2f} s, {self.explained_s:.2f} s explained"
                f"{' (fallback)' if self.rule == 'fallback' else ''}")


@dataclass(frozen=True)
class StallReport:
    checked: int
    """Turns checked."""
    stalls: tuple[Stall, ...]
    bound_s: float = BOUND_S
    missing: tuple[str, ...] = ()
    """Inputs that were missing, and the fallback taken for them."""
    rate_tokens_per_s: float | None = None

    @property
    def count(self) -> int:
        """Turns with at least one stall."""
        return len({s.turn for s in self.stalls})

    @property
    def worst(self) -> Stall | None:
        return max(self.stalls, key=lambda s: s.excess_s, default=None)

    def reason(self) -> str:
        """The health reason ("" without a stall): the count and the worst turn."""
        worst = self.worst
        if worst is None:
            return ""
        return (f"{self.count} turn(s) stalled more than {self.bound_s:g} s beyond their queue and compute "
                f"(worst: {worst.describe()})")

    def to_dict(self, most: int = 20) -> dict[str, Any]:
        """For the bench's JSON: the count, the worst turn, and the ``most`` worst stalls."""
        worst = self.worst
        ranked = sorted(self.stalls, key=lambda s: s.excess_s, reverse=True)[:most]
        return {"count": self.count, "checked": self.checked, "bound_s": self.bound_s,
                "prefill_tokens_per_s": None if self.rate_tokens_per_s is None else round(self.rate_tokens_per_s, 1),
                "worst": None if worst is None else worst.describe(),
                "stalls": [{"turn": s.turn, "kind": s.kind, "measured_s": round(s.measured_s, 3),
                            "explained_s": round(s.explained_s, 3), "rule": s.rule} for s in ranked],
                "missing": list(self.missing)}


def prefill_rate(computed_tokens: float, prefill_time_s: float) -> float | None:
    """``R`` in tokens a second, from the engines' counters; None when either is missing."""
    return computed_tokens / prefill_time_s if computed_tokens > 0 and prefill_time_s > 0 else None


def _one_engine(a: str, b: str) -> bool:
    """Two engine ids name the same engine, or one is unknown (then any engine may be it: lenient)."""
    return a == b or not a or not b


def _weight(t: TurnTiming, context_cost_tokens: float) -> float:
    """What a computed token of ``t`` costs against one at no context (see the module docstring)."""
    computed = t.compute_tokens
    mean_position = max(0, t.prompt_tokens - computed) + computed / 2
    return 1.0 + mean_position / context_cost_tokens


@dataclass
class _Model:
    turns: Sequence[TurnTiming]
    rate: float
    step_tokens: Mapping[str, int] = field(default_factory=dict)
    cores: Mapping[str, str] = field(default_factory=dict)
    """Each engine's cores (its binding, e.g. ``0`` or ``0-1``) where known."""
    context_cost_tokens: float = CONTEXT_COST_TOKENS
    _scale: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        tokens = sum(t.compute_tokens for t in self.turns)
        weighted = sum(t.compute_tokens * _weight(t, self.context_cost_tokens) for t in self.turns)
        mean = weighted / tokens if tokens else 1.0
        self._scale = {id(t): _weight(t, self.context_cost_tokens) / mean for t in self.turns}

    def cost(self, t: TurnTiming) -> float:
        """``t``'s computed tokens in the run's average tokens (``R`` prices those)."""
        return t.compute_tokens * self._scale.get(id(t), 1.0)

    def _same(self, a: str, b: str) -> bool:
        """Two engines compute on the same cores: the same engine, engines bound alike, or one unknown (then any
        engine may be it: lenient)."""
        if _one_engine(a, b):
            return True
        return (ca := self.cores.get(a)) is not None and ca == self.cores.get(b)

    def ahead(self, t: TurnTiming) -> float:
        """Costed tokens computed on ``t``'s cores while it waited, each turn counted whole: on its engine, the turns
        sent before it and without a first token then (first come, first served); on another engine bound to the
        same cores, every turn computing meanwhile (the OS shares the cores, whoever came first). Plus, on its
        engine, turns sent while it waited, up to one step's budget: continuous batching fills the step that
        computes ``t`` with whatever else waits."""
        assert t.start_s is not None and t.ttft_s is not None
        t_first = t.start_s + t.ttft_s
        earlier = joined = 0.0
        for u in self.turns:
            if u is t or u.start_s is None or (first := u.first_s) is None:
                continue
            if _one_engine(u.prefill_engine, t.prefill_engine):
                if u.start_s <= t.start_s < first:
                    earlier += self.cost(u)
                elif t.start_s < u.start_s < t_first:
                    joined += self.cost(u)
            elif self._same(u.prefill_engine, t.prefill_engine) and u.start_s < t_first and first > t.start_s:
                earlier += self.cost(u)
        budget = (self.step_tokens.get(t.prefill_engine) or DEFAULT_STEP_TOKENS) * self._scale.get(id(t), 1.0)
        return earlier + min(joined, budget)

    def step_s(self, engine: str, lo: float, hi: float, t: TurnTiming) -> float:
        """One step of ``engine`` while ``t`` waited on it in [lo, hi]: the most prompt tokens it was computing at
        once meanwhile (prompts whose prefill, sent to first token, overlaps the window and each other), capped at
        its step budget when known."""
        spans = [(max(u.start_s, lo), min(first, hi), self.cost(u)) for u in self.turns
                 if u is not t and u.start_s is not None and (first := u.first_s) is not None
                 and self._same(u.prefill_engine, engine) and u.start_s < hi and first > lo]
        tokens = max((sum(n for a, b, n in spans if a <= at < b) for at, _, _ in spans), default=0.0)
        # The budget caps a step's tokens; at the dearest context among them, as costed tokens.
        cap = self.step_tokens.get(engine, 0) * max((self._scale.get(id(u), 1.0) for u in self.turns
                                                     if self._same(u.prefill_engine, engine)), default=1.0)
        return (min(tokens, cap) if cap > 0 else tokens) / self.rate

    def ttft(self, t: TurnTiming, overhead_s: float, decode_step_s: float) -> float:
        assert t.start_s is not None and t.ttft_s is not None
        own = (self.cost(t) + self.ahead(t) + t.pulled_tokens) / self.rate
        hand_off = 0.0
        if t.decode_engine and t.decode_engine != t.prefill_engine:
            step = self.step_s(t.decode_engine, t.start_s, t.start_s + t.ttft_s, t)
            hand_off = HAND_OFF_STEPS * step + decode_step_s
        return own + hand_off + t.wait_s + overhead_s

    def gap(self, t: TurnTiming, decode_step_s: float) -> float:
        first, end = t.first_s, t.end_s
        assert first is not None and end is not None
        return self.step_s(t.decode_engine, first, end, t) + decode_step_s


def find_stalls(turns: Sequence[TurnTiming], *, prefill_tokens_per_s: float | None, median_gap_s: float | None,
                step_tokens: Mapping[str, int] | None = None, cores: Mapping[str, str] | None = None,
                context_cost_tokens: float = CONTEXT_COST_TOKENS, bound_s: float = BOUND_S,
                overhead_s: float = TURN_OVERHEAD_S, factor: float = FALLBACK_FACTOR) -> StallReport:
    """The stalls among one configuration run's finished turns (see the module's docstring for the rule).

    ``prefill_tokens_per_s``: ``R`` (:func:`prefill_rate`); ``median_gap_s``: the median of every gap between
    streamed tokens of the run (one decode step); ``step_tokens``: each engine's step budget (vLLM's
    ``--max-num-batched-tokens``) by the engine names the turns use, where known; ``cores``: each engine's cores
    by the same names, where known (engines bound to the same cores share one queue)."""
    rate = prefill_tokens_per_s if prefill_tokens_per_s and prefill_tokens_per_s > 0 else None
    model = (_Model(turns, rate, dict(step_tokens or {}), dict(cores or {}), context_cost_tokens)
             if rate is not None else None)
    ttfts = [t.ttft_s for t in turns if t.ttft_s is not None]
    median_ttft_s = statistics.median(ttfts) if ttfts else 0.0
    decode_step_s = median_gap_s or 0.0
    stalls: list[Stall] = []
    missing: list[str] = []
    if rate is None:
        missing.append(f"no prefill rate measured: TTFT against {factor:g}x the median TTFT, gaps against "
                       f"{factor:g}x the median gap")
    if median_gap_s is None and any(t.max_gap_s is not None for t in turns):
        missing.append("no median gap: no decode step allowed for")
    unsent = sum(1 for t in turns if t.start_s is None)
    if unsent and rate is not None:
        missing.append(f"{unsent} turn(s) without send times: no queue worked out, TTFT against the larger of "
                       f"their compute and {factor:g}x the median TTFT, gaps against {factor:g}x the median gap")
    uncounted = sum(1 for t in turns if t.computed_tokens is None)
    if uncounted:
        missing.append(f"{uncounted} turn(s) without the engines' computed-token account: the whole prompt counted")
    unplaced = sum(1 for t in turns if not t.prefill_engine)
    if unplaced:
        missing.append(f"{unplaced} turn(s) without their engine: every engine's turns counted as their queue")
    for t in turns:
        if t.ttft_s is not None:
            if model is not None and t.start_s is not None:
                explained, rule = model.ttft(t, overhead_s, decode_step_s), "model"
            else:
                alone = ((t.compute_tokens + t.pulled_tokens) / rate + t.wait_s + overhead_s) if rate else 0.0
                explained, rule = max(alone, factor * median_ttft_s), "fallback"
            if t.ttft_s - explained > bound_s:
                stalls.append(Stall(t.name, "ttft", t.ttft_s, explained, rule))
        if t.max_gap_s is not None:
            if model is not None and t.first_s is not None and t.end_s is not None:
                explained, rule = model.gap(t, decode_step_s), "model"
            else:
                explained, rule = factor * decode_step_s, "fallback"
            if t.max_gap_s - explained > bound_s:
                stalls.append(Stall(t.name, "gap", t.max_gap_s, explained, rule))
    return StallReport(len(turns), tuple(stalls), bound_s, tuple(missing), rate)
