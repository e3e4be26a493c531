"""A session's turns as the fleet replay sends them: each prompt is the history (every earlier prompt and answer)
plus the turn's new tokens, with the block keys the router would compute for it.

The workload (:mod:`kvloop.app.benchmarks.workload`) gives each turn's new tokens and answer length, not the
answer's tokens: a real engine samples them. Here they are drawn from a generator seeded by the session and turn,
so every configuration replays the same histories, and the keys of a turn's answer blocks are the keys its
session's next prompt starts with, as in a real agent loop.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

from kvloop.app.benchmarks.workload import Conversation
from kvloop.shared.hashing import ExtraKeys, block_key

FINGERPRINT = "fleet-sim"
EXTRA = ExtraKeys(FINGERPRINT)
ANSWER_VOCAB = (300, 4000)


@dataclass(frozen=True, slots=True)
class Turn:
    session: str
    index: int
    """0-based."""
    prompt_tokens: int
    answer_tokens: int
    think_s: float
    """The pause after its answer before the session's next turn (the agent's tool run)."""
    prompt_keys: tuple[bytes, ...]
    """Full blocks of the prompt: what the router asks the broker about."""
    keys: tuple[bytes, ...]
    """Full blocks of the prompt and the answer: what the engine that decodes it holds afterwards."""


@dataclass
class SessionTokens:
    """One session's token history and the chained keys of its full blocks, extended turn by turn."""

    conversation: Conversation
    block_size: int
    salt: str = ""
    """Draws this replay's answers apart from another's of the same sessions (a sweep's next point samples anew)."""
    tokens: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    _digest: bytes = field(default=EXTRA.digest(), repr=False)

    def turn(self, index: int) -> Turn:
        """Turn ``index`` (called in order: each call appends that turn's new tokens and answer)."""
        conv = self.conversation
        if index == 0:
            self.tokens = list(conv.prefix)
        self.tokens += conv.new_tokens[index]
        prompt = len(self.tokens)
        answer = conv.answer(index, 1)
        self.tokens += _answer_ids(f"{self.salt}{conv.conversation_id}", index, answer)
        self._extend_keys()
        prompt_keys = tuple(self.keys[: prompt // self.block_size])
        return Turn(conv.conversation_id, index, prompt, answer, conv.think(index, 0.0), prompt_keys,
                    tuple(self.keys))

    def _extend_keys(self) -> None:
        bs = self.block_size
        parent = self.keys[-1] if self.keys else bytes(32)
        for start in range(len(self.keys) * bs, len(self.tokens) - bs + 1, bs):
            parent = block_key(parent, self.tokens[start: start + bs], self._digest)
            self.keys.append(parent)


def _answer_ids(session: str, turn: int, n: int) -> list[int]:
    rng = random.Random(zlib.crc32(f"{session}/{turn}".encode()))
    low, high = ANSWER_VOCAB
    return [rng.randrange(low, high) for _ in range(n)]
