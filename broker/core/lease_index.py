"""The leases by content and by session: the leases sharing the longest usable prefix with a prompt, the leases a new
one supersedes, and the engine a session last used (placement's affinity)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvloop.broker.core.index import BlockIndex, Match
from kvloop.broker.core.model import Lease


class LeaseIndex:
    def __init__(self) -> None:
        self._blocks = BlockIndex()
        self._sessions: dict[str, set[str]] = {}
        """Session id -> the ids of its leases."""

    def add(self, lease: Lease) -> None:
        self._blocks.add(lease)
        if lease.session_id:
            self._sessions.setdefault(lease.session_id, set()).add(lease.lease_id)

    def remove(self, lease: Lease) -> None:
        self._blocks.remove(lease)
        if lease.session_id:
            held = self._sessions.get(lease.session_id)
            if held is not None:
                held.discard(lease.lease_id)
                if not held:
                    del self._sessions[lease.session_id]

    def superseded(self, keys: Sequence[bytes], engine_id: str, leases: Mapping[str, Lease]) -> list[Lease]:
        """The engine's leases, none being evicted, whose keys are a prefix of ``keys``: a publication of ``keys``
        makes them redundant."""
        return self._blocks.prefixes_of(
            keys, leases, lambda lease: lease.engine_id == engine_id and lease.pending is None)

    def matches(self, keys: Sequence[bytes], usable: int, leases: Mapping[str, Lease],
                eligible: Callable[[Lease], bool]) -> list[Match]:
        """The eligible leases sharing the longest prefix with ``keys``, cut to its first ``usable`` blocks."""
        matches = self._blocks.longest(keys, leases, eligible) if keys else []
        if matches and 0 < usable < matches[0].blocks:
            # The block holding the last prompt token is never reused, so every lease sharing the
            # usable prefix is as good: let the tie-break (same session, recency) choose among them all.
            matches = [Match(lease, usable) for lease in self._blocks.holding(keys, usable, leases, eligible)]
        return matches

    def session_lease_ids(self, session_id: str) -> list[str]:
        return sorted(self._sessions.get(session_id, ())) if session_id else []

    def session_engine(self, session_id: str, leases: Mapping[str, Lease]) -> str:
        """The engine of the session's most recently used lease; "" when it has none."""
        held = self._sessions.get(session_id) if session_id else None
        if not held:
            return ""
        return max((leases[lid] for lid in held), key=lambda lease: lease.last_used).engine_id
