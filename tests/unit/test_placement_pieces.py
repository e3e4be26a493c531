"""The pieces ``place()`` is made of, each on its own: the scene (what a request finds), the prices, the named
vetoes and the choice. The paths end to end are in test_paths.py and test_core_state.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvloop.broker.core import Decision, EngineInfo, EngineLoad, EngineRecord, Lease, PlaceInput, PlacementPolicy, Role
from kvloop.broker.core.choice import cheapest, choose
from kvloop.broker.core.index import Match
from kvloop.broker.core.model import Tier
from kvloop.broker.core.pricing import Option, Tail, prefill_options, read_tail, step_room
from kvloop.broker.core.scene import Scene, read_scene
from kvloop.broker.core.vetoes import NOT_POSSIBLE, RULES, Verdict, first_veto, judge
from kvloop.shared.errors import FailedPrecondition
from kvloop.shared.vocabulary import UNKNOWN_WORDS, Reason, Veto

FP, BS = "fp", 16
POLICY = PlacementPolicy()


def engine(eid: str, role: Role, step_tokens: int = 0, **load: Any) -> EngineRecord:
    return EngineRecord(EngineInfo(eid, role, BS, FP, 1000, step_tokens=step_tokens), 0.0, 0.0, EngineLoad(**load))


def scene(engines: list[EngineRecord], tokens: int = 64 * BS + 100, lease: tuple[str, int] | None = None,
          cached: dict[str, int] | None = None, tier: Tier = Tier.POOL) -> Scene:
    matches = []
    if lease is not None:
        eid, blocks = lease
        matches = [Match(Lease("l", eid, "s", (), tuple(range(blocks)), blocks * BS, 60.0, 1e9, 0.0, 0.0,
                               tier=tier), blocks)]
    request = PlaceInput(tuple(b"k" for _ in range(-(-tokens // BS))), tokens, FP, BS, "s")
    return read_scene(request, engines, matches, POLICY, cached, None)


def test_the_rules_name_every_veto_but_costlier_in_the_order_they_are_asked() -> None:
    assert [veto for veto, _ in RULES] == [v for v in Veto if v is not Veto.COSTLIER and v not in UNKNOWN_WORDS]
    assert all(rule.__name__ == veto.value for veto, rule in RULES)


def test_the_first_rule_that_refuses_is_the_veto() -> None:
    decode = engine("d", Role.DECODE, waiting_requests=1)
    tail = read_tail(scene([engine("p", Role.PREFILL), decode], lease=("d", 64)), decode)
    assert first_veto(tail, POLICY) is Veto.DECODE_BUSY
    assert first_veto(replace(tail, tokens=600), POLICY) is Veto.TAIL_TOKENS  # asked before the busy veto
    assert first_veto(replace(tail, enabled=False, tokens=600), POLICY) is Veto.DISABLED
    assert first_veto(tail, POLICY, rules=()) is None


def test_a_step_its_streams_fill_leaves_no_room() -> None:
    assert step_room(0, 50, 300) == 300  # not reported: the whole tail in one step
    assert step_room(512, 50, 300) == 300 and step_room(512, 400, 300) == 112 and step_room(64, 64, 300) == 0


def test_a_vetoed_tail_on_a_self_serving_engine_is_forced_only_where_no_other_engine_can_take_it() -> None:
    both = engine("b", Role.BOTH)
    tail = read_tail(scene([both], tokens=64 * BS + 600, lease=("b", 64)), both)
    assert tail.self_serve and first_veto(tail, POLICY) is Veto.TAIL_TOKENS
    assert judge(tail, POLICY, others=False) == Verdict(priced=True, veto=None, forced=True)
    assert judge(tail, POLICY, others=True).veto is Veto.TAIL_TOKENS and not judge(tail, POLICY, others=True).priced


def test_nothing_to_judge_where_the_decode_engine_holds_nothing_and_serves_no_prompt() -> None:
    decode = engine("d", Role.DECODE)
    tail = read_tail(scene([engine("p", Role.PREFILL), decode]), decode)
    assert not tail.possible and judge(tail, POLICY, others=True) is NOT_POSSIBLE


def test_a_lease_on_the_host_tier_is_pulled_not_local() -> None:
    fleet = [engine("p", Role.PREFILL), engine("d", Role.DECODE)]
    assert scene(fleet, lease=("d", 64)).held(fleet[1]) == 64
    assert scene(fleet, lease=("d", 64), tier=Tier.HOST).held(fleet[1]) == 0
    assert scene(fleet, cached={"d": 2}).local(fleet[1]) == 0  # 2 blocks are under the 64-token threshold


def test_no_engine_of_a_role_is_a_failed_precondition() -> None:
    with pytest.raises(FailedPrecondition, match="no live decode engine"):
        scene([engine("p", Role.PREFILL)])


def test_each_prefill_engine_is_priced_with_its_own_prefix_and_a_pull_of_the_rest() -> None:
    p1, p2, both = engine("p1", Role.PREFILL), engine("p2", Role.PREFILL), engine("b", Role.BOTH)
    s = scene([p1, p2, both], lease=("p2", 64), cached={"p1": 8})
    paths = {(o.prefill.info.engine_id, o.decision) for o in prefill_options(s, both, self_serve=True)}
    assert paths == {("p1", Decision.PREFILL_LOCAL), ("p1", Decision.TRANSFER), ("p2", Decision.PREFILL_LOCAL),
                     ("b", Decision.TRANSFER)}  # b serves itself: no prefill request to it, but it may pull


def test_equal_prices_go_to_the_path_that_moves_least_then_the_less_loaded_engine() -> None:
    idle, busy = engine("z", Role.PREFILL), engine("a", Role.PREFILL, running_requests=1)
    options = [Option(1.0, Decision.RECOMPUTE, idle, 0, 0), Option(1.0, Decision.TRANSFER, busy, 0, 4),
               Option(1.0, Decision.TRANSFER, idle, 0, 4)]
    assert cheapest(options) is options[2]


def test_a_tail_that_loses_on_price_is_costlier_and_the_recompute_says_so() -> None:
    decode = engine("d", Role.DECODE)
    tail: Tail = read_tail(scene([engine("p", Role.PREFILL), decode], lease=("d", 64)), decode)
    verdict = judge(tail, POLICY, others=True)
    local = Option(2.0, Decision.DECODE_LOCAL, decode, 64, 64)
    recompute = Option(1.0, Decision.RECOMPUTE, engine("p", Role.PREFILL), 0, 0)
    choice = choose([recompute, local], tail, verdict, seen=64)
    assert (choice.best, choice.reason, choice.veto) == (recompute, Reason.RECOMPUTE_CHEAPER, Veto.COSTLIER)
