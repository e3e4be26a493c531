"""The multi-turn benchmark's own arithmetic: percentiles that admit too few samples, the health check (with
injected stalls), ratios over repeats, the agent workload's shape, and the kvloop time breakdown."""

from __future__ import annotations

import statistics

import pytest

from kvloop.app.benchmarks.multiturn import (
    TurnRecord,
    breakdown,
    ratios,
    session_hints,
    sizing,
    tier_recovery,
    timing,
)
from kvloop.app.benchmarks.stats import (
    HEALTH_FACTOR,
    health,
    min_samples,
    percentile,
    percentiles_ms,
    requests_above,
    show,
    spread,
)
from kvloop.app.benchmarks.workload import AgentSpec, agent
from kvloop.shared import headers as hdr


def test_a_percentile_over_too_few_samples_is_not_the_maximum() -> None:
    assert (min_samples(0.5), min_samples(0.95), min_samples(0.99)) == (2, 20, 100)
    seven = [0.1 * i for i in range(1, 8)]
    stats = percentiles_ms(seven)
    assert stats["p50"] == 400.0 and stats["p95"] is None and stats["p99"] is None and stats["n"] == 7
    assert show(stats, "p99") == "n/a (n=7)" and show(stats, "p50") == "400"
    hundred = [float(i) for i in range(1, 101)]
    assert percentile(hundred, 0.99) == 99.0 and percentile(hundred, 0.95) == 95.0
    assert percentile([], 0.5) is None


def test_the_health_check_flags_injected_stalls() -> None:
    # 40 turns of ~2 s that the engines spent ~2 s prefilling: healthy.
    assert health(errors=0, turns=40, ttft_sum_s=80.0, prefill_sum_s=70.0, stalled_requests=0).healthy
    # 40 short turns (a cached prefix, a short tail): fixed costs dominate, still healthy.
    assert health(errors=0, turns=40, ttft_sum_s=40 * 0.12, prefill_sum_s=40 * 0.02, stalled_requests=0).healthy
    # The long turns with a 90 s stall in each of three (connections dropped, blocks held until a timeout).
    stalled = health(errors=0, turns=40, ttft_sum_s=80.0 + 3 * 90.0, prefill_sum_s=70.0, stalled_requests=0)
    assert not stalled.healthy and "prefill time" in stalled.reason and stalled.ttft_over_prefill > HEALTH_FACTOR
    queued = health(errors=0, turns=40, ttft_sum_s=80.0, prefill_sum_s=70.0, stalled_requests=2)
    assert not queued.healthy and "queued" in queued.reason
    failed = health(errors=1, turns=39, ttft_sum_s=80.0, prefill_sum_s=70.0, stalled_requests=0)
    assert not failed.healthy and "failed" in failed.reason


def test_requests_queued_past_the_stall_limit_are_counted_from_the_histogram() -> None:
    name = "vllm:request_queue_time_seconds"
    samples = {f'{name}_bucket{{le="5.0",model_name="m"}}': 8.0, f'{name}_bucket{{le="10.0",model_name="m"}}': 9.0,
               f'{name}_bucket{{le="20.0",model_name="m"}}': 10.0, f'{name}_bucket{{le="+Inf",model_name="m"}}': 11.0}
    assert requests_above(samples, name, 10.0) == 2
    assert requests_above(samples, name, 12.0) == 1  # the next edge up: never counts one under the limit
    assert requests_above({}, name, 10.0) == 0


def _summary(p50: float | None, healthy: bool = True, n: int = 50) -> dict:
    return {"late_ttft_ms": {"p50": p50, "p95": None, "p99": None, "n": n}, "itl_ms": {"p99": 1.0, "n": n},
            "healthy": healthy}


def test_ratios_over_repeats_and_withheld_when_unhealthy() -> None:
    reps = [{"one_way": _summary(400.0), "kvloop": _summary(200.0)},
            {"one_way": _summary(300.0), "kvloop": _summary(200.0)},
            {"one_way": _summary(500.0), "kvloop": _summary(200.0)}]
    out, withheld = ratios(reps)
    assert out["one_way_over_kvloop_late_p50"] == {"median": 2.0, "min": 1.5, "max": 2.5, "n": 3}
    assert "too few samples" in withheld["one_way_over_kvloop_late_p99"]
    reps[1]["one_way"]["healthy"] = False
    out, withheld = ratios(reps)
    assert "one_way_over_kvloop_late_p50" not in out and withheld["one_way_over_kvloop_late_p50"] == \
        "unhealthy: one_way"
    assert spread([None, None]) == {"median": None, "min": None, "max": None, "n": 0}


