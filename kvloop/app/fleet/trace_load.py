"""A Mooncake-format trace (``kvloop bench load --trace``) as the fleet replay's schedule: each request a turn sent at
its timestamp, whatever came back, as AIPerf's fixed schedule sends it. Pure.

AIPerf builds a request's prompt from its ``hash_ids``, one block of ``trace_block`` tokens per id, the same tokens
for the same id, cut to ``input_length``: so here each id's tokens are drawn from a generator seeded by the id, and
the engine's own block keys (its ``block_size``) chained over them, so prompts that share ids share keys whatever
the two block sizes. An answer is never part of a later prompt (AIPerf does not send the engine's answers back):
its keys are the request's own. Sessions (the broker's stickiness) are the conversations
:func:`kvloop.shared.mooncake.conversations` infers.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from kvloop.app.fleet.sessions import ANSWER_VOCAB, EXTRA, Turn
from kvloop.shared import mooncake
from kvloop.shared.hashing import block_key
from kvloop.shared.mooncake import TraceRow


def trace_schedule(rows: Sequence[TraceRow], trace_block: int, block_size: int,
                   salt: str = "") -> list[tuple[float, Turn]]:
    """Each row (in arrival order) as ``(seconds from the start, turn)``. ``salt`` draws every id's tokens anew: AIPerf
    writes new text for the same ids in each run, so the load bench's points share no block (measured: no key in
    common between a replay's points in the router's records)."""
    convs = mooncake.conversations(rows)
    digest = EXTRA.digest()
    low, high = ANSWER_VOCAB
    blocks: dict[int, list[int]] = {}
    turns_seen: Counter[int] = Counter()
    out = []
    for n, (row, conv) in enumerate(zip(rows, convs, strict=True)):
        tokens: list[int] = []
        for h in row.hash_ids:
            if h not in blocks:
                rng = random.Random(f"{salt}id/{h}")
                blocks[h] = [rng.randrange(low, high) for _ in range(trace_block)]
            tokens += blocks[h]
        if len(tokens) < row.input_length:  # ids short of the length: the rest is this request's own
            rng = random.Random(f"{salt}row/{n}")
            tokens += [rng.randrange(low, high) for _ in range(row.input_length - len(tokens))]
        prompt = tokens[: max(1, row.input_length)]
        answer_rng = random.Random(f"{salt}answer/{n}")
        answer = max(1, row.output_length)
        full = prompt + [answer_rng.randrange(low, high) for _ in range(answer)]
        keys, parent = [], bytes(32)
        for start in range(0, len(full) - block_size + 1, block_size):
            parent = block_key(parent, full[start: start + block_size], digest)
            keys.append(parent)
        index = turns_seen[conv]
        turns_seen[conv] += 1
        out.append((row.timestamp_ms / 1000.0, Turn(f"conv-{conv}", index, len(prompt), answer, 0.0,
                                                     tuple(keys[: len(prompt) // block_size]), tuple(keys))))
    return out
