"""The broker's state machine: engines, leases, pins, eviction commands. Pure: every method takes
``now`` (wall-clock seconds) and nothing here touches a clock, a socket or a store.

The shell persists what changed (``take_changes``) and delivers eviction commands to engines.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvloop.broker.core.eviction import EvictionPolicy, RefView, choose_victims
from kvloop.broker.core.fleet import Fleet
from kvloop.broker.core.holders import BlockRefs, SharedIds
from kvloop.broker.core.in_flight import InFlight
from kvloop.broker.core.index import BlockIndex, Match
from kvloop.broker.core.model import (
    DEMOTING_REASONS,
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
from kvloop.broker.core.placement import PlaceInput, PlacementPolicy, place
from kvloop.broker.core.soft_index import SoftAck, SoftIndex
from kvloop.shared.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvloop.shared.hashing import KEY_BYTES
from kvloop.shared.vocabulary import Reason


@dataclass(frozen=True, slots=True)
class Limits:
    max_block_keys: int = 8192
    min_ttl_s: float = 1.0
    max_ttl_s: float = 86400.0
    default_ttl_s: float = 480.0
    default_pin_timeout_s: float = 10.0
    max_pin_timeout_s: float = 120.0
    engine_ttl_s: float = 10.0
    max_id_len: int = 256
    eviction_log_size: int = 4096
    soft_index_max_blocks: int = 65536
    max_cache_event_keys: int = 4096
    # What a registration may claim. Generous for any real engine; a value past them is a bug or a forgery, and
    # one accepted engine's layout or rates otherwise steer every placement (block sizes multiply into token
    # counts, a budget into eviction arithmetic, a rate into every cost estimate).
    max_block_size: int = 4096
    max_retention_budget_blocks: int = 1 << 24
    max_prefill_tokens_per_s: float = 1e8
    max_transfer_bytes_per_s: float = 1e13
    max_host_tier_blocks: int = 1 << 26
    max_step_tokens: int = 1 << 24
    max_residual_s: float = 60.0
    """Largest measured residual a Place may carry, either sign (a router's median of seconds to first token): the
    wire's ``kvloop.shared.protocol.MAX_RESIDUAL_S``, which routers clamp to (the core imports no protocol module;
    tests/unit/test_residuals.py holds the two equal)."""
    host_ttl_s: float = 0.0
    """Retention TTL of a lease once demoted to a host tier (0: the lease's own TTL)."""
    demotion_timeout_s: float = 30.0
    """A demotion the engine has not reported in this long is dropped (its host slots freed)."""


@dataclass
class Changes:
    """What to persist since the last ``take_changes``: objects to put, ids to delete, commands."""

    engines: dict[str, EngineRecord | None] = field(default_factory=dict)
    leases: dict[str, Lease | None] = field(default_factory=dict)
    pins: dict[str, Pin | None] = field(default_factory=dict)
    commands: list[EvictionCommand] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.engines or self.leases or self.pins or self.commands)

    def merge(self, later: Changes) -> None:
        """Fold ``later`` into this batch: the last write of each record wins."""
        self.engines.update(later.engines)
        self.leases.update(later.leases)
        self.pins.update(later.pins)
        self.commands.extend(later.commands)


def _check_id(value: str, name: str, limit: int, *, required: bool = True) -> None:
    if required and not value:
        raise InvalidArgument(f"{name}: must not be empty", field=name)
    if len(value) > limit:
        raise InvalidArgument(f"{name}: longer than {limit} characters", field=name)
    if not value.isprintable():
        raise InvalidArgument(f"{name}: must be printable text", field=name)


FINGERPRINT = re.compile(r"[A-Za-z0-9._:+-]{1,64}")
"""A token of at most 64 characters (``kvloop.shared.hashing.layout_fingerprint`` gives 24 hex digits). A made-up but
well-formed fingerprint cannot be told from a real one here; what keeps it from steering real turns is that the
router places each request with the layout of the engines serving its model, and mTLS on who may register."""
HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")
HTTP_URL = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(:[0-9]{1,5})?(/[\x21-\x7e]*)?")


def _check_address(value: str, name: str, pattern: re.Pattern[str], shape: str) -> None:
    if not value:
        return
    match = pattern.fullmatch(value)
    port = match and (match.group(2) or ":1").lstrip(":")
    if not match or not port or not 0 < int(port) <= 65535:
        raise InvalidArgument(f"{name}: expected {shape} (got {value[:80]!r})", field=name)


