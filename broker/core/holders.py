"""Key to holders (lease ids, engine ids), the memory-lean way: most keys have one holder, so a key's value is that
holder's id itself (a string the holder's record already keeps: no extra object) until a second one joins, and
only then a set. A set costs about 200 bytes; a dict entry pointing at a shared string, about 50."""

from __future__ import annotations

from collections.abc import Iterable


class Holders:
    def __init__(self) -> None:
        self._by_key: dict[bytes, str | set[str]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def add(self, key: bytes, holder: str) -> None:
        held = self._by_key.get(key)
        if held is None:
            self._by_key[key] = holder
        elif isinstance(held, str):
            if held != holder:
                self._by_key[key] = {held, holder}
        else:
            held.add(holder)

    def discard(self, key: bytes, holder: str) -> None:
        held = self._by_key.get(key)
        if held is None:
            return
        if isinstance(held, str):
            if held == holder:
                del self._by_key[key]
            return
        held.discard(holder)
        if len(held) == 1:
            self._by_key[key] = next(iter(held))

    def members(self, key: bytes) -> Iterable[str]:
        held = self._by_key.get(key)
        if held is None:
            return ()
        return (held,) if isinstance(held, str) else held


class SharedIds:
    """One int object per block-id value, shared by every lease that holds that id, on any engine.

    Block ids are slots of an engine's KV pool (or host tier), so engines of one fleet use the same small range of
    values; a lease keeping its own int per block (32 bytes, beside the 8 of its tuple slot) would pay for each
    again. Ids at or over ``limit`` are kept as given, so a table that never shrinks stays bounded (about 73 bytes
    per value held: the int and its dict entry)."""

    def __init__(self, limit: int = 1 << 20) -> None:
        self._limit = limit
        self._ints: dict[int, int] = {}

    def share(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        ints, limit = self._ints, self._limit
        return tuple(ints.setdefault(i, i) if i < limit else i for i in ids)


class BlockRefs:
    """One engine's pool-block refcounts (how many of its leases hold each block id), the memory-lean way: a block
    held once is one bit of a bitmap indexed by its id (block ids are slots of the engine's pool, a dense range),
    and only a block held by several leases (a shared system prompt) has a dict entry with its count. A ``Counter``
    cost about 35 bytes per retained block; this costs an eighth of a byte per pool slot up to the highest id seen.
    Ids at or over ``limit`` are counted in the dict, so the bitmap stays within ``limit / 8`` bytes whatever ids an
    engine sends. Tested against a ``Counter`` in ``tests/unit/test_core_scale.py``."""

    def __init__(self, limit: int = 1 << 21) -> None:
        self._limit = limit
        self._bits = bytearray()
        self._counts: dict[int, int] = {}
        """Ids below ``limit`` held twice or more, and ids at or over it held at all: id -> count."""
        self._held = 0

    def __len__(self) -> int:
        """Distinct blocks held."""
        return self._held

    def get(self, block: int, default: int = 0, /) -> int:
        if block >= self._limit:
            return self._counts.get(block, default)
        byte = block >> 3
        if byte >= len(self._bits) or not self._bits[byte] >> (block & 7) & 1:
            return default
        return self._counts.get(block, 1)

    def __getitem__(self, block: int) -> int:
        return self.get(block, 0)

    def hold(self, blocks: Iterable[int]) -> None:
        """One more hold of each id in ``blocks`` (give each id once)."""
        bits, counts = self._bits, self._counts
        for block in blocks:
            if block >= self._limit:
                n = counts.get(block, 0)
                counts[block] = n + 1
                self._held += n == 0
                continue
            byte, bit = block >> 3, 1 << (block & 7)
            if byte >= len(bits):
                bits.extend(bytes(max(byte + 1, 2 * len(bits)) - len(bits)))
            if bits[byte] & bit:
                counts[block] = counts.get(block, 1) + 1
            else:
                bits[byte] |= bit
                self._held += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One hold less of each id in ``blocks`` (give each id once); an id not held is ignored."""
        bits, counts = self._bits, self._counts
        for block in blocks:
            if block >= self._limit:
                n = counts.get(block, 0)
                if n > 1:
                    counts[block] = n - 1
                elif n == 1:
                    del counts[block]
                    self._held -= 1
                continue
            byte, bit = block >> 3, 1 << (block & 7)
            if byte >= len(bits) or not bits[byte] & bit:
                continue
            n = counts.get(block, 1)
            if n > 2:
                counts[block] = n - 1
            elif n == 2:
                del counts[block]
            else:
                bits[byte] &= ~bit
                self._held -= 1
