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
