"""The broker core's session hints: a pause holds a session's leases past their TTL and ranks them last for eviction,
an end frees them (and the last turn's lease published after it), priority orders eviction, and every hint stays
within the broker's bounds and its owner's sessions."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.broker.core import BrokerState, EngineInfo, EvictionReason, Limits, LruPolicy, Role
from kvloop.broker.core.model import Lease
from kvloop.broker.core.sessions import HintedPolicy, Priority, SessionBook, SessionHint
from kvloop.shared.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from kvloop.shared.hashing import ExtraKeys, block_keys

EXTRA = ExtraKeys("fp")
TTL = 60.0


def broker(budget: int = 8, **limits: Any) -> BrokerState:
    counter = itertools.count(1)
    state = BrokerState(LruPolicy(), limits=Limits(**{"engine_ttl_s": 1e6, **limits}),
                        new_id=lambda: f"l{next(counter)}")
    state.register(EngineInfo("d", Role.DECODE, 1, "fp", budget), 0.0)
    return state


def publish(state: BrokerState, session: str, first_block: int, n: int, now: float) -> tuple[Lease, list[Any]]:
    keys = block_keys(list(range(first_block * 1000, first_block * 1000 + n)), 1, EXTRA)
    return state.publish("d", session, keys, range(first_block, first_block + n), n, TTL, now)


def test_a_pause_holds_the_sessions_leases_past_their_ttl_then_lets_them_expire() -> None:
    state = broker()
    lease, _ = publish(state, "a", 0, 2, now=0.0)
    grant, commands = state.hint_session("t1", "a", SessionHint(pause_s=300.0), now=10.0)
    assert commands == [] and grant.pause_granted_s == 300.0 and grant.refused == ()
    margin = state.limits.session_resume_margin_s
    assert state.leases[lease.lease_id].expires_at == 10.0 + 300.0 + margin
    state.tick(TTL + 1)
    assert lease.lease_id in state.leases  # its own TTL ran out; the pause holds it
    state.tick(10.0 + 300.0 + margin + 0.1)
    assert lease.lease_id not in state.leases


def test_a_lease_published_during_a_pause_is_held_too() -> None:
    state = broker()
    state.hint_session("t1", "a", SessionHint(pause_s=200.0), now=0.0)
    lease, _ = publish(state, "a", 0, 2, now=1.0)
    assert lease.expires_at == 200.0 + state.limits.session_resume_margin_s


def test_a_pause_past_the_bound_is_granted_shorter_and_says_so() -> None:
    state = broker(max_session_pause_s=100.0)
    grant, _ = state.hint_session("t1", "a", SessionHint(pause_s=5000.0), now=0.0)
    assert grant.pause_granted_s == 100.0
    assert grant.refused and grant.refused[0].startswith("pause_s: granted 100 of 5000")


@pytest.mark.parametrize("pause", [-1.0, float("nan"), float("inf"), 1e9])
def test_an_absurd_pause_is_refused_naming_the_field(pause: float) -> None:
    with pytest.raises(InvalidArgument) as err:
        broker().hint_session("t1", "a", SessionHint(pause_s=pause), now=0.0)
    assert err.value.field == "pause_s"


def test_end_frees_the_sessions_leases_now_and_its_last_lease_when_it_arrives() -> None:
    state = broker()
    first, _ = publish(state, "a", 0, 2, now=0.0)
    other, _ = publish(state, "b", 10, 2, now=0.0)
    _, commands = state.hint_session("t1", "a", SessionHint(end=True), now=5.0)
    assert [(c.lease_id, c.reason, c.block_ids) for c in commands] == [(first.lease_id, EvictionReason.RELEASED,
                                                                        (0, 1))]
    assert first.lease_id not in state.leases and other.lease_id in state.leases
    assert state.retained_blocks("d") == 2
    late, commands = publish(state, "a", 20, 3, now=6.0)  # the last turn's lease, published after the end
    assert late.lease_id not in state.leases
    assert [(c.reason, c.block_ids) for c in commands] == [(EvictionReason.RELEASED, (20, 21, 22))]
    state.tick(5.0 + state.limits.session_end_memory_s + 1)
    again, _ = publish(state, "a", 30, 2, now=70.0)  # the end is forgotten: a new session of the same id
    assert again.lease_id in state.leases


def test_end_of_a_pinned_lease_waits_for_the_pin() -> None:
    state = broker()
    state.register(EngineInfo("p", Role.PREFILL, 1, "fp", 0), 0.0)
    lease, _ = publish(state, "a", 0, 2, now=0.0)
    pin = state.pin("p", lease.lease_id, 2, 10.0, now=1.0)
    _, commands = state.hint_session("t1", "a", SessionHint(end=True), now=2.0)
    assert commands == [] and lease.lease_id in state.leases
    state.complete(pin.pin_id, True, 100, 0.1, now=3.0)
    assert lease.lease_id not in state.leases


def test_priority_and_pauses_order_eviction_before_recency() -> None:
    state = broker(budget=6)
    low, _ = publish(state, "low", 0, 2, now=3.0)  # the most recent: LRU alone would evict it last
    paused, _ = publish(state, "paused", 10, 2, now=1.0)
    plain, _ = publish(state, "plain", 20, 2, now=2.0)
    state.hint_session("t1", "low", SessionHint(priority=Priority.LOW), now=4.0)
    state.hint_session("t1", "paused", SessionHint(pause_s=100.0), now=4.0)
    _, commands = publish(state, "new", 30, 2, now=5.0)
    assert [c.lease_id for c in commands] == [low.lease_id]
    _, commands = publish(state, "new2", 40, 2, now=6.0)
    assert [c.lease_id for c in commands] == [plain.lease_id]  # older than `paused`'s, but no pause holds it
    assert paused.lease_id in state.leases


def test_another_owners_session_cannot_be_hinted_or_read() -> None:
    state = broker()
    state.hint_session("t1", "a", SessionHint(pause_s=10.0), now=0.0)
    with pytest.raises(PermissionDenied) as err:
        state.hint_session("t2", "a", SessionHint(end=True), now=1.0)
    assert err.value.field == "session_id"
    with pytest.raises(PermissionDenied):
        state.sessions.get("t2", "a")
    assert state.sessions.get("t1", "a") is not None and not state.sessions.sessions["a"].ended_at


def test_bounds_per_owner_and_on_high_priority() -> None:
    state = broker(max_sessions_per_owner=3, max_high_sessions_per_owner=1)
    for i in range(3):
        state.hint_session("t1", f"s{i}", SessionHint(priority=Priority.HIGH), now=0.0)
    with pytest.raises(ResourceExhausted) as err:
        state.hint_session("t1", "s3", SessionHint(), now=0.0)
    assert err.value.field == "session_id"
    state.hint_session("t2", "s3", SessionHint(), now=0.0)  # another owner's room is its own
    high = [s for s in state.sessions.sessions.values() if s.priority is Priority.HIGH]
    assert [s.session_id for s in high] == ["s0"]
    grant, _ = state.hint_session("t1", "s1", SessionHint(priority=Priority.HIGH), now=1.0)
    assert grant.session.priority is Priority.NORMAL and grant.refused[0].startswith("priority: granted normal")


def test_keep_generated_false_is_granted_remembered_and_carried_by_every_plan_of_the_session() -> None:
    state = broker()
    grant, _ = state.hint_session("t1", "a", SessionHint(keep_generated=False), now=0.0)
    assert not grant.refused and grant.session.drops_generated
    assert state.sessions.drops_generated("a") and not state.sessions.drops_generated("b")
    state.hint_session("t1", "a", SessionHint(pause_s=5.0), now=1.0)  # another hint leaves it as said
    assert state.sessions.drops_generated("a")
    state.hint_session("t1", "a", SessionHint(keep_generated=True), now=2.0)
    assert not state.sessions.drops_generated("a")


def test_idle_sessions_are_forgotten_and_their_room_returns() -> None:
    state = broker(max_sessions_per_owner=1, session_idle_s=100.0)
    state.hint_session("t1", "a", SessionHint(pause_s=50.0), now=0.0)
    state.tick(100.0)
    assert "a" in state.sessions.sessions  # the pause and its margin count before idleness
    state.tick(50.0 + state.limits.session_resume_margin_s + 100.0)
    assert state.sessions.sessions == {}
    state.hint_session("t1", "b", SessionHint(), now=200.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.floats(0, 100)), min_size=1, max_size=12))
def test_with_no_hints_the_order_is_the_base_policys(leases: list[tuple[int, float]]) -> None:
    candidates = [Lease(f"l{i}", "d", f"s{s}", (), (i,), 1, TTL, 1e9, used, 0.0)
                  for i, (s, used) in enumerate(leases)]
    hinted = HintedPolicy(LruPolicy(), SessionBook(Limits()))
    assert hinted.rank(candidates, {}, 0.0) == LruPolicy().rank(candidates, {}, 0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["pause", "end", "low", "high", "none"]), min_size=1, max_size=40),
       st.lists(st.sampled_from(["t1", "t2"]), min_size=40, max_size=40))
def test_owner_counts_stay_true_through_any_hints(hints: list[str], owners: list[str]) -> None:
    book, now = SessionBook(Limits(max_high_sessions_per_owner=2)), 0.0
    for i, (name, owner) in enumerate(zip(hints, owners, strict=False)):
        hint = {"pause": SessionHint(pause_s=5.0), "end": SessionHint(end=True),
                "low": SessionHint(priority=Priority.LOW), "high": SessionHint(priority=Priority.HIGH),
                "none": SessionHint()}[name]
        sid = f"{owner}-{i % 5}"
        now += 3.0
        book.hint(owner, sid, hint, now)
        book.expire(now)
        per_owner = {o: sum(1 for s in book.sessions.values() if s.owner == o) for o in ("t1", "t2")}
        assert {o: n for o, n in per_owner.items() if n} == dict(book._per_owner)
        for o in ("t1", "t2"):
            high = sum(1 for s in book.sessions.values() if s.owner == o and s.priority is Priority.HIGH)
            assert high == book._high[o] <= 2


def test_of_paused_sessions_the_one_resuming_last_goes_first() -> None:
    state = broker(budget=4)
    soon, _ = publish(state, "soon", 0, 2, now=0.0)
    late, _ = publish(state, "late", 10, 2, now=1.0)  # more recent: LRU would keep it over `soon`
    state.hint_session("t1", "soon", SessionHint(pause_s=20.0), now=2.0)
    state.hint_session("t1", "late", SessionHint(pause_s=200.0), now=2.0)
    _, commands = publish(state, "new", 20, 2, now=3.0)
    assert [c.lease_id for c in commands] == [late.lease_id] and soon.lease_id in state.leases
