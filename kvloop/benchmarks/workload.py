"""Multi-turn workloads for ``kvloop bench multiturn``: a seeded synthetic agent generator shaped like vLLM's
multi-turn benchmark, and a replay of a JSONL file of OpenAI chat conversations. Pure data, no I/O besides
reading the replay file.

Synthetic: ``conversations`` conversations of ``turns_min``..``turns_max`` turns; every conversation starts
with the same ``system_tokens`` shared prefix, then its own ``own_prefix_tokens`` (a long task description,
a file it read); each turn adds ``new_min``..``new_max`` tokens (a tool result, a question) and asks for
``output_tokens``. Token ids, not text, so every configuration sees exactly the same prompts.
"""

from __future__ import annotations

import json
import random
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


@dataclass
class Conversation:
    conversation_id: str
    prefix: list[int]
    """The first turn's prompt before its new tokens: shared system prefix plus this conversation's own."""
    new_tokens: list[list[int]] = field(default_factory=list)
    """Per turn, the tokens the user (or a tool) adds."""

    @property
    def turns(self) -> int:
        return len(self.new_tokens)


def synthetic(spec: WorkloadSpec) -> list[Conversation]:
    spec.validate()
    rng = random.Random(spec.seed)
    low, high = spec.vocab

    def draw(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

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


def describe(spec: WorkloadSpec, conversations: list[Conversation]) -> dict[str, Any]:
    longest = max((len(c.prefix) + sum(map(len, c.new_tokens)) for c in conversations), default=0)
    return {**asdict(spec), "vocab": list(spec.vocab), "turns_total": sum(c.turns for c in conversations),
            "longest_prompt_tokens_without_outputs": longest}
