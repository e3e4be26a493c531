"""Multi-turn workloads for ``kvloop bench multiturn``, seeded, as token ids (every configuration sees exactly
the same prompts). Pure data, no I/O besides reading a replay file.

- :func:`agent` (the default, :class:`AgentSpec`): agent sessions. One shared system prompt (tools,
  instructions); each session starts with a short task and grows over ``turns_min``..``turns_max`` turns, each
  adding a tool output whose length has a heavy tail (log-normal, clipped) and a short instruction, and asking
  for an answer of ``answer_min``..``answer_max`` tokens; the agent thinks (runs its tool) between turns.
- :func:`synthetic` (:class:`WorkloadSpec`): long-context chats that start big (a large own prefix) and add a
  small tail each turn, shaped like vLLM's multi-turn benchmark.
- :func:`replay`: a JSONL file of OpenAI chat conversations, tokenized by the served model's chat template.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class WorkloadSpec:
    conversations: int = 4
    turns_min: int = 8
    turns_max: int = 12
    system_tokens: int = 500
    own_prefix_tokens: int = 6000
    new_min: int = 100
    new_max: int = 200
    output_tokens: int = 32
    think_time_s: float = 0.0
    concurrency: int = 2
    seed: int = 0
    vocab: tuple[int, int] = (300, 4000)
    """Token ids are drawn from this range (the tiny model's ordinary tokens; no special ids)."""

    def validate(self) -> None:
        for name in ("conversations", "turns_min", "new_min", "output_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1 (got {getattr(self, name)})")
        if self.turns_max < self.turns_min or self.new_max < self.new_min:
            raise ValueError("turns_max and new_max must be at least turns_min and new_min")
        if self.system_tokens < 0 or self.own_prefix_tokens < 0 or self.think_time_s < 0:
            raise ValueError("system_tokens, own_prefix_tokens and think_time_s must be >= 0")


@dataclass(frozen=True)
class AgentSpec:
    sessions: int = 8
    turns_min: int = 20
    turns_max: int = 30
    system_tokens: int = 1500
    task_min: int = 40
    task_max: int = 200
    tool_median: int = 150
    """Median tool-output tokens; log-normal with ``tool_sigma``, clipped to ``tool_min``..``tool_max``."""
    tool_sigma: float = 1.0
    tool_min: int = 10
    tool_max: int = 1500
    instruction_min: int = 10
    instruction_max: int = 40
    answer_min: int = 32
    answer_max: int = 256
    think_min_s: float = 0.2
    think_max_s: float = 1.5
    think_dist: str = "uniform"
    """How a tool pause is drawn within ``think_min_s``..``think_max_s``: ``uniform``, or ``loguniform`` (as many
    pauses of 2-6 s as of 20-60 s: tool runs of seconds to minutes, a few long ones)."""
    concurrency: int = 3
    """Sessions in flight at once (each session's turns are sequential)."""
    seed: int = 0
    vocab: tuple[int, int] = (300, 4000)

    def validate(self) -> None:
        for name in ("sessions", "turns_min", "answer_min", "concurrency", "tool_min", "instruction_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1 (got {getattr(self, name)})")
        for low, high in (("turns_min", "turns_max"), ("task_min", "task_max"), ("tool_min", "tool_max"),
                          ("instruction_min", "instruction_max"), ("answer_min", "answer_max"),
                          ("think_min_s", "think_max_s")):
            if getattr(self, high) < getattr(self, low):
                raise ValueError(f"{high}: must be at least {low}")
        if self.system_tokens < 0 or self.think_min_s < 0 or self.tool_sigma < 0:
            raise ValueError("system_tokens, think_min_s and tool_sigma must be >= 0")
        if self.think_dist not in THINK_DISTS:
            raise ValueError(f"think_dist: {self.think_dist!r} is not one of {', '.join(THINK_DISTS)}")
        if self.think_dist == "loguniform" and self.think_min_s <= 0:
            raise ValueError("think_min_s: must be above 0 for loguniform pauses")


THINK_DISTS = ("uniform", "loguniform")


def draw_think(rng: random.Random, spec: AgentSpec) -> float:
    """One tool pause, in seconds, rounded to the millisecond."""
    if spec.think_dist == "loguniform":
        return round(math.exp(rng.uniform(math.log(spec.think_min_s), math.log(spec.think_max_s))), 3)
    return round(rng.uniform(spec.think_min_s, spec.think_max_s), 3)


@dataclass
class Conversation:
    conversation_id: str
    prefix: list[int]
    """The first turn's prompt before its new tokens: shared system prefix plus this conversation's own."""
    new_tokens: list[list[int]] = field(default_factory=list)
    """Per turn, the tokens the user (or a tool) adds."""
    answer_tokens: list[int] = field(default_factory=list)
    """Per turn, the answer's length (generated with ``ignore_eos``); empty: the spec's ``output_tokens``."""
    think_s: list[float] = field(default_factory=list)
    """Per turn, the pause after its answer (the agent's tool run); empty: the spec's ``think_time_s``."""

    @property
    def turns(self) -> int:
        return len(self.new_tokens)

    def answer(self, turn: int, default: int) -> int:
        return self.answer_tokens[turn] if self.answer_tokens else default

    def think(self, turn: int, default: float) -> float:
        return self.think_s[turn] if self.think_s else default

    def context_tokens(self, turn: int, default_answer: int) -> int:
        """The prompt length of ``turn`` (0-based): prefix, every earlier turn's new tokens and answer, its own."""
        return len(self.prefix) + sum(len(n) for n in self.new_tokens[: turn + 1]) + sum(
            self.answer(i, default_answer) for i in range(turn))


def _tokens(rng: random.Random, vocab: tuple[int, int]) -> Callable[[int], list[int]]:
    """``draw(n)``: n token ids from ``vocab``, from ``rng`` (every draw advances the one seeded stream)."""
    low, high = vocab
    return lambda n: [rng.randrange(low, high) for _ in range(n)]


def agent(spec: AgentSpec) -> list[Conversation]:
    spec.validate()
    rng = random.Random(spec.seed)
    draw = _tokens(rng, spec.vocab)
    system = draw(spec.system_tokens)
    out = []
    mu = math.log(spec.tool_median)
    for i in range(spec.sessions):
        conv = Conversation(f"agent-{i}", system + draw(rng.randint(spec.task_min, spec.task_max)))
        for turn in range(rng.randint(spec.turns_min, spec.turns_max)):
            instruction = draw(rng.randint(spec.instruction_min, spec.instruction_max))
            # The first turn is the task itself; later turns each bring a tool's output.
            tool = 0 if turn == 0 else min(spec.tool_max, max(spec.tool_min,
                                                               round(rng.lognormvariate(mu, spec.tool_sigma))))
            conv.new_tokens.append(draw(tool) + instruction)
            conv.answer_tokens.append(rng.randint(spec.answer_min, spec.answer_max))
            conv.think_s.append(draw_think(rng, spec))
        out.append(conv)
    return out


def synthetic(spec: WorkloadSpec) -> list[Conversation]:
    spec.validate()
    rng = random.Random(spec.seed)
    draw = _tokens(rng, spec.vocab)
    system = draw(spec.system_tokens)
    out = []
    for i in range(spec.conversations):
        conv = Conversation(f"conv-{i}", system + draw(spec.own_prefix_tokens))
        for _ in range(rng.randint(spec.turns_min, spec.turns_max)):
            conv.new_tokens.append(draw(rng.randint(spec.new_min, spec.new_max)))
        out.append(conv)
    return out


def replay(path: Path, tokenize: Any, limit: int = 0) -> list[Conversation]:
    """Conversations from JSONL: one per line, ``{"messages": [...]}`` or a bare list of OpenAI messages.
    Each user message starts a turn; ``tokenize(messages) -> token ids`` renders them (the engines' own
    chat template), and a turn's new tokens are what its messages add to the previous rendering."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        record = json.loads(line)
        messages = record["messages"] if isinstance(record, dict) else record
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"{path}:{n + 1}: expected a list of OpenAI messages")
        cuts = [i + 1 for i, m in enumerate(messages) if m["role"] == "user"]
        if not cuts:
            continue
        renders = [list(tokenize(messages[:cut])) for cut in cuts]
        conv = Conversation(f"replay-{n}", [])
        previous: list[int] = []
        for tokens in renders:
            common = 0
            while common < min(len(tokens), len(previous)) and tokens[common] == previous[common]:
                common += 1
            conv.new_tokens.append(tokens[common:])
            previous = tokens
        out.append(conv)
        if limit and len(out) >= limit:
            break
    return out


def describe(spec: AgentSpec | WorkloadSpec, conversations: list[Conversation], answer: int,
             late_tokens: int) -> dict[str, Any]:
    """The workload's shape, for the JSON: the spec, turns, context lengths, late turns."""
    contexts = [c.context_tokens(t, answer) for c in conversations for t in range(c.turns)]
    return {"kind": type(spec).__name__, "spec": {**asdict(spec), "vocab": list(spec.vocab)},
            "sessions": len(conversations), "turns_total": len(contexts),
            "context_tokens": {"min": min(contexts, default=0), "max": max(contexts, default=0),
                               "median": sorted(contexts)[len(contexts) // 2] if contexts else 0},
            "late_tokens": late_tokens, "late_turns": sum(1 for c in contexts if c >= late_tokens)}
