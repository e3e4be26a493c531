"""The benches' per-turn stall check (:mod:`kvloop.app.benchmarks.stalls`): a turn is a stall when its TTFT or largest
inter-token gap exceeds what its engine's queue and compute explain by more than 1 s; a configuration with one is
unhealthy, and both benches withhold its ratios."""

from __future__ import annotations

import dataclasses

from kvloop.app.benchmarks.aiperf import Request
from kvloop.app.benchmarks.load import compare, point_health
from kvloop.app.benchmarks.load_stats import request_turns
from kvloop.app.benchmarks.multiturn import TurnRecord, ratios, recheck, run_stalls, summarize
from kvloop.app.benchmarks.stalls import BOUND_S, TurnTiming, find_stalls
from kvloop.app.benchmarks.stats import TURN_OVERHEAD_S, health

RATE = 1000.0
"""The configurations' measured prefill rate in these cases, tokens a second."""


def turn(name: str, *, start: float, ttft: float, end: float | None = None, computed: int = 100,
         gap: float | None = 0.02, prefill: str = "p0", decode: str = "d0") -> TurnTiming:
    return TurnTiming(name, ttft, gap, start, end if end is not None else start + ttft + 1.0, prompt_tokens=8000,
                      computed_tokens=computed, prefill_engine=prefill, decode_engine=decode)


def test_a_5_s_gap_among_20_ms_gaps_is_a_stall_and_a_prefill_step_is_not() -> None:
    calm = [turn(f"t{i}", start=2.0 * i, ttft=0.2) for i in range(20)]
    stalled = turn("t20", start=40.0, ttft=0.2, end=46.0, gap=5.018)
    report = find_stalls([*calm, stalled], prefill_tokens_per_s=RATE, median_gap_s=0.02)
    assert report.count == 1 and report.checked == 21
    (stall,) = report.stalls
    assert (stall.turn, stall.kind, stall.rule) == ("t20", "gap", "model")
    assert stall.explained_s == 0.02 and stall.excess_s > BOUND_S
    assert "t20: inter-token gap 5.02 s" in report.reason() and report.reason().startswith("1 turn(s) stalled")
    # A 1.8 s gap while a 1,500-token prompt was computed on the same engine (an aggregated engine: one engine
    # prefills and decodes) is within one step of it (1.5 s) and a bound: explained. Capped at a 512-token step
    # budget, the step is 0.512 s, and the gap is a stall.
    long_prompt = turn("long", start=40.5, ttft=1.5, computed=1500, prefill="e", decode="e")
    streaming = turn("streaming", start=40.0, ttft=0.2, end=43.0, gap=1.8, prefill="e", decode="e")
    assert find_stalls([long_prompt, streaming], prefill_tokens_per_s=RATE, median_gap_s=0.02).count == 0
    capped = find_stalls([long_prompt, streaming], prefill_tokens_per_s=RATE, median_gap_s=0.02,
                         step_tokens={"e": 512}, context_cost_tokens=float("inf"))
    assert capped.count == 1 and capped.stalls[0].explained_s == 0.512 + 0.02
    # A step holds the prompts computed at once: two 1,500-token prompts one after the other explain a 1.5 s
    # step, not a 3 s one; the same two at the same time explain 3 s.
    slow = turn("slow", start=40.0, ttft=0.2, end=50.0, gap=3.2, prefill="e", decode="e")
    one_then_other = [turn("x", start=41.0, ttft=1.5, computed=1500, prefill="e", decode="e"),
                      turn("y", start=43.0, ttft=1.5, computed=1500, prefill="e", decode="e")]
    together = [turn("x", start=41.0, ttft=1.5, computed=1500, prefill="e", decode="e"),
                turn("y", start=41.2, ttft=1.5, computed=1500, prefill="e", decode="e")]
    assert [s.turn for s in find_stalls([slow, *one_then_other], prefill_tokens_per_s=RATE,
                                        median_gap_s=0.02).stalls] == ["slow"]
    assert find_stalls([slow, *together], prefill_tokens_per_s=RATE, median_gap_s=0.02).count == 0