def check_engine_info(info: EngineInfo, lim: Limits) -> None:
    """A registration's bounds; every error names the field."""
    _check_id(info.engine_id, "engine.engine_id", lim.max_id_len)
    _check_id(info.incarnation, "engine.incarnation", lim.max_id_len, required=False)
    _check_id(info.model, "engine.model", lim.max_id_len, required=False)
    if not FINGERPRINT.fullmatch(info.layout_fingerprint):
        raise InvalidArgument("engine.layout_fingerprint: expected 1 to 64 letters, digits or ._:+- "
                              f"(got {info.layout_fingerprint[:80]!r})",
                              field="engine.layout_fingerprint")
    if not 0 < info.block_size <= lim.max_block_size:
        raise InvalidArgument(f"engine.block_size: must be within 1..{lim.max_block_size} tokens",
                              field="engine.block_size")
    if not 0 <= info.retention_budget_blocks <= lim.max_retention_budget_blocks:
        raise InvalidArgument(f"engine.retention_budget_blocks: must be within 0..{lim.max_retention_budget_blocks}",
                              field="engine.retention_budget_blocks")
    if not 0 <= info.host_tier_blocks <= lim.max_host_tier_blocks:
        raise InvalidArgument(f"engine.host_tier_blocks: must be within 0..{lim.max_host_tier_blocks}",
                              field="engine.host_tier_blocks")
    if not 0 <= info.host_tier_first_id < 1 << 40:
        raise InvalidArgument("engine.host_tier_first_id: must be within 0..2^40-1", field="engine.host_tier_first_id")
    if not 0 <= info.step_tokens <= lim.max_step_tokens:
        raise InvalidArgument(f"engine.step_tokens: must be within 0..{lim.max_step_tokens}",
                              field="engine.step_tokens")
    _check_address(info.addresses.grpc, "engine.addresses.grpc", HOST_PORT, "host:port")
    _check_address(info.addresses.nixl, "engine.addresses.nixl", HOST_PORT, "host:port")
    _check_address(info.addresses.http, "engine.addresses.http", HTTP_URL, "an http(s)://host[:port] URL")


@dataclass
class EngineBooks:
    """What the broker derives for one engine from its leases: each retained block's lease count, the engine's
    lease ids, and the recent eviction commands (for an engine that reconnects with an older sequence number)."""

    log: deque[EvictionCommand]
    refs: BlockRefs = field(default_factory=BlockRefs)
    """Pool blocks: how many of the engine's pool-tier leases hold each."""
    lease_ids: set[str] = field(default_factory=set)
    host_slots: set[int] = field(default_factory=set)
    """Host-tier slots in use, by the engine's host-tier leases (one lease per slot: demoted copies are not
    shared)."""