def test_the_agent_workload_starts_small_grows_and_has_a_heavy_tail() -> None:
    spec = AgentSpec(sessions=6, seed=3)
    a, b = agent(spec), agent(spec)
    assert [(c.prefix, c.new_tokens, c.answer_tokens, c.think_s) for c in a] == \
        [(c.prefix, c.new_tokens, c.answer_tokens, c.think_s) for c in b]
    assert agent(AgentSpec(sessions=1, seed=4))[0].new_tokens != a[0].new_tokens
    assert all(c.prefix[:spec.system_tokens] == a[0].prefix[:spec.system_tokens] for c in a)  # shared system prompt
    assert all(spec.turns_min <= c.turns <= spec.turns_max for c in a)
    for c in a:
        contexts = [c.context_tokens(t, 0) for t in range(c.turns)]
        assert contexts[0] < spec.system_tokens + spec.task_max + spec.instruction_max + 1  # starts small
        assert contexts == sorted(contexts) and contexts[-1] > 3 * contexts[0]  # and grows
        assert all(spec.answer_min <= n <= spec.answer_max for n in c.answer_tokens)
        assert all(spec.think_min_s <= s <= spec.think_max_s for s in c.think_s)
    tools = [len(n) for c in a for n in c.new_tokens[1:]]
    assert min(tools) >= spec.tool_min and max(tools) <= spec.tool_max + spec.instruction_max
    assert max(tools) > 4 * statistics.median(tools)  # a heavy tail: a few tool outputs are far longer
    for seed in range(3):  # the default run's workload, as --repeat 3 draws it: enough late turns for a late p95
        default = agent(AgentSpec(seed=seed))
        assert sum(1 for c in default for t in range(c.turns) if c.context_tokens(t, 0) >= 8000) >= 40


def test_sizing_gives_every_prefill_engine_room_for_concurrent_prompts() -> None:
    convs = agent(AgentSpec(sessions=2, turns_min=3, turns_max=3, seed=1))
    size = sizing(convs, 0, concurrency=3, pressure=False)
    assert size.notes["prefill_room_for_longest_prompts"] >= 3 and size.decode_blocks is None
    assert sizing(convs, 0, concurrency=3, pressure=True).decode_blocks is not None
    half, quarter = (sizing(convs, 0, 3, pressure=True, retention_share=f) for f in (0.5, 0.25))
    assert quarter.notes["decode_retention_budget_blocks"] < half.notes["decode_retention_budget_blocks"]
    assert quarter.decode_blocks is not None and half.decode_blocks is not None
    assert quarter.decode_blocks < half.decode_blocks
    tight = sizing(convs, 0, 3, pressure=True, retention_share=0.25, decode_room=1)
    assert tight.decode_blocks == quarter.decode_blocks - 2 * tight.notes["longest_prompt_blocks"]
    many = agent(AgentSpec(sessions=12, turns_min=3, turns_max=3, seed=1))
    churning = sizing(many, 0, 12, pressure=False, prefill_room=2)
    assert churning.notes["prefill_room_for_longest_prompts"] == 2
    assert churning.prefill_blocks < sizing(many, 0, 12, pressure=False).prefill_blocks


def test_a_hinting_agent_says_each_tool_pause_then_its_end() -> None:
    conv = agent(AgentSpec(sessions=1, turns_min=3, turns_max=3, seed=2))[0]
    said = [session_hints(conv, turn, 0.0) for turn in range(conv.turns)]
    assert said[-1] == {hdr.SESSION_END: "true"}
    assert [float(h[hdr.SESSION_PAUSE]) for h in said[:-1]] == pytest.approx(conv.think_s[:2], abs=1e-3)


def test_the_breakdown_reads_the_routers_timing_and_keeps_what_is_left() -> None:
    record = TurnRecord("kvloop", 0, "s", 2, 9000, ttft_s=0.2, decision="TRANSFER", detail={
        "timing": "tokenize=0.0,place=3.0,pin=1.0,prefill=120.0,decode_first=50.0,prefill_queue=5.0,pull=10.0,"
                  "prefill_compute=80.0"})
    steps = timing(record)
    assert steps["prefill_http"] == pytest.approx(25.0) and "prefill" not in steps
    assert steps["router_other"] == pytest.approx(200.0 - (3 + 1 + 50 + 5 + 10 + 80 + 25))
    table = breakdown([record, record])
    assert table["pull"] == {"p50": 10.0, "p90": 10.0, "n": 2} and "publication_wait" not in table