def test_without_a_rate_gaps_fall_back_to_ten_median_gaps_and_say_so() -> None:
    turns = [turn("a", start=0.0, ttft=0.2, gap=5.018), turn("b", start=0.0, ttft=0.2, gap=0.9)]
    report = find_stalls(turns, prefill_tokens_per_s=None, median_gap_s=0.008)
    assert [s.turn for s in report.stalls] == ["a"] and report.stalls[0].rule == "fallback"
    assert report.stalls[0].explained_s == 0.08 and "no prefill rate" in report.missing[0]


def test_a_long_ttft_explained_by_a_long_prompt_at_the_measured_rate_is_not_a_stall() -> None:
    # 6,000 tokens computed at 1,000 tokens/s: 6 s of prefill; 6.1 s to the first token is explained.
    long = turn("long", start=0.0, ttft=6.1, computed=6000)
    assert find_stalls([long], prefill_tokens_per_s=RATE, median_gap_s=0.02).count == 0
    # The same 6.1 s for a 200-token tail is a stall: 6.1 - (0.2 + the hand-off's decode step + the turn overhead)
    # > 1 s.
    short = turn("short", start=0.0, ttft=6.1, computed=200)
    report = find_stalls([short], prefill_tokens_per_s=RATE, median_gap_s=0.02)
    assert report.count == 1 and report.stalls[0].explained_s == 0.2 + 0.02 + TURN_OVERHEAD_S
    # Without the engines' account, the whole prompt (8,000 tokens) counts as computed, and the report says so.
    unknown = TurnTiming("unknown", 6.1, None, 0.0, 7.0, prompt_tokens=8000, prefill_engine="p0")
    lenient = find_stalls([unknown], prefill_tokens_per_s=RATE, median_gap_s=0.02)
    assert lenient.count == 0 and "whole prompt counted" in lenient.missing[0]


def test_a_ttft_explained_by_a_queue_of_earlier_turns_on_the_same_engine_is_not_a_stall() -> None:
    earlier = [turn("a", start=0.0, ttft=4.1, computed=4000), turn("b", start=0.1, ttft=7.2, computed=3000)]
    waiting = turn("t", start=0.2, ttft=7.5, computed=100)
    # (100 + 4,000 + 3,000) / 1,000 + 0.25 = 7.35 s explained: the queue ahead of it.
    assert find_stalls([*earlier, waiting], prefill_tokens_per_s=RATE, median_gap_s=0.02).count == 0
    # The same wait on another engine than the queue's: nothing ahead of it there, a stall.
    elsewhere = turn("t", start=0.2, ttft=7.5, computed=100, prefill="p1")
    report = find_stalls([*earlier, elsewhere], prefill_tokens_per_s=RATE, median_gap_s=0.02)
    assert [s.turn for s in report.stalls] == ["t"] and report.stalls[0].kind == "ttft"
    # Turns sent after it are not ahead of it (the engines schedule first come, first served).
    later = [turn("a", start=0.3, ttft=4.1, computed=4000), turn("b", start=0.4, ttft=7.2, computed=3000)]
    assert find_stalls([*later, waiting], prefill_tokens_per_s=RATE, median_gap_s=0.02).count == 1
    # Engines unknown: every engine's earlier turns count as the queue (lenient), and the report says so.
    pooled = [TurnTiming(t.name, t.ttft_s, t.max_gap_s, t.start_s, t.end_s, t.prompt_tokens, t.computed_tokens)
              for t in (*earlier, elsewhere)]
    lenient = find_stalls(pooled, prefill_tokens_per_s=RATE, median_gap_s=0.02)
    assert lenient.count == 0 and any("without their engine" in m for m in lenient.missing)


