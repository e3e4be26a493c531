"""A modelled engine's KV pool: the blocks of its prefix cache, by key, and the blocks private to running requests.

As in vLLM, a computed full block is cached under its key; a block some request (or a retained lease) references
is pinned; an unreferenced cached block stays until the pool needs its room, least recently used first. A block
still being computed, or a request's partial last block, has no key yet: it is private to its request. Pure: no
clock (recency is the order of use), no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockPool:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._refs: dict[bytes, int] = {}
        """Every cached block and how many requests or leases hold it (0: evictable)."""
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        """The unreferenced cached blocks, least recently used first."""
        self.private = 0
        self.stored: list[bytes] = []
        self.removed: list[bytes] = []
        """Keys cached and evicted since the last :meth:`take_events` (vLLM's KV cache events)."""

    @property
    def used(self) -> int:
        return len(self._refs) + self.private

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def evictable(self) -> int:
        return len(self._lru)

    @property
    def cached(self) -> int:
        return len(self._refs)

    def cached_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading ``keys`` the cache holds, in blocks."""
        n = 0
        for key in keys:
            if key not in self._refs:
                break
            n += 1
        return n

    def room(self, hits: Sequence[bytes]) -> int:
        """New blocks that fit beside the cached ``hits``, which stop being evictable once held."""
        return self.free + self.evictable - sum(1 for k in hits if k in self._lru)

    def fits(self, hits: Sequence[bytes], private: int) -> bool:
        return private <= self.room(hits)

    def take(self, hits: Sequence[bytes], private: int) -> None:
        """Hold ``hits`` and ``private`` new blocks, evicting the least recently used to make room (``fits`` first)."""
        for key in hits:
            self.hold(key)
        self._evict(private - self.free)
        self.private += private

    def hold(self, key: bytes) -> None:
        refs = self._refs[key]
        if refs == 0:
            del self._lru[key]
        self._refs[key] = refs + 1

    def drop(self, key: bytes) -> None:
        """End one hold; an unheld block becomes the most recently used evictable one."""
        refs = self._refs[key] - 1
        self._refs[key] = refs
        if refs == 0:
            self._lru[key] = None

    def cache(self, key: bytes) -> None:
        """A private block of a request was computed in full: cache it under ``key``, still held by the request.
        Where another request cached the same key meanwhile, the request holds that one and frees its own."""
        self.private -= 1
        if key in self._refs:
            self.hold(key)
            return
        self._refs[key] = 1
        self.stored.append(key)

    def release(self, private: int) -> None:
        self.private -= private

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        stored, removed = self.stored, self.removed
        self.stored, self.removed = [], []
        return stored, removed

    def _evict(self, blocks: int) -> None:
        for _ in range(max(0, blocks)):
            key, _ = self._lru.popitem(last=False)
            del self._refs[key]
            self.removed.append(key)
