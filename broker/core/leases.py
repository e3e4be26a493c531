"""The lease book: each lease from publication to its end (release, expiry, supersession, eviction for a budget or
memory pressure), its demotion to its engine's host tier, the blocks each engine's leases hold, and the eviction
commands those ends issue. A pinned lease's end waits for its last pin (the pin book's), never longer."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from kvloop.broker.core.changes import Journal
from kvloop.broker.core.engines import Engines
from kvloop.broker.core.eviction import EvictionPolicy, RefView, choose_victims
from kvloop.broker.core.holders import SharedIds
from kvloop.broker.core.holdings import Holdings
from kvloop.broker.core.lease_index import LeaseIndex
from kvloop.broker.core.limits import Limits, check_ttl
from kvloop.broker.core.model import (
    DEMOTING_REASONS,
    EngineLoad,
    EngineRecord,
    EvictionCommand,
    EvictionReason,
    Lease,
    Pin,
    Tier,
)
from kvloop.broker.core.pins import PinBook
from kvloop.shared.errors import FailedPrecondition, NotFound, ResourceExhausted


class LeaseBook:
    def __init__(self, policy: EvictionPolicy, limits: Limits, engines: Engines, pins: PinBook, journal: Journal,
                 new_id: Callable[[], str], held_until: Callable[[str, float], float] = lambda session, now: 0.0
                 ) -> None:
        self.policy = policy
        self._held_until = held_until
        """Until when a session's pause keeps its leases (0: none): a demotion keeps that hold."""
        self.limits = limits
        self._engines = engines
        self._pins = pins
        self._journal = journal
        self._new_id = new_id
        self.leases: dict[str, Lease] = {}
        self.index = LeaseIndex()
        self._holdings: dict[str, Holdings] = {}
        """Per registered engine, what its leases hold: opened and closed with the engine's record."""
        self._block_ids = SharedIds()
        """One int per block-id value for every lease's ``block_ids`` (engines share the pool's range of ids)."""
        self._demoting: dict[str, float] = {}
        """Lease id -> ``demoting_until`` of each demotion the engine has not reported yet (:meth:`expire` drops
        those past due)."""
        self._expiry: list[tuple[float, str]] = []
        """(expires_at, lease id) per lease and per renewal: :meth:`expire` pops what is due instead of walking every
        lease. An entry whose lease is gone or whose expiry moved is stale and skipped."""

    # ----------------------------------------------------------------- per engine
    def open(self, engine_id: str) -> None:
        self._holdings[engine_id] = Holdings()

    def close(self, engine_id: str) -> None:
        self._holdings.pop(engine_id, None)

    def remove_all(self, engine_id: str) -> int:
        """End every lease of an engine that is gone (no commands: its blocks went with it)."""
        lease_ids = self.lease_ids(engine_id)
        for lid in lease_ids:
            self.remove(self.leases[lid])
        return len(lease_ids)

    def retained_blocks(self, engine_id: str) -> int:
        holdings = self._holdings.get(engine_id)  # remove() uncounts blocks whose count reaches 0
        return len(holdings.refs) if holdings is not None else 0

    def host_blocks(self, engine_id: str) -> int:
        """Host-tier slots the engine's leases hold."""
        holdings = self._holdings.get(engine_id)
        return len(holdings.host_slots) if holdings is not None else 0

    def lease_ids(self, engine_id: str) -> list[str]:
        holdings = self._holdings.get(engine_id)
        return sorted(holdings.lease_ids) if holdings is not None else []

    def of_engine(self, engine_id: str) -> list[Lease]:
        holdings = self._holdings.get(engine_id)
        return [self.leases[lid] for lid in holdings.lease_ids] if holdings is not None else []

    # ----------------------------------------------------------------- records
    def get(self, lease_id: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise NotFound(f"lease_id: lease {lease_id!r} does not exist (released, evicted or expired)",
                           field="lease_id")
        return lease

    def add(self, lease: Lease) -> None:
        lease.block_ids = self._block_ids.share(lease.block_ids)
        self.leases[lease.lease_id] = lease
        self._schedule(lease)
        self.index.add(lease)
        self._holdings[lease.engine_id].add(lease)
        if lease.demoting_until:
            self._demoting[lease.lease_id] = lease.demoting_until

    def remove(self, lease: Lease) -> None:
        """Forget the lease and its pins; the caller issues the command that frees its blocks, if any."""
        del self.leases[lease.lease_id]
        self.index.remove(lease)
        self._holdings[lease.engine_id].remove(lease)
        self._demoting.pop(lease.lease_id, None)
        self._pins.drop(lease.pin_ids)
        self._journal.drop_lease(lease.lease_id)

    def _schedule(self, lease: Lease) -> None:
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))

    def publish(self, rec: EngineRecord, session_id: str, keys: Sequence[bytes], block_ids: Sequence[int],
                num_tokens: int, ttl_s: float, now: float) -> tuple[Lease, list[EvictionCommand]]:
        """A new lease on engine ``rec`` (its arguments checked: ``limits.check_publish``), and the commands that
        made room for it."""
        engine_id = rec.info.engine_id
        commands = self._make_room(engine_id, keys, block_ids, rec.info.retention_budget_blocks, now)
        lease = Lease(
            lease_id=self._new_id(), engine_id=engine_id, session_id=session_id, keys=tuple(keys),
            block_ids=tuple(block_ids), num_tokens=num_tokens, ttl_s=ttl_s, expires_at=now + ttl_s,
            last_used=now, created_at=now,
        )
        self.add(lease)
        self._journal.put_lease(lease)
        return lease, commands

    def _make_room(self, engine_id: str, keys: Sequence[bytes], block_ids: Sequence[int], budget: int,
                   now: float) -> list[EvictionCommand]:
        """Supersede the engine's leases that ``keys`` extends and evict what the budget needs for ``block_ids``.
        Raises ``ResourceExhausted``, changing nothing, when pinned leases hold too much of the budget."""
        # Leases on this engine that the new one extends (same content, a prefix of it) are redundant.
        superseded = self.index.superseded(keys, engine_id, self.leases)
        view = RefView(self._holdings[engine_id].refs)
        for old in superseded:
            if not old.pinned and old.tier is Tier.POOL:
                view.release(old.block_ids)
        view.hold(block_ids)
        need = view.distinct() - budget
        gone = {old.lease_id for old in superseded}
        candidates = [
            lease for lease in self._pool_candidates(engine_id) if lease.lease_id not in gone
        ] if need > 0 else []
        victims, freed = choose_victims(self.policy, candidates, view, need, now)
        if freed < need:
            raise ResourceExhausted(
                f"block_ids: engine {engine_id!r}'s retention budget of {budget} blocks is held by pinned "
                f"leases; {need - freed} more blocks cannot be freed now",
                field="block_ids",
            )
        commands: list[EvictionCommand] = []
        for old in superseded:
            commands.extend(self.evict(old, EvictionReason.SUPERSEDED, now))
        for victim in victims:
            commands.extend(self.evict(victim, EvictionReason.BUDGET, now))
        return commands

    def renew(self, lease_id: str, ttl_s: float, now: float) -> Lease:
        lease = self.get(lease_id)
        if lease.pending is not None:
            raise FailedPrecondition(f"lease_id: lease {lease_id!r} is being evicted ({lease.pending.value})",
                                     field="lease_id")
        lease.ttl_s = check_ttl(ttl_s, self.limits) if ttl_s else lease.ttl_s
        lease.expires_at = now + lease.ttl_s
        lease.last_used = now
        self._schedule(lease)
        self._journal.put_lease(lease)
        return lease

    def release(self, lease_id: str) -> bool:
        """Engine-initiated release. Returns True when deferred by a pin: the engine then frees the
        blocks on the RELEASED eviction command, not before."""
        lease = self.get(lease_id)
        if lease.pinned:
            lease.pending = lease.pending or EvictionReason.RELEASED
            self._journal.put_lease(lease)
            return True
        self.remove(lease)
        return False

    def hold(self, lease: Lease, until: float) -> bool:
        """Keep the lease at least until ``until`` (a session's pause); True when that moved its expiry."""
        if lease.pending is not None or until <= lease.expires_at:
            return False
        lease.expires_at = until
        self._schedule(lease)
        self._journal.put_lease(lease)
        return True

    def of_session(self, session_id: str) -> list[Lease]:
        return [self.leases[lid] for lid in self.index.session_lease_ids(session_id)]

    def used(self, lease: Lease, now: float) -> None:
        """A pull out of the lease succeeded: a turn used it, so its TTL starts again. A TTL that ran out during the
        pull stays run out, whether or not a tick saw it yet: expiry is deferred by a pin, never cancelled by one."""
        if lease.pending is None and lease.expires_at > now:
            lease.expires_at = now + lease.ttl_s
            lease.last_used = now
            self._schedule(lease)
            self._journal.put_lease(lease)

    def unpinned(self, pin: Pin, now: float) -> None:
        """``pin`` ended: once the lease's last pin is gone, the end that waited on it (or a TTL run out) happens."""
        lease = self.leases.get(pin.lease_id)
        if lease is None:
            return
        lease.pin_ids.discard(pin.pin_id)
        self._journal.put_lease(lease)
        if not lease.pinned and lease.pending is None and lease.expires_at <= now:
            lease.pending = EvictionReason.TTL_EXPIRED
        if not lease.pinned and lease.pending is not None:
            reason, lease.pending = lease.pending, None
            self.evict(lease, reason, now)

    def expire(self, now: float) -> None:
        """End the leases whose TTL ran out, then the demotions the engine never reported."""
        while self._expiry and self._expiry[0][0] <= now:
            at, lease_id = heapq.heappop(self._expiry)
            lease = self.leases.get(lease_id)
            # Skipped: gone, renewed (its later entry is queued), or being evicted already (its pin's end evicts it).
            if lease is not None and lease.expires_at == at and lease.pending is None:
                self.evict(lease, EvictionReason.TTL_EXPIRED, now)
        for lease_id in [lid for lid, until in self._demoting.items() if until <= now]:
            self._end_demotion(self.leases[lease_id])

    # ----------------------------------------------------------------- eviction
    def evict(self, lease: Lease, reason: EvictionReason, now: float) -> list[EvictionCommand]:
        """Evict now, or defer while pinned; an eviction that makes room demotes a pool lease to the engine's host
        tier where the tier has (or can make) room. Returns the commands issued."""
        if lease.pinned:
            if lease.pending is None:
                lease.pending = reason
                self._journal.put_lease(lease)
            return []
        if reason in DEMOTING_REASONS and lease.tier is Tier.POOL:
            demoted = self._demote(lease, reason, now)
            if demoted is not None:
                return demoted
        self.remove(lease)
        return [self._engines.issue(lease.engine_id, lease.lease_id, lease.block_ids, reason, tier=lease.tier)]

    def evict_for(self, engine_id: str, need: int, reason: EvictionReason, now: float) -> list[EvictionCommand]:
        """Evict the engine's pool leases the policy picks to free ``need`` blocks (fewer where pins hold them)."""
        refs = self._holdings[engine_id].refs
        victims, _ = choose_victims(self.policy, self._pool_candidates(engine_id), refs, need, now)
        return [cmd for victim in victims for cmd in self.evict(victim, reason, now)]

    def make_room(self, engine_id: str, need: int, may_go: Callable[[Lease], bool], now: float
                  ) -> list[EvictionCommand] | None:
        """Free ``need`` blocks of the engine's retention budget by evicting (demoting, where the engine has a tier)
        pool leases that ``may_go`` allows, in the policy's order; None, evicting nothing, when they cannot free
        that many."""
        candidates = [lease for lease in self._pool_candidates(engine_id) if may_go(lease)]
        victims, freed = choose_victims(self.policy, candidates, self._holdings[engine_id].refs, need, now)
        if freed < need:
            return None
        return [cmd for victim in victims for cmd in self.evict(victim, EvictionReason.BUDGET, now)]

    def fit(self, rec: EngineRecord, now: float) -> None:
        """Bring the engine's leases within its (maybe smaller) budgets at once; pinned leases go when pins end."""
        engine_id = rec.info.engine_id
        over = self.retained_blocks(engine_id) - rec.info.retention_budget_blocks
        if over > 0:
            self.evict_for(engine_id, over, EvictionReason.BUDGET, now)
        host_over = self.host_blocks(engine_id) - rec.info.host_tier_blocks
        if host_over > 0:
            self._free_host(engine_id, host_over, now)

    def relieve(self, engine_id: str, load: EngineLoad, now: float) -> None:
        """An engine under memory pressure: free what it asks for, or a tenth of its retained blocks."""
        if load.memory_pressure:
            retained = self.retained_blocks(engine_id)
            need = load.pressure_free_blocks or max(1, retained // 10)
            self.evict_for(engine_id, need, EvictionReason.MEMORY_PRESSURE, now)

    def _pool_candidates(self, engine_id: str) -> list[Lease]:
        """The engine's pool-tier leases an eviction may take: not pinned, none pending."""
        return [lease for lid in self._holdings[engine_id].lease_ids
                if (lease := self.leases[lid]).tier is Tier.POOL and not lease.pinned and lease.pending is None]

    def _host_candidates(self, engine_id: str) -> list[Lease]:
        """The engine's host-tier leases the tier may drop for room: not pinned, none pending, copy done."""
        return [lease for lid in self._holdings[engine_id].lease_ids
                if (lease := self.leases[lid]).tier is Tier.HOST and not lease.pinned and lease.pending is None
                and not lease.demoting_until]

    # ----------------------------------------------------------------- host tier
    def _demote(self, lease: Lease, reason: EvictionReason, now: float) -> list[EvictionCommand] | None:
        """Move ``lease`` to its engine's host tier: slots for its blocks (dropping the tier's victims to make
        room), its pool blocks released now, one command telling the engine to copy then free. None when the engine
        has no tier or the tier cannot make room (the lease is then dropped)."""
        info = self._engines.records[lease.engine_id].info
        holdings = self._holdings[lease.engine_id]
        need, capacity = len(lease.block_ids), info.host_tier_blocks
        if need > capacity:
            return None
        commands: list[EvictionCommand] = []
        short = need - (capacity - len(holdings.host_slots))
        if short > 0:
            victims, freed = choose_victims(self.policy, self._host_candidates(lease.engine_id),
                                            holdings.slot_counts(), short, now)
            if freed < short:
                return None
            for victim in victims:
                commands.extend(self.evict(victim, reason, now))
        slots = holdings.free_slots(info.host_tier_first_id, capacity, need)
        pool_ids = lease.block_ids
        holdings.release(lease)
        lease.tier, lease.block_ids = Tier.HOST, self._block_ids.share(slots)
        lease.demoting_until = now + self.limits.demotion_timeout_s
        lease.ttl_s = self.limits.host_ttl_s or lease.ttl_s
        # A paused session's lease is demoted, not dropped, and its pause still holds it on the tier.
        lease.expires_at = max(now + lease.ttl_s, self._held_until(lease.session_id, now))
        self._schedule(lease)
        holdings.hold(lease)
        self._demoting[lease.lease_id] = lease.demoting_until
        self._journal.put_lease(lease)
        commands.append(self._engines.issue(lease.engine_id, lease.lease_id, pool_ids, reason, demote_to=slots))
        return commands

    def complete_demotion(self, engine_id: str, lease_id: str, success: bool) -> Lease | None:
        """The engine's report of a demotion: copied (the lease is offered again, from the host tier) or failed
        (the lease is dropped). A repeated success report is answered again. Returns the lease if it is still
        retained. Raises ``NotFound`` (the lease went: superseded, expired or timed out) or ``FailedPrecondition``
        (not this engine's lease, or not being demoted)."""
        lease = self.get(lease_id)
        if lease.engine_id != engine_id:
            raise FailedPrecondition(f"lease_id: lease {lease_id!r} is engine {lease.engine_id!r}'s, not "
                                     f"{engine_id!r}'s", field="lease_id")
        if lease.tier is Tier.POOL:
            raise FailedPrecondition(f"lease_id: lease {lease_id!r} is not being demoted", field="lease_id")
        if not success:
            self._end_demotion(lease)
            return None
        if not lease.demoting_until:
            return lease
        lease.demoting_until = 0.0
        self._demoting.pop(lease_id, None)
        self._journal.put_lease(lease)
        return lease

    def _end_demotion(self, lease: Lease) -> None:
        """Drop a host-tier lease whose copy failed or never came; the engine frees its slots on the command."""
        if lease.pinned:  # a pin cannot start while demoting; a finished copy may have been pinned since
            lease.pending = lease.pending or EvictionReason.DEMOTION_FAILED
            self._journal.put_lease(lease)
            return
        self.remove(lease)
        self._engines.issue(lease.engine_id, lease.lease_id, lease.block_ids, EvictionReason.DEMOTION_FAILED,
                            tier=lease.tier)

    def _free_host(self, engine_id: str, need: int, now: float) -> None:
        victims, _ = choose_victims(self.policy, self._host_candidates(engine_id),
                                    self._holdings[engine_id].slot_counts(), need, now)
        for victim in victims:
            self.remove(victim)
            self._engines.issue(engine_id, victim.lease_id, victim.block_ids, EvictionReason.BUDGET, tier=Tier.HOST)
