"""The broker core's host tier: evictions that make room demote, the tier drops only for room or TTL, pinned leases
never move, and a fake engine that applies every command agrees with the broker's books (nothing freed twice)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvloop.broker.core import (
    BrokerState,
    EngineInfo,
    EngineLoad,
    EvictionCommand,
    EvictionReason,
    Limits,
    LruPolicy,
    PlaceInput,
    Role,
    Tier,
)
from kvloop.broker.core.sessions import SessionHint
from kvloop.broker.store import codec
from kvloop.shared.errors import FailedPrecondition, NotFound, ResourceExhausted
from kvloop.shared.hashing import ExtraKeys, block_keys

EXTRA = ExtraKeys("fp")


def ids() -> Callable[[], str]:
    counter = itertools.count(1)
    return lambda: f"l{next(counter)}"


def keys(n: int, start: int = 0) -> tuple[bytes, ...]:
    return tuple(block_keys(list(range(start, start + n)), 1, EXTRA))


FIRST = 50
"""The tier's first slot id (after the pool's blocks, as kvloop's connector lays it out)."""


def broker(budget: int = 4, host: int = 4, **limits: Any) -> BrokerState:
    state = BrokerState(LruPolicy(), limits=Limits(**{"engine_ttl_s": 1e4, **limits}), new_id=ids())
    state.register(EngineInfo("d", Role.DECODE, 1, "fp", budget, host_tier_blocks=host, host_tier_first_id=FIRST),
                   0.0)
    state.register(EngineInfo("p", Role.PREFILL, 1, "fp", 0), 0.0)
    state.take_changes()
    return state


def publish(state: BrokerState, n: int, start: int, block_ids: range, now: float) -> tuple[str, list[EvictionCommand]]:
    lease, commands = state.publish("d", "s", keys(n, start), tuple(block_ids), n, 60.0, now)
    return lease.lease_id, commands


def test_a_budget_eviction_demotes_and_the_lease_is_offered_again_once_copied() -> None:
    state = broker()
    first, _ = publish(state, 3, 0, range(0, 3), 1.0)
    second, commands = publish(state, 3, 100, range(3, 6), 2.0)
    (cmd,) = commands
    assert (cmd.lease_id, cmd.block_ids, cmd.tier, cmd.demote_to) == (first, (0, 1, 2), Tier.POOL, (50, 51, 52))
    lease = state.leases[first]
    assert lease.tier is Tier.HOST and lease.block_ids == (50, 51, 52) and lease.demoting_until > 0
    assert state.retained_blocks("d") == 3 and state.host_blocks("d") == 3
    request = PlaceInput(keys=keys(4, 0), num_tokens=4, block_size=1, layout_fingerprint="fp")
    assert state.place(request, 3.0).matched_blocks == 0  # not offered while the copy runs
    with pytest.raises(FailedPrecondition, match="host tier"):
        state.pin("p", first, 3, 5.0, 3.0)
    assert state.complete_demotion("d", first, True, 3.0) is lease and not lease.demoting_until
    plan = state.place(request, 4.0)
    assert plan.source_lease_id == first and plan.source_tier is Tier.HOST and plan.source_block_ids == (50, 51, 52)
    assert plan.decision.value != "DECODE_LOCAL"  # on the host tier the decode engine does not hold it itself
    state.pin("p", first, 3, 5.0, 4.0)
    assert state.leases[second].tier is Tier.POOL


def test_the_tier_drops_its_least_recent_lease_for_room_and_ttl_ends_a_demoted_lease() -> None:
    state = broker(budget=2, host=2, host_ttl_s=30.0)
    a, _ = publish(state, 2, 0, range(0, 2), 1.0)
    b, _ = publish(state, 2, 100, range(2, 4), 2.0)
    state.complete_demotion("d", a, True, 2.0)
    assert state.leases[a].expires_at == 32.0  # the host tier's TTL from the demotion
    c, commands = publish(state, 2, 200, range(4, 6), 3.0)
    assert [(x.lease_id, x.tier, x.demote_to) for x in commands] == [(a, Tier.HOST, ()), (b, Tier.POOL, (50, 51))]
    assert a not in state.leases and state.leases[b].tier is Tier.HOST
    state.complete_demotion("d", b, True, 3.0)
    state.take_changes()
    state.tick(40.0)
    (expired,) = state.take_changes().commands
    assert (expired.lease_id, expired.tier, expired.reason) == (b, Tier.HOST, EvictionReason.TTL_EXPIRED)
    assert c in state.leases and state.host_blocks("d") == 0  # c's pool TTL (60 s from 3.0) runs on


