"""The four paths of placement (DECODE_LOCAL, PREFILL_LOCAL, TRANSFER, RECOMPUTE) on the pure ``place()``:
each chosen when it should be and not when it should not, with the plan saying why; plus a property that the
plan always takes the cheapest allowed path of its own cost model."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvloop.broker.core import Decision, EngineInfo, EngineLoad, EngineRecord, Lease, PlaceInput, PlacementPolicy, Role
from kvloop.broker.core.index import Match
from kvloop.broker.core.placement import place
from kvloop.shared.hashing import ExtraKeys, block_keys

FP, BS = "fp", 16


def engine(eid: str, role: Role, **load: Any) -> EngineRecord:
    return EngineRecord(EngineInfo(eid, role, BS, FP, 1000), 0.0, 0.0, EngineLoad(**load))


def lease_on(eid: str, blocks: int) -> Lease:
    keys = tuple(block_keys(list(range(blocks * BS)), BS, ExtraKeys(FP)))
    return Lease(f"lease-{eid}", eid, "s", keys, tuple(range(blocks)), blocks * BS, 60.0, 1e9, 0.0, 0.0)


def plan_for(num_tokens: int, engines: list[EngineRecord], *, lease: tuple[str, int] | None = None,
             cached: dict[str, int] | None = None, policy: PlacementPolicy | None = None,
             residuals: tuple[float, float] = (0.0, 0.0)) -> Any:
    keys = block_keys(list(range(num_tokens)), BS, ExtraKeys(FP))
    matches = [Match(lease_on(*lease), lease[1])] if lease else []
    request = PlaceInput(keys, num_tokens, FP, BS, "s", pd_residual_s=residuals[0],
                         decode_local_residual_s=residuals[1])
    return place(request, engines, matches, policy or PlacementPolicy(), cached=cached)


def cluster(**decode_load: Any) -> list[EngineRecord]:
    return [engine("p1", Role.PREFILL), engine("p2", Role.PREFILL), engine("d", Role.DECODE, **decode_load)]


def test_a_short_tail_runs_on_the_decode_engine_that_holds_the_prefix() -> None:
    plan = plan_for(64 * BS + 100, cluster(), lease=("d", 64))
    assert (plan.decision, plan.reason) == (Decision.DECODE_LOCAL, "short_tail_on_decode")
    assert plan.decode.engine_id == "d" and plan.prefill.engine_id == "d" and plan.decode_sticky
    assert plan.local_tokens == 64 * BS and plan.recompute_tokens == 100 and plan.pull_tokens == 0
    assert plan.decode_local_veto == "" and plan.cached_tokens_seen == 64 * BS
    assert 0 < plan.cost.decode_local_s < plan.cost.transfer_path_s < plan.cost.recompute_path_s


@pytest.mark.parametrize(("tokens", "lease_blocks", "load", "policy", "veto"), [
    (64 * BS + 600, 64, {}, PlacementPolicy(), "tail_tokens"),          # 600 > 512 uncached tokens
    (10 * BS + 200, 10, {}, PlacementPolicy(), "tail_share"),           # 200 of 360 tokens is over half
    (64 * BS + 100, 64, {"waiting_requests": 1}, PlacementPolicy(), "decode_busy"),
    (64 * BS + 100, 64, {"running_requests": 120}, PlacementPolicy(), "decode_busy"),  # 120 x 20 ms > 2 s
    (64 * BS + 100, 64, {}, PlacementPolicy(decode_local=False), "disabled"),
])
def test_decode_local_is_vetoed_by_each_knob(tokens: int, lease_blocks: int, load: dict[str, Any],
                                             policy: PlacementPolicy, veto: str) -> None:
    plan = plan_for(tokens, cluster(**load), lease=("d", lease_blocks), policy=policy)
    assert plan.decision is Decision.TRANSFER and plan.decode_local_veto == veto
    assert plan.prefill.engine_id in ("p1", "p2") and plan.pull_tokens == lease_blocks * BS


def test_a_tail_is_vetoed_when_the_decode_engines_step_has_no_room() -> None:
    """A 500-token tail runs on a decode engine of 128-token steps in chunks of what its streams leave; with 128
    streams the step has no room for a chunk at all (the stream-seconds budget lifted here, to see the step alone).
    A short tail is not held to the step budget (that is for prompts only relief lets on the engine)."""
    def with_step(step_tokens: int, **load: Any) -> list[EngineRecord]:
        d = EngineRecord(EngineInfo("d", Role.DECODE, BS, FP, 1000, step_tokens=step_tokens), 0.0, 0.0,
                         EngineLoad(prefill_tokens_per_s=10_000, **load))
        return [engine("p", Role.PREFILL, prefill_tokens_per_s=10_000), d]

    tokens = 64 * BS + 500
    assert plan_for(tokens, with_step(0), lease=("d", 64)).decision is Decision.DECODE_LOCAL
    chunked = plan_for(tokens, with_step(128), lease=("d", 64))
    assert chunked.decision is Decision.DECODE_LOCAL and chunked.decode_local_veto == ""
    lifted = PlacementPolicy(decode_local_stall_budget_s=1e9)
    full = plan_for(tokens, with_step(128, running_requests=128), lease=("d", 64), policy=lifted)
    assert (full.decision, full.decode_local_veto) == (Decision.TRANSFER, "step_full")


def test_decode_local_loses_to_a_cheaper_path() -> None:
    # The decode engine computes slowly, the prefill engine is fast: P/D with a pull is cheaper.
    engines = [engine("p", Role.PREFILL, prefill_tokens_per_s=1e6), engine("d", Role.DECODE, prefill_tokens_per_s=500)]
    plan = plan_for(64 * BS + 100, engines, lease=("d", 64))
    assert plan.decision is not Decision.DECODE_LOCAL and plan.decode_local_veto == "costlier"


def test_the_routers_measured_residuals_price_the_paths_of_their_kind() -> None:
    """The decode engine has 1,500 tail tokens queued (0.15 s at 10,000 tokens/s): at the idle hop (80 ms) a pull
    to a prefill engine is cheaper. A router that measured its P/D turns 0.4 s over their estimates keeps the tail
    on the decode engine; one that measured its DECODE_LOCAL turns 0.5 s over sends it over the hop again."""
    def busy() -> list[EngineRecord]:
        return [engine("p", Role.PREFILL, prefill_tokens_per_s=10_000, queued_prefill_tokens=0),
                engine("d", Role.DECODE, prefill_tokens_per_s=10_000, queued_prefill_tokens=1500)]

    tokens = 64 * BS + 100
    idle = plan_for(tokens, busy(), lease=("d", 64))
    assert (idle.decision, idle.decode_local_veto) == (Decision.TRANSFER, "costlier")
    measured = plan_for(tokens, busy(), lease=("d", 64), residuals=(0.4, 0.0))
    assert (measured.decision, measured.decode_local_veto) == (Decision.DECODE_LOCAL, "")
    assert measured.cost.transfer_path_s == pytest.approx(idle.cost.transfer_path_s + 0.4)
    assert measured.cost.pd_residual_s == 0.4 and measured.cost.decode_local_residual_s == 0.0
    both = plan_for(tokens, busy(), lease=("d", 64), residuals=(0.4, 0.5))
    assert both.decision is Decision.TRANSFER
    assert both.cost.decode_local_s == pytest.approx(idle.cost.decode_local_s + 0.5)
    off = plan_for(tokens, busy(), lease=("d", 64), residuals=(0.4, 0.0),
                   policy=PlacementPolicy(measured_residuals=False))
    assert off.decision is Decision.TRANSFER and off.cost.pd_residual_s == 0.0
    # A negative residual lowers a price, never below the path's compute.
    faster = plan_for(tokens, busy(), lease=("d", 64), residuals=(-1.0, -1.0))
    assert faster.cost.decode_local_s == pytest.approx(100 / 10_000)
    assert faster.cost.transfer_path_s == pytest.approx(idle.cost.transfer_path_s - 0.08)


def test_a_residual_moves_a_price_at_most_by_the_policys_bound() -> None:
    """One engine's stall holds a kind's turns seconds over their estimates; applied whole, such a residual would
    price the kind out of the fleet. The broker applies at most ``residual_bound_s`` either way, and the plan's
    cost says what it applied."""
    def engines() -> list[EngineRecord]:
        return [engine("p", Role.PREFILL, prefill_tokens_per_s=10_000, queued_prefill_tokens=0),
                engine("d", Role.DECODE, prefill_tokens_per_s=10_000, queued_prefill_tokens=0)]

    tokens = 64 * BS + 100
    idle = plan_for(tokens, engines(), lease=("d", 64))
    stalled = plan_for(tokens, engines(), lease=("d", 64), residuals=(-9.0, 5.0),
                       policy=PlacementPolicy(residual_bound_s=0.5))
    assert (stalled.cost.pd_residual_s, stalled.cost.decode_local_residual_s) == (-0.5, 0.5)
    assert stalled.cost.decode_local_s == pytest.approx(idle.cost.decode_local_s + 0.5)
    within = plan_for(tokens, engines(), lease=("d", 64), residuals=(0.3, -0.2),
                      policy=PlacementPolicy(residual_bound_s=0.5))
    assert (within.cost.pd_residual_s, within.cost.decode_local_residual_s) == (0.3, -0.2)


def test_a_residual_measured_per_engine_reprices_that_engine_only() -> None:
    """A router that measured its P/D turns on prefill engine p1 1.5 s over their estimates (a stall there) and
    none on p2 sends them per engine: p1's paths carry the 1.5 s, p2's nothing, and the turn goes to p2, which the
    kind's figure alone (1.5 s on every P/D path) would not tell apart."""
    engines = [engine("p1", Role.PREFILL, prefill_tokens_per_s=10_000, queued_prefill_tokens=0),
               engine("p2", Role.PREFILL, prefill_tokens_per_s=10_000, queued_prefill_tokens=500),
               engine("d", Role.DECODE, prefill_tokens_per_s=10_000, queued_prefill_tokens=0)]
    tokens = 40 * BS
    keys = block_keys(list(range(tokens)), BS, ExtraKeys(FP))
    kind_only = place(PlaceInput(keys, tokens, FP, BS, "s", decode_local=False, pd_residual_s=1.5), engines, [],
                      PlacementPolicy())
    assert kind_only.prefill.engine_id == "p1"  # the shorter queue: the kind's residual is on both
    per_engine = place(PlaceInput(keys, tokens, FP, BS, "s", decode_local=False, pd_residual_s=1.5,
                                  pd_residual_by_engine={"p1": 1.5}), engines, [], PlacementPolicy())
    assert per_engine.prefill.engine_id == "p2" and per_engine.cost.pd_residual_s == 0.0
    assert per_engine.cost.recompute_path_s == pytest.approx(kind_only.cost.recompute_path_s - 1.5 + 500 / 10_000)


