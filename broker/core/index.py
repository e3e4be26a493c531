"""Content index: which leases hold which block keys, and the longest prefix match.

Block keys are chained hashes (a key fixes its whole prefix), so the set of depths at which some lease
holds the query's key is closed downwards, and the deepest one is found by binary search: O(log n)
lookups instead of a walk over every block of a 100k-token prompt. The winners are then verified key
by key, so a lease whose published chain is malformed yields a shorter match (by the exact linear walk),
never a wrong one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvloop.broker.core.holders import Holders
from kvloop.broker.core.model import Lease


@dataclass(frozen=True, slots=True)
class Match:
    lease: Lease
    blocks: int


def _always(_lease: Lease) -> bool:
    return True


class BlockIndex:
    def __init__(self) -> None:
        self._by_key = Holders()
        self._by_last_key = Holders()

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, lease: Lease) -> None:
        for key in lease.keys:
            self._by_key.add(key, lease.lease_id)
        self._by_last_key.add(lease.keys[-1], lease.lease_id)

    def remove(self, lease: Lease) -> None:
        for key in lease.keys:
            self._by_key.discard(key, lease.lease_id)
        self._by_last_key.discard(lease.keys[-1], lease.lease_id)

    def _held(self, keys: Sequence[bytes], depth: int, leases: Mapping[str, Lease],
              eligible: Callable[[Lease], bool]) -> bool:
        """Does some eligible lease hold the query's key at position ``depth - 1``?"""
        key = keys[depth - 1]
        return any(True for lid in self._by_key.members(key)
                   if len(leases[lid].keys) >= depth and leases[lid].keys[depth - 1] == key and eligible(leases[lid]))

    def holding(self, keys: Sequence[bytes], depth: int, leases: Mapping[str, Lease],
                 eligible: Callable[[Lease], bool]) -> list[Lease]:
        """Eligible leases holding the query's key at position ``depth - 1`` with the whole prefix."""
        key = keys[depth - 1]
        found = []
        for lid in self._by_key.members(key):
            lease = leases[lid]
            if len(lease.keys) >= depth and lease.keys[depth - 1] == key and eligible(lease):
                found.append(lease)
        prefix = tuple(keys[:depth])
        return [lease for lease in found if lease.keys[:depth] == prefix]

    def longest(self, keys: Sequence[bytes], leases: Mapping[str, Lease],
                eligible: Callable[[Lease], bool] = _always) -> list[Match]:
        """The eligible leases sharing the longest prefix with ``keys`` (all of them, same depth)."""
        if not keys or not self._held(keys, 1, leases, eligible):
            return []
        lo, hi = 1, len(keys)  # invariant: depth lo is held
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._held(keys, mid, leases, eligible):
                lo = mid
            else:
                hi = mid - 1
        winners = self.holding(keys, lo, leases, eligible)
        if winners:
            return [Match(lease, lo) for lease in winners]
        return self._longest_linear(keys, leases, eligible)

    def _longest_linear(self, keys: Sequence[bytes], leases: Mapping[str, Lease],
                        eligible: Callable[[Lease], bool]) -> list[Match]:
        """Exact walk, for malformed chains only: narrow the candidates block by block."""
        alive = [leases[lid] for lid in self._by_key.members(keys[0])
                 if leases[lid].keys[0] == keys[0] and eligible(leases[lid])]
        depth = 1
        while depth < len(keys):
            still = [x for x in alive if len(x.keys) > depth and x.keys[depth] == keys[depth]]
            if not still:
                break
            alive, depth = still, depth + 1
        return [Match(lease, depth) for lease in alive]

    def prefixes_of(self, keys: Sequence[bytes], leases: Mapping[str, Lease],
                    eligible: Callable[[Lease], bool] = _always) -> list[Lease]:
        """Eligible leases whose whole key list is a prefix of ``keys`` (what a new lease supersedes)."""
        found = []
        for depth, key in enumerate(keys, start=1):
            for lid in self._by_last_key.members(key):
                lease = leases[lid]
                if len(lease.keys) == depth and lease.keys == tuple(keys[:depth]) and eligible(lease):
                    found.append(lease)
        return found

