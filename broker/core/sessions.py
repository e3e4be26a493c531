"""The session book: what agents say of their sessions (a pause before the next turn, the end, a priority), held to
the broker's bounds. Pure: time is an argument.

A hint is a request, not a command. The book grants what its bounds allow and says what it did not:

- ``pause_s`` keeps the session's leases until the stated resume plus ``Limits.session_resume_margin_s``, at most
  ``Limits.max_session_pause_s`` (a longer pause is granted that long, and the grant says so); while it waits, the
  session's leases are evicted after every lease of the same priority that does not wait, and before those of
  sessions that resume sooner (:class:`HintedPolicy`); an eviction that makes room still demotes them to a host
  tier first, as for any lease;
- ``end`` frees the session's leases at once and remembers the end for ``Limits.session_end_memory_s``, so a lease
  the decode engine publishes after the end (the last turn's own) is freed as it arrives;
- ``priority`` orders eviction: low before normal before high. High is a share, not a right: an owner holds at most
  ``Limits.max_high_sessions_per_owner`` high sessions, and a hint past that is granted normal;
- ``keep_generated: false`` (the session's answers will not be repeated: a reasoning model whose next turn drops
  its thinking) is remembered with the session; every plan for it then says so, and the decode engine retains each
  turn's prompt blocks and frees the answer's at once. ``true`` undoes it. It asks nothing of the budgets, so it is
  always granted.

A session belongs to its owner (the router's tenant: the API key that opened it). Another owner's hint or read is
refused, and an owner holds at most ``Limits.max_sessions_per_owner`` sessions, the broker ``Limits.max_sessions``.
A session the owner has not touched for ``Limits.session_idle_s`` (after its pause) is forgotten; its leases then
live by their own TTLs. The book is in memory only: a new leader starts without hints (the leases' expiries, which
a pause extends, are persisted with the leases).
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace

from kvloop.broker.core.eviction import EvictionPolicy, Refcounts
from kvloop.broker.core.limits import Limits, check_id
from kvloop.broker.core.model import Lease
from kvloop.shared.errors import InvalidArgument, PermissionDenied, ResourceExhausted


class Priority(enum.IntEnum):
    """Eviction order between sessions: a lower priority's leases go first."""

    LOW = 0
    NORMAL = 1
    HIGH = 2


@dataclass(frozen=True, slots=True)
class SessionHint:
    """What a caller says of a session; None: says nothing of it."""

    pause_s: float | None = None
    end: bool = False
    priority: Priority | None = None
    keep_generated: bool | None = None


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    owner: str
    opened_at: float
    touched_at: float
    priority: Priority = Priority.NORMAL
    resume_at: float = 0.0
    """When the caller said the next turn comes (0: no pause stated)."""
    hold_until: float = 0.0
    """Until when the pause keeps the session's leases: ``resume_at`` plus the margin (0: no pause)."""
    ended_at: float = 0.0
    drops_generated: bool = False
    """The caller said the session's answers will not be repeated (``keep_generated: false``)."""

    def waiting(self, now: float) -> bool:
        return not self.ended_at and now < self.hold_until


@dataclass(frozen=True, slots=True)
class SessionGrant:
    """What a hint got: the session as it stands, the pause granted (seconds from the hint), and each part of the
    hint not granted as asked, as ``field: why``."""

    session: Session
    pause_granted_s: float = 0.0
    refused: tuple[str, ...] = ()

    @property
    def not_granted(self) -> frozenset[str]:
        """The fields of the hint not granted as asked (the ``field`` of each ``field: why``)."""
        return frozenset(r.split(":", 1)[0] for r in self.refused)