def test_a_prefill_engine_with_the_prefix_in_its_own_cache_serves_it_without_a_pull() -> None:
    plan = plan_for(64 * BS + 100, cluster(), cached={"p2": 64})
    assert (plan.decision, plan.reason) == (Decision.PREFILL_LOCAL, "local_prefix")
    assert plan.prefill.engine_id == "p2" and plan.local_tokens == 64 * BS and plan.pull_tokens == 0
    assert plan.recompute_tokens == 100 and plan.source is None


def test_transfer_pulls_only_beyond_the_chosen_prefill_engines_own_prefix() -> None:
    # p2's cache holds 40 of the 64 blocks the decode engine's lease has: p2, pulling 24, beats p1 pulling 64.
    policy = PlacementPolicy(decode_local=False)
    plan = plan_for(64 * BS + 100, cluster(), lease=("d", 64), cached={"p2": 40}, policy=policy)
    assert (plan.decision, plan.reason) == (Decision.TRANSFER, "transfer_cheaper")
    assert plan.prefill.engine_id == "p2" and plan.local_tokens == 40 * BS and plan.pull_tokens == 24 * BS
    assert plan.matched_tokens == 64 * BS and plan.recompute_tokens == 100


def test_the_prefill_engine_is_chosen_by_cost_not_by_load_alone() -> None:
    # p1 is idle, p2 has one request but holds the prefix: p2's tail is cheaper than p1's whole prompt.
    engines = [engine("p1", Role.PREFILL), engine("p2", Role.PREFILL, running_requests=1), engine("d", Role.DECODE)]
    plan = plan_for(200 * BS + 10, engines, cached={"p2": 200})
    assert plan.decision is Decision.PREFILL_LOCAL and plan.prefill.engine_id == "p2"


