"""Example-based tests of every BrokerState operation, its validation errors and the placement decisions."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from kvloop.broker.core import (
    Addresses,
    BrokerState,
    CostAwarePolicy,
    Decision,
    EngineInfo,
    EngineLoad,
    EvictionPolicy,
    EvictionReason,
    Lease,
    Limits,
    LruPolicy,
    PlaceInput,
    PlacementPolicy,
    Plan,
    Role,
    make_policy,
)
from kvloop.shared.errors import FailedPrecondition, InvalidArgument, KvloopError, NotFound, ResourceExhausted, Status
from kvloop.shared.hashing import ExtraKeys, block_keys

FP = "fp-test"
BS = 16
EXTRA = ExtraKeys(FP)


def counter_ids() -> Callable[[], str]:
    counter = itertools.count(1)
    return lambda: f"id{next(counter)}"


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def keys_of(tokens: Sequence[int], bs: int = BS) -> tuple[bytes, ...]:
    return tuple(block_keys(list(tokens), bs, EXTRA))


def info(eid: str, role: Role = Role.BOTH, budget: int = 1000, *, fp: str = FP, bs: int = BS,
         incarnation: str = "inc1", addresses: Addresses | None = None, model: str = "") -> EngineInfo:
    return EngineInfo(eid, role, bs, fp, budget, addresses or Addresses(grpc=f"{eid}:1"), incarnation, model)


class Cluster:
    """A BrokerState with deterministic ids and engine block ids that follow vLLM's prefix cache: one
    physical block per (engine, block key), so leases with a common prefix share its blocks."""

    def __init__(self, *engines: EngineInfo, policy: EvictionPolicy | None = None,
                 placement: PlacementPolicy | None = None, limits: Limits | None = None) -> None:
        self.state = BrokerState(policy or LruPolicy(), placement, limits, new_id=counter_ids())
        self._alloc: dict[tuple[str, bytes], int] = {}
        for e in engines:
            self.state.register(e, 0.0)
        self.state.take_changes()

    def ids(self, eid: str, keys: Sequence[bytes]) -> tuple[int, ...]:
        return tuple(self._alloc.setdefault((eid, k), len(self._alloc)) for k in keys)

    def publish(self, eid: str, tokens: Sequence[int], *, session: str = "", now: float = 0.0,
                ttl: float = 0.0) -> tuple[Lease, list[Any]]:
        keys = keys_of(tokens)
        return self.state.publish(eid, session, keys, self.ids(eid, keys), len(tokens), ttl, now)

    def place(self, tokens: Sequence[int], *, session: str = "", fp: str = FP, bs: int = BS,
              now: float = 100.0) -> Plan:
        return self.state.place(PlaceInput(keys_of(tokens, bs), len(tokens), fp, bs, session), now)

    def load(self, eid: str, now: float = 0.0, **fields: Any) -> None:
        self.state.keepalive(eid, EngineLoad(**fields), now)


def snapshot(state: BrokerState) -> tuple[Any, ...]:
    return (
        {lid: (x.keys, x.block_ids, x.expires_at, x.last_used, frozenset(x.pin_ids), x.pending)
         for lid, x in state.leases.items()},
        dict(state.pins),
        {e: (r.info, r.last_seen, r.eviction_seq) for e, r in state.engines.items()},
        {e: state.retained_blocks(e) for e in state.engines},
    )


def raises(cls: type[KvloopError], field: str, fn: Callable[[], object]) -> KvloopError:
    with pytest.raises(cls) as exc:
        fn()
    assert type(exc.value) is cls
    assert exc.value.field == field, exc.value.message
    assert exc.value.message.startswith(field), exc.value.message
    return exc.value


# =====================================================================================================
# Engines
# =====================================================================================================


def test_register_new_engine() -> None:
    c = Cluster()
    rec, live = c.state.register(info("e1", Role.DECODE), 3.0)
    assert live == [] and rec.registered_at == rec.last_seen == 3.0 and rec.eviction_seq == 0
    assert c.state.engines["e1"] is rec
    assert c.state.take_changes().engines == {"e1": rec}
    assert c.state.retained_blocks("e1") == 0


def test_reregister_same_incarnation_is_idempotent() -> None:
    c = Cluster(info("e1"))
    lease, _ = c.publish("e1", toks(32))
    rec = c.state.engines["e1"]
    moved = info("e1", budget=500, addresses=Addresses(grpc="elsewhere:2"))
    again, live = c.state.register(moved, 5.0)
    assert again is rec and live == [lease.lease_id]
    assert rec.info.addresses.grpc == "elsewhere:2" and rec.info.retention_budget_blocks == 500
    assert rec.last_seen == 5.0 and rec.registered_at == 0.0
    assert c.state.leases[lease.lease_id] is lease
    assert c.state.register(moved, 6.0) == (rec, [lease.lease_id])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"fp": "other-fp"}, "engine.layout_fingerprint"),
        ({"bs": 32}, "engine.block_size"),
        ({"role": Role.DECODE}, "engine.role"),
    ],
)
def test_live_incarnation_cannot_change_layout_or_role(change: dict[str, Any], field: str) -> None:
    c = Cluster(info("e1", Role.BOTH))
    c.publish("e1", toks(32))
    before = snapshot(c.state)
    raises(FailedPrecondition, field, lambda: c.state.register(info("e1", **change), 1.0))
    assert snapshot(c.state) == before


def test_new_incarnation_drops_the_old_leases() -> None:
    c = Cluster(info("e1", budget=2), info("r", Role.PREFILL))
    c.publish("e1", toks(32, 0))  # 2 blocks
    c.publish("e1", toks(32, 100))  # evicts the first: seq 1
    kept = next(iter(c.state.leases))
    pin = c.state.pin("r", kept, 1, 0.0, 1.0)
    c.state.take_changes()
    rec, live = c.state.register(info("e1", budget=2, incarnation="inc2"), 2.0)
    assert live == [] and rec is c.state.engines["e1"] and rec.registered_at == 2.0
    assert not c.state.leases and not c.state.pins and c.state.retained_blocks("e1") == 0
    changes = c.state.take_changes()
    assert changes.commands == []  # the restarted process freed its blocks itself
    assert changes.leases == {kept: None} and changes.pins == {pin.pin_id: None}
    assert rec.eviction_seq == 1, "the sequence survives a restart"
    assert c.state.commands_after("e1", 1) == []
    (resync,) = c.state.commands_after("e1", 0)
    assert resync.reason is EvictionReason.RESYNC and resync.live_lease_ids == () and resync.seq == 1


def test_commands_past_the_durable_seq_are_withheld_and_so_is_a_resync() -> None:
    c = Cluster(info("e1", budget=2))
    first, _ = c.publish("e1", toks(32, 0))
    second, _ = c.publish("e1", toks(32, 100))  # evicts the first: seq 1
    c.publish("e1", toks(32, 200))  # evicts the second: seq 2
    assert [x.lease_id for x in c.state.commands_after("e1", 0, durable_seq=1)] == [first.lease_id]
    assert [x.lease_id for x in c.state.commands_after("e1", 0, durable_seq=2)] == [first.lease_id,
                                                                                   second.lease_id]
    assert c.state.commands_after("e1", 1, durable_seq=1) == []
    assert c.state.commands_after("e1", 5, durable_seq=1) == []  # a resync waits for the write too
    (resync,) = c.state.commands_after("e1", 5, durable_seq=2)
    assert resync.reason is EvictionReason.RESYNC


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"eid": ""}, "engine.engine_id"),
        ({"eid": "x" * 257}, "engine.engine_id"),
        ({"fp": ""}, "engine.layout_fingerprint"),
        ({"fp": "f" * 257}, "engine.layout_fingerprint"),
        ({"incarnation": "i" * 257}, "engine.incarnation"),
        ({"bs": 0}, "engine.block_size"),
        ({"bs": -16}, "engine.block_size"),
        ({"budget": -1}, "engine.retention_budget_blocks"),
        # The registration found by hand (issue 13): a block size, a budget and a fingerprint no engine has.
        ({"bs": 4294967295}, "engine.block_size"),
        ({"bs": 4097}, "engine.block_size"),
        ({"budget": 2**63}, "engine.retention_budget_blocks"),
        ({"fp": "f" * 65}, "engine.layout_fingerprint"),
        ({"fp": "fp with spaces"}, "engine.layout_fingerprint"),
        ({"fp": "fp\x00"}, "engine.layout_fingerprint"),
        ({"model": "m\n"}, "engine.model"),
        ({"addresses": Addresses(grpc="no-port")}, "engine.addresses.grpc"),
        ({"addresses": Addresses(grpc="host:70000")}, "engine.addresses.grpc"),
        ({"addresses": Addresses(nixl="host:0")}, "engine.addresses.nixl"),
        ({"addresses": Addresses(http="ftp://host:80")}, "engine.addresses.http"),
        ({"addresses": Addresses(http="http://host:99999")}, "engine.addresses.http"),
        ({"addresses": Addresses(http="http://host:80/a b")}, "engine.addresses.http"),
    ],
)
def test_register_validation(kwargs: dict[str, Any], field: str) -> None:
    c = Cluster()
    args = {"eid": "e1", **kwargs}
    raises(InvalidArgument, field, lambda: c.state.register(info(**args), 0.0))
    assert not c.state.engines


def test_register_accepts_limits_and_empty_incarnation() -> None:
    c = Cluster()
    c.state.register(info("x" * 256, incarnation="", budget=0), 0.0)
    assert "x" * 256 in c.state.engines
    addresses = Addresses(grpc="[::1]:50051", http="https://engine-0.ns.svc:8000/v1", nixl="10.0.0.7:5600")
    c.state.register(info("y", bs=4096, budget=1 << 24, fp="a" * 64, model="org/Model-7B:v1",
                          addresses=addresses), 0.0)
    assert c.state.engines["y"].info.model == "org/Model-7B:v1"


def test_deregister() -> None:
    c = Cluster(info("e1"), info("e2"))
    c.publish("e1", toks(32))
    c.publish("e1", toks(32, 500))
    c.publish("e2", toks(32))
    assert c.state.deregister("e1", 0.0) == 2
    assert set(c.state.engines) == {"e2"} and all(x.engine_id == "e2" for x in c.state.leases.values())
    assert c.state.take_changes().engines["e1"] is None
    raises(NotFound, "engine_id", lambda: c.state.deregister("e1", 0.0))


def test_keepalive_records_load_and_liveness() -> None:
    c = Cluster(info("e1"))
    load = EngineLoad(running_requests=2, waiting_requests=1, kv_usage=0.5, prefill_tokens_per_s=900.0)
    rec = c.state.keepalive("e1", load, 7.0)
    assert rec.load == load and rec.last_seen == 7.0 and load.score == 3.5
    assert c.state.take_changes().engines == {"e1": rec}


@pytest.mark.parametrize(
    ("load", "field"),
    [
        (EngineLoad(kv_usage=1.5), "load.kv_usage"),
        (EngineLoad(kv_usage=-0.1), "load.kv_usage"),
        (EngineLoad(kv_usage=float("nan")), "load.kv_usage"),
        (EngineLoad(prefill_tokens_per_s=-1.0), "load.prefill_tokens_per_s"),
        (EngineLoad(prefill_tokens_per_s=float("nan")), "load.prefill_tokens_per_s"),
        (EngineLoad(transfer_bytes_per_s=-1.0), "load.transfer_bytes_per_s"),
        (EngineLoad(transfer_bytes_per_s=float("inf")), "load.transfer_bytes_per_s"),
        (EngineLoad(prefill_tokens_per_s=1e12), "load.prefill_tokens_per_s"),
        (EngineLoad(transfer_bytes_per_s=1e15), "load.transfer_bytes_per_s"),
    ],
)
def test_keepalive_validation(load: EngineLoad, field: str) -> None:
    c = Cluster(info("e1"))
    raises(InvalidArgument, field, lambda: c.state.keepalive("e1", load, 1.0))
    assert c.state.engines["e1"].last_seen == 0.0
    raises(NotFound, "engine_id", lambda: c.state.keepalive("nope", EngineLoad(), 1.0))


def three_leases(c: Cluster) -> list[Lease]:
    """Disjoint two-block leases used at t = 1, 2, 3."""
    return [c.publish("e1", toks(32, 1000 * i), now=float(i))[0] for i in (1, 2, 3)]


def test_memory_pressure_evicts_least_recently_used_first() -> None:
    c = Cluster(info("e1"))
    a, b, d = three_leases(c)
    c.state.take_changes()
    c.load("e1", 4.0, memory_pressure=True, pressure_free_blocks=3)
    cmds = c.state.take_changes().commands
    assert [(x.lease_id, x.reason, x.seq) for x in cmds] == [
        (a.lease_id, EvictionReason.MEMORY_PRESSURE, 1),
        (b.lease_id, EvictionReason.MEMORY_PRESSURE, 2),
    ]
    assert cmds[0].block_ids == a.block_ids
    assert list(c.state.leases) == [d.lease_id] and c.state.retained_blocks("e1") == 2


def test_memory_pressure_without_a_count_frees_a_tenth_at_least_one() -> None:
    c = Cluster(info("e1"))
    a, _, _ = three_leases(c)
    c.load("e1", 4.0, memory_pressure=True)
    assert [x.lease_id for x in c.state.take_changes().commands] == [a.lease_id]
    assert c.state.retained_blocks("e1") == 4


def test_memory_pressure_never_touches_pinned_leases() -> None:
    c = Cluster(info("e1"))
    a, b, _ = three_leases(c)
    c.state.pin("e1", a.lease_id, 2, 0.0, 4.0)
    c.state.take_changes()
    c.load("e1", 4.0, memory_pressure=True, pressure_free_blocks=1)
    assert [x.lease_id for x in c.state.take_changes().commands] == [b.lease_id]
    assert a.lease_id in c.state.leases and a.pending is None
    # Asking for more than the unpinned leases hold frees them all, and still not the pinned one.
    c.load("e1", 5.0, memory_pressure=True, pressure_free_blocks=100)
    assert list(c.state.leases) == [a.lease_id]


def test_memory_pressure_cost_aware_keeps_the_long_context() -> None:
    long_tokens, short_tokens = toks(16 * BS), toks(BS, 10_000)
    lru, cost = Cluster(info("e1")), Cluster(info("e1"), policy=CostAwarePolicy())
    for c in (lru, cost):
        c.publish("e1", long_tokens, now=0.0)
        c.publish("e1", short_tokens, now=10.0)
        c.state.take_changes()
        c.load("e1", 11.0, memory_pressure=True, pressure_free_blocks=1)
    assert [x.block_ids for x in lru.state.take_changes().commands] == [lru.ids("e1", keys_of(long_tokens))]
    assert [x.block_ids for x in cost.state.take_changes().commands] == [cost.ids("e1", keys_of(short_tokens))]


# =====================================================================================================
# Leases
# =====================================================================================================


def test_publish_creates_a_lease() -> None:
    c = Cluster(info("e1"))
    tokens = toks(3 * BS + 5)
    lease, cmds = c.publish("e1", tokens, session="s", now=2.0)
    assert cmds == []
    assert lease.lease_id == "id1" and lease.engine_id == "e1" and lease.session_id == "s"
    assert lease.keys == keys_of(tokens) and len(lease.keys) == 3 and lease.num_tokens == 3 * BS + 5
    assert lease.ttl_s == 480.0 and lease.expires_at == 482.0
    assert lease.created_at == lease.last_used == 2.0 and not lease.pinned and lease.pending is None
    assert c.state.retained_blocks("e1") == 3 and c.state.engine_lease_ids("e1") == ["id1"]
    assert c.state.take_changes().leases == {"id1": lease}
    assert c.publish("e1", toks(BS, 900), ttl=30.0, now=1.0)[0].expires_at == 31.0


def test_publish_supersedes_the_same_engines_prefix_leases() -> None:
    c = Cluster(info("e1"), info("e2"))
    first, _ = c.publish("e1", toks(2 * BS), session="s")
    other_engine, _ = c.publish("e2", toks(2 * BS), session="s")
    diverging, _ = c.publish("e1", toks(BS) + toks(BS, 5000))
    longer, _ = c.publish("e1", toks(5 * BS), session="s", now=1.0)
    changes = c.state.take_changes()
    assert [(x.lease_id, x.reason, x.block_ids, x.seq) for x in changes.commands] == [
        (first.lease_id, EvictionReason.SUPERSEDED, first.block_ids, 1)
    ]
    assert set(c.state.leases) == {other_engine.lease_id, diverging.lease_id, longer.lease_id}
    assert changes.leases[first.lease_id] is None
    # Shared blocks count once: 5 blocks of the longer lease plus the diverging one's second block.
    assert c.state.retained_blocks("e1") == 6
    # A shorter prefix does not supersede the longer lease that holds it.
    shorter, cmds = c.publish("e1", toks(3 * BS), now=2.0)
    assert cmds == [] and longer.lease_id in c.state.leases and shorter.lease_id in c.state.leases
    assert c.state.retained_blocks("e1") == 6


def test_superseding_a_pinned_lease_is_deferred_until_the_pin_ends() -> None:
    c = Cluster(info("e1"), info("r", Role.PREFILL))
    first, _ = c.publish("e1", toks(2 * BS))
    pin = c.state.pin("r", first.lease_id, 2, 0.0, 1.0)
    _, cmds = c.publish("e1", toks(4 * BS), now=2.0)
    assert cmds == [] and first.pending is EvictionReason.SUPERSEDED and first.lease_id in c.state.leases
    c.state.take_changes()
    assert c.state.complete(pin.pin_id, True, 1000, 0.001, 3.0) is None
    (cmd,) = c.state.take_changes().commands
    assert (cmd.lease_id, cmd.reason, cmd.block_ids) == (first.lease_id, EvictionReason.SUPERSEDED, first.block_ids)
    assert first.lease_id not in c.state.leases


def test_budget_eviction_lru_versus_cost_aware() -> None:
    """Budget 18: a 12-block context L (used at 0), two sessions A and B sharing a 4-block system prompt
    (used at 5 and 6). A one-block publication at 7 needs one block. LRU drops all of L; the cost-aware
    policy drops A's own last block only: L is long and recent enough to keep, and the shared system
    prompt stays with B."""
    long_ctx = toks(12 * BS)
    system = toks(4 * BS, 1000)
    a, b, new = toks(BS, 2000), toks(BS, 3000), toks(BS, 4000)

    def run(policy: EvictionPolicy) -> tuple[Cluster, list[Any], dict[str, Lease]]:
        c = Cluster(info("e1", budget=18), policy=policy)
        held = {
            "L": c.publish("e1", long_ctx, session="l", now=0.0)[0],
            "A": c.publish("e1", system + a, session="a", now=5.0)[0],
            "B": c.publish("e1", system + b, session="b", now=6.0)[0],
        }
        assert c.state.retained_blocks("e1") == 18
        _, cmds = c.publish("e1", new, session="n", now=7.0)
        return c, cmds, held

    c, cmds, held = run(LruPolicy())
    assert [(x.lease_id, x.reason) for x in cmds] == [(held["L"].lease_id, EvictionReason.BUDGET)]
    assert c.state.retained_blocks("e1") == 7

    c, cmds, held = run(CostAwarePolicy())
    assert [(x.lease_id, x.reason) for x in cmds] == [(held["A"].lease_id, EvictionReason.BUDGET)]
    assert cmds[0].block_ids == held["A"].block_ids  # the command lists the lease's blocks ...
    assert c.state.retained_blocks("e1") == 18  # ... but only A's last block was freed
    assert {held["L"].lease_id, held["B"].lease_id} <= set(c.state.leases)
    plan = c.place(system + toks(BS, 7777), session="z")
    assert plan.source_lease_id == held["B"].lease_id and plan.matched_blocks == 4


def test_budget_refusal_changes_nothing() -> None:
    c = Cluster(info("e1", budget=4), info("r", Role.PREFILL))
    held, _ = c.publish("e1", toks(4 * BS))
    raises(ResourceExhausted, "block_ids", lambda: c.publish("e1", toks(5 * BS, 100)))
    pin = c.state.pin("r", held.lease_id, 4, 0.0, 1.0)
    c.state.take_changes()
    before = snapshot(c.state)
    err = raises(ResourceExhausted, "block_ids", lambda: c.publish("e1", toks(BS, 100), now=2.0))
    assert err.status is Status.RESOURCE_EXHAUSTED
    assert snapshot(c.state) == before and not c.state.take_changes()
    c.state.complete(pin.pin_id, True, 0, 0.0, 3.0)
    _, cmds = c.publish("e1", toks(BS, 100), now=4.0)
    assert [(x.lease_id, x.reason) for x in cmds] == [(held.lease_id, EvictionReason.BUDGET)]
    assert c.state.retained_blocks("e1") == 1


def test_budget_counts_blocks_freed_by_a_superseded_lease() -> None:
    c = Cluster(info("e1", budget=4))
    c.publish("e1", toks(3 * BS))
    # 4 blocks extending the first: the superseded lease's blocks are reused, nothing else is evicted.
    second, cmds = c.publish("e1", toks(4 * BS), now=1.0)
    assert [x.reason for x in cmds] == [EvictionReason.SUPERSEDED]
    assert c.state.retained_blocks("e1") == 4 and list(c.state.leases) == [second.lease_id]


def publish_args(**override: Any) -> dict[str, Any]:
    keys = keys_of(toks(2 * BS))
    args = {"engine_id": "e1", "session_id": "s", "keys": keys, "block_ids": (1, 2), "num_tokens": 2 * BS,
            "ttl_s": 0.0, "now": 0.0}
    args.update(override)
    return args


@pytest.mark.parametrize(
    ("override", "cls", "field"),
    [
        ({"engine_id": "nope"}, NotFound, "engine_id"),
        ({"session_id": "s" * 257}, InvalidArgument, "session_id"),
        ({"keys": (), "block_ids": (), "num_tokens": 0}, InvalidArgument, "block_keys"),
        ({"keys": keys_of(toks(3 * BS)), "block_ids": (1, 2, 3), "num_tokens": 3 * BS}, ResourceExhausted,
         "block_keys"),
        ({"keys": (b"short", keys_of(toks(2 * BS))[1])}, InvalidArgument, "block_keys"),
        ({"block_ids": (1,)}, InvalidArgument, "block_ids"),
        ({"block_ids": (1, 2, 3)}, InvalidArgument, "block_ids"),
        ({"block_ids": (-1, 2)}, InvalidArgument, "block_ids"),
        ({"block_ids": (2, 2)}, InvalidArgument, "block_ids"),
        ({"num_tokens": 2 * BS - 1}, InvalidArgument, "num_tokens"),
        ({"num_tokens": 3 * BS}, InvalidArgument, "num_tokens"),
        ({"ttl_s": 0.5}, InvalidArgument, "ttl_s"),
        ({"ttl_s": -5.0}, InvalidArgument, "ttl_s"),
        ({"ttl_s": 86400.5}, InvalidArgument, "ttl_s"),
    ],
)
def test_publish_validation(override: dict[str, Any], cls: type[KvloopError], field: str) -> None:
    c = Cluster(info("e1"), limits=Limits(max_block_keys=2))
    raises(cls, field, lambda: c.state.publish(**publish_args(**override)))
    assert not c.state.leases and not c.state.take_changes()


def test_publish_accepts_the_bounds() -> None:
    c = Cluster(info("e1"), limits=Limits(max_block_keys=2))
    lease, _ = c.state.publish(**publish_args(num_tokens=3 * BS - 1, ttl_s=1.0, session_id="s" * 256))
    assert lease.ttl_s == 1.0
    lease, _ = c.state.publish(**publish_args(block_ids=(0, 7), ttl_s=86400.0, session_id=""))
    assert lease.ttl_s == 86400.0 and lease.session_id == ""


def test_renew() -> None:
    c = Cluster(info("e1"))
    lease, _ = c.publish("e1", toks(BS), ttl=10.0)
    assert c.state.renew(lease.lease_id, 0.0, 5.0) is lease
    assert (lease.ttl_s, lease.expires_at, lease.last_used) == (10.0, 15.0, 5.0)
    c.state.renew(lease.lease_id, 30.0, 6.0)
    assert (lease.ttl_s, lease.expires_at, lease.last_used) == (30.0, 36.0, 6.0)
    assert c.state.take_changes().leases == {lease.lease_id: lease}
    raises(InvalidArgument, "ttl_s", lambda: c.state.renew(lease.lease_id, 0.1, 7.0))
    assert lease.expires_at == 36.0
    raises(NotFound, "lease_id", lambda: c.state.renew("nope", 0.0, 7.0))


def test_ttl_expiry_via_tick() -> None:
    c = Cluster(info("e1"), limits=Limits(engine_ttl_s=1000.0))
    lease, _ = c.publish("e1", toks(2 * BS), ttl=10.0)
    kept, _ = c.publish("e1", toks(BS, 500), ttl=10.0)
    c.state.renew(kept.lease_id, 0.0, 5.0)
    c.state.take_changes()
    c.state.tick(9.99)
    assert lease.lease_id in c.state.leases and not c.state.take_changes()
    c.state.tick(10.0)
    (cmd,) = c.state.take_changes().commands
    assert (cmd.lease_id, cmd.reason, cmd.block_ids) == (lease.lease_id, EvictionReason.TTL_EXPIRED, lease.block_ids)
    assert list(c.state.leases) == [kept.lease_id]
    c.state.tick(15.0)
    assert not c.state.leases


def test_release_unpinned_is_immediate_and_silent() -> None:
    c = Cluster(info("e1"))
    lease, _ = c.publish("e1", toks(2 * BS))
    c.state.take_changes()
    assert c.state.release(lease.lease_id, 1.0) is False
    assert not c.state.leases and c.state.retained_blocks("e1") == 0
    changes = c.state.take_changes()
    assert changes.commands == [] and changes.leases == {lease.lease_id: None}
    raises(NotFound, "lease_id", lambda: c.state.release(lease.lease_id, 2.0))


def test_release_while_pinned_is_deferred() -> None:
    c = Cluster(info("e1", Role.DECODE), info("p", Role.PREFILL))
    lease, _ = c.publish("e1", toks(8 * BS + 1), session="s")
    pin1 = c.state.pin("p", lease.lease_id, 8, 0.0, 1.0)
    pin2 = c.state.pin("p", lease.lease_id, 4, 0.0, 1.0)
    assert c.state.release(lease.lease_id, 2.0) is True
    assert lease.pending is EvictionReason.RELEASED and lease.lease_id in c.state.leases
    assert c.state.release(lease.lease_id, 2.5) is True  # again: still deferred, same reason
    raises(FailedPrecondition, "lease_id", lambda: c.state.renew(lease.lease_id, 0.0, 3.0))
    raises(FailedPrecondition, "lease_id", lambda: c.state.pin("p", lease.lease_id, 1, 0.0, 3.0))
    assert c.place(toks(8 * BS + 5)).reason == "no_match"  # being evicted: not offered
    c.state.take_changes()
    c.state.complete(pin1.pin_id, True, 1000, 0.1, 4.0)
    assert lease.lease_id in c.state.leases and not c.state.take_changes().commands
    assert c.state.complete(pin2.pin_id, False, 0, 0.0, 5.0) is None
    (cmd,) = c.state.take_changes().commands
    assert (cmd.lease_id, cmd.reason) == (lease.lease_id, EvictionReason.RELEASED)


# =====================================================================================================
# Pins
# =====================================================================================================


def test_pin_and_complete_renew_and_learn_bandwidth() -> None:
    c = Cluster(info("d", Role.DECODE), info("p", Role.PREFILL))
    lease, _ = c.publish("d", toks(4 * BS), ttl=10.0)
    c.state.take_changes()
    pin = c.state.pin("p", lease.lease_id, 3, 0.0, 5.0)
    assert (pin.lease_id, pin.reader_engine_id, pin.num_blocks, pin.expires_at) == (lease.lease_id, "p", 3, 15.0)
    assert lease.pin_ids == {pin.pin_id} and c.state.pins == {pin.pin_id: pin}
    assert c.state.hold_until(lease) == 15.0
    changes = c.state.take_changes()
    assert changes.pins == {pin.pin_id: pin} and changes.leases == {lease.lease_id: lease}
    assert c.state.complete(pin.pin_id, True, 1_000_000, 0.5, 8.0) is lease
    assert lease.expires_at == 18.0 and lease.last_used == 8.0 and not lease.pinned
    assert c.state.engines["d"].learned_bandwidth == 2_000_000
    assert c.state.take_changes().pins == {pin.pin_id: None}
    pin2 = c.state.pin("p", lease.lease_id, 1, 0.0, 9.0)
    c.state.complete(pin2.pin_id, True, 1_000_000, 0.1, 9.5)  # EWMA: 0.7 * old + 0.3 * sample
    assert c.state.engines["d"].learned_bandwidth == pytest.approx(0.7 * 2e6 + 0.3 * 1e7)
    raises(NotFound, "pin_id", lambda: c.state.complete(pin2.pin_id, True, 1, 1.0, 10.0))


def test_failed_or_empty_transfer_neither_renews_nor_learns() -> None:
    c = Cluster(info("d", Role.DECODE), info("p", Role.PREFILL))
    lease, _ = c.publish("d", toks(4 * BS), ttl=10.0)
    pin = c.state.pin("p", lease.lease_id, 2, 0.0, 1.0)
    assert c.state.complete(pin.pin_id, False, 1_000_000, 0.5, 8.0) is lease
    assert lease.expires_at == 10.0 and lease.last_used == 0.0
    assert c.state.engines["d"].learned_bandwidth == 0.0
    pin = c.state.pin("p", lease.lease_id, 2, 0.0, 8.0)
    c.state.complete(pin.pin_id, True, 0, 0.0, 9.0)  # renews (a turn used it) but nothing to learn from
    assert lease.expires_at == 19.0 and c.state.engines["d"].learned_bandwidth == 0.0


def test_pin_defers_expiry() -> None:
    c = Cluster(info("d", Role.DECODE), info("p", Role.PREFILL), limits=Limits(engine_ttl_s=1000.0))
    lease, _ = c.publish("d", toks(4 * BS + 1), ttl=10.0)
    pin = c.state.pin("p", lease.lease_id, 4, 60.0, 5.0)
    assert c.state.hold_until(lease) == 65.0
    c.state.take_changes()
    c.state.tick(20.0)
    assert c.state.leases[lease.lease_id] is lease and lease.pending is EvictionReason.TTL_EXPIRED
    assert not c.state.take_changes().commands
    assert c.place(toks(4 * BS + 1)).reason == "no_match"
    c.state.tick(30.0)  # still pinned: still held, the deferral is not repeated
    assert lease.pending is EvictionReason.TTL_EXPIRED and not c.state.take_changes().commands
    assert c.state.complete(pin.pin_id, True, 1_000_000, 0.5, 31.0) is None
    assert c.state.engines["d"].learned_bandwidth == 2_000_000  # the pull still teaches bandwidth
    (cmd,) = c.state.take_changes().commands
    assert (cmd.lease_id, cmd.reason) == (lease.lease_id, EvictionReason.TTL_EXPIRED)


def test_pin_defers_budget_and_pressure_eviction() -> None:
    c = Cluster(info("d", Role.DECODE, budget=4), info("p", Role.PREFILL))
    old, _ = c.publish("d", toks(2 * BS), now=0.0)
    young, _ = c.publish("d", toks(2 * BS, 500), now=1.0)
    c.state.pin("p", old.lease_id, 2, 0.0, 2.0)
    c.load("d", 3.0, memory_pressure=True, pressure_free_blocks=2)
    assert old.lease_id in c.state.leases and young.lease_id not in c.state.leases
    third, cmds = c.publish("d", toks(2 * BS, 900), now=4.0)
    assert cmds == [] and old.pending is None  # room was there: nothing evicted
    fourth, cmds = c.publish("d", toks(BS, 1300), now=5.0)  # the budget goes past the older, pinned lease
    assert [(x.lease_id, x.reason) for x in cmds] == [(third.lease_id, EvictionReason.BUDGET)]
    assert old.pending is None and c.state.retained_blocks("d") == 3
    c.state.pin("p", fourth.lease_id, 1, 0.0, 6.0)
    raises(ResourceExhausted, "block_ids", lambda: c.publish("d", toks(2 * BS, 1700), now=7.0))
    assert set(c.state.leases) == {old.lease_id, fourth.lease_id}


def test_pin_timeout() -> None:
    c = Cluster(info("d", Role.DECODE), info("p", Role.PREFILL), limits=Limits(engine_ttl_s=1000.0))
    lease, _ = c.publish("d", toks(2 * BS))
    pin = c.state.pin("p", lease.lease_id, 1, 5.0, 0.0)
    default_pin = c.state.pin("p", lease.lease_id, 1, 0.0, 0.0)
    assert default_pin.expires_at == 10.0
    assert c.state.release(lease.lease_id, 1.0) is True
    c.state.take_changes()
    c.state.tick(4.99)
    assert lease.pin_ids == {pin.pin_id, default_pin.pin_id}
    c.state.tick(5.0)
    assert lease.pin_ids == {default_pin.pin_id}
    changes = c.state.take_changes()
    assert changes.pins == {pin.pin_id: None} and changes.commands == []
    raises(NotFound, "pin_id", lambda: c.state.complete(pin.pin_id, True, 1, 1.0, 6.0))
    c.state.tick(10.0)  # the last pin times out: the deferred release is carried out
    (cmd,) = c.state.take_changes().commands
    assert (cmd.lease_id, cmd.reason) == (lease.lease_id, EvictionReason.RELEASED)
    assert not c.state.leases and not c.state.pins


@pytest.mark.parametrize(
    ("reader", "lease", "num_blocks", "timeout", "cls", "field"),
    [
        ("nope", "id1", 1, 0.0, NotFound, "reader_engine_id"),
        ("p", "nope", 1, 0.0, NotFound, "lease_id"),
        ("other-fp", "id1", 1, 0.0, FailedPrecondition, "reader_engine_id"),
        ("other-bs", "id1", 1, 0.0, FailedPrecondition, "reader_engine_id"),
        ("p", "id1", 0, 0.0, InvalidArgument, "num_blocks"),
        ("p", "id1", 3, 0.0, InvalidArgument, "num_blocks"),
        ("p", "id1", 1, 120.5, InvalidArgument, "timeout_s"),
        ("p", "id1", 1, -1.0, InvalidArgument, "timeout_s"),
    ],
)
def test_pin_validation(reader: str, lease: str, num_blocks: int, timeout: float, cls: type[KvloopError],
                        field: str) -> None:
    c = Cluster(info("d", Role.DECODE), info("p", Role.PREFILL), info("other-fp", Role.PREFILL, fp="x"),
                info("other-bs", Role.PREFILL, bs=32))
    held, _ = c.publish("d", toks(2 * BS))
    assert held.lease_id == "id1"
    raises(cls, field, lambda: c.state.pin(reader, lease, num_blocks, timeout, 1.0))
    assert not c.state.pins and not held.pinned
    assert c.state.pin("p", "id1", 2, 120.0, 1.0).expires_at == 121.0


def test_complete_validation() -> None:
    c = Cluster(info("d", Role.DECODE), info("p", Role.PREFILL))
    lease, _ = c.publish("d", toks(2 * BS))
    pin = c.state.pin("p", lease.lease_id, 1, 0.0, 0.0)
    raises(NotFound, "pin_id", lambda: c.state.complete("nope", True, 1, 1.0, 1.0))
    raises(InvalidArgument, "bytes", lambda: c.state.complete(pin.pin_id, True, -1, 1.0, 1.0))
    raises(InvalidArgument, "duration_s", lambda: c.state.complete(pin.pin_id, True, 1, -1.0, 1.0))
    assert pin.pin_id in c.state.pins and lease.pinned


# =====================================================================================================
# Engine expiry
# =====================================================================================================


def test_engine_expiry_drops_its_leases_and_its_pins() -> None:
    c = Cluster(info("d1", Role.DECODE), info("d2", Role.DECODE), info("p", Role.PREFILL),
                limits=Limits(engine_ttl_s=10.0))
    on_d1, _ = c.publish("d1", toks(2 * BS))
    on_d2, _ = c.publish("d2", toks(2 * BS, 500))
    c.state.pin("p", on_d1.lease_id, 1, 60.0, 1.0)  # pinned, yet the engine holding it is gone
    reader_pin = c.state.pin("p", on_d2.lease_id, 1, 60.0, 1.0)
    c.state.release(on_d2.lease_id, 2.0)  # deferred by p's pin
    c.load("d2", 5.0)
    c.load("p", 0.5)
    c.state.take_changes()
    c.state.tick(9.99)
    assert set(c.state.engines) == {"d1", "d2", "p"}
    c.state.tick(10.5)  # d1 (last seen 0) and p (last seen 0.5) expire; d2 was seen at 5
    assert set(c.state.engines) == {"d2"}
    changes = c.state.take_changes()
    assert changes.engines["d1"] is None and changes.engines["p"] is None
    assert on_d1.lease_id not in c.state.leases and not c.state.pins
    assert changes.pins[reader_pin.pin_id] is None
    # p's pin on d2's released lease ended with p: the deferred release went out to d2.
    assert [(x.engine_id, x.lease_id, x.reason) for x in changes.commands] == [
        ("d2", on_d2.lease_id, EvictionReason.RELEASED)
    ]
    assert not c.state.leases
    raises(NotFound, "engine_id", lambda: c.state.publish("d1", "", keys_of(toks(BS)), (1,), BS, 0.0, 11.0))


# =====================================================================================================
# Placement
# =====================================================================================================


STRICT_PD = PlacementPolicy(decode_local=False)
"""Strict disaggregation: the P/D paths alone (the decode-local tests below turn DECODE_LOCAL on)."""


def pd_cluster(placement: PlacementPolicy | None = None, **kw: Any) -> Cluster:
    """One prefill engine and two decode engines, all idle; strict P/D unless ``placement`` says otherwise."""
    return Cluster(info("p", Role.PREFILL), info("d1", Role.DECODE), info("d2", Role.DECODE),
                   placement=placement or STRICT_PD, **kw)


def test_place_no_match() -> None:
    c = pd_cluster()
    plan = c.place(toks(100))
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, "no_match")
    assert plan.prefill.engine_id == "p" and plan.decode.engine_id == "d1"  # ties: lowest id
    assert plan.source is None and plan.source_lease_id == "" and plan.source_block_ids == ()
    assert (plan.matched_blocks, plan.matched_tokens, plan.recompute_tokens) == (0, 0, 100)
    assert plan.prompt_blocks == 6 and plan.candidates == 0 and not plan.decode_sticky
    assert plan.threshold_tokens == 64 and plan.cost.transfer_s == 0.0


def test_place_below_threshold() -> None:
    c = pd_cluster()
    lease, _ = c.publish("d2", toks(3 * BS))
    plan = c.place(toks(3 * BS + 10))
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, "below_threshold")
    assert plan.matched_blocks == 3 and plan.matched_tokens == 48 and plan.recompute_tokens == 58
    assert plan.source is not None and plan.source.engine_id == "d2" and plan.source_lease_id == lease.lease_id
    assert plan.decode.engine_id == "d2" and plan.decode_sticky  # it holds the prefix


def test_place_transfer_cheaper_with_default_figures() -> None:
    c = pd_cluster()
    lease, _ = c.publish("d2", toks(8 * BS), session="s")
    plan = c.place(toks(8 * BS + 5), session="s")
    assert (plan.decision, plan.reason) == (Decision.TRANSFER, "transfer_cheaper")
    assert plan.prefill.engine_id == "p" and plan.decode.engine_id == "d2" and plan.decode_sticky
    assert plan.source_block_ids == lease.block_ids and plan.matched_tokens == 128
    assert plan.recompute_tokens == 5 and plan.candidates == 1 and plan.session_id == "s"
    cost = plan.cost
    assert not cost.measured and cost.bandwidth_bytes_per_s == 1e9 and cost.bytes_per_block == 262144
    assert cost.transfer_s == pytest.approx(0.005 + 8 * 262144 / 1e9)
    assert cost.recompute_s == pytest.approx(128 / 5000)


def test_place_recompute_cheaper_on_a_slow_link_and_learned_bandwidth_wins() -> None:
    c = pd_cluster()
    lease, _ = c.publish("d2", toks(8 * BS))
    c.load("d2", transfer_bytes_per_s=1e6, bytes_per_block=262144)
    c.load("p", prefill_tokens_per_s=5000.0)
    plan = c.place(toks(8 * BS + 5))
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, "recompute_cheaper")
    assert plan.recompute_tokens == 8 * BS + 5 and plan.source_lease_id == lease.lease_id
    assert plan.cost.measured and plan.cost.bandwidth_bytes_per_s == 1e6
    assert plan.cost.transfer_s == pytest.approx(0.005 + 8 * 262144 / 1e6) and plan.cost.transfer_s > 2.0
    # A completed pull measured a fast link: learned bandwidth beats the reported figure.
    pin = c.state.pin("p", lease.lease_id, 8, 0.0, 1.0)
    c.state.complete(pin.pin_id, True, 8 * 262144, 8 * 262144 / 5e9, 1.5)
    plan = c.place(toks(8 * BS + 5))
    assert plan.decision is Decision.TRANSFER and plan.cost.bandwidth_bytes_per_s == pytest.approx(5e9)


def test_place_local_prefix_on_a_prefill_capable_source() -> None:
    c = Cluster(info("p", Role.PREFILL), info("b", Role.BOTH), info("d", Role.DECODE), placement=STRICT_PD)
    lease, _ = c.publish("b", toks(8 * BS))
    plan = c.place(toks(8 * BS + 3))
    assert (plan.decision, plan.reason) == (Decision.PREFILL_LOCAL, "local_prefix")
    assert plan.prefill.engine_id == "b" and plan.decode.engine_id == "b" and plan.decode_sticky
    assert plan.recompute_tokens == 3 and plan.source_lease_id == lease.lease_id
    # Much busier than the idle prefill engine: prefill moves away and pulls; decode moves too.
    c.load("b", running_requests=10)
    plan = c.place(toks(8 * BS + 3))
    assert (plan.decision, plan.reason) == (Decision.TRANSFER, "transfer_cheaper")
    assert plan.prefill.engine_id == "p" and plan.decode.engine_id == "d" and not plan.decode_sticky
    # A prefill-only engine holding the prefix prefills locally; decode goes to the least loaded.
    c2 = Cluster(info("p", Role.PREFILL), info("d1", Role.DECODE), info("d2", Role.DECODE), placement=STRICT_PD)
    c2.publish("p", toks(8 * BS))
    c2.load("d1", running_requests=1)
    plan = c2.place(toks(8 * BS + 3))
    assert plan.decision is Decision.PREFILL_LOCAL and plan.prefill.engine_id == "p"
    assert plan.decode.engine_id == "d2" and not plan.decode_sticky


@pytest.mark.parametrize(("busy", "sticky"), [(4, True), (5, False)])
def test_place_decode_stickiness_and_load_gap(busy: int, sticky: bool) -> None:
    c = pd_cluster()
    c.publish("d1", toks(8 * BS), session="s")  # the session's own history
    c.load("d1", running_requests=busy)
    plan = c.place(toks(8 * BS + 1), session="s")
    assert plan.decode_sticky is sticky
    assert plan.decode.engine_id == ("d1" if sticky else "d2")
    assert plan.source is not None and plan.source.engine_id == "d1" and plan.decision is Decision.TRANSFER


@pytest.mark.parametrize(("busy", "sticky"), [(1, True), (2, False)])
def test_a_prefix_other_sessions_share_keeps_a_new_session_only_within_the_shared_gap(busy: int,
                                                                                      sticky: bool) -> None:
    """d1 holds a system prompt another session's lease covers; d2 (restarted, say) holds nothing. A new session
    follows the prefix only while d1 is at most ``shared_prefix_load_gap`` (1) busier: else d2 takes it and
    computes the prefix once, instead of every new session following the first engine that held it."""
    c = pd_cluster()
    c.publish("d1", toks(8 * BS), session="other")
    c.load("d1", running_requests=busy)
    plan = c.place(toks(8 * BS + 1), session="new")
    assert plan.decode_sticky is sticky and plan.decode.engine_id == ("d1" if sticky else "d2")


def test_place_sticky_gap_is_configurable() -> None:
    c = pd_cluster(PlacementPolicy(sticky_load_gap=0.0, decode_local=False))
    c.publish("d1", toks(8 * BS), session="s")
    c.load("d1", kv_usage=0.1)
    assert c.place(toks(8 * BS + 1), session="s").decode.engine_id == "d2"


def test_place_session_engine_is_sticky_without_a_match() -> None:
    c = pd_cluster()
    c.publish("d2", toks(4 * BS, 9000), session="s")
    plan = c.place(toks(100), session="s")
    assert plan.reason == "no_match" and plan.decode.engine_id == "d2" and plan.decode_sticky
    plan = c.place(toks(100), session="other")
    assert plan.decode.engine_id == "d1" and not plan.decode_sticky
    c.load("d2", running_requests=6)
    assert c.place(toks(100), session="s").decode.engine_id == "d1"


def test_place_ties_go_to_the_session_then_the_most_recent() -> None:
    c = pd_cluster()
    on_d1, _ = c.publish("d1", toks(8 * BS), session="a", now=0.0)
    on_d2, _ = c.publish("d2", toks(8 * BS), session="b", now=1.0)
    prompt = toks(8 * BS + 7)
    assert c.place(prompt, session="a").source_lease_id == on_d1.lease_id
    assert c.place(prompt, session="b").source_lease_id == on_d2.lease_id
    assert c.place(prompt, session="c").source_lease_id == on_d2.lease_id  # most recently used
    assert c.place(prompt).source_lease_id == on_d2.lease_id
    c.state.renew(on_d1.lease_id, 0.0, 2.0)
    assert c.place(prompt, session="c").source_lease_id == on_d1.lease_id
    assert c.place(prompt, session="b").source_lease_id == on_d2.lease_id
    plan = c.place(prompt, session="a")
    assert plan.candidates == 2 and plan.decode.engine_id == "d1"
    # A longer match beats the session preference.
    longer, _ = c.publish("d2", toks(9 * BS), session="b", now=3.0)
    assert c.place(toks(9 * BS + 1), session="a").source_lease_id == longer.lease_id


def test_place_edited_history_matches_up_to_the_first_changed_block() -> None:
    c = pd_cluster(PlacementPolicy(threshold_tokens=32, decode_local=False))
    turn1 = toks(8 * BS + 5)
    c.publish("d1", turn1, session="s")
    appended = turn1 + toks(40, 50_000)
    assert c.place(appended, session="s").matched_blocks == 8
    edited = list(appended)
    edited[3 * BS + 2] = 99_999  # an edit inside block 3
    plan = c.place(edited, session="s")
    assert plan.matched_blocks == 3 and plan.matched_tokens == 48 and plan.decision is Decision.TRANSFER
    assert plan.recompute_tokens == len(edited) - 48
    edited[0] = 99_999
    assert c.place(edited, session="s").reason == "no_match"


def test_place_sessions_share_a_system_prompt() -> None:
    c = pd_cluster()
    system = toks(4 * BS, 70_000)
    lease_a, _ = c.publish("d1", system + toks(4 * BS, 1_000), session="a", now=0.0)
    plan = c.place(system + toks(20, 2_000), session="b")
    assert plan.source_lease_id == lease_a.lease_id and plan.matched_blocks == 4
    assert plan.source_block_ids == lease_a.block_ids[:4] and plan.decode.engine_id == "d1"
    lease_b, cmds = c.publish("d1", system + toks(4 * BS, 2_000), session="b", now=1.0)
    assert cmds == [] and lease_a.lease_id in c.state.leases  # diverges after the prompt: not superseded
    assert lease_b.block_ids[:4] == lease_a.block_ids[:4]
    assert c.state.retained_blocks("d1") == 12  # the system prompt's 4 blocks are held once
    assert c.place(system + toks(4 * BS, 2_000) + toks(5), session="b").source_lease_id == lease_b.lease_id
    c.state.release(lease_a.lease_id, 2.0)
    assert c.state.retained_blocks("d1") == 8  # b still holds the system prompt
    assert c.place(system + toks(4 * BS, 1_000) + [1], session="a").matched_blocks == 4


def test_place_never_reuses_the_block_holding_the_last_token() -> None:
    c = pd_cluster()
    lease, _ = c.publish("d1", toks(8 * BS))
    plan = c.place(toks(8 * BS))
    assert plan.matched_blocks == 7 and plan.recompute_tokens == BS
    assert plan.source_block_ids == lease.block_ids[:7]
    assert c.place(toks(8 * BS + 1)).matched_blocks == 8
    assert c.place(toks(1)).matched_blocks == 0


def test_place_filters_by_fingerprint_and_block_size() -> None:
    c = Cluster(info("p", Role.PREFILL), info("d", Role.DECODE),
                info("pb", Role.PREFILL, fp="fp-b"), info("db", Role.DECODE, fp="fp-b"),
                info("d32", Role.DECODE, bs=32))
    c.publish("d", toks(8 * BS))
    assert c.place(toks(8 * BS + 1)).matched_blocks == 8
    # Same keys (a test shortcut: real keys differ per fingerprint), other layout: no match.
    plan = c.place(toks(8 * BS + 1), fp="fp-b")
    assert plan.reason == "no_match" and plan.candidates == 0
    assert plan.prefill.engine_id == "pb" and plan.decode.engine_id == "db"
    err = raises(FailedPrecondition, "layout_fingerprint", lambda: c.place(toks(100), fp="fp-c"))
    assert "prefill" in err.message
    # Only a decode engine uses block size 32.
    err = raises(FailedPrecondition, "layout_fingerprint", lambda: c.place(toks(100), bs=32))
    assert "prefill" in err.message
    c.state.deregister("d", 0.0)
    err = raises(FailedPrecondition, "layout_fingerprint", lambda: c.place(toks(100)))
    assert "decode" in err.message


def test_place_skips_leases_being_evicted_but_not_merely_pinned() -> None:
    c = pd_cluster()
    lease, _ = c.publish("d1", toks(8 * BS))
    c.state.pin("p", lease.lease_id, 8, 0.0, 0.0)
    assert c.place(toks(8 * BS + 1)).source_lease_id == lease.lease_id
    c.state.release(lease.lease_id, 0.0)
    assert c.place(toks(8 * BS + 1)).source is None


@pytest.mark.parametrize(
    ("request_", "cls", "field"),
    [
        (PlaceInput((), 10, FP, BS, session_id="s" * 257), InvalidArgument, "session_id"),
        (PlaceInput((b"x" * 31,), 16, FP, BS), InvalidArgument, "block_keys"),
        (PlaceInput(keys_of(toks(3 * BS)), 3 * BS, FP, BS), ResourceExhausted, "block_keys"),
        (PlaceInput((), 10, FP, 0), InvalidArgument, "block_size"),
        (PlaceInput(keys_of(toks(2 * BS)), 2 * BS - 1, FP, BS), InvalidArgument, "num_tokens"),
    ],
)
def test_place_validation(request_: PlaceInput, cls: type[KvloopError], field: str) -> None:
    c = pd_cluster(limits=Limits(max_block_keys=2))
    raises(cls, field, lambda: c.state.place(request_, 0.0))


def test_place_with_no_keys() -> None:
    plan = pd_cluster().state.place(PlaceInput((), 5, FP, BS), 0.0)
    assert plan.reason == "no_match" and plan.prompt_blocks == 0 and plan.recompute_tokens == 5


# =====================================================================================================
# Eviction stream, changes, restore
# =====================================================================================================


def test_commands_after() -> None:
    c = Cluster(info("e1", budget=1), limits=Limits(eviction_log_size=2))
    leases = [c.publish("e1", toks(BS, 100 * i), now=float(i))[0] for i in range(4)]  # evicts 0, 1, 2
    cmds = c.state.take_changes().commands
    assert [(x.seq, x.lease_id) for x in cmds] == [(i + 1, leases[i].lease_id) for i in range(3)]
    assert c.state.commands_after("e1", 3) == []
    assert c.state.commands_after("e1", 2) == cmds[2:]
    assert c.state.commands_after("e1", 1) == cmds[1:]
    for k in (0, -1, 4, 10):  # seq 1 fell out of the two-command log, or the engine is ahead
        (resync,) = c.state.commands_after("e1", k)
        assert resync.reason is EvictionReason.RESYNC and resync.seq == 3
        assert resync.live_lease_ids == (leases[3].lease_id,) and resync.lease_id == ""
    raises(NotFound, "engine_id", lambda: c.state.commands_after("nope", 0))


def test_commands_after_on_a_fresh_engine() -> None:
    c = Cluster(info("e1"))
    assert c.state.commands_after("e1", 0) == []
    (resync,) = c.state.commands_after("e1", 7)
    assert resync.reason is EvictionReason.RESYNC and resync.seq == 0


def test_take_changes_reports_puts_and_deletes_once() -> None:
    c = Cluster(info("e1", budget=2))
    assert not c.state.take_changes()
    first, _ = c.publish("e1", toks(2 * BS))
    second, _ = c.publish("e1", toks(2 * BS, 500), now=1.0)
    changes = c.state.take_changes()
    assert changes.leases == {first.lease_id: None, second.lease_id: second}
    assert [x.lease_id for x in changes.commands] == [first.lease_id]
    assert changes.engines == {"e1": c.state.engines["e1"]}  # its eviction seq moved
    assert not c.state.take_changes()


def test_load_restores_a_state() -> None:
    c = pd_cluster()
    lease, _ = c.publish("d1", toks(8 * BS), session="s")
    c.publish("d1", toks(BS, 9000))
    pin = c.state.pin("p", lease.lease_id, 4, 0.0, 0.0)
    c.state.engines["d1"].eviction_seq = 5
    restored = BrokerState(LruPolicy(), new_id=counter_ids())
    stray = Lease("ghost", "gone-engine", "", keys_of(toks(BS)), (1,), BS, 10.0, 10.0, 0.0, 0.0)
    restored.load(c.state.engines.values(), [*c.state.leases.values(), stray],
                  [*c.state.pins.values()])
    assert not restored.take_changes()
    assert set(restored.leases) == set(c.state.leases) and restored.pins == {pin.pin_id: pin}
    assert restored.leases[lease.lease_id].pin_ids == {pin.pin_id}
    assert restored.retained_blocks("d1") == c.state.retained_blocks("d1") == 9
    # Until an engine is heard from, its safety holds may be lapsing: its leases are neither matched nor pinned.
    assert restored.unheard == {"p", "d1", "d2"}
    request = PlaceInput(keys_of(toks(8 * BS + 1)), 8 * BS + 1, FP, BS, "s")
    assert restored.place(request, 1.0).source_lease_id == ""
    raises(FailedPrecondition, "lease_id", lambda: restored.pin("p", lease.lease_id, 4, 0.0, 1.0))
    restored.keepalive("d1", EngineLoad(), 1.0)
    assert restored.unheard == {"p", "d2"}
    plan = restored.place(request, 1.0)
    assert plan.source_lease_id == lease.lease_id and plan.matched_blocks == 8
    restored.pin("p", lease.lease_id, 4, 0.0, 1.0)
    (resync,) = restored.commands_after("d1", 4)  # the log starts empty after a restore
    assert resync.reason is EvictionReason.RESYNC and resync.seq == 5
    assert restored.commands_after("d1", 5) == []


def test_make_policy() -> None:
    assert isinstance(make_policy("lru"), LruPolicy)
    policy = make_policy("cost", 30.0)
    assert isinstance(policy, CostAwarePolicy) and policy.recency_half_life_s == 30.0
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo")


# =====================================================================================================
# Decisions made after review
# =====================================================================================================


def test_ttl_that_ran_out_during_a_pull_is_not_renewed_by_it() -> None:
    # No tick ran between the expiry and the completion: the outcome must not depend on tick timing.
    c = Cluster(info("d", Role.DECODE), info("p", Role.PREFILL))
    lease, _ = c.publish("d", toks(4 * BS), ttl=5.0, now=0.0)
    pin = c.state.pin("p", lease.lease_id, 2, 30.0, now=1.0)
    c.state.take_changes()
    assert c.state.complete(pin.pin_id, True, 1000, 0.01, now=6.0) is None
    commands = c.state.take_changes().commands
    assert [(cmd.lease_id, cmd.reason) for cmd in commands] == [(lease.lease_id, EvictionReason.TTL_EXPIRED)]


def test_successful_pull_within_ttl_renews() -> None:
    c = Cluster(info("d", Role.DECODE), info("p", Role.PREFILL))
    lease, _ = c.publish("d", toks(4 * BS), ttl=5.0, now=0.0)
    pin = c.state.pin("p", lease.lease_id, 2, 30.0, now=1.0)
    renewed = c.state.complete(pin.pin_id, True, 1000, 0.01, now=4.0)
    assert renewed is not None and renewed.expires_at == 9.0 and renewed.last_used == 4.0


def test_reregistering_with_a_smaller_budget_evicts_down_to_it() -> None:
    c = Cluster(info("d", Role.DECODE, budget=100))
    first, _ = c.publish("d", toks(4 * BS), now=0.0)
    second, _ = c.publish("d", toks(4 * BS, 9000), now=1.0)
    c.state.take_changes()
    c.state.register(info("d", Role.DECODE, budget=5), now=2.0)
    assert c.state.retained_blocks("d") <= 5
    commands = c.state.take_changes().commands
    assert [(cmd.lease_id, cmd.reason) for cmd in commands] == [(first.lease_id, EvictionReason.BUDGET)]
    assert set(c.state.leases) == {second.lease_id}


def test_session_tie_break_applies_after_the_last_block_cap() -> None:
    # Session "a" holds exactly the prompt's full blocks; session "b" holds them plus one more block.
    # The prompt's last full block can't be reused, so both leases are equally usable: "a" must win.
    c = Cluster(info("d1", Role.DECODE), info("d2", Role.DECODE), info("p", Role.PREFILL))
    prompt = toks(4 * BS)
    c.publish("d1", prompt, session="a", now=0.0)
    c.publish("d2", prompt + toks(BS, 7000), session="b", now=1.0)
    plan = c.place(prompt, session="a")
    assert plan.matched_blocks == 3 and plan.source is not None and plan.source.engine_id == "d1"
    assert plan.decode.engine_id == "d1" and plan.decode_sticky


def test_a_decode_engine_of_role_both_computes_its_prompt_in_one_request() -> None:
    """A fleet of one engine of role both: nothing cached, or a tail past the busy veto, is still the decode
    request's own work (DECODE_LOCAL), never a prefill request to the engine that then decodes it."""
    c = Cluster(info("b"))
    plan = c.place(toks(8 * BS))
    assert plan.decision is Decision.DECODE_LOCAL and plan.prefill.engine_id == plan.decode.engine_id == "b"
    assert plan.reason == "no_match" and plan.local_tokens == 0 and plan.recompute_tokens == 8 * BS
    assert plan.cost.decode_local_s > 0 and plan.cost.recompute_path_s == 0  # no hop priced
    c.publish("b", toks(8 * BS))
    c.load("b", running_requests=60, prefill_tokens_per_s=1000.0)  # 60 streams x a 3-block tail: over the budget
    busy = c.place(toks(11 * BS + 1))
    assert busy.decision is Decision.DECODE_LOCAL and busy.reason == "decode_engine_computes"
    assert busy.decode_local_veto == "" and busy.cost.decode_stall_s > 0


def test_a_vetoed_tail_on_a_both_engine_goes_to_another_prefill_engine() -> None:
    c = Cluster(info("b"), info("p", Role.PREFILL))
    c.publish("b", toks(8 * BS))
    c.load("b", running_requests=60, prefill_tokens_per_s=1000.0)
    plan = c.place(toks(11 * BS + 1))
    assert plan.decode.engine_id == "b" and plan.prefill.engine_id == "p"
    assert plan.decision is not Decision.DECODE_LOCAL and plan.decode_local_veto == "decode_busy"