def test_no_tier_or_no_room_drops_as_before() -> None:
    state = broker(budget=2, host=0)
    a, _ = publish(state, 2, 0, range(0, 2), 1.0)
    _, (cmd,) = publish(state, 2, 100, range(2, 4), 2.0)
    assert (cmd.lease_id, cmd.demote_to) == (a, ()) and a not in state.leases
    state = broker(budget=3, host=2)  # 3 blocks, 2 slots
    a, _ = publish(state, 3, 0, range(0, 3), 1.0)
    _, (cmd,) = publish(state, 3, 100, range(3, 6), 2.0)
    assert (cmd.lease_id, cmd.demote_to) == (a, ()) and a not in state.leases


def test_a_pinned_lease_is_not_taken_for_room_and_a_lost_copy_is_dropped() -> None:
    state = broker(demotion_timeout_s=5.0)
    a, _ = publish(state, 3, 0, range(0, 3), 1.0)
    pin = state.pin("p", a, 3, 10.0, 1.0)
    state.keepalive("d", EngineLoad(memory_pressure=True, pressure_free_blocks=3), 2.0)
    assert state.take_changes().commands == [] and state.leases[a].tier is Tier.POOL
    state.complete(pin.pin_id, True, 0, 0.0, 3.0)
    state.keepalive("d", EngineLoad(memory_pressure=True, pressure_free_blocks=3), 3.0)
    (cmd,) = state.take_changes().commands
    assert cmd.demote_to == (50, 51, 52) and cmd.reason is EvictionReason.MEMORY_PRESSURE
    state.tick(9.0)  # the engine never reported the copy
    (lost,) = state.take_changes().commands
    assert (lost.lease_id, lost.tier, lost.reason) == (a, Tier.HOST, EvictionReason.DEMOTION_FAILED)
    with pytest.raises(NotFound):
        state.complete_demotion("d", a, True, 9.5)


def test_demotion_reports_are_checked() -> None:
    state = broker()
    a, _ = publish(state, 3, 0, range(0, 3), 1.0)
    with pytest.raises(FailedPrecondition, match="not being demoted"):
        state.complete_demotion("d", a, True, 1.0)
    publish(state, 3, 100, range(3, 6), 2.0)
    with pytest.raises(FailedPrecondition, match="not 'p'") as exc:
        state.complete_demotion("p", a, True, 2.0)
    assert exc.value.field == "lease_id"
    assert state.complete_demotion("d", a, False, 2.0) is None and a not in state.leases
    (failed,) = state.take_changes().commands[-1:]
    assert failed.reason is EvictionReason.DEMOTION_FAILED and failed.tier is Tier.HOST


# ---------------------------------------------------------------------------------------------- random runs
TIER_FIRST = 1 << 20
"""In random runs pool block ids grow without bound; the tier's ids start above every one of them."""


class FakeEngine:
    """An engine applying the broker's commands to its own memory: which lease holds each pool block and slot."""

    def __init__(self, capacity: int) -> None:
        self.pool: Counter[int] = Counter()
        self.slots: dict[int, str] = {}
        self.capacity = capacity
        self.copying: set[str] = set()
        self.promoting: dict[str, tuple[tuple[int, ...], str]] = {}
        """Lease id -> (slots, pin) of each promotion asked for and not yet loaded."""

    def apply(self, cmd: EvictionCommand, holds: dict[str, tuple[Tier, tuple[int, ...]]]) -> None:
        if cmd.promote_pin:  # a promotion frees nothing: the engine loads the slots later
            assert cmd.reason is EvictionReason.PREFETCH and holds[cmd.lease_id] == (Tier.HOST, cmd.block_ids)
            self.promoting[cmd.lease_id] = (cmd.block_ids, cmd.promote_pin)
            return
        tier, held = holds.pop(cmd.lease_id)
        assert (tier, held) == (cmd.tier, cmd.block_ids), "a command for blocks the engine does not hold"
        if tier is Tier.POOL:
            self.pool.subtract(set(held))
            assert min(self.pool.values(), default=0) >= 0, "a pool block freed twice"
        else:
            for slot in held:
                assert self.slots.pop(slot) == cmd.lease_id, "a slot freed twice or not this lease's"
        if cmd.demote_to:
            assert len(cmd.demote_to) == len(held)
            assert TIER_FIRST <= min(cmd.demote_to) <= max(cmd.demote_to) < TIER_FIRST + self.capacity
            for slot in cmd.demote_to:
                assert slot not in self.slots, "a copy over another lease's slot"
                self.slots[slot] = cmd.lease_id
            holds[cmd.lease_id] = (Tier.HOST, cmd.demote_to)
            self.copying.add(cmd.lease_id)


