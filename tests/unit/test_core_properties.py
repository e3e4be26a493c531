"""Hypothesis properties of the broker's pure core: pins, budgets, matching, victims, the eviction log."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvloop.broker.core import (
    BlockIndex,
    BrokerState,
    CostAwarePolicy,
    Decision,
    EngineInfo,
    EngineLoad,
    EvictionCommand,
    EvictionPolicy,
    EvictionReason,
    Lease,
    Limits,
    LruPolicy,
    Pin,
    PlaceInput,
    PlacementPolicy,
    Role,
    choose_victims,
)
from kvloop.shared.errors import FailedPrecondition, NotFound, ResourceExhausted
from kvloop.shared.hashing import ExtraKeys, block_keys, common_prefix_blocks

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXTRA = ExtraKeys("prop-fp")
POLICY_FACTORIES: list[Callable[[], EvictionPolicy]] = [LruPolicy, lambda: CostAwarePolicy(recency_half_life_s=5.0)]


@cache
def chain(path: tuple[int, ...]) -> tuple[bytes, ...]:
    """Chained keys of a token path, one token per block: equal prefixes give equal keys."""
    return tuple(block_keys(list(path), 1, EXTRA))


def counter_ids(prefix: str = "id") -> Callable[[], str]:
    counter = itertools.count(1)
    return lambda: f"{prefix}{next(counter):04d}"


def make_lease(lease_id: str, keys: tuple[bytes, ...], block_ids: tuple[int, ...] = (), *, engine: str = "e0",
               session: str = "", last_used: float = 0.0, pending: EvictionReason | None = None) -> Lease:
    return Lease(lease_id=lease_id, engine_id=engine, session_id=session, keys=keys,
                 block_ids=block_ids or tuple(range(len(keys))), num_tokens=len(keys), ttl_s=60.0,
                 expires_at=last_used + 60.0, last_used=last_used, created_at=last_used, pending=pending)


# =====================================================================================================
# The state machine under random operations
# =====================================================================================================

ROLES = (Role.BOTH, Role.DECODE, Role.PREFILL)
ENGINE_TTL = 25.0
LOG_SIZE = 4

ids_modes = st.one_of(
    st.just(("shared",)),  # one physical block per (engine, key): vLLM's prefix cache
    st.just(("fresh",)),  # never shared
    st.tuples(st.just("pool"), st.permutations(range(6))),  # arbitrary overlaps, even across contents
)
publish_op = st.tuples(st.just("publish"), st.integers(0, 2), st.lists(st.integers(0, 1), min_size=1, max_size=4),
                       st.integers(0, 2), ids_modes, st.sampled_from([0.0, 2.0, 5.0, 20.0]))
pin_op = st.tuples(st.just("pin"), st.integers(0, 2), st.integers(0, 99), st.integers(0, 99),
                   st.sampled_from([0.0, 1.0, 4.0, 30.0]))
complete_op = st.tuples(st.just("complete"), st.integers(0, 99), st.booleans())
tick_op = st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 2.0, 5.0, 12.0]))
pressure_op = st.tuples(st.just("pressure"), st.integers(0, 2), st.integers(0, 4))
keepalive_op = st.tuples(st.just("keepalive"), st.integers(0, 2))
release_op = st.tuples(st.just("release"), st.integers(0, 99))
renew_op = st.tuples(st.just("renew"), st.integers(0, 99), st.sampled_from([0.0, 3.0, 30.0]))
register_op = st.tuples(st.just("register"), st.integers(0, 2), st.booleans())
OP_WEIGHTS = [(publish_op, 8), (pin_op, 4), (complete_op, 3), (tick_op, 2), (pressure_op, 1), (keepalive_op, 2),
              (release_op, 1), (renew_op, 1), (register_op, 1)]
operations = st.lists(
    st.sampled_from([op for op, weight in OP_WEIGHTS for _ in range(weight)]).flatmap(lambda op: op),
    min_size=20,
    max_size=60,
)

ALLOWED_REASONS = {
    "publish": {EvictionReason.SUPERSEDED, EvictionReason.BUDGET},
    "pressure": {EvictionReason.MEMORY_PRESSURE},
    "tick": {EvictionReason.TTL_EXPIRED},
}


def lease_snapshot(lease: Lease) -> tuple[Any, ...]:
    return (lease.engine_id, lease.session_id, lease.keys, lease.block_ids, lease.num_tokens, lease.ttl_s,
            lease.expires_at, lease.last_used, frozenset(lease.pin_ids), lease.pending)


def state_snapshot(state: BrokerState) -> tuple[Any, ...]:
    return (
        {lid: lease_snapshot(lease) for lid, lease in state.leases.items()},
        dict(state.pins),
        {e: (r.info, r.last_seen, r.eviction_seq, r.load, r.learned_bandwidth) for e, r in state.engines.items()},
        {e: state.retained_blocks(e) for e in state.engines},
    )


class Harness:
    """Drives a BrokerState and keeps an independent model of pins, commands and sequence numbers."""

    def __init__(self, budgets: list[int], policy: EvictionPolicy) -> None:
        self.now = 0.0
        self.n = len(budgets)
        self.state = BrokerState(
            policy,
            limits=Limits(engine_ttl_s=ENGINE_TTL, eviction_log_size=LOG_SIZE, max_pin_timeout_s=60.0),
            new_id=counter_ids(),
        )
        self.budgets = budgets
        self.incarnations = [0] * self.n
        self.pins: dict[str, Pin] = {}
        self.last_seq: dict[str, int] = {}
        self.logs: dict[str, list[EvictionCommand]] = {}
        self.commanded: set[str] = set()
        self.block_alloc: dict[tuple[str, bytes], int] = {}
        self.fresh = itertools.count(10_000)
        for i in range(self.n):
            self.register(i)
        self.state.take_changes()

    def engine_id(self, i: int) -> str:
        return f"e{i % self.n}"

    def info(self, i: int) -> EngineInfo:
        i %= self.n
        return EngineInfo(f"e{i}", ROLES[i], 1, "fp", self.budgets[i], incarnation=f"inc{self.incarnations[i]}")

    def register(self, i: int) -> None:
        eid = self.engine_id(i)
        old = self.state.engines.get(eid)
        rec, live = self.state.register(self.info(i), self.now)
        if rec is not old:
            assert live == []
            self.logs[eid] = []
            self.last_seq[eid] = rec.eviction_seq
            if old is not None:
                assert rec.eviction_seq == old.eviction_seq  # a restart keeps the sequence going
        else:
            assert live == self.state.engine_lease_ids(eid)

    def pick(self, items: list[str], k: int) -> str | None:
        return sorted(items)[k % len(items)] if items else None

    def block_ids(self, eid: str, keys: tuple[bytes, ...], mode: tuple[Any, ...]) -> tuple[int, ...]:
        if mode[0] == "shared":
            return tuple(self.block_alloc.setdefault((eid, k), len(self.block_alloc) + 100) for k in keys)
        if mode[0] == "fresh":
            return tuple(next(self.fresh) for _ in keys)
        return tuple(mode[1][: len(keys)])

    # ------------------------------------------------------------------ one operation
    def step(self, op: tuple[Any, ...]) -> None:
        st_ = self.state
        kind = op[0]
        leases_before = {lid: lease_snapshot(lease) for lid, lease in st_.leases.items()}
        lease_engine = {lid: s[0] for lid, s in leases_before.items()}
        pending_before = {lid: s[9] for lid, s in leases_before.items() if s[9] is not None}
        recs_before = dict(st_.engines)
        released_without_command: str | None = None

        if kind == "publish":
            _, ei, path, session, mode, ttl = op
            self.publish(self.engine_id(ei), chain(tuple(path)), f"s{session}", mode, ttl)
        elif kind == "pin":
            _, ri, lk, nk, timeout = op
            reader, lid = self.engine_id(ri), self.pick(list(st_.leases), lk)
            if lid is not None:
                self.pin(reader, lid, nk, timeout)
        elif kind == "complete":
            _, pk, success = op
            pid = self.pick(list(self.pins), pk)
            if pid is not None:
                pin = self.pins.pop(pid)
                lease = st_.leases[pin.lease_id]
                was_pending = lease.pending
                out = st_.complete(pid, success, 1_000_000, 0.01, self.now)
                if success and was_pending is None:
                    assert out is lease and lease.expires_at == self.now + lease.ttl_s
                    assert lease.last_used == self.now
        elif kind == "tick":
            self.now += op[1]
            st_.tick(self.now)
            for pid in [p for p, pin in self.pins.items() if pin.expires_at <= self.now]:
                del self.pins[pid]
        elif kind == "pressure":
            _, ei, free = op
            self.keepalive(self.engine_id(ei), EngineLoad(memory_pressure=True, pressure_free_blocks=free))
        elif kind == "keepalive":
            self.keepalive(self.engine_id(op[1]), EngineLoad(running_requests=1))
        elif kind == "release":
            lid = self.pick(list(st_.leases), op[1])
            if lid is not None:
                pinned = st_.leases[lid].pinned
                deferred = st_.release(lid, self.now)
                assert deferred == pinned
                if deferred:
                    assert st_.leases[lid].pending is not None
                    assert st_.leases[lid].pending == (pending_before.get(lid) or EvictionReason.RELEASED)
                else:
                    assert lid not in st_.leases
                    released_without_command = lid
        elif kind == "renew":
            _, lk, ttl = op
            lid = self.pick(list(st_.leases), lk)
            if lid is not None:
                lease = st_.leases[lid]
                if lease.pending is not None:
                    with pytest.raises(FailedPrecondition) as exc:
                        st_.renew(lid, ttl, self.now)
                    assert exc.value.field == "lease_id"
                else:
                    st_.renew(lid, ttl, self.now)
                    assert lease.expires_at == self.now + lease.ttl_s and lease.last_used == self.now
        elif kind == "register":
            _, ei, restart = op
            if restart:
                self.incarnations[ei % self.n] += 1
            self.register(ei)
        else:  # pragma: no cover
            raise AssertionError(kind)

        # Engines that went away in this operation (expired, or replaced by a new incarnation).
        dropped = {e for e, rec in recs_before.items() if st_.engines.get(e) is not rec}
        for pid in [p for p, pin in self.pins.items()
                    if pin.reader_engine_id in dropped or lease_engine.get(pin.lease_id) in dropped]:
            del self.pins[pid]
        self.check_commands(kind, st_.take_changes().commands, leases_before, pending_before, dropped)
        for e in dropped - set(st_.engines):
            del self.logs[e]
        self.check_gone(leases_before, dropped, released_without_command)
        self.check_invariants(after_tick=kind == "tick")

    def publish(self, eid: str, keys: tuple[bytes, ...], session: str, mode: tuple[Any, ...], ttl: float) -> None:
        st_ = self.state
        if eid not in st_.engines:
            with pytest.raises(NotFound) as nf:
                st_.publish(eid, session, keys, (0,) * len(keys), len(keys), ttl, self.now)
            assert nf.value.field == "engine_id"
            return
        ids = self.block_ids(eid, keys, mode)
        budget = st_.engines[eid].info.retention_budget_blocks
        # Whatever cannot go (pinned or already pending leases) plus the new blocks: the least the engine
        # can hold after this publication. It fits the budget exactly when the publication must succeed.
        floor = set(ids)
        for lease in st_.leases.values():
            if lease.engine_id == eid and (lease.pinned or lease.pending is not None):
                floor |= set(lease.block_ids)
        prefix_leases = [
            lease for lease in st_.leases.values()
            if lease.engine_id == eid and lease.pending is None and keys[: len(lease.keys)] == lease.keys
        ]
        before = state_snapshot(st_)
        if len(floor) > budget:
            event("publish refused: budget held by pinned leases")
            with pytest.raises(ResourceExhausted) as exc:
                st_.publish(eid, session, keys, ids, len(keys), ttl, self.now)
            assert exc.value.field == "block_ids"
            assert state_snapshot(st_) == before
            assert not st_.take_changes()
            return
        lease, commands = st_.publish(eid, session, keys, ids, len(keys), ttl, self.now)
        assert st_.leases[lease.lease_id] is lease
        assert (lease.keys, lease.block_ids, lease.session_id) == (keys, ids, session)
        assert lease.expires_at == self.now + (ttl or st_.limits.default_ttl_s)
        assert st_.retained_blocks(eid) <= budget
        assert all(c.engine_id == eid for c in commands)
        for old in prefix_leases:  # a lease this one extends is superseded, or marked so while pinned
            if old.pinned:
                assert old.lease_id in st_.leases and old.pending is EvictionReason.SUPERSEDED
            else:
                assert old.lease_id not in st_.leases
                assert any(c.lease_id == old.lease_id and c.reason is EvictionReason.SUPERSEDED for c in commands)
        assert all(c.reason is EvictionReason.BUDGET for c in commands
                   if c.lease_id not in {o.lease_id for o in prefix_leases})

    def pin(self, reader: str, lid: str, nk: int, timeout: float) -> None:
        st_ = self.state
        lease = st_.leases[lid]
        if reader not in st_.engines:
            with pytest.raises(NotFound) as nf:
                st_.pin(reader, lid, 1, timeout, self.now)
            assert nf.value.field == "reader_engine_id"
            return
        if lease.pending is not None:
            with pytest.raises(FailedPrecondition) as fp:
                st_.pin(reader, lid, 1, timeout, self.now)
            assert fp.value.field == "lease_id"
            return
        num = 1 + nk % len(lease.block_ids)
        pin = st_.pin(reader, lid, num, timeout, self.now)
        assert pin.expires_at == self.now + (timeout or st_.limits.default_pin_timeout_s)
        assert pin.pin_id in lease.pin_ids and st_.pins[pin.pin_id] == pin
        self.pins[pin.pin_id] = pin

    def keepalive(self, eid: str, load: EngineLoad) -> None:
        if eid not in self.state.engines:
            with pytest.raises(NotFound):
                self.state.keepalive(eid, load, self.now)
            return
        pinned_blocks = {b for lease in self.state.leases.values() if lease.engine_id == eid and lease.pinned
                         for b in lease.block_ids}
        retained = self.state.retained_blocks(eid)
        self.state.keepalive(eid, load, self.now)
        after = self.state.retained_blocks(eid)
        if load.memory_pressure:
            need = load.pressure_free_blocks or max(1, retained // 10)
            # Frees what it was asked to, or else everything that no pinned lease holds.
            assert retained - after >= need or after == len(pinned_blocks)
        else:
            assert after == retained

    # ------------------------------------------------------------------ checks
    def check_commands(self, kind: str, commands: list[EvictionCommand], leases_before: dict[str, Any],
                       pending_before: dict[str, EvictionReason], dropped: set[str]) -> None:
        st_ = self.state
        live_pinned = {pin.lease_id for pin in self.pins.values()}
        for cmd in commands:
            assert cmd.seq == self.last_seq[cmd.engine_id] + 1, "per-engine seqs increase by exactly one"
            self.last_seq[cmd.engine_id] = cmd.seq
            self.logs[cmd.engine_id].append(cmd)
            assert cmd.lease_id in leases_before and cmd.lease_id not in st_.leases
            assert cmd.lease_id not in self.commanded, "one eviction command per lease"
            self.commanded.add(cmd.lease_id)
            snap = leases_before[cmd.lease_id]
            assert (cmd.engine_id, cmd.block_ids) == (snap[0], snap[3])
            assert cmd.lease_id not in live_pinned, "never evict a pinned lease"
            event(f"command {cmd.reason.value}{' (deferred)' if cmd.lease_id in pending_before else ''}")
            if cmd.lease_id in pending_before:
                assert cmd.reason is pending_before[cmd.lease_id], "a deferred eviction keeps its reason"
            else:
                assert cmd.reason in ALLOWED_REASONS.get(kind, set()), (kind, cmd.reason)
        for eid, rec in st_.engines.items():
            assert rec.eviction_seq == self.last_seq[eid]
        for eid in dropped & set(st_.engines):
            assert st_.engines[eid].eviction_seq == self.last_seq[eid]

    def check_gone(self, leases_before: dict[str, Any], dropped: set[str], released: str | None) -> None:
        for lid, snap in leases_before.items():
            if lid in self.state.leases:
                if snap[9] is not None:  # a deferred eviction is never forgotten or replaced
                    assert self.state.leases[lid].pending is snap[9]
                continue
            assert lid in self.commanded or lid == released or snap[0] in dropped, f"{lid} vanished silently"

    def check_invariants(self, *, after_tick: bool) -> None:
        st_ = self.state
        assert set(st_.pins) == set(self.pins)
        for pid, pin in self.pins.items():
            assert pin.lease_id in st_.leases, "a pinned lease is never evicted or expired"
            assert pid in st_.leases[pin.lease_id].pin_ids
        for lid, lease in st_.leases.items():
            assert lease.pin_ids == {p for p, pin in self.pins.items() if pin.lease_id == lid}
            assert lease.pending is None or lease.pinned, "pending only while pinned"
            assert lease.engine_id in st_.engines
            if after_tick:
                assert lease.expires_at > self.now or lease.pending is not None
        for eid, rec in st_.engines.items():
            i = int(eid[1:])
            held = {b for lease in st_.leases.values() if lease.engine_id == eid for b in lease.block_ids}
            assert st_.retained_blocks(eid) == len(held)
            assert len(held) <= rec.info.retention_budget_blocks == self.budgets[i]
            assert st_.engine_lease_ids(eid) == sorted(lid for lid, x in st_.leases.items() if x.engine_id == eid)
            if after_tick:
                assert rec.last_seen > self.now - ENGINE_TTL
            self.check_commands_after(eid)

    def check_commands_after(self, eid: str) -> None:
        st_ = self.state
        last = st_.engines[eid].eviction_seq
        log = self.logs[eid][-LOG_SIZE:]
        first = log[0].seq if log else last + 1
        probes = {-1, 0, 1, first - 2, first - 1, first, last - 1, last, last + 1, last + 2}
        for k in sorted(p for p in probes if p >= -1):
            got = st_.commands_after(eid, k)
            if k == last:
                assert got == []
            elif log and first - 1 <= k < last:
                assert got == [c for c in log if c.seq > k]
                assert [c.seq for c in got] == list(range(k + 1, last + 1))
            else:
                assert len(got) == 1
                (resync,) = got
                assert resync.reason is EvictionReason.RESYNC and resync.seq == last
                assert resync.engine_id == eid and resync.lease_id == "" and resync.block_ids == ()
                assert resync.live_lease_ids == tuple(st_.engine_lease_ids(eid))


@PROPS
@given(
    budgets=st.lists(st.integers(3, 9), min_size=2, max_size=3),
    policy=st.sampled_from(POLICY_FACTORIES),
    ops=operations,
)
def test_random_operations_keep_every_invariant(
    budgets: list[int], policy: Callable[[], EvictionPolicy], ops: list[tuple[Any, ...]]
) -> None:
    """Pinned leases are never evicted or expired; deferred evictions are carried out with their reason
    once the pins end; budgets hold; a budget refusal changes nothing; eviction seqs run 1, 2, 3, ...;
    commands_after replays the log or resyncs."""
    h = Harness(budgets, policy())
    for op in ops:
        h.step(op)
    # End every pin: each deferred eviction then happens, with a command.
    pending = {lid: lease.pending for lid, lease in h.state.leases.items() if lease.pending is not None}
    for pid in sorted(h.pins):
        h.step(("complete", sorted(h.pins).index(pid), True))
    assert not h.state.pins
    for lid in pending:
        assert lid not in h.state.leases and lid in h.commanded
    assert all(lease.pending is None for lease in h.state.leases.values())


# =====================================================================================================
# The eviction log in isolation
# =====================================================================================================


@PROPS
@given(
    evictions=st.integers(0, 20),
    log_size=st.integers(1, 6),
    restart_at=st.one_of(st.none(), st.integers(0, 20)),
)
def test_commands_after_replays_exactly_or_resyncs(evictions: int, log_size: int, restart_at: int | None) -> None:
    state = BrokerState(LruPolicy(), limits=Limits(eviction_log_size=log_size), new_id=counter_ids())
    info = EngineInfo("e0", Role.DECODE, 1, "fp", retention_budget_blocks=1, incarnation="a")
    state.register(info, 0.0)
    issued: list[EvictionCommand] = []
    for i in range(evictions + 1):
        if restart_at == i:
            state.register(EngineInfo("e0", Role.DECODE, 1, "fp", 1, incarnation=f"b{i}"), float(i))
            issued = []
        _, cmds = state.publish("e0", "", chain((i,)), (i,), 1, 0.0, float(i))
        issued.extend(cmds)  # each publication evicts the previous lease (budget of one block)
    all_cmds = state.take_changes().commands
    assert [c.seq for c in all_cmds] == list(range(1, len(all_cmds) + 1))
    last = state.engines["e0"].eviction_seq
    assert last == len(all_cmds) == evictions - (1 if restart_at is not None and 0 < restart_at <= evictions else 0)
    log = issued[-log_size:]
    for k in range(-1, last + 3):
        got = state.commands_after("e0", k)
        if k == last:
            assert got == []
        elif log and log[0].seq - 1 <= k < last:
            assert got == [c for c in issued if c.seq > k]
        else:
            assert [c.reason for c in got] == [EvictionReason.RESYNC]
            assert got[0].seq == last and got[0].live_lease_ids == tuple(state.leases)
    with pytest.raises(NotFound) as nf:
        state.commands_after("nope", 0)
    assert nf.value.field == "engine_id"


# =====================================================================================================
# Matching: the index against brute force
# =====================================================================================================

KEY_ALPHABET = [bytes([i]) * 32 for i in range(4)]
key_lists = st.lists(st.sampled_from(KEY_ALPHABET), min_size=1, max_size=6).map(tuple)


@PROPS
@given(
    lease_keys=st.lists(key_lists, max_size=10),
    query=st.lists(st.sampled_from(KEY_ALPHABET), max_size=7),
    eligible_mask=st.lists(st.booleans(), min_size=10, max_size=10),
    remove_mask=st.lists(st.booleans(), min_size=10, max_size=10),
)
def test_index_longest_and_prefixes_match_brute_force(
    lease_keys: list[tuple[bytes, ...]], query: list[bytes], eligible_mask: list[bool], remove_mask: list[bool]
) -> None:
    """Arbitrary (even malformed, non-chained) key lists: ``longest`` returns exactly the eligible leases
    whose common prefix with the query is the longest (at least one block), with that length;
    ``prefixes_of`` exactly the eligible leases whose whole key list starts the query; removal leaves
    no trace."""
    leases = {f"L{i}": make_lease(f"L{i}", keys) for i, keys in enumerate(lease_keys)}
    index = BlockIndex()
    for lease in leases.values():
        index.add(lease)
    for i, lid in enumerate(list(leases)):
        if remove_mask[i]:
            index.remove(leases.pop(lid))
    eligible_ids = {f"L{i}" for i in range(10) if eligible_mask[i]}

    def eligible(lease: Lease) -> bool:
        return lease.lease_id in eligible_ids

    for only in (eligible, None):
        pool = {lid: lease for lid, lease in leases.items() if only is None or only(lease)}
        depth = {lid: common_prefix_blocks(lease.keys, query) for lid, lease in pool.items()}
        best = max(depth.values(), default=0)
        expected = {lid: best for lid, d in depth.items() if d == best and best >= 1}
        found = index.longest(query, leases, only) if only else index.longest(query, leases)
        assert len(found) == len({m.lease.lease_id for m in found}), "each lease at most once"
        assert {m.lease.lease_id: m.blocks for m in found} == expected
        prefixes = index.prefixes_of(query, leases, only) if only else index.prefixes_of(query, leases)
        assert sorted(x.lease_id for x in prefixes) == sorted(
            lid for lid, lease in pool.items() if tuple(query[: len(lease.keys)]) == lease.keys
        )
    assert len(index) == len({k for lease in leases.values() for k in lease.keys})


@PROPS
@given(
    paths=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), max_size=8),
    query=st.lists(st.integers(0, 2), max_size=10),
)
def test_index_longest_on_chained_keys(paths: list[list[int]], query: list[int]) -> None:
    """Real (chained) keys, deeper trees: the longest match equals the longest common token prefix."""
    leases = {f"L{i}": make_lease(f"L{i}", chain(tuple(p))) for i, p in enumerate(paths)}
    index = BlockIndex()
    for lease in leases.values():
        index.add(lease)
    keys = chain(tuple(query))
    found = {m.lease.lease_id: m.blocks for m in index.longest(keys, leases)}

    def common(p: list[int]) -> int:
        n = 0
        while n < min(len(p), len(query)) and p[n] == query[n]:
            n += 1
        return n

    best = max((common(p) for p in paths), default=0)
    assert found == {f"L{i}": best for i, p in enumerate(paths) if common(p) == best and best >= 1}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    publications=st.lists(
        st.tuples(st.integers(0, 4), st.lists(st.integers(0, 1), min_size=1, max_size=5), st.integers(0, 2)),
        max_size=12,
    ),
    pinned_releases=st.lists(st.integers(0, 99), max_size=3),
    query=st.lists(st.integers(0, 1), max_size=6),
    extra_tokens=st.integers(0, 3),
    fingerprint=st.sampled_from(["fpA", "fpB", "fpC"]),
    block_size=st.sampled_from([1, 2]),
    session=st.integers(0, 3),
)
def test_place_picks_the_longest_usable_prefix(
    publications: list[tuple[int, list[int], int]],
    pinned_releases: list[int],
    query: list[int],
    extra_tokens: int,
    fingerprint: str,
    block_size: int,
    session: int,
) -> None:
    """The plan's match is the longest common prefix over the leases of engines that fit the request
    (fingerprint and block size), ignoring leases being evicted, capped so that the block holding the
    last prompt token is recomputed; ties go to the request's session, then the most recently used."""
    engines = [
        EngineInfo("a-both", Role.BOTH, 1, "fpA", 1000),
        EngineInfo("a-decode", Role.DECODE, 1, "fpA", 1000),
        EngineInfo("a-prefill-bs2", Role.PREFILL, 2, "fpA", 1000),
        EngineInfo("a-decode-bs2", Role.DECODE, 2, "fpA", 1000),
        EngineInfo("b-both", Role.BOTH, 1, "fpB", 1000),
    ]
    state = BrokerState(LruPolicy(), PlacementPolicy(threshold_tokens=2), new_id=counter_ids())
    for e in engines:
        state.register(e, 0.0)
    for t, (ei, path, sess) in enumerate(publications):
        e = engines[ei]
        keys = chain(tuple(path))
        state.publish(e.engine_id, f"s{sess}", keys, tuple(range(len(keys))), len(keys) * e.block_size, 0.0,
                      float(t % 4))  # repeated times make last_used ties
    for k in pinned_releases:  # leases released while pinned are pending: placement must skip them
        lid = sorted(state.leases)[k % len(state.leases)] if state.leases else None
        if lid is not None and state.leases[lid].pending is None:
            state.pin(state.leases[lid].engine_id, lid, 1, 0.0, 5.0)
            state.release(lid, 5.0)

    keys = chain(tuple(query))
    num_tokens = len(keys) * block_size + extra_tokens
    request = PlaceInput(keys, num_tokens, fingerprint, block_size, session_id=f"s{session}")
    fit = {e.engine_id for e in engines if e.layout_fingerprint == fingerprint and e.block_size == block_size}
    if not any(e.role.can_prefill for e in engines if e.engine_id in fit) or not any(
        e.role.can_decode for e in engines if e.engine_id in fit
    ):
        with pytest.raises(FailedPrecondition) as exc:
            state.place(request, 10.0)
        assert exc.value.field == "layout_fingerprint"
        return
    plan = state.place(request, 10.0)

    cap = max(0, (num_tokens - 1) // block_size)
    usable = {
        lid: common_prefix_blocks(lease.keys, keys)
        for lid, lease in state.leases.items()
        if lease.engine_id in fit and lease.pending is None and common_prefix_blocks(lease.keys, keys) >= 1
    }
    best = max(usable.values(), default=0)
    # The block holding the last prompt token is never reused, so every lease holding the usable (capped)
    # prefix is as good as the longest one: all of them are candidates, tied on length.
    length = {lid: min(d, cap) for lid, d in usable.items()} if 0 < cap < best else dict(usable)
    # Candidates are the leases tied at the longest (capped) prefix.
    assert plan.candidates == sum(1 for d in length.values() if d == max(length.values(), default=0) and d > 0)
    assert plan.matched_blocks == min(best, cap)
    assert plan.matched_tokens == plan.matched_blocks * block_size
    assert plan.prompt_blocks == len(keys)
    # DECODE_LOCAL: the decode engine computes the prompt's tail itself, so it is the plan's prefill engine.
    assert plan.prefill.engine_id in fit and (plan.prefill.role.can_prefill or plan.decision is Decision.DECODE_LOCAL)
    assert plan.decode.engine_id in fit and plan.decode.role.can_decode
    if not usable:
        assert plan.source is None and plan.source_lease_id == "" and plan.reason == "no_match"
        return
    chosen = state.leases[plan.source_lease_id]
    assert plan.source is not None and plan.source.engine_id == chosen.engine_id

    def rank(lid: str) -> tuple[Any, ...]:
        # The longest (capped) prefix wins; ties go to the request's session, then the latest use.
        lease = state.leases[lid]
        return length[lid], lease.session_id == request.session_id, lease.last_used, lid

    assert plan.source_lease_id == max(usable, key=rank)
    assert chosen.keys[: plan.matched_blocks] == keys[: plan.matched_blocks]
    assert plan.source_block_ids == chosen.block_ids[: plan.matched_blocks]
    event(f"decision {plan.decision.value}")
    if plan.matched_blocks == 0 or plan.matched_tokens < state.placement_policy.threshold_tokens:
        # Nothing to reuse: recomputed, or (a decode engine of role both) computed whole in the decode request.
        whole_on_decode = plan.decision is Decision.DECODE_LOCAL and plan.decode.role is Role.BOTH
        assert plan.decision is Decision.RECOMPUTE or whole_on_decode
        assert plan.recompute_tokens == num_tokens
    elif plan.decision is Decision.PREFILL_LOCAL:
        assert plan.prefill.engine_id == chosen.engine_id and plan.reason == "local_prefix"
        assert plan.recompute_tokens == num_tokens - plan.matched_tokens == num_tokens - plan.local_tokens
    elif plan.decision is Decision.DECODE_LOCAL:
        assert plan.prefill.engine_id == plan.decode.engine_id == chosen.engine_id
        # decode_engine_computes: the tail was vetoed, and no other engine could take it from a role-both engine.
        assert plan.decode_local_veto == "" and (plan.reason == "short_tail_on_decode" or (
            plan.reason == "decode_engine_computes" and plan.decode.role is Role.BOTH))
        assert plan.recompute_tokens == num_tokens - plan.matched_tokens == num_tokens - plan.local_tokens
    elif plan.decision is Decision.TRANSFER:
        assert plan.prefill.engine_id != chosen.engine_id and plan.reason == "transfer_cheaper"
        assert plan.cost.transfer_path_s <= plan.cost.recompute_path_s
        assert plan.recompute_tokens == num_tokens - plan.matched_tokens
    else:
        assert plan.reason == "recompute_cheaper" or (plan.reason == "decode_local_vetoed"
                                                      and plan.decode_local_veto != "")
        assert plan.recompute_tokens == num_tokens - plan.local_tokens


# =====================================================================================================
# Victims
# =====================================================================================================

block_sets = st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True), min_size=0, max_size=7)