@pytest.mark.parametrize(("lease", "cached", "reason"), [
    (None, None, "no_match"),
    (("d", 2), None, "below_threshold"),
    (None, {"p1": 2}, "below_threshold"),
])
def test_recompute_reasons(lease: tuple[str, int] | None, cached: dict[str, int] | None, reason: str) -> None:
    plan = plan_for(20 * BS, cluster(), lease=lease, cached=cached)
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, reason)
    assert plan.recompute_tokens == 20 * BS and plan.local_tokens == 0 and plan.pull_tokens == 0


def test_a_cached_block_holding_the_last_prompt_token_is_not_reused() -> None:
    plan = plan_for(64 * BS, cluster(), cached={"p1": 64})
    assert plan.decision is Decision.PREFILL_LOCAL and plan.local_tokens == 63 * BS and plan.recompute_tokens == BS


PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(
    tokens=st.integers(1, 300 * BS),
    lease_blocks=st.integers(0, 300),
    lease_engine=st.sampled_from(["p1", "d"]),
    cached=st.dictionaries(st.sampled_from(["p1", "p2", "d"]), st.integers(0, 300), max_size=3),
    loads=st.lists(st.tuples(st.integers(0, 10), st.integers(0, 2), st.sampled_from([0.0, 800.0, 5e4])),
                   min_size=3, max_size=3),
    decode_local=st.booleans(),
)
def test_the_plan_takes_the_cheapest_allowed_path(tokens: int, lease_blocks: int, lease_engine: str,
                                                   cached: dict[str, int], loads: list[tuple[int, int, float]],
                                                   decode_local: bool) -> None:
    roles = {"p1": Role.PREFILL, "p2": Role.PREFILL, "d": Role.DECODE}
    engines = [engine(eid, role, running_requests=r, waiting_requests=w, prefill_tokens_per_s=tps)
               for (eid, role), (r, w, tps) in zip(roles.items(), loads, strict=True)]
    plan = plan_for(tokens, engines, lease=(lease_engine, lease_blocks) if lease_blocks else None, cached=cached,
                    policy=PlacementPolicy(decode_local=decode_local))
    usable_max = (tokens - 1) // BS
    assert plan.recompute_tokens + plan.local_tokens + plan.pull_tokens == tokens
    assert plan.local_tokens <= usable_max * BS and plan.pull_tokens <= usable_max * BS
    assert plan.cached_tokens_seen <= usable_max * BS
    costs = {Decision.DECODE_LOCAL: plan.cost.decode_local_s, Decision.PREFILL_LOCAL: plan.cost.prefill_local_s,
             Decision.TRANSFER: plan.cost.transfer_path_s, Decision.RECOMPUTE: plan.cost.recompute_path_s}
    possible = [c for c in costs.values() if c > 0]
    assert costs[plan.decision] == min(possible)
    if plan.decision is Decision.DECODE_LOCAL:
        assert decode_local and plan.prefill.engine_id == plan.decode.engine_id == "d"
        assert plan.recompute_tokens <= 512 and plan.recompute_tokens <= 0.5 * tokens
    elif plan.decision is Decision.TRANSFER:
        assert plan.source is not None and plan.source.engine_id != plan.prefill.engine_id and plan.pull_tokens > 0
    else:
        assert plan.pull_tokens == 0
    if plan.decision is Decision.PREFILL_LOCAL:
        assert plan.local_tokens >= 64 and plan.prefill.engine_id in ("p1", "p2")
    if not decode_local and plan.decode_local_veto:
        assert plan.decode_local_veto == "disabled"


