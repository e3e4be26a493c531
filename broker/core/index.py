"""Content index: which leases hold which block keys, and the longest prefix match.

Block keys are chained hashes (a key fixes its whole prefix), so a lease that holds the query's key
at position ``i`` also holds keys ``0..i``. The match still checks each position explicitly: an engine
that published a malformed chain gets a shorter match, never a wrong one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from broker.core.model import Lease


@dataclass(frozen=True, slots=True)
class Match:
    lease: Lease
    blocks: int


class BlockIndex:
    def __init__(self) -> None:
        self._by_key: dict[bytes, set[str]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, lease: Lease) -> None:
        for key in lease.keys:
            self._by_key.setdefault(key, set()).add(lease.lease_id)

    def remove(self, lease: Lease) -> None:
        for key in lease.keys:
            holders = self._by_key.get(key)
            if holders is None:
                continue
            holders.discard(lease.lease_id)
            if not holders:
                del self._by_key[key]

    def matches(
        self,
        keys: Sequence[bytes],
        leases: Mapping[str, Lease],
        eligible: Callable[[Lease], bool] = lambda _lease: True,
    ) -> list[Match]:
        """Every eligible lease sharing at least the first block, with its matched block count."""
        if not keys:
            return []
        alive = {
            lid
            for lid in self._by_key.get(keys[0], ())
            if leases[lid].keys[0] == keys[0] and eligible(leases[lid])
        }
        found: list[Match] = []
        depth = 1
        while alive and depth < len(keys):
            key = keys[depth]
            still = {lid for lid in alive if depth < len(leases[lid].keys) and leases[lid].keys[depth] == key}
            found.extend(Match(leases[lid], depth) for lid in alive - still)
            alive = still
            depth += 1
        found.extend(Match(leases[lid], depth) for lid in alive)
        return found