ops = st.lists(st.one_of(
    st.tuples(st.just("publish"), st.integers(1, 4), st.integers(0, 5)),
    st.tuples(st.just("pressure"), st.integers(1, 6)),
    st.tuples(st.just("pin"), st.integers(0, 50)),
    st.tuples(st.just("unpin"), st.integers(0, 50)),
    st.tuples(st.just("copied"), st.integers(0, 50), st.booleans()),
    st.tuples(st.just("tick"), st.sampled_from([1.0, 4.0, 20.0])),
    st.tuples(st.just("pause"), st.integers(0, 5), st.sampled_from([5.0, 12.0, 40.0])),
    st.tuples(st.just("promoted"), st.integers(0, 50), st.booleans()),
), min_size=10, max_size=50)
"""A run's steps. Pauses, copies and promotions come in runs of their own as well (``paused_ops``): a promotion
needs a lease published, paused, demoted and copied, and its pause's prefetch time reached, in that order."""
paused_ops = st.lists(st.one_of(
    st.tuples(st.just("publish"), st.integers(1, 4), st.integers(0, 3)),
    st.tuples(st.just("pause"), st.integers(0, 3), st.sampled_from([5.0, 12.0, 40.0])),
    st.tuples(st.just("pressure"), st.integers(1, 6)),
    st.tuples(st.just("copied"), st.integers(0, 50), st.just(True)),
    st.tuples(st.just("tick"), st.sampled_from([1.0, 4.0, 20.0])),
    st.tuples(st.just("promoted"), st.integers(0, 50), st.booleans()),
    st.tuples(st.just("pin"), st.integers(0, 50)),
), min_size=30, max_size=80)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget=st.integers(3, 8), host=st.integers(0, 10), run=ops)
def test_random_runs_keep_the_tiers_books_and_the_engines_memory_in_agreement(
        budget: int, host: int, run: list[tuple[Any, ...]]) -> None:
    drive(budget, host, run)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget=st.integers(3, 8), host=st.integers(1, 10), run=paused_ops)
def test_random_runs_with_pauses_never_promote_from_a_slot_another_lease_holds(
        budget: int, host: int, run: list[tuple[Any, ...]]) -> None:
    drive(budget, host, run)


