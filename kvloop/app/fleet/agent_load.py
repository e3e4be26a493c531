"""``kvloop bench load``'s agent workload (:class:`~kvloop.app.benchmarks.aiperf.AgentLoad`) as the fleet replay's
conversations: what AIPerf 0.13 sends for the load bench's command line (:func:`kvloop.app.benchmarks.aiperf.command`),
in token counts. Pure.

AIPerf's synthetic multi-turn chat, as its source builds it: one system prompt of ``system_tokens`` shared by every
session; ``sessions`` sessions of exactly ``turns`` turns (the turn count's stddev is 0); each turn a new user message
of exactly ``user_tokens`` and an answer of exactly ``answer_tokens`` (``max_tokens`` with ``ignore_eos``), every turn
carrying the whole history with the answers the engine gave; a delay of ``think_ms`` before every turn but the first,
counted from the previous answer's end; ``--concurrency`` session slots, a slot held from a session's first turn until
its last answer returns (no delay after it), then taken by the next session.

What the token counts leave out: the chat template's own tokens (role headers, end-of-turn markers; AIPerf sends
chat and subtracts none of them without ``--apply-chat-template``), and the engine's re-tokenization of an answer's
text in the next turn's prompt (here the next prompt holds the answer's tokens exactly).
"""

from __future__ import annotations

import random

from kvloop.app.benchmarks.aiperf import AgentLoad
from kvloop.app.benchmarks.workload import Conversation
from kvloop.app.fleet.sessions import ANSWER_VOCAB


def think_seconds(load: AgentLoad) -> float:
    """The delay before each later turn as AIPerf draws it with stddev 0: none for 0, else ``max(1, int(mean))``
    whole milliseconds."""
    return max(1, int(load.think_ms)) / 1e3 if load.think_ms > 0 else 0.0


def agent_conversations(load: AgentLoad) -> list[Conversation]:
    """The load's sessions, seeded by ``load.seed``: one shared system prompt, each session's own user messages."""
    rng = random.Random(load.seed)
    low, high = ANSWER_VOCAB  # the ordinary-token range the replay draws answers from: no special ids

    def draw(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    system = draw(load.system_tokens)
    think = think_seconds(load)
    # A conversation's think time is the pause after a turn's answer: AIPerf's delay before turn i + 1, and none
    # after the last turn, whose return frees the session's slot at once.
    pauses = [think] * (load.turns - 1) + [0.0]
    return [Conversation(f"session-{i}", list(system), [draw(load.user_tokens) for _ in range(load.turns)],
                         [load.answer_tokens] * load.turns, list(pauses))
            for i in range(load.sessions)]