def test_a_request_can_ask_for_strict_pd() -> None:
    keys = block_keys(list(range(64 * BS + 100)), BS, ExtraKeys(FP))
    request = PlaceInput(keys, 64 * BS + 100, FP, BS, "s", decode_local=False)
    plan = place(request, cluster(), [Match(lease_on("d", 64), 64)], PlacementPolicy())
    assert plan.decision is Decision.TRANSFER and plan.decode_local_veto == "disabled"


def test_a_decode_engine_without_its_own_rate_is_priced_at_its_peers() -> None:
    engines = [engine("p1", Role.PREFILL, prefill_tokens_per_s=500.0), engine("d", Role.DECODE)]
    plan = plan_for(64 * BS + 100, engines, lease=("d", 64))
    assert plan.decision is Decision.DECODE_LOCAL and plan.cost.measured
    assert plan.cost.decode_local_s == pytest.approx(100 / 500.0)


def test_recompute_when_only_the_decode_engine_held_the_prefix_and_it_was_vetoed() -> None:
    # No lease (nothing to pull), the decode engine's own cache holds the history, the tail is too long for it.
    plan = plan_for(64 * BS + 700, cluster(), cached={"d": 64})
    assert (plan.decision, plan.reason, plan.decode_local_veto) == (Decision.RECOMPUTE, "decode_local_vetoed",
                                                                    "tail_tokens")
    assert plan.cached_tokens_seen == 64 * BS and plan.recompute_tokens == 64 * BS + 700


