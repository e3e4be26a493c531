"""The broker core's prefetch: a paused session's host-tier lease is promoted back into its engine's pool
``session_prefetch_lead_s`` before the stated resume, into free budget room only, under a pin that keeps the host
slots until the engine reports; the pool copy the engine publishes supersedes the host lease."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest

from kvloop.broker.core import BrokerState, EngineInfo, EvictionCommand, EvictionReason, Limits, LruPolicy, Role, Tier
from kvloop.broker.core.model import Decision, Lease, Plan
from kvloop.broker.core.prefetch import choose_promotion, promotable
from kvloop.broker.core.sessions import SessionHint
from kvloop.shared.errors import FailedPrecondition, NotFound
from kvloop.shared.hashing import ExtraKeys, block_keys
from kvloop.shared.vocabulary import Reason

EXTRA = ExtraKeys("fp")
FIRST = 50
LEAD = 5.0


def broker(budget: int = 4, host: int = 4, **limits: Any) -> BrokerState:
    counter = itertools.count(1)
    state = BrokerState(LruPolicy(), limits=Limits(**{"engine_ttl_s": 1e6, "session_prefetch_lead_s": LEAD,
                                                      **limits}),
                        new_id=lambda: f"l{next(counter)}")
    state.register(EngineInfo("d", Role.DECODE, 1, "fp", budget, host_tier_blocks=host, host_tier_first_id=FIRST),
                   0.0)
    state.take_changes()
    return state


def keys(session: int, n: int) -> tuple[bytes, ...]:
    return tuple(block_keys(list(range(session * 1000, session * 1000 + n)), 1, EXTRA))


def publish(state: BrokerState, session: int, block_ids: range, now: float) -> tuple[Lease, list[EvictionCommand]]:
    """A lease whose TTL (600 s) outlasts every test here: only hints, budgets and promotions move it."""
    return state.publish("d", f"s{session}", keys(session, len(block_ids)), tuple(block_ids), len(block_ids), 600.0,
                         now)


def demoted_pause(state: BrokerState, resume_in: float = 100.0) -> Lease:
    """Session 1 paused at t=1 for ``resume_in`` s; session 2's lease at t=2 demotes session 1's to the host tier."""
    lease, _ = publish(state, 1, range(0, 3), 0.0)
    state.hint_session("o", "s1", SessionHint(pause_s=resume_in), 1.0)
    _, commands = publish(state, 2, range(3, 6), 2.0)
    assert [c.lease_id for c in commands if c.demote_to] == [lease.lease_id]
    state.complete_demotion("d", lease.lease_id, True, 3.0)
    assert state.leases[lease.lease_id].tier is Tier.HOST
    state.take_changes()
    return state.leases[lease.lease_id]


def promotion(state: BrokerState) -> EvictionCommand:
    """The one promotion among the commands since the last look (an end's release may be there too)."""
    return promotion_of(state.take_changes().commands)


def promotion_of(commands: list[EvictionCommand]) -> EvictionCommand:
    (cmd,) = [c for c in commands if c.reason is EvictionReason.PREFETCH]
    return cmd


def promoted(state: BrokerState) -> tuple[Lease, EvictionCommand]:
    """Session 1's demoted lease, promoted at 96 s (5 s before its resume) into the room session 2's end freed."""
    lease = demoted_pause(state)
    state.hint_session("o", "s2", SessionHint(end=True), 50.0)
    state.tick(96.0)
    return lease, promotion(state)


def plan(decision: Decision, session: str = "s1", decode: str = "d") -> Plan:
    info = EngineInfo(decode, Role.DECODE, 1, "fp", 4)
    return Plan(decision=decision, reason=Reason.SHORT_TAIL_ON_DECODE, prompt_blocks=3, threshold_tokens=1,
                prefill=info, decode=info, decode_sticky=True, session_id=session)


def test_a_demoted_paused_session_is_promoted_lead_seconds_before_its_resume_once_room_is_free() -> None:
    state = broker()
    lease = demoted_pause(state)
    state.hint_session("o", "s2", SessionHint(end=True), 50.0)  # session 2 done: its pool room is free
    state.take_changes()
    state.tick(101.0 - LEAD - 0.01)
    assert not state.take_changes().commands
    state.tick(101.0 - LEAD)
    commands = state.take_changes().commands
    assert len(commands) == 1
    cmd = commands[0]
    assert (cmd.reason, cmd.tier, cmd.lease_id, cmd.block_ids) == (EvictionReason.PREFETCH, Tier.HOST,
                                                                    lease.lease_id, lease.block_ids)
    assert cmd.promote_pin in state.pins and cmd.promote_within_s == state.limits.demotion_timeout_s
    assert state.leases[lease.lease_id].pinned and not cmd.demote_to
    state.tick(101.0 - LEAD + 1)
    assert not state.take_changes().commands  # each pause is prefetched once


def test_a_promotion_takes_the_room_of_a_lease_lower_in_the_eviction_order_only() -> None:
    state = broker(host=8)
    lease = demoted_pause(state)  # session 2 holds 3 of the 4 blocks and said nothing: below a paused session
    state.tick(101.0 - LEAD)
    commands = state.take_changes().commands
    demoted = [c for c in commands if c.demote_to]
    assert [c.lease_id for c in demoted] == ["l2"] and promotion_of(commands).lease_id == lease.lease_id
    assert not set(demoted[0].demote_to) & set(lease.block_ids)  # the promoted lease's slots stay its own
    state = broker(host=4)  # no tier room for session 2's lease beside the pinned one: it is dropped, not the pinned
    lease = demoted_pause(state)
    state.tick(101.0 - LEAD)
    commands = state.take_changes().commands
    assert [(c.lease_id, c.reason) for c in commands] == [("l2", EvictionReason.BUDGET), (lease.lease_id,
                                                                                          EvictionReason.PREFETCH)]
    # A session that resumes sooner keeps its room; one that resumes later gives it up.
    for resume, promoted in ((98.0, False), (200.0, True)):
        state = broker()
        lease = demoted_pause(state)
        state.hint_session("o", "s2", SessionHint(pause_s=resume - 3.0), 3.0)
        state.take_changes()
        state.tick(101.0 - LEAD)
        commands = state.take_changes().commands
        assert any(c.reason is EvictionReason.PREFETCH for c in commands) is promoted, resume
        assert state.leases[lease.lease_id].pinned is promoted


def test_a_session_that_paused_anew_is_prefetched_at_its_new_resume_only() -> None:
    state = broker()
    lease = demoted_pause(state)
    state.hint_session("o", "s2", SessionHint(end=True), 50.0)
    state.hint_session("o", "s1", SessionHint(pause_s=200.0), 60.0)  # a longer tool run: resume at 260
    state.take_changes()
    state.tick(101.0 - LEAD)
    assert not state.take_changes().commands
    state.tick(260.0 - LEAD)
    assert [c.lease_id for c in state.take_changes().commands] == [lease.lease_id]


def test_the_pin_keeps_the_slots_until_the_report_then_the_pool_copy_supersedes_the_host_lease() -> None:
    state = broker()
    lease, cmd = promoted(state)
    with pytest.raises(FailedPrecondition, match="pin_id"):
        state.complete_promotion("other", lease.lease_id, cmd.promote_pin, True, 96.5)
    # The engine retained the loaded copy and its sidecar published it (same keys, pool blocks) before reporting.
    pool, _ = publish(state, 1, range(6, 9), 97.0)
    assert lease.lease_id in state.leases  # pinned: superseded when the pin ends
    state.complete_promotion("d", lease.lease_id, cmd.promote_pin, True, 97.5)
    assert lease.lease_id not in state.leases and pool.lease_id in state.leases
    freed = state.take_changes().commands
    assert [(c.lease_id, c.reason, c.tier) for c in freed] == [(lease.lease_id, EvictionReason.SUPERSEDED, Tier.HOST)]
    assert state.host_blocks("d") == 0 and state.retained_blocks("d") == 3
    assert state.prefetch_use(plan(Decision.DECODE_LOCAL)) == "used"
    assert state.prefetch_use(plan(Decision.DECODE_LOCAL)) is None  # counted once


def test_a_failed_or_unreported_promotion_leaves_the_lease_on_the_host_tier() -> None:
    state = broker()
    lease, cmd = promoted(state)
    state.complete_promotion("d", lease.lease_id, cmd.promote_pin, False, 97.0)
    assert state.leases[lease.lease_id].tier is Tier.HOST and not state.leases[lease.lease_id].pinned
    assert state.prefetch_use(plan(Decision.TRANSFER)) is None  # nothing was loaded: nothing to count
    with pytest.raises(NotFound, match="pin_id"):
        state.complete_promotion("d", lease.lease_id, cmd.promote_pin, True, 98.0)


def test_a_prefetch_the_next_turn_did_not_use_counts_unused() -> None:
    state = broker()
    lease, cmd = promoted(state)
    state.complete_promotion("d", lease.lease_id, cmd.promote_pin, True, 97.0)
    assert state.prefetch_use(plan(Decision.TRANSFER)) == "unused"


def test_choose_promotion_takes_the_longest_promotable_lease_that_fits() -> None:
    def lease(lease_id: str, tokens: int, blocks: int, **kw: Any) -> Lease:
        return Lease(lease_id, "d", "s", (), tuple(range(blocks)), tokens, 60.0, 60.0, 0.0, 0.0, tier=Tier.HOST,
                     **kw)

    short, long = lease("a", 2, 2), lease("b", 4, 4)
    assert choose_promotion([short, long], lambda engine: 4) is long
    assert choose_promotion([short, long], lambda engine: 3) is None  # the latest turn or nothing
    demoting = dataclasses.replace(long, demoting_until=5.0)
    pending = dataclasses.replace(long, pending=EvictionReason.TTL_EXPIRED)
    pooled = dataclasses.replace(long, tier=Tier.POOL)
    pinned = dataclasses.replace(long, pin_ids={"p"})
    assert not any(promotable(x) for x in (demoting, pending, pooled, pinned))
    assert choose_promotion([short, demoting], lambda engine: 4) is short


def test_a_demoted_paused_lease_keeps_its_pause_past_its_ttl() -> None:
    state = broker(session_prefetch_lead_s=0.0)  # no prefetch: the tier holds it
    lease, _ = state.publish("d", "s1", keys(1, 3), (0, 1, 2), 3, 60.0, 0.0)
    state.hint_session("o", "s1", SessionHint(pause_s=100.0), 1.0)  # held until 101 + the margin (30 s)
    publish(state, 2, range(3, 6), 2.0)  # demotes session 1's lease
    state.complete_demotion("d", lease.lease_id, True, 3.0)
    state.tick(120.0)  # its TTL (60 s from the demotion) has run out; the pause has not
    assert state.leases[lease.lease_id].tier is Tier.HOST
    state.tick(131.0)
    assert lease.lease_id not in state.leases
