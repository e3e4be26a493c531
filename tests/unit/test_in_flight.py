"""The routers' in-flight counts: the broker's book of them, placement priced on them, and the router's counter."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvloop.broker.core import (
    BrokerState,
    Decision,
    EngineInfo,
    EngineLoad,
    LruPolicy,
    PlaceInput,
    PlacementPolicy,
    Role,
)
from kvloop.broker.core.in_flight import InFlight
from kvloop.router.in_flight import InFlightCounts
from kvloop.shared.errors import InvalidArgument
from kvloop.shared.hashing import ExtraKeys, block_keys

FP, BS = "fp", 16


def test_totals_sum_the_fresh_routers_and_none_means_nobody_counts() -> None:
    book = InFlight(ttl_s=10.0)
    assert book.totals(0.0) is None
    book.report("r1", {"d": 2, "p": 1}, now=0.0)
    book.report("r2", {"d": 3, "idle": 0}, now=5.0)
    assert book.totals(6.0) == {"d": 5, "p": 1}
    book.report("r1", {}, now=7.0)  # r1's requests ended: its later report replaces the earlier one
    assert book.totals(8.0) == {"d": 3}
    assert book.totals(15.5) == {}  # r2 went silent past the TTL; r1 (7.0) still counts, with nothing in flight
    assert book.totals(17.5) is None and book.routers(17.5) == 0


@given(st.lists(st.tuples(st.sampled_from("abc"), st.dictionaries(st.sampled_from("xyz"), st.integers(0, 9)),
                          st.floats(0, 100)), max_size=30), st.floats(0, 120))
def test_totals_are_the_sum_of_each_fresh_routers_latest_report(reports: list[tuple[str, dict[str, int], float]],
                                                                 now: float) -> None:
    book = InFlight(ttl_s=10.0)
    latest: dict[str, tuple[float, dict[str, int]]] = {}
    for router, counts, at in reports:
        book.report(router, counts, at)
        latest[router] = (at, counts)
    fresh = [counts for at, counts in latest.values() if now - at <= 10.0]
    expected = {e: sum(c.get(e, 0) for c in fresh) for e in "xyz"}
    totals = book.totals(now)
    if not fresh:
        assert totals is None
    else:
        assert totals is not None
        assert {e: totals.get(e, 0) for e in "xyz"} == expected


def test_the_book_keeps_a_bounded_number_of_routers() -> None:
    book = InFlight(max_routers=3)
    for i in range(10):
        book.report(f"r{i}", {"d": 1}, now=float(i))
    assert book.totals(9.0) == {"d": 3}


def _state(policy: PlacementPolicy | None = None) -> BrokerState:
    state = BrokerState(LruPolicy(), policy)
    for eid, role in (("p", Role.PREFILL), ("d", Role.DECODE)):
        state.register(EngineInfo(eid, role, BS, FP, 1000), 0.0)
    return state


def _retained_turn(state: BrokerState) -> list[int]:
    """A decode engine retaining a 64-block turn; the next turn adds a short tail (a DECODE_LOCAL candidate)."""
    tokens = list(range(64 * BS))
    keys = tuple(block_keys(tokens, BS, ExtraKeys(FP)))
    state.publish("d", "s", keys, tuple(range(64)), len(tokens), 0.0, 1.0)
    return [*tokens, *range(100)]


def _place(state: BrokerState, tokens: list[int], now: float) -> tuple[Decision, str]:
    keys = block_keys(tokens, BS, ExtraKeys(FP))
    plan = state.place(PlaceInput(keys, len(tokens), FP, BS, "s"), now)
    return plan.decision, plan.decode_local_veto


def test_a_stale_busy_report_no_longer_vetoes_once_the_router_counts_the_engine_idle() -> None:
    """The compose cluster's case: the decode engine's last keep-alive was taken while the previous turn waited
    for its KV (waiting 1); the router, placing the next turn, has nothing in flight there."""
    state = _state()
    tokens = _retained_turn(state)
    state.keepalive("d", EngineLoad(running_requests=0, waiting_requests=1), now=1.5)
    assert _place(state, tokens, now=2.0) == (Decision.TRANSFER, "decode_busy")  # the report alone: vetoed
    state.report_in_flight("router", {}, now=2.0)
    assert _place(state, tokens, now=2.0) == (Decision.DECODE_LOCAL, "")
    # The router's own streams: 120 of them, each held up by the 100-token tail's 20 ms (the default 5,000
    # tokens/s), 2.4 stream-seconds over the 2 s budget: really busy.
    state.report_in_flight("router", {"d": 120}, now=3.0)
    assert _place(state, tokens, now=3.0) == (Decision.TRANSFER, "decode_busy")
    # Past the TTL the router's counts stand for nothing: the sidecars' reports are back.
    assert _place(state, tokens, now=3.0 + state.placement_policy.in_flight_ttl_s + 1) == (Decision.TRANSFER,
                                                                                          "decode_busy")


def test_counts_for_engines_the_broker_does_not_know_are_dropped_and_the_router_id_is_checked() -> None:
    state = _state()
    state.report_in_flight("router", {"ghost": 5, "d": 1}, now=0.0)
    assert state.in_flight.totals(0.0) == {"d": 1}
    with pytest.raises(InvalidArgument) as exc:
        state.report_in_flight("", {}, now=0.0)
    assert exc.value.field == "router_id"


def test_the_prefill_queue_is_priced_on_the_routers_counts() -> None:
    state = _state()
    state.register(EngineInfo("p2", Role.PREFILL, BS, FP, 1000), 0.0)
    tokens = list(range(40 * BS))
    keys = block_keys(tokens, BS, ExtraKeys(FP))
    state.keepalive("p2", EngineLoad(running_requests=3), now=1.0)  # an old report: p2 busy
    state.report_in_flight("router", {"p": 2}, now=2.0)  # now: p has two of this router's requests, p2 none
    plan = state.place(PlaceInput(keys, len(tokens), FP, BS, "s"), 2.0)
    assert plan.decision is Decision.RECOMPUTE and plan.prefill.engine_id == "p2"


def test_the_routers_counter_counts_while_a_request_runs_even_when_it_fails() -> None:
    counts = InFlightCounts()
    with counts.track("d"), counts.track("d"):
        assert counts["d"] == 2 and counts.snapshot() == {"d": 2}
    with pytest.raises(RuntimeError), counts.track("p"):
        assert counts.snapshot() == {"p": 1}
        raise RuntimeError("engine failed")
    assert counts.snapshot() == {} and counts["p"] == 0


def test_the_busy_veto_follows_from_the_stall_budget_not_a_count() -> None:
    """Thirty streams: a 100-token tail holds them up 30 x 20 ms, inside the 2 s budget; a 400-token tail
    30 x 80 ms, over it (the stall left unpriced here, to see the budget alone)."""
    state = _state(PlacementPolicy(decode_stall_weight=0.0))
    tokens = _retained_turn(state)
    state.report_in_flight("router", {"d": 30}, now=2.0)
    assert _place(state, tokens, now=2.0) == (Decision.DECODE_LOCAL, "")
    assert _place(state, [*tokens, *range(300)], now=2.0) == (Decision.TRANSFER, "decode_busy")


def test_the_stall_of_the_decode_engines_streams_is_priced() -> None:
    """Two streams: the 100-token tail costs 20 ms + 0.25 x 2 x 20 ms held up, under TRANSFER's 80 ms hop + pull
    + tail (122 ms); 24 streams: 20 + 0.25 x 24 x 20 ms = 140 ms, over it, so the tail moves to the prefill engine
    (the veto: costlier)."""
    state = _state()
    tokens = _retained_turn(state)
    keys = block_keys(tokens, BS, ExtraKeys(FP))
    state.report_in_flight("router", {"d": 2}, now=2.0)
    plan = state.place(PlaceInput(keys, len(tokens), FP, BS, "s"), 2.0)
    assert plan.decision is Decision.DECODE_LOCAL
    assert plan.cost.decode_stall_s == pytest.approx(0.25 * 2 * 100 / 5000)
    assert plan.cost.decode_local_s == pytest.approx(1.5 * 100 / 5000)
    state.report_in_flight("router", {"d": 24}, now=3.0)
    assert _place(state, tokens, now=3.0) == (Decision.TRANSFER, "costlier")


def test_queued_tokens_price_the_wait_and_spread_long_tails_over_the_prefill_engines() -> None:
    """p holds the prefix in its cache and would prefill locally; 20,000 tokens queued there (4 s at 5,000/s)
    make the idle p2, which must compute the whole prompt (40 blocks, 0.13 s), the cheaper engine."""
    state = _state()
    state.register(EngineInfo("p2", Role.PREFILL, BS, FP, 1000), 0.0)
    tokens = list(range(40 * BS))
    keys = block_keys(tokens, BS, ExtraKeys(FP))
    state.report_cache_events("p", "", 1, reset=False, cleared=False, stored=keys[:30], removed=[])
    state.report_in_flight("router", {"p": 1}, now=1.0, tokens={"p": 100})
    plan = state.place(PlaceInput(keys, len(tokens), FP, BS, "s"), 1.0)
    assert (plan.decision, plan.prefill.engine_id) == (Decision.PREFILL_LOCAL, "p")
    assert plan.cost.prefill_queue_s == pytest.approx(100 / 5000)
    state.report_in_flight("router", {"p": 1}, now=2.0, tokens={"p": 20_000})
    plan = state.place(PlaceInput(keys, len(tokens), FP, BS, "s"), 2.0)
    assert (plan.decision, plan.prefill.engine_id) == (Decision.RECOMPUTE, "p2") and plan.cost.prefill_queue_s == 0


def test_tokens_in_flight_over_any_prompt_are_refused_naming_the_field() -> None:
    state = _state()
    with pytest.raises(InvalidArgument) as exc:
        state.report_in_flight("router", {"d": 1}, now=0.0, tokens={"d": 1 << 40})
    assert exc.value.field == "in_flight_tokens"


def test_the_routers_counter_counts_tokens_until_computed() -> None:
    counts = InFlightCounts()
    with counts.track("p", 300), counts.track("p", 200) as computed:
        assert counts.tokens() == {"p": 500}
        computed()
        computed()  # once only
        assert counts.tokens() == {"p": 300} and counts["p"] == 2
    assert counts.tokens() == {} and counts.snapshot() == {}


def test_the_places_of_one_burst_see_the_ones_before_and_not_for_long() -> None:
    """Two fresh 2,000-token prompts placed at one instant, each with the router's same snapshot (nothing in
    flight): the first two go to the two prefill engines in turn, not both to the first; 0.2 s later (placed_s)
    the placements no longer count, and the router's own counts are all there is."""
    state = _state()
    state.register(EngineInfo("p2", Role.PREFILL, BS, FP, 1000), 0.0)
    tokens = list(range(5000, 7000))
    keys = block_keys(tokens, BS, ExtraKeys(FP))
    engines = []
    for _ in range(2):
        state.report_in_flight("router", {}, now=2.0, tokens={})
        plan = state.place(PlaceInput(keys, len(tokens), FP, BS), 2.0)
        state.count_placement(plan, 2.0)
        engines.append(plan.prefill.engine_id)
    assert sorted(engines) == ["p", "p2"]
    placed = {e.info.engine_id: e.load for e in state.engines_as_placed(2.0)}
    assert placed["p"].queued_prefill_tokens == placed["p2"].queued_prefill_tokens == 2000
    assert placed["d"].running_requests == 0  # the decode requests start when their prefills end
    state.report_in_flight("router", {}, now=2.3, tokens={})
    assert all(e.load.queued_prefill_tokens == 0 and e.load.running_requests == 0
               for e in state.engines_as_placed(2.3))
    # A short tail on the decode engine holding its history is the router's to count: not counted twice.
    tail = _retained_turn(state)
    plan = state.place(PlaceInput(block_keys(tail, BS, ExtraKeys(FP)), len(tail), FP, BS, "s"), 2.4)
    state.count_placement(plan, 2.4)
    assert plan.decision is Decision.DECODE_LOCAL
    assert all(e.load.queued_prefill_tokens == 0 for e in state.engines_as_placed(2.4))
