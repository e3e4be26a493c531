"""The soft index: per engine, the block keys its own prefix cache holds, as its sidecar reports them from
vLLM's KV cache events (``ReportCacheEvents``). Pure: no I/O, no clock.

A *hint*, unlike a lease (a promise): vLLM may evict a cached block at any step, and nothing pins it. So the
index is bounded per engine (the oldest-stored keys go first), kept in memory only, and reset whenever its
continuity is in doubt. Placement may use it to prefer an engine that already caches a prompt's prefix; it
never hands out block ids from it.

Continuity: batches of one engine incarnation carry sequence numbers 1, 2, 3, ... A batch is applied on top of
what the index holds only when its ``seq`` is the one expected. A new incarnation, a sender that asks for a
``reset``, or any other ``seq`` first empties the engine's index (a reset); the batch is then applied, and the
ack tells the sender, which re-sends its whole mirror unless it asked for the reset itself.

Inputs are assumed valid here (key lengths, counts, a registered engine): :class:`BrokerState` checks them.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvloop.broker.core.holders import Holders


class ResetReason(enum.Enum):
    REQUESTED = "requested"
    """The sender lost track (missed events, a restart, its first batch after registering) and said so."""
    GAP = "gap"
    """The batch's seq was not the one expected: batches were lost, or the broker restarted or failed over."""
    INCARNATION = "incarnation"
    """The engine restarted: its cache is a new one."""


@dataclass(frozen=True, slots=True)
class SoftAck:
    reset: bool
    """The engine's index was emptied before this batch was applied."""
    reason: ResetReason | None
    counted: bool
    """Whether the reset counts in ``resets``: not the first batch of a fresh index asking for one."""
    cached_blocks: int
    expected_seq: int
    stored: int
    removed: int
    dropped: int
    """Keys dropped to stay within the cap, oldest-stored first."""


@dataclass(slots=True)
class _EngineIndex:
    incarnation: str
    expected_seq: int = 1
    started: bool = False
    """Whether a batch was applied: a reset before that discards nothing and is not counted."""
    resets: int = 0
    keys: OrderedDict[bytes, None] = field(default_factory=OrderedDict)


class SoftIndex:
    def __init__(self, max_blocks: int) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self._engines: dict[str, _EngineIndex] = {}
        self._holders = Holders()
        """Key to the engines caching it: what :meth:`prefixes` walks, instead of every engine's index."""

    def apply(self, engine_id: str, incarnation: str, seq: int, *, reset: bool, cleared: bool,
              stored: Sequence[bytes], removed: Sequence[bytes]) -> SoftAck:
        """Apply one batch: a reset if due, then ``cleared``, the stored keys in order, the removed keys."""
        index = self._engines.get(engine_id)
        if index is None:
            index = self._engines[engine_id] = _EngineIndex(incarnation)
        reason = (ResetReason.INCARNATION if index.incarnation != incarnation
                  else ResetReason.REQUESTED if reset
                  else ResetReason.GAP if seq != index.expected_seq
                  else None)
        counted = reason is not None and (index.started or reason is not ResetReason.REQUESTED)
        if reason is not None:
            self._clear(engine_id, index)
            index.incarnation = incarnation
            index.resets += int(counted)
        if cleared:
            self._clear(engine_id, index)
        keys, holders = index.keys, self._holders
        for key in stored:
            if key in keys:
                keys.move_to_end(key)  # stored again: the newest now, the last to go over the cap
            else:
                keys[key] = None
                holders.add(key, engine_id)
        gone = 0
        for key in removed:
            if key in keys:
                del keys[key]
                holders.discard(key, engine_id)
                gone += 1
        dropped = 0
        while len(keys) > self.max_blocks:
            holders.discard(keys.popitem(last=False)[0], engine_id)
            dropped += 1
        index.expected_seq = seq + 1
        index.started = True
        return SoftAck(reset=reason is not None, reason=reason, counted=counted, cached_blocks=len(keys),
                       expected_seq=index.expected_seq, stored=len(stored), removed=gone, dropped=dropped)

    def _clear(self, engine_id: str, index: _EngineIndex) -> None:
        for key in index.keys:
            self._holders.discard(key, engine_id)
        index.keys.clear()

    def prefixes(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Per engine caching ``keys[0]``, how many leading ``keys`` it caches (:meth:`cached_prefix` of each), found
        by walking the prompt's keys once: O(prompt blocks x engines still matching), not O(fleet)."""
        if not keys:
            return {}
        alive = set(self._holders.members(keys[0]))
        out: dict[str, int] = {}
        depth = 1
        for key in keys[1:]:
            if not alive:
                break
            still = alive.intersection(self._holders.members(key))
            for engine_id in alive - still:
                out[engine_id] = depth
            alive, depth = still, depth + 1
        for engine_id in alive:
            out[engine_id] = depth
        return out

    def cached_prefix(self, engine_id: str, keys: Iterable[bytes]) -> int:
        """How many leading ``keys`` the engine caches: the contiguous run from the first, stopping at the first
        missing one (keys are chained, so a later key present after a missing one is no prefix of the prompt)."""
        index = self._engines.get(engine_id)
        if index is None or not index.keys:
            return 0
        held, n = index.keys, 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def cached_blocks(self, engine_id: str) -> int:
        index = self._engines.get(engine_id)
        return len(index.keys) if index is not None else 0

    def resets(self, engine_id: str) -> int:
        index = self._engines.get(engine_id)
        return index.resets if index is not None else 0

    def keys(self, engine_id: str) -> list[bytes]:
        """The engine's keys, oldest-stored first (tests and inspection)."""
        index = self._engines.get(engine_id)
        return list(index.keys) if index is not None else []

    def drop(self, engine_id: str) -> None:
        """The engine is gone (deregistered, expired, or registered anew with a new incarnation)."""
        index = self._engines.pop(engine_id, None)
        if index is not None:
            self._clear(engine_id, index)