@PROPS
@given(
    candidate_blocks=block_sets,
    other_blocks=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True), max_size=3),
    last_used=st.lists(st.integers(0, 5), min_size=7, max_size=7),
    need=st.integers(-1, 12),
    policy=st.sampled_from(POLICY_FACTORIES),
)
def test_choose_victims_frees_what_it_can(
    candidate_blocks: list[list[int]],
    other_blocks: list[list[int]],
    last_used: list[int],
    need: int,
    policy: Callable[[], EvictionPolicy],
) -> None:
    """Victims are distinct candidates and free at least ``need`` blocks whenever evicting all candidates
    could; otherwise everything that can be freed. Blocks also held by non-candidates (pinned leases)
    never count as freed."""
    candidates = [make_lease(f"c{i}", tuple(KEY_ALPHABET[:1]) * len(b), tuple(b), last_used=last_used[i])
                  for i, b in enumerate(candidate_blocks)]
    others = [make_lease(f"o{i}", tuple(KEY_ALPHABET[:1]) * len(b), tuple(b)) for i, b in enumerate(other_blocks)]
    refcounts = Counter(b for lease in candidates + others for b in set(lease.block_ids))
    holders_in_candidates = Counter(b for lease in candidates for b in set(lease.block_ids))
    freeable = {b for b, n in holders_in_candidates.items() if refcounts[b] == n}

    victims, freed = choose_victims(policy(), candidates, refcounts, need, 6.0)

    ids = [v.lease_id for v in victims]
    assert len(ids) == len(set(ids)), "no duplicates"
    assert set(ids) <= {c.lease_id for c in candidates}
    by_victims = Counter(b for v in victims for b in set(v.block_ids))
    actually_freed = {b for b, n in by_victims.items() if refcounts[b] == n}
    assert freed == len(actually_freed)
    assert refcounts == Counter(b for lease in candidates + others for b in set(lease.block_ids)), "not mutated"
    if need <= 0:
        assert victims == [] and freed == 0
    elif need <= len(freeable):
        assert freed >= need
    else:
        assert actually_freed == freeable


