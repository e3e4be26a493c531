"""The broker's state machine, as one facade over books that each own one concern: the engines (:mod:`.engines`), the
leases and their tiers (:mod:`.leases`), the pins (:mod:`.pins`) and placement's view (:mod:`.placing`). Pure: every
method takes ``now`` (wall-clock seconds) and nothing here touches a clock, a socket or a store.

The shell persists what changed (``take_changes``) and delivers eviction commands to engines. What stays here are
the steps that cross books: an engine's end takes its leases and its pins, a pin's end may end its lease.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from kvloop.broker.core.changes import Changes, Journal
from kvloop.broker.core.engines import Engines
from kvloop.broker.core.eviction import EvictionPolicy
from kvloop.broker.core.in_flight import InFlight
from kvloop.broker.core.index import Match
from kvloop.broker.core.leases import LeaseBook
from kvloop.broker.core.limits import (
    Limits,
    check_cache_events,
    check_engine_info,
    check_place,
    check_publish,
    check_pull,
)
from kvloop.broker.core.model import (
    Decision,
    EngineInfo,
    EngineLoad,
    EngineRecord,
    EvictionCommand,
    EvictionReason,
    Lease,
    Pin,
    Plan,
    Tier,
)
from kvloop.broker.core.pins import PinBook
from kvloop.broker.core.placement import PlaceInput, PlacementPolicy
from kvloop.broker.core.placing import PlacementView
from kvloop.broker.core.prefetch import choose_promotion
from kvloop.broker.core.sessions import HintedPolicy, SessionBook, SessionGrant, SessionHint
from kvloop.broker.core.soft_index import SoftAck, SoftIndex
from kvloop.shared.errors import FailedPrecondition

__all__ = ["BrokerState", "Changes", "Limits", "check_engine_info"]


class BrokerState:
    def __init__(
        self,
        eviction_policy: EvictionPolicy,
        placement_policy: PlacementPolicy | None = None,
        limits: Limits | None = None,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self.eviction_policy = eviction_policy
        self.placement_policy = placement_policy or PlacementPolicy()
        self.limits = limits or Limits()
        self._journal = Journal()
        self._engines = Engines(self.limits, self._journal)
        self._pins = PinBook(self.limits, self._journal, new_id)
        self.sessions = SessionBook(self.limits)
        """What callers said of their sessions: in memory only, never in ``Changes`` (a pause's effect, the leases'
        later expiries, is)."""
        self._leases = LeaseBook(HintedPolicy(eviction_policy, self.sessions), self.limits, self._engines,
                                 self._pins, self._journal, new_id, self.sessions.hold_until)
        self.soft = SoftIndex(self.limits.soft_index_max_blocks)
        """Each engine's prefix cache as its KV events tell it: in memory only, never in ``Changes``."""
        self.in_flight = InFlight(ttl_s=self.placement_policy.in_flight_ttl_s,
                                  placed_s=self.placement_policy.placed_s)
        """The routers' requests in flight per engine: in memory only, never in ``Changes``."""
        self._view = PlacementView(self.placement_policy, self.limits, self._engines, self._leases, self.soft,
                                   self.in_flight)
        # The books' own maps, to read: every change goes through a method, which keeps the books consistent.
        self.engines: dict[str, EngineRecord] = self._engines.records
        self.leases: dict[str, Lease] = self._leases.leases
        self.pins: dict[str, Pin] = self._pins.pins
        self.fleet = self._engines.fleet
        self.unheard: set[str] = self._engines.unheard
        """Engines restored by :meth:`load` not heard from since: their leases are neither matched nor pinned."""
        self.promoted: dict[str, str] = {}
        """Session id -> the engine a promotion loaded its lease into, until the session's next placement says
        whether the prefetch was used (:meth:`prefetch_use`): in memory only."""

    # ----------------------------------------------------------------- bookkeeping
    def take_changes(self) -> Changes:
        return self._journal.take()

    def retained_blocks(self, engine_id: str) -> int:
        return self._leases.retained_blocks(engine_id)

    def host_blocks(self, engine_id: str) -> int:
        """Host-tier slots the engine's leases hold."""
        return self._leases.host_blocks(engine_id)

    def engine_lease_ids(self, engine_id: str) -> list[str]:
        return self._leases.lease_ids(engine_id)

    def hold_until(self, lease: Lease) -> float:
        """When the lease may disappear from a store at the latest: its expiry or its last pin's."""
        return self._pins.hold_until(lease)

    def load(self, engines: Iterable[EngineRecord], leases: Iterable[Lease], pins: Iterable[Pin]) -> None:
        """Restore from a store (a restarted broker or a new leader). Eviction logs start empty, so an
        engine that reconnects with an older sequence number gets a resync."""
        for rec in engines:
            self._open(rec)
            self.unheard.add(rec.info.engine_id)
        for lease in leases:
            if lease.engine_id in self.engines:
                lease.pin_ids = set()
                self._leases.add(lease)
        for pin in pins:
            if pin.lease_id in self.leases:
                self._pins.restore(pin, self.leases[pin.lease_id])
        self._journal.take()

    # ----------------------------------------------------------------- engines
    def register(self, info: EngineInfo, now: float) -> tuple[EngineRecord, list[str]]:
        """A reconnect keeps the engine's leases (within its budgets, which may have shrunk); a new incarnation
        (the process restarted, its retained blocks gone) ends the old one's first."""
        rec = self._engines.reconnect(info, now)
        if rec is not None:
            self._leases.fit(rec, now)
            return rec, self.engine_lease_ids(info.engine_id)
        old = self.engines.get(info.engine_id)
        if old is not None:
            self._drop_engine(info.engine_id, now)
        rec = self._engines.admit(info, now, old.eviction_seq if old else 0)
        self._leases.open(info.engine_id)
        return rec, []

    def _open(self, rec: EngineRecord) -> None:
        self._engines.open(rec)
        self._leases.open(rec.info.engine_id)

    def keepalive(self, engine_id: str, load: EngineLoad, now: float) -> EngineRecord:
        rec = self._engines.keepalive(engine_id, load, now)
        self._leases.relieve(engine_id, load, now)
        return rec

    def deregister(self, engine_id: str, now: float) -> int:
        self._engines.get(engine_id)
        return self._drop_engine(engine_id, now)

    def _drop_engine(self, engine_id: str, now: float) -> int:
        """End an engine: its leases (no commands: its blocks went with it), its pins as a reader, its records."""
        n = self._leases.remove_all(engine_id)
        for pin in self._pins.of_reader(engine_id):
            self._unpin(pin.pin_id, now)
        self._engines.drop(engine_id)
        self.soft.drop(engine_id)
        self._leases.close(engine_id)
        return n

    # ----------------------------------------------------------------- leases
    def publish(self, engine_id: str, session_id: str, keys: Sequence[bytes], block_ids: Sequence[int],
                num_tokens: int, ttl_s: float, now: float) -> tuple[Lease, list[EvictionCommand]]:
        rec = self._engines.get(engine_id)
        ttl = check_publish(rec, session_id, keys, block_ids, num_tokens, ttl_s, self.limits)
        lease, commands = self._leases.publish(rec, session_id, keys, block_ids, num_tokens, ttl, now)
        if self.sessions.ended(session_id):  # the ended session's last turn, published after its end
            commands += self._leases.evict(lease, EvictionReason.RELEASED, now)
        else:
            self._leases.hold(lease, self.sessions.hold_until(session_id, now))
        return lease, commands

    def renew(self, lease_id: str, ttl_s: float, now: float) -> Lease:
        return self._leases.renew(lease_id, ttl_s, now)

    def release(self, lease_id: str, now: float) -> bool:
        """Engine-initiated release. Returns True when deferred by a pin: the engine then frees the
        blocks on the RELEASED eviction command, not before."""
        return self._leases.release(lease_id)

    def complete_demotion(self, engine_id: str, lease_id: str, success: bool, now: float) -> Lease | None:
        """The engine's report of a demotion (:meth:`LeaseBook.complete_demotion`); the lease if still retained."""
        return self._leases.complete_demotion(engine_id, lease_id, success)

    # ----------------------------------------------------------------- sessions
    def hint_session(self, owner: str, session_id: str, hint: SessionHint, now: float
                     ) -> tuple[SessionGrant, list[EvictionCommand]]:
        """Apply a caller's hint (:mod:`.sessions`) and act on the session's leases: an end frees them (pinned ones
        when their pins end), a pause holds them. Returns the grant and the commands issued."""
        grant = self.sessions.hint(owner, session_id, hint, now)
        commands: list[EvictionCommand] = []
        for lease in self._leases.of_session(session_id):
            if grant.session.ended_at:
                commands += self._leases.evict(lease, EvictionReason.RELEASED, now)
            elif grant.session.waiting(now):
                self._leases.hold(lease, grant.session.hold_until)
        return grant, commands

    def session_leases(self, session_id: str) -> list[Lease]:
        return self._leases.of_session(session_id)

    def prefetch(self, now: float) -> list[EvictionCommand]:
        """Promote the host-tier lease of each paused session whose prefetch time has come (:mod:`.prefetch`): a pin
        on the lease keeps its slots while the engine loads them, and a PREFETCH command asks the engine to."""
        commands = []
        for session_id in self.sessions.due_prefetches(now):
            lease = choose_promotion(self._leases.of_session(session_id), self._room_for(session_id, now))
            if lease is None or lease.engine_id in self.unheard:
                continue
            engine = self.engines[lease.engine_id]
            timeout = self.limits.demotion_timeout_s
            # Pinned first: the room it makes may demote a lease into the tier, which must not drop this one.
            pin = self._pins.open(engine, lease, engine, False, len(lease.block_ids), timeout, now)
            made = self._leases.make_room(lease.engine_id, len(lease.block_ids) - self._room(lease.engine_id),
                                          self._ranks_below(session_id, now), now)
            if made is None:  # the room went to leases no lower in the eviction order
                self._unpin(pin.pin_id, now)
                continue
            commands += made
            commands.append(self._engines.issue(lease.engine_id, lease.lease_id, lease.block_ids,
                                                EvictionReason.PREFETCH, tier=Tier.HOST, promote_pin=pin.pin_id,
                                                promote_within_s=timeout))
        return commands

    def _ranks_below(self, session_id: str, now: float) -> Callable[[Lease], bool]:
        """Whether a lease is lower in the eviction order than ``session_id``'s: of a lower priority, held by no
        pause, or of a session that resumes later (the turn needed last gives up its room: Belady's rule)."""
        rank = self.sessions.keep_rank(session_id, now)
        return lambda lease: self.sessions.keep_rank(lease.session_id, now) < rank

    def _room_for(self, session_id: str, now: float) -> Callable[[str], int]:
        """Blocks a promotion of ``session_id`` may have on an engine: what its retention budget has free, plus
        what the pool leases below the session in the eviction order hold. An upper bound (pinned leases count), so
        a promotion it rules out takes no pin; :meth:`LeaseBook.make_room` decides the rest."""
        below = self._ranks_below(session_id, now)

        def room(engine_id: str) -> int:
            lower = {b for lease in self._leases.of_engine(engine_id) if lease.tier is Tier.POOL and below(lease)
                     for b in lease.block_ids}
            return self._room(engine_id) + len(lower)

        return room

    def _room(self, engine_id: str) -> int:
        """Blocks the engine's retention budget has free; none for an engine this leader has not heard from."""
        rec = self.engines.get(engine_id)
        if rec is None or engine_id in self.unheard:
            return 0
        return rec.info.retention_budget_blocks - self._leases.retained_blocks(engine_id)

    def complete_promotion(self, engine_id: str, lease_id: str, pin_id: str, success: bool, now: float) -> None:
        """The engine's report of a promotion: its pin ends (the lease, superseded by the pool copy the engine
        published, goes with it; after a failure it stays on the host tier). ``NotFound`` for a pin that timed
        out; ``FailedPrecondition`` for a pin that is not this promotion's."""
        pin = self._pins.get(pin_id)
        if pin.lease_id != lease_id or pin.reader_engine_id != engine_id:
            raise FailedPrecondition(f"pin_id: pin {pin_id!r} is not engine {engine_id!r}'s promotion of lease "
                                     f"{lease_id!r}", field="pin_id")
        lease = self.leases.get(lease_id)
        if success and lease is not None:
            self.promoted[lease.session_id] = engine_id
        self._unpin(pin_id, now)

    def prefetch_use(self, plan: Plan) -> str | None:
        """Whether a promoted session's next placement used the prefetch ("used": DECODE_LOCAL on the engine holding
        it) or not ("unused"); None for a session with no promotion outstanding."""
        engine_id = self.promoted.pop(plan.session_id, None) if plan.session_id else None
        if engine_id is None:
            return None
        return "used" if plan.decision is Decision.DECODE_LOCAL and plan.decode.engine_id == engine_id else "unused"

    # ----------------------------------------------------------------- pins
    def pin(self, reader_engine_id: str, lease_id: str, num_blocks: int, timeout_s: float, now: float) -> Pin:
        reader = self._engines.get(reader_engine_id, "reader_engine_id")
        lease = self._leases.get(lease_id)
        source = self.engines[lease.engine_id]
        return self._pins.open(reader, lease, source, lease.engine_id in self.unheard, num_blocks, timeout_s, now)

    def complete(self, pin_id: str, success: bool, nbytes: int, duration_s: float, now: float) -> Lease | None:
        """End a pin. A successful pull renews the lease (a turn used it) and teaches the broker the
        source's bandwidth. Returns the lease if it is still retained."""
        pin = self._pins.get(pin_id)
        check_pull(nbytes, duration_s)
        lease = self.leases.get(pin.lease_id)
        if success and lease is not None:
            self._engines.learn_bandwidth(lease.engine_id, nbytes, duration_s)
            self._leases.used(lease, now)
        self._unpin(pin_id, now)
        return self.leases.get(pin.lease_id)

    def _unpin(self, pin_id: str, now: float) -> None:
        self._leases.unpinned(self._pins.pop(pin_id), now)

    # ----------------------------------------------------------------- time
    def tick(self, now: float) -> None:
        """Expire pins, then leases; promote what is due (:meth:`prefetch`); forget idle sessions; drop engines whose
        keep-alive stopped."""
        for pin in self._pins.due(now):
            self._unpin(pin.pin_id, now)
        self._leases.expire(now)
        self.prefetch(now)
        for session_id in self.sessions.expire(now):
            self.promoted.pop(session_id, None)
        for engine_id in self._engines.due(now):
            self._drop_engine(engine_id, now)

    # ----------------------------------------------------------------- placement
    def place(self, request: PlaceInput, now: float) -> Plan:
        check_place(request, self.limits)
        plan = self._view.place(request, now)
        if request.session_id and self.sessions.drops_generated(request.session_id):
            plan = replace(plan, session_drops_generated=True)
        return plan

    def lease_matches(self, request: PlaceInput) -> tuple[list[Match], str]:
        """The leases sharing the longest usable prefix with the request, and the session's engine ("" if none)."""
        return self._view.lease_matches(request)

    def report_in_flight(self, router: str, counts: Mapping[str, int], now: float,
                         tokens: Mapping[str, int] | None = None) -> None:
        """A router's requests (and prompt tokens) in flight per engine; ``InvalidArgument`` for implausible tokens."""
        self._view.report_in_flight(router, counts, now, tokens)

    def count_placement(self, plan: Plan, now: float) -> None:
        """Count a plan's prompt on its engine until the router's own counts can (see ``PlacementView``)."""
        self._view.count_placement(plan, now)

    def engines_as_placed(self, now: float) -> list[EngineRecord]:
        """The live engines with the load placement prices (the routers' counts where they count)."""
        return self._view.engines_as_placed(now)

    def cached_prefixes(self, request: PlaceInput) -> dict[str, int]:
        """Per live engine of the request's layout, the leading blocks its prefix cache holds (the tests' oracle)."""
        return self._view.cached_prefixes(request)

    # ----------------------------------------------------------------- soft index
    def report_cache_events(self, engine_id: str, incarnation: str, seq: int, *, reset: bool, cleared: bool,
                            stored: Sequence[bytes], removed: Sequence[bytes]) -> SoftAck:
        """An engine's prefix-cache events (``ReportCacheEvents``) into the soft index. Nothing here is persisted:
        the shell runs it through ``BrokerRuntime.volatile``."""
        rec = self._engines.get(engine_id)
        check_cache_events(rec, incarnation, seq, stored, removed, self.limits)
        return self.soft.apply(engine_id, incarnation, seq, reset=reset, cleared=cleared, stored=stored,
                               removed=removed)

    # ----------------------------------------------------------------- eviction stream
    def commands_after(self, engine_id: str, after_seq: int, durable_seq: int | None = None) -> list[EvictionCommand]:
        """Commands an engine has not applied yet, withholding those past ``durable_seq`` (the store's last); a
        RESYNC when the log no longer covers the gap (:meth:`Engines.commands_after`)."""
        return self._engines.commands_after(engine_id, after_seq, durable_seq,
                                            lambda: self.engine_lease_ids(engine_id))