def relief_cluster(queued: int | None, step_tokens: int = 256, **decode_load: Any) -> list[EngineRecord]:
    """Two prefill engines with ``queued`` prompt tokens each counted by the routers (None: no router counts them),
    and a decode engine of 256-token steps; every engine at 10,000 tokens/s."""
    d = EngineRecord(EngineInfo("d", Role.DECODE, BS, FP, 1000, step_tokens=step_tokens), 0.0, 0.0,
                     EngineLoad(prefill_tokens_per_s=10_000, queued_prefill_tokens=0, **decode_load))
    return [engine(p, Role.PREFILL, prefill_tokens_per_s=10_000, queued_prefill_tokens=queued) for p in ("p1", "p2")
            ] + [d]


def test_the_decode_engine_relieves_queued_prefill_engines_of_a_fresh_prompt() -> None:
    """2,000 tokens take the decode engine 0.2 s; each prefill engine has 5,000 tokens (0.5 s) queued before it."""
    plan = plan_for(2000, relief_cluster(5000))
    assert (plan.decision, plan.reason) == (Decision.DECODE_LOCAL, "prefill_queued")
    assert plan.decode.engine_id == "d" and plan.prefill.engine_id == "d" and plan.recompute_tokens == 2000
    assert plan.cost.decode_local_s < plan.cost.recompute_path_s


@pytest.mark.parametrize(("queued", "decode_load", "policy", "why"), [
    (1000, {}, PlacementPolicy(), "a queue of 0.1 s: a prefill engine starts it before the decode engine is done"),
    (None, {}, PlacementPolicy(), "no router counts the prefill engines' queues"),
    (5000, {}, PlacementPolicy(prefill_relief=False), "relief off"),
    (5000, {"running_requests": 3}, PlacementPolicy(), "3 streams x 0.2 s is over relief's 0.5 stream-second budget"),
    (5000, {"waiting_requests": 1}, PlacementPolicy(), "the decode engine has a queue of its own"),
])
def test_no_relief(queued: int | None, decode_load: dict[str, Any], policy: PlacementPolicy, why: str) -> None:
    plan = plan_for(2000, relief_cluster(queued, **decode_load), policy=policy)
    assert plan.decision is Decision.RECOMPUTE and plan.prefill.engine_id in ("p1", "p2"), why


def test_relief_is_held_to_a_stricter_stall_budget_than_a_sessions_own_tail() -> None:
    """Twelve streams on the decode engine, the prefill engines queued: its own 400-token tail holds them up
    12 x 40 ms, inside the tails' 2 stream-seconds; a 600-token tail only relief would let on it, 12 x 60 ms, over
    relief's 0.5."""
    own = plan_for(64 * BS + 400, relief_cluster(5000, running_requests=12), lease=("d", 64))
    assert (own.decision, own.reason) == (Decision.DECODE_LOCAL, "short_tail_on_decode")
    long = plan_for(64 * BS + 600, relief_cluster(5000, running_requests=12), lease=("d", 64))
    assert (long.decision, long.decode_local_veto) == (Decision.TRANSFER, "decode_busy")
    lenient = plan_for(64 * BS + 600, relief_cluster(5000, running_requests=12), lease=("d", 64),
                       policy=PlacementPolicy(relief_stall_budget_s=2.0))
    assert (lenient.decision, lenient.reason) == (Decision.DECODE_LOCAL, "prefill_queued")


def test_relief_lifts_the_length_vetoes_only() -> None:
    """A 600-token tail on the decode engine that holds the history: over decode_local_max_tokens, so a pull to a
    prefill engine while those start it sooner; the decode engine once they are queued past its 60 ms; never on
    an engine whose step is unknown or larger than decode_local_max_tokens (512)."""
    tokens = 64 * BS + 600
    assert plan_for(tokens, relief_cluster(0), lease=("d", 64)).decode_local_veto == "tail_tokens"
    plan = plan_for(tokens, relief_cluster(5000), lease=("d", 64))
    assert (plan.decision, plan.reason, plan.local_tokens) == (Decision.DECODE_LOCAL, "prefill_queued", 64 * BS)
    for step_tokens in (0, 2048):
        big_step = plan_for(tokens, relief_cluster(5000, step_tokens=step_tokens), lease=("d", 64))
        assert (big_step.decision, big_step.decode_local_veto) == (Decision.TRANSFER, "step_budget")