@PROPS
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    last_used=st.lists(st.integers(0, 100), min_size=8, max_size=8, unique=True),
    need=st.integers(1, 20),
)
def test_lru_evicts_the_shortest_oldest_first_run(sizes: list[int], last_used: list[int], need: int) -> None:
    """Without sharing, LRU takes leases oldest first and stops as soon as ``need`` is met."""
    blocks = itertools.count()
    candidates = [make_lease(f"c{i}", (KEY_ALPHABET[0],) * n, tuple(next(blocks) for _ in range(n)),
                             last_used=last_used[i]) for i, n in enumerate(sizes)]
    refcounts = Counter(b for lease in candidates for b in lease.block_ids)
    victims, freed = choose_victims(LruPolicy(), candidates, refcounts, need, 200.0)
    order = sorted(candidates, key=lambda lease: lease.last_used)
    total, expected = 0, []
    for lease in order:
        if total >= need:
            break
        expected.append(lease)
        total += len(lease.block_ids)
    assert victims == expected and freed == total


@PROPS
@given(
    candidate_blocks=block_sets,
    last_used=st.lists(st.integers(0, 50), min_size=7, max_size=7),
    now=st.integers(50, 400),
)
def test_policies_rank_every_candidate_once(candidate_blocks: list[list[int]], last_used: list[int], now: int) -> None:
    candidates = [make_lease(f"c{i}", (KEY_ALPHABET[0],) * len(b), tuple(b), last_used=last_used[i])
                  for i, b in enumerate(candidate_blocks)]
    refcounts = Counter(b for lease in candidates for b in set(lease.block_ids))
    for policy in (LruPolicy(), CostAwarePolicy()):
        ranked = policy.rank(candidates, refcounts, float(now))
        assert sorted(x.lease_id for x in ranked) == sorted(c.lease_id for c in candidates)
    lru = LruPolicy().rank(candidates, refcounts, float(now))
    assert [x.last_used for x in lru] == sorted(x.last_used for x in candidates)
    cost = CostAwarePolicy()
    values = [cost.value_per_freed_block(x, refcounts, float(now)) for x in cost.rank(candidates, refcounts, now)]
    assert values == sorted(values)