def check_hint(session_id: str, owner: str, hint: SessionHint, lim: Limits) -> None:
    """A hint's bounds; every error names the field. A pause past the broker's bound is not an error (it is granted
    shorter); one that is not a plausible number of seconds is."""
    check_id(session_id, "session_id", lim.max_id_len)
    check_id(owner, "owner", lim.max_id_len, required=False)
    if hint.pause_s is not None and not (math.isfinite(hint.pause_s) and 0 <= hint.pause_s <= lim.max_ttl_s):
        raise InvalidArgument(f"pause_s: {hint.pause_s} is outside 0..{lim.max_ttl_s:g} seconds", field="pause_s")
    if hint.end and (hint.pause_s is not None or hint.priority is not None):
        raise InvalidArgument("end: a session that ends takes no pause or priority", field="end")


class SessionBook:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.sessions: dict[str, Session] = {}
        self._per_owner: Counter[str] = Counter()
        self._high: Counter[str] = Counter()
        self._expiry: list[tuple[float, str]] = []
        """(forget_at, session id) per change; an entry whose session moved on is stale and skipped."""
        self._prefetch: list[tuple[float, str]] = []
        """(when to prefetch, session id) per pause: ``Limits.session_prefetch_lead_s`` before its stated resume."""

    def get(self, owner: str, session_id: str) -> Session | None:
        """The owner's session; None when there is none. ``PermissionDenied`` when it is another owner's."""
        session = self.sessions.get(session_id)
        if session is not None and session.owner != owner:
            raise PermissionDenied(f"session_id: session {session_id!r} belongs to another caller", field="session_id")
        return session

    def drops_generated(self, session_id: str) -> bool:
        """Whether the session said its answers will not be repeated (placement copies it into the plan)."""
        session = self.sessions.get(session_id)
        return session is not None and session.drops_generated

    def hint(self, owner: str, session_id: str, hint: SessionHint, now: float) -> SessionGrant:
        """Apply ``hint`` to the owner's session (opening it, or reopening an ended one); the caller acts on the
        session's leases."""
        check_hint(session_id, owner, hint, self.limits)
        old = self.get(owner, session_id)
        if old is None:
            self._check_room(owner, session_id)
            old = Session(session_id=session_id, owner=owner, opened_at=now, touched_at=now)
        elif old.ended_at and not hint.end:
            old = Session(session_id=session_id, owner=owner, opened_at=now, touched_at=now, priority=old.priority,
                          drops_generated=old.drops_generated)
        refused: list[str] = []
        session = replace(old, touched_at=now)
        pause = 0.0
        if hint.end:
            session = replace(session, ended_at=now, resume_at=0.0, hold_until=0.0)
        if hint.pause_s is not None:
            pause = min(hint.pause_s, self.limits.max_session_pause_s)
            if pause < hint.pause_s:
                refused.append(f"pause_s: granted {pause:g} of {hint.pause_s:g} s (the broker's bound)")
            session = replace(session, resume_at=now + pause,
                              hold_until=now + pause + self.limits.session_resume_margin_s)
            if self.limits.session_prefetch_lead_s > 0:
                heapq.heappush(self._prefetch, (session.resume_at - self.limits.session_prefetch_lead_s,
                                                session_id))
        if hint.priority is not None:
            priority = hint.priority
            if (priority is Priority.HIGH and old.priority is not Priority.HIGH
                    and self._high[owner] >= self.limits.max_high_sessions_per_owner):
                priority = Priority.NORMAL
                refused.append(f"priority: granted normal (this caller holds {self._high[owner]} high sessions, "
                               f"the most the broker grants one caller)")
            session = replace(session, priority=priority)
        if hint.keep_generated is not None:
            session = replace(session, drops_generated=not hint.keep_generated)
        self._put(old if old.session_id in self.sessions else None, session)
        return SessionGrant(session=session, pause_granted_s=pause, refused=tuple(refused))

    def _check_room(self, owner: str, session_id: str) -> None:
        if self._per_owner[owner] >= self.limits.max_sessions_per_owner:
            raise ResourceExhausted(f"session_id: this caller holds {self._per_owner[owner]} sessions, the most the "
                                    "broker keeps for one caller; end some", field="session_id")
        if len(self.sessions) >= self.limits.max_sessions:
            raise ResourceExhausted(f"session_id: the broker holds {len(self.sessions)} sessions, its most",
                                    field="session_id")

    def _put(self, old: Session | None, session: Session) -> None:
        if old is None:
            self._per_owner[session.owner] += 1
        if (old is not None and old.priority is Priority.HIGH) != (session.priority is Priority.HIGH):
            self._high[session.owner] += 1 if session.priority is Priority.HIGH else -1
        self.sessions[session.session_id] = session
        heapq.heappush(self._expiry, (self._forget_at(session), session.session_id))

    def _forget_at(self, session: Session) -> float:
        if session.ended_at:
            return session.ended_at + self.limits.session_end_memory_s
        return max(session.touched_at, session.hold_until) + self.limits.session_idle_s

    def forget(self, session_id: str) -> None:
        session = self.sessions.pop(session_id)
        self._per_owner[session.owner] -= 1
        if not self._per_owner[session.owner]:
            del self._per_owner[session.owner]
        if session.priority is Priority.HIGH:
            self._high[session.owner] -= 1

    def expire(self, now: float) -> list[str]:
        """Forget the sessions whose time ran out; their ids."""
        gone = []
        while self._expiry and self._expiry[0][0] <= now:
            at, session_id = heapq.heappop(self._expiry)
            session = self.sessions.get(session_id)
            if session is not None and self._forget_at(session) == at:
                self.forget(session_id)
                gone.append(session_id)
        return gone

    def due_prefetches(self, now: float) -> list[str]:
        """The paused sessions whose prefetch time has come (each pause once); a session that resumed, ended, paused
        anew or was forgotten since is skipped (its newer pause has its own entry)."""
        due = []
        lead = self.limits.session_prefetch_lead_s
        while self._prefetch and self._prefetch[0][0] <= now:
            at, session_id = heapq.heappop(self._prefetch)
            session = self.sessions.get(session_id)
            if session is not None and session.waiting(now) and session.resume_at - lead == at:
                due.append(session_id)
        return due

    # ----------------------------------------------------------------- what the lease book asks
    def ended(self, session_id: str) -> bool:
        session = self.sessions.get(session_id) if session_id else None
        return session is not None and bool(session.ended_at)

    def hold_until(self, session_id: str, now: float) -> float:
        """Until when a pause keeps the session's leases (0: no pause holds them)."""
        session = self.sessions.get(session_id) if session_id else None
        return session.hold_until if session is not None and session.waiting(now) else 0.0

    def keep_rank(self, session_id: str, now: float) -> tuple[int, int, float]:
        """Eviction order between sessions, lowest first: priority, then whether a pause holds it, then (among
        paused ones) the latest stated resume first: the turn needed last is the one to give up (Belady's rule, on
        the agents' own word)."""
        session = self.sessions.get(session_id) if session_id else None
        if session is None:
            return Priority.NORMAL, 0, 0.0
        waiting = session.waiting(now)
        return session.priority, int(waiting), -session.resume_at if waiting else 0.0

    def counts(self, now: float) -> dict[str, int]:
        """Sessions by state, for a gauge."""
        states: Counter[str] = Counter()
        for session in self.sessions.values():
            states["ended" if session.ended_at else "paused" if session.waiting(now) else "active"] += 1
        return dict(states)


@dataclass(frozen=True)
class HintedPolicy:
    """``base``'s order, regrouped by what sessions said: a lower priority's leases first; within a priority the
    leases no pause holds before those one does, and of those the latest to resume first. Leases of sessions that
    said nothing rank as normal, not waiting, so a broker no caller hints evicts exactly as ``base`` does."""

    base: EvictionPolicy
    sessions: SessionBook

    @property
    def name(self) -> str:
        return self.base.name

    def rank(self, candidates: Iterable[Lease], refcounts: Refcounts, now: float) -> list[Lease]:
        ordered = self.base.rank(candidates, refcounts, now)
        if not self.sessions.sessions:
            return ordered
        return sorted(ordered, key=lambda lease: self.sessions.keep_rank(lease.session_id, now))
