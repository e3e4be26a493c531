"""Recently answered turns, so that the next turn of a conversation does not outrun its own lease.

When a turn's answer ends, the decode engine's connector hands the retained blocks to its sidecar, which
publishes the lease to the broker a few milliseconds later. A client that sends its next turn at once (an
agent loop with no think time) can be placed in between, find only an older, shorter lease (or none), and
recompute what was about to be published. The router knows the race is possible: it just answered a turn
whose prompt the new one extends. So it remembers, per answered turn, the chained key of the prompt's last
full block and when the answer ended. A new prompt whose keys contain such a key extends that turn, and its
match should cover at least that many blocks; until it does, and for at most ``window_s`` after the answer,
the router places again.

Matching is by content (chained block keys), not by session id, so a client that sends no session hint gets
the same protection, and an edited history (whose keys diverge) does not wait. Pure: no I/O, no clock of its
own (callers pass ``now``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class RecentTurns:
    """Answered turns of the last ``window_s`` seconds: last full prompt block key -> (end time, blocks)."""

    def __init__(self, window_s: float, capacity: int = 65536) -> None:
        self.window_s = window_s
        self.capacity = capacity
        self._ended: OrderedDict[bytes, tuple[float, int]] = OrderedDict()

    def answered(self, prompt_keys: Sequence[bytes], now: float) -> None:
        """A turn whose prompt had these full-block keys has just been answered."""
        if not prompt_keys or self.window_s <= 0:
            return
        self._forget(now)
        key = prompt_keys[-1]
        self._ended.pop(key, None)
        self._ended[key] = (now, len(prompt_keys))
        while len(self._ended) > self.capacity:
            self._ended.popitem(last=False)

    def expected(self, prompt_keys: Sequence[bytes], now: float) -> tuple[int, float]:
        """(blocks the broker's match should reach, deadline to wait for it); (0, now) when nothing is due.

        The longest recently answered prompt that this one extends wins: its lease covers those blocks."""
        if self.window_s <= 0 or not self._ended:
            return 0, now
        self._forget(now)
        for i in range(len(prompt_keys) - 1, -1, -1):
            hit = self._ended.get(prompt_keys[i])
            if hit is not None and hit[1] == i + 1:
                return i + 1, hit[0] + self.window_s
        return 0, now

    def _forget(self, now: float) -> None:
        while self._ended:
            key, (ended, _) = next(iter(self._ended.items()))
            if now - ended <= self.window_s:
                break
            del self._ended[key]

    def __len__(self) -> int:
        return len(self._ended)