def test_tier_recovery_counts_the_turns_pressure_made_recompute_and_the_tier_won_back() -> None:
    def rec(config: str, conv: str, turn: int, computed: int, error: str = "") -> TurnRecord:
        return TurnRecord(config, 0, conv, turn, 100, 0.1, "TRANSFER", error=error,
                          detail={"computed-tokens": computed})

    records = [
        *(rec(c, "a", 1, 1600) for c in ("kvloop", "kvloop_pressure", "kvloop_pressure_tier")),  # nothing lost
        rec("kvloop", "a", 2, 100), rec("kvloop_pressure", "a", 2, 3000), rec("kvloop_pressure_tier", "a", 2, 120),
        rec("kvloop", "b", 2, 100), rec("kvloop_pressure", "b", 2, 3000), rec("kvloop_pressure_tier", "b", 2, 3000),
        rec("kvloop", "c", 2, 100), rec("kvloop_pressure", "c", 2, 200), rec("kvloop_pressure_tier", "c", 2, 100),
        rec("kvloop", "d", 2, 100), rec("kvloop_pressure", "d", 2, 3000),  # its tier turn failed: not compared
        rec("kvloop_pressure_tier", "d", 2, 0, error="timeout"),
    ]
    out = tier_recovery(records)
    assert out is not None and out["turns_compared"] == 4
    assert (out["recomputed_under_pressure"], out["served_by_reuse_with_tier"]) == (2, 1)
    assert out["share_served_by_reuse"] == 0.5 and out["recomputed_with_tier"] == 1
    assert out["extra_tokens_computed"] == {"kvloop_pressure": 5900, "kvloop_pressure_tier": 2920}
    assert tier_recovery([r for r in records if r.config != "kvloop"]) is None


def test_resumed_turns_are_those_after_a_pause_with_their_recompute_share_and_p99() -> None:
    def rec(config: str, conv: str, turn: int, computed: int, ttft_s: float) -> TurnRecord:
        return TurnRecord(config, 0, conv, turn, 100, ttft_s, "TRANSFER", detail={"computed-tokens": computed})

    fix = "kvloop_pressure_hints_tier"
    records = []
    for i in range(100):  # 100 resumed turns: pressure recomputes 40 of them, the fix 5
        conv = f"s{i}"
        records += [rec(c, conv, 1, 1600, 9.0) for c in ("kvloop", "kvloop_pressure", fix)]  # first turns: left out
        records += [rec("kvloop", conv, 2, 100, 0.1), rec("kvloop_pressure", conv, 2, 3000 if i < 40 else 100, 0.3),
                    rec(fix, conv, 2, 3000 if i < 5 else 100, 0.1 if i else 0.15)]
    out = tier_recovery(records, fix=fix, label="hints_tier")
    assert out is not None
    resumed = out["resumed"]
    assert resumed["turns"] == 100
    assert resumed["share_recomputed_under_pressure"] == 0.4
    assert resumed["share_served_by_reuse_with_fix"] == 0.95
    assert resumed["ttft_ms"]["kvloop"]["p99"] == 100.0 and resumed["ttft_ms"]["kvloop"]["n"] == 100
    assert resumed["p99_over_no_pressure"] == {"kvloop_pressure": 3.0, fix: 1.0}
    assert resumed["by_session"]["s0"] == {"resumed": 1, "kvloop_pressure": 1, fix: 1}
    assert resumed["by_session"]["s50"] == {"resumed": 1, "kvloop_pressure": 0, fix: 0}


def test_loguniform_pauses_spread_over_decades_and_keep_the_uniform_draw_as_it_was() -> None:
    uniform = agent(AgentSpec(sessions=3, seed=5))
    assert uniform == agent(AgentSpec(sessions=3, seed=5, think_dist="uniform"))
    spec = AgentSpec(sessions=40, turns_min=10, turns_max=10, think_min_s=2, think_max_s=60, think_dist="loguniform",
                     seed=1)
    pauses = [p for c in agent(spec) for p in c.think_s]
    assert all(2 <= p <= 60 for p in pauses)
    short, long = sum(p < 6 for p in pauses), sum(p > 20 for p in pauses)
    assert 0.25 < short / len(pauses) < 0.40 and 0.25 < long / len(pauses) < 0.40  # ln 3 / ln 30 each: 0.32
    with pytest.raises(ValueError, match="think_min_s"):
        AgentSpec(think_min_s=0, think_dist="loguniform").validate()
    with pytest.raises(ValueError, match="think_dist"):
        AgentSpec(think_dist="normal").validate()