def _multiturn_run(stall_gap_s: float | None) -> dict:
    """A run of 20 turns of 200 ms TTFT, 150 tokens computed each at 1,000 tokens/s, 20 ms gaps; with one
    turn's largest gap ``stall_gap_s``."""
    records = []
    for i in range(20):
        gap = stall_gap_s if stall_gap_s is not None and i == 7 else 0.02
        records.append(TurnRecord("kvloop", 0, f"agent-{i % 4}", i // 4 + 1, 9000, ttft_s=0.2, decision="TRANSFER",
                                  e2e_s=0.2 + gap + 1.0, itl_p50_ms=20.0, itl_max_ms=gap * 1e3,
                                  detail={"computed-tokens": "150", "pulled-tokens": "0"}, start_s=3.0 * i,
                                  prefill_engine="prefill-0", decode_engine="decode-2"))
    return {"records": records, "gaps": [0.02] * 1000 + ([stall_gap_s] if stall_gap_s else []),
            "engines": {"vllm:request_prefill_time_seconds_sum": 3.0, "computed_all": 3000.0, "stalled": 0.0},
            "seconds": 60.0, "step_tokens": {"decode-2": 512}}


def test_a_configuration_with_one_stall_is_unhealthy_and_its_ratios_are_withheld() -> None:
    calm, stalled = _multiturn_run(None), _multiturn_run(5.018)
    assert run_stalls(calm).count == 0
    report = run_stalls(stalled)
    assert report.count == 1 and report.worst is not None and report.worst.turn == "agent-3 turn 2"
    # The configuration-wide checks alone pass it (TTFT 1.33x the prefill time, nothing queued over 10 s).
    assert health(errors=0, turns=20, ttft_sum_s=4.0, prefill_sum_s=3.0, stalled_requests=0).healthy
    sick = summarize("kvloop", [stalled], late_tokens=8000)
    well = summarize("kvloop", [calm], late_tokens=8000)
    assert well["healthy"] and well["stalls"]["count"] == 0
    assert not sick["healthy"] and sick["stalls"]["count"] == 1 and sick["health"][0]["stalled_turns"] == 1
    assert "1 turn(s) stalled more than 1 s" in sick["health"][0]["reason"]
    assert "agent-3 turn 2: inter-token gap 5.02 s" in sick["health"][0]["reason"]
    out, withheld = ratios([{"kvloop": sick, "ideal": well}])
    assert "kvloop_over_ideal_late_p50" not in out and withheld["kvloop_over_ideal_late_p50"] == "unhealthy: kvloop"
    out, withheld = ratios([{"kvloop": well, "ideal": well}])
    assert out["kvloop_over_ideal_late_p50"]["median"] == 1.0 and "kvloop_over_ideal_late_p50" not in withheld


def _requests(stalled_ttft_ms: float) -> list[Request]:
    """20 AIPerf requests of one session each, 150 of 900 prompt tokens computed, 20 ms gaps; the last one's TTFT
    ``stalled_ttft_ms``."""
    out = []
    for i in range(20):
        ttft = stalled_ttft_ms if i == 19 else 200.0
        start = 10.0 + 3.0 * i
        out.append(Request(f"s{i}", 0, int(start * 1e9), int((start + ttft / 1e3 + 1.0) * 1e9), ttft, 20.0, 0.0,
                           50, 900, 750, [20.0] * 49))
    return out