class SlotCounts:
    """A host tier's slots as refcounts for :func:`choose_victims`: each slot in use is held once."""

    def __init__(self, slots: set[int]) -> None:
        self._slots = slots

    def get(self, slot: int, default: int = 0) -> int:
        return 1 if slot in self._slots else default

    def __getitem__(self, slot: int) -> int:
        return self.get(slot)

    def __len__(self) -> int:
        return len(self._slots)


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
        self._new_id = new_id
        self.engines: dict[str, EngineRecord] = {}
        self.leases: dict[str, Lease] = {}
        self.pins: dict[str, Pin] = {}
        self._index = BlockIndex()
        self._books: dict[str, EngineBooks] = {}
        """Per registered engine, what the broker derives from its leases (never stored): opened with the engine's
        record (:meth:`_open_engine`), closed with it (:meth:`_drop_engine`)."""
        self._session_leases: dict[str, set[str]] = {}
        self._block_ids = SharedIds()
        """One int per block-id value for every lease's ``block_ids`` (engines share the pool's range of ids)."""
        self._demoting: dict[str, float] = {}
        """Lease id -> ``demoting_until`` of each demotion the engine has not reported yet (:meth:`tick` drops those
        past due)."""
        self._expiry: list[tuple[float, str]] = []
        """(expires_at, lease id) per lease and per renewal: :meth:`tick` pops what is due instead of walking every
        lease. An entry whose lease is gone or whose expiry moved is stale and skipped."""
        self.fleet = Fleet()
        """The live engines by layout and load order: which few placement prices besides the prefix's holders."""
        self.soft = SoftIndex(self.limits.soft_index_max_blocks)
        """Each engine's prefix cache as its KV events tell it: in memory only, never in ``Changes``."""
        self.in_flight = InFlight(ttl_s=self.placement_policy.in_flight_ttl_s,
                                  placed_s=self.placement_policy.placed_s)
        """The routers' requests in flight per engine: in memory only, never in ``Changes``."""
        self.unheard: set[str] = set()
        """Engines restored from a store (:meth:`load`) that have not registered or kept alive with this state yet.
        Their leases are neither matched nor pinned: the sidecar renews its engine's safety holds only after a
        keep-alive succeeds, so across a fail-over an engine's holds may be lapsing while the new leader still
        lists its leases (it gives the engine a keep-alive period to find it)."""
        self._changes = Changes()

    # ----------------------------------------------------------------- bookkeeping
    def take_changes(self) -> Changes:
        changes, self._changes = self._changes, Changes()
        return changes

    def _touch_engine(self, rec: EngineRecord) -> None:
        self._changes.engines[rec.info.engine_id] = rec

    def _touch_lease(self, lease: Lease) -> None:
        self._changes.leases[lease.lease_id] = lease

    def retained_blocks(self, engine_id: str) -> int:
        books = self._books.get(engine_id)  # _remove_lease deletes blocks whose count reaches 0
        return len(books.refs) if books is not None else 0

    def host_blocks(self, engine_id: str) -> int:
        """Host-tier slots the engine's leases hold."""
        books = self._books.get(engine_id)
        return len(books.host_slots) if books is not None else 0

    def engine_lease_ids(self, engine_id: str) -> list[str]:
        books = self._books.get(engine_id)
        return sorted(books.lease_ids) if books is not None else []

    def hold_until(self, lease: Lease) -> float:
        """When the lease may disappear from a store at the latest: its expiry or its last pin's."""
        pins = [self.pins[p].expires_at for p in lease.pin_ids if p in self.pins]
        return max([lease.expires_at, *pins])

    def load(self, engines: Iterable[EngineRecord], leases: Iterable[Lease], pins: Iterable[Pin]) -> None:
        """Restore from a store (a restarted broker or a new leader). Eviction logs start empty, so an
        engine that reconnects with an older sequence number gets a resync."""
        for rec in engines:
            self._open_engine(rec)
            self.unheard.add(rec.info.engine_id)
        for lease in leases:
            if lease.engine_id in self.engines:
                lease.pin_ids = set()
                self._add_lease(lease)
        for pin in pins:
            if pin.lease_id in self.leases:
                self.pins[pin.pin_id] = pin
                self.leases[pin.lease_id].pin_ids.add(pin.pin_id)
        self._changes = Changes()

    # ----------------------------------------------------------------- engines
    def register(self, info: EngineInfo, now: float) -> tuple[EngineRecord, list[str]]:
        check_engine_info(info, self.limits)
        self.unheard.discard(info.engine_id)
        old = self.engines.get(info.engine_id)
        if old is not None and old.info.incarnation == info.incarnation:
            changed = ("engine.layout_fingerprint" if old.info.layout_fingerprint != info.layout_fingerprint
                       else "engine.block_size" if old.info.block_size != info.block_size
                       else "engine.role" if old.info.role != info.role
                       else "engine.model" if old.info.model != info.model else "")
            if changed:
                raise FailedPrecondition(
                    f"{changed}: engine {info.engine_id!r} is registered with role "
                    f"{old.info.role.value}, fingerprint {old.info.layout_fingerprint!r} and block size "
                    f"{old.info.block_size}; a live incarnation cannot change them",
                    field=changed,
                )
            old.info = info  # a reconnect: addresses or budget may have changed
            old.last_seen = now
            self._touch_engine(old)
            over = self.retained_blocks(info.engine_id) - info.retention_budget_blocks
            if over > 0:  # a smaller budget applies at once (pinned leases go when their pins end)
                self._evict_for(info.engine_id, over, EvictionReason.BUDGET, now)
            host_over = self.host_blocks(info.engine_id) - info.host_tier_blocks
            if host_over > 0:
                self._free_host(info.engine_id, host_over, now)
            return old, self.engine_lease_ids(info.engine_id)
        if old is not None:
            # A new incarnation: the process restarted, its retained blocks are gone.
            self._drop_engine(info.engine_id, now)
        rec = EngineRecord(info=info, registered_at=now, last_seen=now,
                           eviction_seq=old.eviction_seq if old else 0)
        self._open_engine(rec)
        self._touch_engine(rec)
        return rec, []

    def _open_engine(self, rec: EngineRecord) -> None:
        self.engines[rec.info.engine_id] = rec
        self.fleet.update(rec)
        self._books[rec.info.engine_id] = EngineBooks(log=deque(maxlen=self.limits.eviction_log_size))

    def _engine(self, engine_id: str, field_name: str = "engine_id") -> EngineRecord:
        rec = self.engines.get(engine_id)
        if rec is None:
            raise NotFound(f"{field_name}: engine {engine_id!r} is not registered (or expired)", field=field_name)
        return rec

    def keepalive(self, engine_id: str, load: EngineLoad, now: float) -> EngineRecord:
        rec = self._engine(engine_id)
        if not 0.0 <= load.kv_usage <= 1.0:
            raise InvalidArgument("load.kv_usage: must be within 0..1", field="load.kv_usage")
        for name, most in (("prefill_tokens_per_s", self.limits.max_prefill_tokens_per_s),
                           ("transfer_bytes_per_s", self.limits.max_transfer_bytes_per_s)):
            if not 0 <= getattr(load, name) <= most:  # NaN fails too: it would poison every cost estimate
                raise InvalidArgument(f"load.{name}: must be within 0..{most:g}", field=f"load.{name}")
        rec.load = load
        rec.last_seen = now
        self.unheard.discard(engine_id)
        self.fleet.update(rec)
        self._touch_engine(rec)
        if load.memory_pressure:
            retained = self.retained_blocks(engine_id)
            need = load.pressure_free_blocks or max(1, retained // 10)
            self._evict_for(engine_id, need, EvictionReason.MEMORY_PRESSURE, now)
        return rec

    def deregister(self, engine_id: str, now: float) -> int:
        self._engine(engine_id)
        return self._drop_engine(engine_id, now)

    def _drop_engine(self, engine_id: str, now: float) -> int:
        lease_ids = self.engine_lease_ids(engine_id)
        for lid in lease_ids:
            self._remove_lease(self.leases[lid])
        for pin in [p for p in self.pins.values() if p.reader_engine_id == engine_id]:
            self._unpin(pin.pin_id, now)
        self.engines.pop(engine_id, None)
        self.fleet.remove(engine_id)
        self.soft.drop(engine_id)
        self._books.pop(engine_id, None)
        self.unheard.discard(engine_id)
        self._changes.engines[engine_id] = None
        return len(lease_ids)

    # ----------------------------------------------------------------- leases
    def _validate_ttl(self, ttl_s: float, name: str = "ttl_s") -> float:
        if ttl_s == 0:
            return self.limits.default_ttl_s
        if not self.limits.min_ttl_s <= ttl_s <= self.limits.max_ttl_s:
            raise InvalidArgument(
                f"{name}: {ttl_s} is outside {self.limits.min_ttl_s}..{self.limits.max_ttl_s} seconds", field=name
            )
        return ttl_s

    def _validate_keys(self, keys: Sequence[bytes], name: str = "block_keys") -> None:
        if not keys:
            raise InvalidArgument(f"{name}: must not be empty", field=name)
        if len(keys) > self.limits.max_block_keys:
            raise ResourceExhausted(
                f"{name}: {len(keys)} keys exceed the limit of {self.limits.max_block_keys}", field=name
            )
        for i, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                raise InvalidArgument(f"{name}[{i}]: a block key is {KEY_BYTES} bytes, got {len(key)}", field=name)

    def publish(
        self,
        engine_id: str,
        session_id: str,
        keys: Sequence[bytes],
        block_ids: Sequence[int],
        num_tokens: int,
        ttl_s: float,
        now: float,
    ) -> tuple[Lease, list[EvictionCommand]]:
        rec = self._engine(engine_id)
        _check_id(session_id, "session_id", self.limits.max_id_len, required=False)
        self._validate_keys(keys)
        if len(block_ids) != len(keys):
            raise InvalidArgument(
                f"block_ids: {len(block_ids)} ids for {len(keys)} keys; give one id per key", field="block_ids"
            )
        if min(block_ids) < 0 or len(set(block_ids)) != len(block_ids):
            raise InvalidArgument("block_ids: ids must be non-negative and distinct", field="block_ids")
        bs = rec.info.block_size
        if not len(keys) * bs <= num_tokens < (len(keys) + 1) * bs:
            raise InvalidArgument(
                f"num_tokens: {num_tokens} tokens do not fit {len(keys)} full blocks of {bs}", field="num_tokens"
            )
        ttl = self._validate_ttl(ttl_s)
        budget = rec.info.retention_budget_blocks
        if len(block_ids) > budget:
            raise ResourceExhausted(
                f"block_ids: {len(block_ids)} blocks exceed engine {engine_id!r}'s retention budget of {budget}",
                field="block_ids",
            )

        # Leases on this engine that the new one extends (same content, a prefix of it) are redundant.
        superseded = self._index.prefixes_of(
            keys, self.leases, lambda lease: lease.engine_id == engine_id and lease.pending is None)
        books = self._books[engine_id]
        view = RefView(books.refs)
        for old in superseded:
            if not old.pinned and old.tier is Tier.POOL:
                view.release(old.block_ids)
        view.hold(block_ids)
        need = view.distinct() - budget
        gone = {old.lease_id for old in superseded}
        candidates = [
            lease for lease in self._pool_candidates(engine_id) if lease.lease_id not in gone
        ] if need > 0 else []
        victims, freed = choose_victims(self.eviction_policy, candidates, view, need, now)
        if freed < need:
            raise ResourceExhausted(
                f"block_ids: engine {engine_id!r}'s retention budget of {budget} blocks is held by pinned "
                f"leases; {need - freed} more blocks cannot be freed now",
                field="block_ids",
            )
        commands: list[EvictionCommand] = []
        for old in superseded:
            commands.extend(self._evict(old, EvictionReason.SUPERSEDED, now))
        for victim in victims:
            commands.extend(self._evict(victim, EvictionReason.BUDGET, now))
        lease = Lease(
            lease_id=self._new_id(), engine_id=engine_id, session_id=session_id, keys=tuple(keys),
            block_ids=tuple(block_ids), num_tokens=num_tokens, ttl_s=ttl, expires_at=now + ttl,
            last_used=now, created_at=now,
        )
        self._add_lease(lease)
        self._touch_lease(lease)
        return lease, commands

    def _lease(self, lease_id: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise NotFound(f"lease_id: lease {lease_id!r} does not exist (released, evicted or expired)",
                           field="lease_id")
        return lease

    def renew(self, lease_id: str, ttl_s: float, now: float) -> Lease:
        lease = self._lease(lease_id)
        if lease.pending is not None:
            raise FailedPrecondition(f"lease_id: lease {lease_id!r} is being evicted ({lease.pending.value})",
                                     field="lease_id")
        lease.ttl_s = self._validate_ttl(ttl_s) if ttl_s else lease.ttl_s
        lease.expires_at = now + lease.ttl_s
        lease.last_used = now
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
        self._touch_lease(lease)
        return lease

    def release(self, lease_id: str, now: float) -> bool:
        """Engine-initiated release. Returns True when deferred by a pin: the engine then frees the
        blocks on the RELEASED eviction command, not before."""
        lease = self._lease(lease_id)
        if lease.pinned:
            lease.pending = lease.pending or EvictionReason.RELEASED
            self._touch_lease(lease)
            return True
        self._remove_lease(lease)
        return False

    def _add_lease(self, lease: Lease) -> None:
        lease.block_ids = self._block_ids.share(lease.block_ids)
        self.leases[lease.lease_id] = lease
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
        self._index.add(lease)
        books = self._books[lease.engine_id]
        self._hold_blocks(books, lease)
        books.lease_ids.add(lease.lease_id)
        if lease.demoting_until:
            self._demoting[lease.lease_id] = lease.demoting_until
        if lease.session_id:
            self._session_leases.setdefault(lease.session_id, set()).add(lease.lease_id)

    def _remove_lease(self, lease: Lease) -> None:
        del self.leases[lease.lease_id]
        self._index.remove(lease)
        books = self._books[lease.engine_id]
        self._release_blocks(books, lease)
        books.lease_ids.discard(lease.lease_id)
        self._demoting.pop(lease.lease_id, None)
        if lease.session_id:
            held = self._session_leases.get(lease.session_id)
            if held is not None:
                held.discard(lease.lease_id)
                if not held:
                    del self._session_leases[lease.session_id]
        for pin_id in list(lease.pin_ids):
            self.pins.pop(pin_id, None)
            self._changes.pins[pin_id] = None
        self._changes.leases[lease.lease_id] = None

    @staticmethod
    def _hold_blocks(books: EngineBooks, lease: Lease) -> None:
        if lease.tier is Tier.POOL:
            books.refs.hold(set(lease.block_ids))
        else:
            books.host_slots.update(lease.block_ids)

    @staticmethod
    def _release_blocks(books: EngineBooks, lease: Lease) -> None:
        if lease.tier is not Tier.POOL:
            books.host_slots.difference_update(lease.block_ids)
            return
        books.refs.release(set(lease.block_ids))

    def _evict(self, lease: Lease, reason: EvictionReason, now: float) -> list[EvictionCommand]:
        """Evict now, or defer while pinned; an eviction that makes room demotes a pool lease to the engine's host
        tier where the tier has (or can make) room. Returns the commands issued."""
        if lease.pinned:
            if lease.pending is None:
                lease.pending = reason
                self._touch_lease(lease)
            return []
        if reason in DEMOTING_REASONS and lease.tier is Tier.POOL:
            demoted = self._demote(lease, reason, now)
            if demoted is not None:
                return demoted
        self._remove_lease(lease)
        return [self._command(lease.engine_id, lease.lease_id, lease.block_ids, reason, tier=lease.tier)]

    def _demote(self, lease: Lease, reason: EvictionReason, now: float) -> list[EvictionCommand] | None:
        """Move ``lease`` to its engine's host tier: slots for its blocks (dropping the tier's victims to make
        room), its pool blocks released now, one command telling the engine to copy then free. None when the engine
        has no tier or the tier cannot make room (the lease is then dropped)."""
        rec = self.engines[lease.engine_id]
        books = self._books[lease.engine_id]
        need = len(lease.block_ids)
        capacity = rec.info.host_tier_blocks
        if need > capacity:
            return None
        commands: list[EvictionCommand] = []
        short = need - (capacity - len(books.host_slots))
        if short > 0:
            victims, freed = choose_victims(self.eviction_policy, self._host_candidates(lease.engine_id),
                                            SlotCounts(books.host_slots), short, now)
            if freed < short:
                return None
            for victim in victims:
                commands.extend(self._evict(victim, reason, now))
        first = rec.info.host_tier_first_id
        slots = tuple(s for s, _ in zip((s for s in range(first, first + capacity) if s not in books.host_slots),
                                        range(need), strict=False))
        pool_ids = lease.block_ids
        self._release_blocks(books, lease)
        lease.tier, lease.block_ids = Tier.HOST, self._block_ids.share(slots)
        lease.demoting_until = now + self.limits.demotion_timeout_s
        lease.ttl_s = self.limits.host_ttl_s or lease.ttl_s
        lease.expires_at = now + lease.ttl_s
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
        self._hold_blocks(books, lease)
        self._demoting[lease.lease_id] = lease.demoting_until
        self._touch_lease(lease)
        commands.append(self._command(lease.engine_id, lease.lease_id, pool_ids, reason, demote_to=slots))
        return commands

    def complete_demotion(self, engine_id: str, lease_id: str, success: bool, now: float) -> Lease | None:
        """The engine's report of a demotion: copied (the lease is offered again, from the host tier) or failed
        (the lease is dropped). A repeated success report is answered again. Returns the lease if it is still
        retained. Raises ``NotFound`` (the lease went: superseded, expired or timed out) or ``FailedPrecondition``
        (not this engine's lease, or not being demoted)."""
        lease = self._lease(lease_id)
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
        self._touch_lease(lease)
        return lease

    def _end_demotion(self, lease: Lease) -> None:
        """Drop a host-tier lease whose copy failed or never came; the engine frees its slots on the command."""
        if lease.pinned:  # a pin cannot start while demoting; a finished copy may have been pinned since
            lease.pending = lease.pending or EvictionReason.DEMOTION_FAILED
            self._touch_lease(lease)
            return
        self._remove_lease(lease)
        self._command(lease.engine_id, lease.lease_id, lease.block_ids, EvictionReason.DEMOTION_FAILED,
                      tier=lease.tier)

    def _pool_candidates(self, engine_id: str) -> list[Lease]:
        """The engine's pool-tier leases an eviction may take: not pinned, none pending."""
        return [lease for lid in self._books[engine_id].lease_ids
                if (lease := self.leases[lid]).tier is Tier.POOL and not lease.pinned and lease.pending is None]

    def _host_candidates(self, engine_id: str) -> list[Lease]:
        """The engine's host-tier leases the tier may drop for room: not pinned, none pending, copy done."""
        return [lease for lid in self._books[engine_id].lease_ids
                if (lease := self.leases[lid]).tier is Tier.HOST and not lease.pinned and lease.pending is None
                and not lease.demoting_until]

    def _free_host(self, engine_id: str, need: int, now: float) -> None:
        books = self._books[engine_id]
        victims, _ = choose_victims(self.eviction_policy, self._host_candidates(engine_id),
                                    SlotCounts(books.host_slots), need, now)
        for victim in victims:
            self._remove_lease(victim)
            self._command(engine_id, victim.lease_id, victim.block_ids, EvictionReason.BUDGET, tier=Tier.HOST)

    def _command(self, engine_id: str, lease_id: str, block_ids: tuple[int, ...], reason: EvictionReason, *,
                 tier: Tier = Tier.POOL, demote_to: tuple[int, ...] = ()) -> EvictionCommand:
        rec = self.engines[engine_id]
        rec.eviction_seq += 1
        cmd = EvictionCommand(seq=rec.eviction_seq, engine_id=engine_id, lease_id=lease_id,
                              block_ids=block_ids, reason=reason, tier=tier, demote_to=demote_to)
        self._books[engine_id].log.append(cmd)
        self._changes.commands.append(cmd)
        self._touch_engine(rec)
        return cmd

    def _evict_for(self, engine_id: str, need: int, reason: EvictionReason, now: float) -> list[EvictionCommand]:
        books = self._books[engine_id]
        victims, _ = choose_victims(self.eviction_policy, self._pool_candidates(engine_id), books.refs, need, now)
        return [cmd for victim in victims for cmd in self._evict(victim, reason, now)]

    # ----------------------------------------------------------------- pins
    def pin(self, reader_engine_id: str, lease_id: str, num_blocks: int, timeout_s: float, now: float) -> Pin:
        reader = self._engine(reader_engine_id, "reader_engine_id")
        lease = self._lease(lease_id)
        if lease.pending is not None:
            raise FailedPrecondition(f"lease_id: lease {lease_id!r} is being evicted ({lease.pending.value})",
                                     field="lease_id")
        if lease.demoting_until:
            raise FailedPrecondition(f"lease_id: lease {lease_id!r} is being copied to its engine's host tier",
                                     field="lease_id")
        if lease.engine_id in self.unheard:
            raise FailedPrecondition(f"lease_id: lease {lease_id!r} is on engine {lease.engine_id!r}, which has not "
                                     "kept alive with this leader yet (its safety hold may be running out)",
                                     field="lease_id")
        if not reader.info.same_layout(self.engines[lease.engine_id].info):
            raise FailedPrecondition(
                f"reader_engine_id: engine {reader_engine_id!r} has a different KV layout fingerprint or block "
                f"size than the lease's engine {lease.engine_id!r}",
                field="reader_engine_id",
            )
        if not 1 <= num_blocks <= len(lease.block_ids):
            raise InvalidArgument(f"num_blocks: must be within 1..{len(lease.block_ids)}", field="num_blocks")
        timeout = timeout_s or self.limits.default_pin_timeout_s
        if not 0 < timeout <= self.limits.max_pin_timeout_s:
            raise InvalidArgument(f"timeout_s: must be within 0..{self.limits.max_pin_timeout_s}",
                                  field="timeout_s")
        pin = Pin(pin_id=self._new_id(), lease_id=lease_id, reader_engine_id=reader_engine_id,
                  num_blocks=num_blocks, expires_at=now + timeout)
        self.pins[pin.pin_id] = pin
        lease.pin_ids.add(pin.pin_id)
        self._changes.pins[pin.pin_id] = pin
        self._touch_lease(lease)
        return pin

    def complete(self, pin_id: str, success: bool, nbytes: int, duration_s: float, now: float) -> Lease | None:
        """End a pin. A successful pull renews the lease (a turn used it) and teaches the broker the
        source's bandwidth. Returns the lease if it is still retained."""
        pin = self.pins.get(pin_id)
        if pin is None:
            raise NotFound(f"pin_id: pin {pin_id!r} does not exist (completed or timed out)", field="pin_id")
        if nbytes < 0 or duration_s < 0:
            name = "bytes" if nbytes < 0 else "duration_s"
            raise InvalidArgument(f"{name}: must not be negative", field=name)
        lease = self.leases.get(pin.lease_id)
        if success and lease is not None:
            source = self.engines[lease.engine_id]
            if nbytes > 0 and duration_s > 0:
                sample = nbytes / duration_s
                old = source.learned_bandwidth
                source.learned_bandwidth = sample if old == 0 else 0.7 * old + 0.3 * sample
                self._touch_engine(source)
            # A TTL that ran out during the pull stays run out, whether or not a tick saw it yet:
            # expiry is deferred by a pin, never cancelled by one.
            if lease.pending is None and lease.expires_at > now:
                lease.expires_at = now + lease.ttl_s
                lease.last_used = now
                heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
                self._touch_lease(lease)
        self._unpin(pin_id, now)
        return self.leases.get(pin.lease_id)

    def _unpin(self, pin_id: str, now: float) -> None:
        pin = self.pins.pop(pin_id)
        self._changes.pins[pin_id] = None
        lease = self.leases.get(pin.lease_id)
        if lease is None:
            return
        lease.pin_ids.discard(pin_id)
        self._touch_lease(lease)
        if not lease.pinned and lease.pending is None and lease.expires_at <= now:
            lease.pending = EvictionReason.TTL_EXPIRED
        if not lease.pinned and lease.pending is not None:
            reason, lease.pending = lease.pending, None
            self._evict(lease, reason, now)

    # ----------------------------------------------------------------- time
    def tick(self, now: float) -> None:
        """Expire pins, then leases, then engines whose keep-alive stopped."""
        for pin in [p for p in self.pins.values() if p.expires_at <= now]:
            self._unpin(pin.pin_id, now)
        while self._expiry and self._expiry[0][0] <= now:
            at, lease_id = heapq.heappop(self._expiry)
            lease = self.leases.get(lease_id)
            # Skipped: gone, renewed (its later entry is queued), or being evicted already (its pin's end evicts it).
            if lease is not None and lease.expires_at == at and lease.pending is None:
                self._evict(lease, EvictionReason.TTL_EXPIRED, now)
        for lease_id in [lid for lid, until in self._demoting.items() if until <= now]:
            self._end_demotion(self.leases[lease_id])
        deadline = now - self.limits.engine_ttl_s
        for engine_id in [e for e, rec in self.engines.items() if rec.last_seen <= deadline]:
            self._drop_engine(engine_id, now)

    # ----------------------------------------------------------------- placement
    def place(self, request: PlaceInput, now: float) -> Plan:
        _check_id(request.session_id, "session_id", self.limits.max_id_len, required=False)
        if request.keys:
            self._validate_keys(request.keys)
        if request.block_size <= 0:
            raise InvalidArgument("block_size: must be positive", field="block_size")
        if not len(request.keys) * request.block_size <= request.num_tokens:
            raise InvalidArgument(
                f"num_tokens: {request.num_tokens} tokens cannot hold {len(request.keys)} full blocks",
                field="num_tokens",
            )
        for name in ("pd_residual_s", "decode_local_residual_s"):
            value = getattr(request, name)
            if not math.isfinite(value) or abs(value) > self.limits.max_residual_s:
                raise InvalidArgument(f"{name}: {value} is not within +-{self.limits.max_residual_s} s", field=name)
        matches, session_engine = self.lease_matches(request)
        layout = (request.layout_fingerprint, request.block_size)
        members = self.fleet.members(layout)
        cached = {e: n for e, n in self.soft.prefixes(request.keys).items() if e in members}
        return place(request, self._candidates(layout, members, matches, session_engine, cached, now), matches,
                     self.placement_policy, session_engine, cached=cached, fleet_rate=self.fleet.median_rate(layout))

    def _candidates(self, layout: tuple[str, int], members: set[str], matches: Sequence[Match], session_engine: str,
                    cached: Mapping[str, int], now: float) -> list[EngineRecord]:
        """The engines placement prices, with the load it prices (:meth:`engines_as_placed`): the prefix's holders,
        the session's engine, and the least loaded few of each role that hold nothing. Where routers count their
        requests, every engine they have one on is priced too (its load is theirs), and the few are the idle ones of
        least KV usage, whose placed load is just that. Within a layout group of alike engines this prices the same
        cheapest plan as all of them would (tests/unit/test_core_scale.py checks it against the whole fleet)."""
        chosen = set(cached) | {m.lease.engine_id for m in matches} | {session_engine}
        totals, tokens = self._in_flight_totals(now)
        if totals is not None:
            chosen |= {e for e in (*totals, *tokens) if e in members}
        k = self.placement_policy.least_loaded_candidates
        for role in ("prefill", "decode"):
            # One prefill engine more: the decode engine may be one of them (role both), and placement prices a
            # prompt on it as its decode request's own work, not as a prefill (broker.core.placement).
            n = k + 1 if role == "prefill" else k
            chosen.update(self.fleet.least_loaded(layout, role, n, chosen.__contains__, by_kv=totals is not None))
        return self._placed(sorted(e for e in chosen if e in self.engines), totals, tokens)

    def lease_matches(self, request: PlaceInput) -> tuple[list[Match], str]:
        """The leases sharing the longest usable prefix with the request, and the engine of the session's latest
        lease ("" when none)."""
        def eligible(lease: Lease) -> bool:
            rec = self.engines.get(lease.engine_id)
            return (rec is not None and lease.pending is None and not lease.demoting_until
                    and lease.engine_id not in self.unheard and rec.info.block_size == request.block_size
                    and rec.info.layout_fingerprint == request.layout_fingerprint)

        matches = self._index.longest(request.keys, self.leases, eligible) if request.keys else []
        usable = (request.num_tokens - 1) // request.block_size
        if matches and 0 < usable < matches[0].blocks:
            # The block holding the last prompt token is never reused, so every lease sharing the
            # usable prefix is as good: let the tie-break (same session, recency) choose among them all.
            matches = [Match(lease, usable) for lease in
                       self._index.holding(request.keys, usable, self.leases, eligible)]
        session_engine = ""
        held = self._session_leases.get(request.session_id) if request.session_id else None
        if held:
            latest = max((self.leases[lid] for lid in held), key=lambda lease: lease.last_used)
            session_engine = latest.engine_id
        return matches, session_engine

    def report_in_flight(self, router: str, counts: Mapping[str, int], now: float,
                         tokens: Mapping[str, int] | None = None) -> None:
        """A router's requests in flight per engine id, and their prompt tokens not computed yet, at ``now`` (see
        :mod:`.in_flight`). Raises ``InvalidArgument`` naming ``in_flight_tokens`` for a count over
        ``Limits.max_block_keys`` blocks' worth of tokens of the largest block size (no prompt is longer)."""
        _check_id(router, "router_id", self.limits.max_id_len)
        most = self.limits.max_block_keys * 1024
        for engine_id, n in (tokens or {}).items():
            if n > most:
                raise InvalidArgument(f"in_flight_tokens[{engine_id!r}]: {n} tokens in flight exceed {most}",
                                      field="in_flight_tokens")
        self.in_flight.report(router, {e: n for e, n in counts.items() if e in self.engines}, now,
                              {e: n for e, n in (tokens or {}).items() if e in self.engines})

    def count_placement(self, plan: Plan, now: float) -> None:
        """A plan just given to a router that counts its requests: the engine that computes its prompt (the
        decode engine on DECODE_LOCAL) counts the request and its tokens to compute until the router's own counts
        can (:mod:`.in_flight`). A P/D plan's decode request is not counted: it starts when the prefill ends, and a
        stream counted before then would veto DECODE_LOCAL tails on streams that are not there yet. Nor is a short
        tail on the decode engine that holds its history: it goes there by affinity, the router counts it as it
        starts, and counted twice meanwhile the tails of sessions arriving together looked costlier there than
        the P/D hop, which under load costs far more than it is priced (``kvloop bench load``, agent workload)."""
        if plan.decision is Decision.DECODE_LOCAL and plan.reason is not Reason.PREFILL_QUEUED:
            return
        self.in_flight.placed(plan.prefill.engine_id, plan.recompute_tokens, now)

    def engines_as_placed(self, now: float) -> list[EngineRecord]:
        """The live engines with the load placement prices: where routers count their requests in flight, those
        counts replace the sidecars' (older) running and waiting figures, and their tokens not yet computed are
        the engines' queues; KV usage, pressure and rates stay. All of them: placement's oracle in the tests."""
        return self._placed(list(self.engines), *self._in_flight_totals(now))

    def _in_flight_totals(self, now: float) -> tuple[dict[str, int] | None, dict[str, int]]:
        """The routers' requests and prompt tokens in flight per engine; requests None where no router counts."""
        totals = self.in_flight.totals(now)
        return totals, (self.in_flight.token_totals(now) or {}) if totals is not None else {}

    def _placed(self, ids: Iterable[str], totals: dict[str, int] | None,
                tokens: dict[str, int]) -> list[EngineRecord]:
        if totals is None:
            return [self.engines[e] for e in ids]
        return [dataclasses.replace(self.engines[e], load=dataclasses.replace(
                    self.engines[e].load, running_requests=totals.get(e, 0), waiting_requests=0,
                    queued_prefill_tokens=tokens.get(e, 0)))
                for e in ids]

    def cached_prefixes(self, request: PlaceInput) -> dict[str, int]:
        """Per live engine of the request's layout, how many leading blocks of ``request.keys`` its own prefix
        cache holds (the soft index); engines holding none are left out. Each engine asked in turn: placement walks
        the soft index's key-to-engines map instead (``SoftIndex.prefixes``); this is its oracle in the tests."""
        cached: dict[str, int] = {}
        if not request.keys:
            return cached
        for engine_id, rec in self.engines.items():
            if (rec.info.block_size == request.block_size
                    and rec.info.layout_fingerprint == request.layout_fingerprint):
                n = self.soft.cached_prefix(engine_id, request.keys)
                if n:
                    cached[engine_id] = n
        return cached

    # ----------------------------------------------------------------- soft index
    def _validate_event_keys(self, keys: Sequence[bytes], name: str) -> None:
        if len(keys) > self.limits.max_cache_event_keys:
            raise InvalidArgument(
                f"{name}: {len(keys)} keys exceed the limit of {self.limits.max_cache_event_keys} per batch; "
                "send more batches", field=name)
        for i, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                raise InvalidArgument(f"{name}[{i}]: a block key is {KEY_BYTES} bytes, got {len(key)}", field=name)

    def report_cache_events(self, engine_id: str, incarnation: str, seq: int, *, reset: bool, cleared: bool,
                            stored: Sequence[bytes], removed: Sequence[bytes]) -> SoftAck:
        """An engine's prefix-cache events (``ReportCacheEvents``) into the soft index. Nothing here is persisted:
        the shell runs it through ``BrokerRuntime.volatile``."""
        rec = self._engine(engine_id)
        if incarnation != rec.info.incarnation:
            raise FailedPrecondition(
                f"incarnation: engine {engine_id!r} is registered with incarnation {rec.info.incarnation!r}, "
                f"not {incarnation!r}; register the new incarnation first", field="incarnation")
        if seq < 1:
            raise InvalidArgument("seq: batches are numbered from 1", field="seq")
        self._validate_event_keys(stored, "stored_keys")
        self._validate_event_keys(removed, "removed_keys")
        return self.soft.apply(engine_id, incarnation, seq, reset=reset, cleared=cleared, stored=stored,
                               removed=removed)

    # ----------------------------------------------------------------- eviction stream
    def commands_after(self, engine_id: str, after_seq: int, durable_seq: int | None = None) -> list[EvictionCommand]:
        """Commands an engine has not applied yet; a RESYNC when the log no longer covers the gap.

        ``durable_seq``: the engine's last command whose change the store holds (None: no durable store). A command
        past it is withheld: the engine would free blocks that a new leader, loading the store, still offers.
        While any is pending, no RESYNC is sent either (its live leases would be this state's, not the store's);
        the shell wakes the stream once the write lands."""
        rec = self._engine(engine_id)
        log = self._books[engine_id].log
        last = rec.eviction_seq
        pending = durable_seq is not None and durable_seq < last
        if after_seq == last:
            return []
        if after_seq > last or not log or after_seq < log[0].seq - 1:
            if pending:
                return []
            return [EvictionCommand(seq=last, engine_id=engine_id, lease_id="", block_ids=(),
                                    reason=EvictionReason.RESYNC,
                                    live_lease_ids=tuple(self.engine_lease_ids(engine_id)))]
        upto = last if durable_seq is None else min(last, durable_seq)
        return [cmd for cmd in log if after_seq < cmd.seq <= upto]
