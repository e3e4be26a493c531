"""The registered engines: registration, keep-alive and expiry, the fleet placement reads, and each engine's eviction
stream (commands numbered in order, and a log to replay them to an engine that reconnects behind)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from kvloop.broker.core.changes import Journal
from kvloop.broker.core.fleet import Fleet
from kvloop.broker.core.limits import Limits, check_engine_info, check_load, check_same_engine
from kvloop.broker.core.model import EngineInfo, EngineLoad, EngineRecord, EvictionCommand, EvictionReason, Tier
from kvloop.shared.errors import NotFound


class Engines:
    def __init__(self, limits: Limits, journal: Journal) -> None:
        self.limits = limits
        self._journal = journal
        self.records: dict[str, EngineRecord] = {}
        self.fleet = Fleet()
        """The live engines by layout and load order: which few placement prices besides the prefix's holders."""
        self.unheard: set[str] = set()
        """Engines restored from a store that have not registered or kept alive with this state yet. Their leases
        are neither matched nor pinned: the sidecar renews its engine's safety holds only after a keep-alive
        succeeds, so across a fail-over an engine's holds may be lapsing while the new leader still lists its leases
        (it gives the engine a keep-alive period to find it)."""
        self._logs: dict[str, deque[EvictionCommand]] = {}
        """Each engine's recent commands, for one that reconnects with an older sequence number; never stored."""

    def open(self, rec: EngineRecord) -> None:
        self.records[rec.info.engine_id] = rec
        self.fleet.update(rec)
        self._logs[rec.info.engine_id] = deque(maxlen=self.limits.eviction_log_size)

    def get(self, engine_id: str, field_name: str = "engine_id") -> EngineRecord:
        rec = self.records.get(engine_id)
        if rec is None:
            raise NotFound(f"{field_name}: engine {engine_id!r} is not registered (or expired)", field=field_name)
        return rec

    def reconnect(self, info: EngineInfo, now: float) -> EngineRecord | None:
        """Check a registration; for a reconnect of the live incarnation, its record updated (addresses or budgets
        may change). None for a new engine or incarnation: the caller ends the old one, then :meth:`admit`."""
        check_engine_info(info, self.limits)
        self.unheard.discard(info.engine_id)
        old = self.records.get(info.engine_id)
        if old is None or old.info.incarnation != info.incarnation:
            return None
        check_same_engine(old.info, info)
        old.info = info
        old.last_seen = now
        self._journal.put_engine(old)
        return old

    def admit(self, info: EngineInfo, now: float, eviction_seq: int) -> EngineRecord:
        """A new incarnation's record; its commands number on from its predecessor's (``eviction_seq``)."""
        rec = EngineRecord(info=info, registered_at=now, last_seen=now, eviction_seq=eviction_seq)
        self.open(rec)
        self._journal.put_engine(rec)
        return rec

    def keepalive(self, engine_id: str, load: EngineLoad, now: float) -> EngineRecord:
        rec = self.get(engine_id)
        check_load(load, self.limits)
        rec.load = load
        rec.last_seen = now
        self.unheard.discard(engine_id)
        self.fleet.update(rec)
        self._journal.put_engine(rec)
        return rec

    def drop(self, engine_id: str) -> None:
        self.records.pop(engine_id, None)
        self.fleet.remove(engine_id)
        self._logs.pop(engine_id, None)
        self.unheard.discard(engine_id)
        self._journal.drop_engine(engine_id)

    def due(self, now: float) -> list[str]:
        """The engines whose keep-alive stopped ``engine_ttl_s`` ago or more."""
        deadline = now - self.limits.engine_ttl_s
        return [e for e, rec in self.records.items() if rec.last_seen <= deadline]

    def learn_bandwidth(self, engine_id: str, nbytes: int, duration_s: float) -> None:
        """A completed pull out of the engine: its bytes/s, folded into an EWMA (placement's transfer estimate)."""
        if nbytes > 0 and duration_s > 0:
            source = self.records[engine_id]
            sample = nbytes / duration_s
            old = source.learned_bandwidth
            source.learned_bandwidth = sample if old == 0 else 0.7 * old + 0.3 * sample
            self._journal.put_engine(source)

    def issue(self, engine_id: str, lease_id: str, block_ids: tuple[int, ...], reason: EvictionReason, *,
              tier: Tier = Tier.POOL, demote_to: tuple[int, ...] = (), promote_pin: str = "",
              promote_within_s: float = 0.0) -> EvictionCommand:
        """The engine's next command: numbered, logged, and journaled for the shell to persist and deliver."""
        rec = self.records[engine_id]
        rec.eviction_seq += 1
        cmd = EvictionCommand(seq=rec.eviction_seq, engine_id=engine_id, lease_id=lease_id,
                              block_ids=block_ids, reason=reason, tier=tier, demote_to=demote_to,
                              promote_pin=promote_pin, promote_within_s=promote_within_s)
        self._logs[engine_id].append(cmd)
        self._journal.command(cmd)
        self._journal.put_engine(rec)
        return cmd

    def commands_after(self, engine_id: str, after_seq: int, durable_seq: int | None,
                       live_lease_ids: Callable[[], Sequence[str]]) -> list[EvictionCommand]:
        """Commands an engine has not applied yet; a RESYNC listing ``live_lease_ids()`` when the log no longer
        covers the gap.

        ``durable_seq``: the engine's last command whose change the store holds (None: no durable store). A command
        past it is withheld: the engine would free blocks that a new leader, loading the store, still offers.
        While any is pending, no RESYNC is sent either (its live leases would be this state's, not the store's);
        the shell wakes the stream once the write lands."""
        rec = self.get(engine_id)
        log = self._logs[engine_id]
        last = rec.eviction_seq
        pending = durable_seq is not None and durable_seq < last
        if after_seq == last:
            return []
        if after_seq > last or not log or after_seq < log[0].seq - 1:
            if pending:
                return []
            return [EvictionCommand(seq=last, engine_id=engine_id, lease_id="", block_ids=(),
                                    reason=EvictionReason.RESYNC, live_lease_ids=tuple(live_lease_ids()))]
        upto = last if durable_seq is None else min(last, durable_seq)
        return [cmd for cmd in log if after_seq < cmd.seq <= upto]