def drive(budget: int, host: int, run: list[tuple[Any, ...]]) -> None:
    """``run`` against the broker and a fake engine that applies its commands, checking both agree after each step."""
    limits = Limits(demotion_timeout_s=10.0, host_ttl_s=15.0, engine_ttl_s=1e4, session_prefetch_lead_s=3.0)
    state = BrokerState(LruPolicy(), limits=limits, new_id=ids())
    state.register(EngineInfo("d", Role.DECODE, 1, "fp", budget, host_tier_blocks=host, host_tier_first_id=TIER_FIRST),
                   0.0)
    state.register(EngineInfo("p", Role.PREFILL, 1, "fp", 0), 0.0)
    engine = FakeEngine(host)
    holds: dict[str, tuple[Tier, tuple[int, ...]]] = {}
    pins: dict[str, tuple[str, Tier, tuple[int, ...]]] = {}
    fresh = itertools.count()
    now = 0.0
    for op in run:
        if op[0] == "publish" and op[1] <= budget:
            blocks = tuple(next(fresh) for _ in range(op[1]))
            try:
                lease, _ = state.publish("d", f"s{op[2]}", keys(op[1], 1000 * op[2]), blocks, op[1], 30.0, now)
            except ResourceExhausted:  # the pinned leases hold the budget: refused, nothing retained
                pass
            else:
                engine.pool.update(blocks)
                holds[lease.lease_id] = (Tier.POOL, blocks)
        elif op[0] == "pressure":
            state.keepalive("d", EngineLoad(memory_pressure=True, pressure_free_blocks=op[1]), now)
        elif op[0] == "pin" and state.leases:
            lid = sorted(state.leases)[op[1] % len(state.leases)]
            lease = state.leases[lid]
            if lease.pending is None and not lease.demoting_until:
                pin = state.pin("p", lid, len(lease.block_ids), 60.0, now)
                pins[pin.pin_id] = (lid, lease.tier, lease.block_ids)
        elif op[0] == "unpin" and pins:
            pid = sorted(pins)[op[1] % len(pins)]
            del pins[pid]
            state.complete(pid, True, 1000, 0.001, now)
        elif op[0] == "copied" and engine.copying:
            lid = sorted(engine.copying)[op[1] % len(engine.copying)]
            engine.copying.discard(lid)
            if lid in state.leases and state.leases[lid].demoting_until:
                state.complete_demotion("d", lid, op[2], now)
        elif op[0] == "tick":
            now += op[1]
            state.tick(now)
            pins = {p: v for p, v in pins.items() if p in state.pins}
        elif op[0] == "pause":
            state.hint_session("o", f"s{op[1]}", SessionHint(pause_s=op[2]), now)
        elif op[0] == "promoted" and engine.promoting:
            lid = sorted(engine.promoting)[op[1] % len(engine.promoting)]
            slots, pin = engine.promoting.pop(lid)
            if pin in state.pins:  # the engine's deadline: it reads the slots only while the broker's pin holds them
                event("a promotion loaded while pinned")
                assert all(engine.slots.get(slot) == lid for slot in slots), "a promotion read another lease's slot"
                lease = state.leases[lid]
                if op[2]:  # loaded: the engine retains the copy and publishes it, then reports
                    blocks = tuple(next(fresh) for _ in slots)
                    try:
                        copy, _ = state.publish("d", lease.session_id, lease.keys, blocks, len(blocks), 30.0, now)
                    except ResourceExhausted:
                        pass
                    else:
                        engine.pool.update(blocks)
                        holds[copy.lease_id] = (Tier.POOL, blocks)
                state.complete_promotion("d", lid, pin, op[2], now)
        for cmd in state.take_changes().commands:
            engine.apply(cmd, holds)
            engine.copying -= {cmd.lease_id} if not cmd.demote_to else set()
        # The broker's books against the engine's memory and against its own leases.
        assert {lid: (lease.tier, lease.block_ids) for lid, lease in state.leases.items()} == holds
        pool = Counter(b for lid, (tier, held) in holds.items() if tier is Tier.POOL for b in held)
        assert +engine.pool == pool and state.retained_blocks("d") == len(pool) <= budget
        assert state.host_blocks("d") == len(engine.slots) <= host
        for lid, tier, held in pins.values():  # never moved while pinned
            assert (state.leases[lid].tier, state.leases[lid].block_ids) == (tier, held)


def test_the_store_keeps_a_demoted_lease_and_the_engines_tier() -> None:
    state = broker(budget=2, host=4)
    a, _ = publish(state, 2, 0, range(0, 2), 1.0)
    publish(state, 2, 100, range(2, 4), 2.0)
    lease = state.leases[a]
    back = codec.decode_lease(codec.encode_lease(lease))
    assert (back.tier, back.block_ids) == (Tier.HOST, (50, 51)) and back.demoting_until == lease.demoting_until > 0
    assert codec.decode_engine(codec.encode_engine(state.engines["d"])).info.host_tier_blocks == 4
    assert codec.decode_engine(codec.encode_engine(state.engines["d"])).info.host_tier_first_id == FIRST
    record = state.engines["d"]
    stepped = dataclasses.replace(record, info=dataclasses.replace(record.info, step_tokens=256))
    assert codec.decode_engine(codec.encode_engine(stepped)).info.step_tokens == 256
    restored = BrokerState(LruPolicy(), limits=Limits(engine_ttl_s=1e4), new_id=ids())
    restored.load(list(state.engines.values()), [back, *(x for x in state.leases.values() if x is not lease)], [])
    assert restored.host_blocks("d") == 2 and restored.retained_blocks("d") == 2
    restored.tick(2.0 + Limits().demotion_timeout_s)  # a new leader still times the copy out
    assert a not in restored.leases and restored.host_blocks("d") == 0