def test_a_load_point_with_one_stall_is_unhealthy_and_its_ratio_against_the_aggregated_engine_withheld() -> None:
    def point(load: float, requests: list[Request], lowest: bool) -> dict:
        report = find_stalls(request_turns(requests, only_engine="both-0"), prefill_tokens_per_s=RATE,
                             median_gap_s=0.02)
        figures = {"load": load, "goodput_rps": 2.0, "ttft_ms": {"p99": 200.0}, "itl_ms": {"p99": 20.0},
                   "errors": 0, "requests": 20, "stalled_requests": 0, "ttft_sum_s": 4.0, "prefill_time_s": 3.0,
                   "stalls": report.to_dict()}
        figures["health"] = point_health(figures, lowest=lowest, stalls=report)
        return figures

    base = {"points": [point(4, _requests(200.0), True), point(8, _requests(200.0), False)]}
    kv = {"points": [point(4, _requests(5000.0), True), point(8, _requests(5000.0), False)]}
    for p in kv["points"]:
        assert not p["health"]["healthy"] and p["health"]["stalled_turns"] == 1 and p["stalls"]["count"] == 1
        assert "s19 turn 0: time to first token 5.00 s" in p["health"]["reason"]
    assert all(p["health"]["healthy"] for p in base["points"])
    out = compare({"aggregated": base, "kvloop": kv})
    assert "stalled more than 1 s" in out["kvloop_over_aggregated@4"]["withheld"]
    assert "stalled more than 1 s" in out["kvloop_over_aggregated@8"]["withheld"]


def test_router_records_name_each_requests_engines_and_computed_tokens() -> None:
    requests = _requests(200.0)[:2]
    records = [{"t": 10.002, "prompt_tokens": 900, "computed_tokens": 40, "pulled_tokens": 860,
                "prefill_engine": "prefill-1", "decode_engine": "decode-2", "timings_ms": {"publication_wait": 120.0}},
               {"t": 13.001, "prompt_tokens": 900, "computed_tokens": 900, "prefill_engine": "prefill-0",
                "decode_engine": "decode-2", "error": "boom"},  # a failed turn is no request's
               {"t": 99.0, "prompt_tokens": 900, "computed_tokens": 7}]  # another point's
    first, second = request_turns(requests, records)
    assert (first.prefill_engine, first.decode_engine, first.computed_tokens, first.pulled_tokens) == \
        ("prefill-1", "decode-2", 40, 860)
    assert first.wait_s == 0.12 and first.start_s == 10.0 and first.max_gap_s == 0.02
    assert (second.prefill_engine, second.computed_tokens) == ("", 150)  # its usage: 900 prompt, 750 cached


def test_requests_sent_together_with_one_prompt_length_get_their_own_sessions_records() -> None:
    """Sixteen first turns of one length sent at once: by time alone the first sent took the first record, whoever
    the router served first; the session AIPerf sent names the record."""
    sent = [Request(f"session_{i}", 0, int((10.0 + 0.001 * i) * 1e9), int(14e9), ttft, 20.0, 0.0, 50, 900, 0, [20.0],
                    correlation_id=f"uuid-{i}") for i, ttft in enumerate((3500.0, 500.0))]
    records = [{"t": 10.0005, "session": "uuid-1", "prompt_tokens": 900, "prefill_engine": "decode-2",
                "decode_engine": "decode-2", "computed_tokens": 900},
               {"t": 10.0015, "session": "uuid-0", "prompt_tokens": 900, "prefill_engine": "prefill-1",
                "decode_engine": "decode-2", "computed_tokens": 600}]
    slow, fast = request_turns(sent, records)
    assert (slow.prefill_engine, slow.computed_tokens) == ("prefill-1", 600)
    assert (fast.prefill_engine, fast.computed_tokens) == ("decode-2", 900)


def test_a_hand_off_waits_up_to_three_steps_of_its_decode_engine_and_no_more() -> None:
    """A P/D turn's first token on a decode engine busy with 512-token chunks of another turn's long prompt: vLLM
    takes the hand-off between steps, pulls its KV during the next and computes its first token in the one after."""
    chunks = turn("tail", start=0.0, ttft=3.0, computed=3000, prefill="d0", decode="d0")  # DECODE_LOCAL
    handed = turn("handed", start=0.1, ttft=1.9, computed=200, prefill="p0", decode="d0")
    # 0.2 s of its own prefill + 3 steps of 0.512 s + a decode step + the overhead: explained.
    report = find_stalls([chunks, handed], prefill_tokens_per_s=RATE, median_gap_s=0.02, step_tokens={"d0": 512},
                         context_cost_tokens=float("inf"))
    assert report.count == 0
    # A 5 s wait on the same engine is not three steps.
    stalled = dataclasses.replace(handed, ttft_s=5.0)
    report = find_stalls([chunks, stalled], prefill_tokens_per_s=RATE, median_gap_s=0.02, step_tokens={"d0": 512},
                         context_cost_tokens=float("inf"))
    assert [s.turn for s in report.stalls] == ["handed"]
    assert abs(report.stalls[0].explained_s - (0.2 + 3 * 0.512 + 0.02 + TURN_OVERHEAD_S)) < 1e-9


def test_engines_bound_to_the_same_cores_share_one_queue() -> None:
    """Two prefill engines on one core (the benches' split): a 3,000-token prompt computed on p1 slows a turn on p0
    that was sent just after it. Apart, the turn's 3.3 s is a stall (0.1 s of its own compute); bound alike, the
    other engine's prompt is queue it waited behind; engines on other cores still do not count."""
    big = turn("big", start=0.0, ttft=3.1, computed=3000, prefill="p1")
    late = turn("late", start=0.1, ttft=3.3, computed=100, prefill="p0")
    apart = find_stalls([big, late], prefill_tokens_per_s=RATE, median_gap_s=0.02)
    assert [s.turn for s in apart.stalls] == ["late"]
    shared = find_stalls([big, late], prefill_tokens_per_s=RATE, median_gap_s=0.02, cores={"p0": "0", "p1": "0"})
    assert shared.count == 0
    split = find_stalls([big, late], prefill_tokens_per_s=RATE, median_gap_s=0.02, cores={"p0": "0", "p1": "1"})
    assert [s.turn for s in split.stalls] == ["late"]


def test_a_token_at_long_context_is_explained_as_dearer_than_one_at_short_context() -> None:
    """R is the run's average: a turn computing 1,000 tokens at 20,000 tokens of context takes longer than 1,000 at
    none, and the run's total is kept (the short turn's share shrinks as the long one's grows)."""
    short = TurnTiming("short", 0.5, None, 0.0, 2.0, prompt_tokens=1000, computed_tokens=1000, prefill_engine="a")
    long = TurnTiming("long", 2.4, None, 10.0, 14.0, prompt_tokens=21000, computed_tokens=1000, prefill_engine="a")
    report = find_stalls([short, long], prefill_tokens_per_s=RATE, median_gap_s=0.02, overhead_s=0.0)
    assert report.count == 0  # 2,000 tokens at 1,000/s: 2 s together, 0.39 s and 1.61 s by context
    assert report.checked == 2
    flat = find_stalls([short, long], prefill_tokens_per_s=RATE, median_gap_s=0.02, overhead_s=0.0,
                       context_cost_tokens=float("inf"))
    assert [s.turn for s in flat.stalls] == ["long"] and flat.stalls[0].explained_s == 1.0


def test_a_written_run_is_checked_again_with_the_rules_of_today() -> None:
    """``kvloop bench multiturn --recheck``: the stall check over a run's written turns and gaps finds what the run's
    own check found (the 5 s gap; nothing in the calm run)."""
    full: dict = {"configs": {}, "turns": [], "itl_gaps_ms": {}, "engines": {"cores": {"prefill": "0", "decode": "1"}}}
    for name, gap in (("calm", None), ("sick", 5.018)):
        run = _multiturn_run(gap)
        full["configs"][name] = summarize(name, [run], late_tokens=8000)
        full["turns"] += [{**dataclasses.asdict(r), "config": name} for r in run["records"]]
        full["itl_gaps_ms"][name] = [g * 1e3 for g in run["gaps"]]
    reports = recheck(full)
    assert [r.count for r in reports["calm"]] == [0]
    (sick,) = reports["sick"]
    assert sick.count == 1 and sick.worst is not None and sick.worst.turn == "agent-3 turn 2"
