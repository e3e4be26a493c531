"""``kvloop bench load``'s pure pieces: AIPerf's command line and records, a point's figures, the knee, the cores'
busy share, the trace scaling and the argument checks. The bench itself runs in ``tests/engines/test_load.py``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from kvloop.app.benchmarks import aiperf
from kvloop.app.benchmarks.aiperf import AgentLoad, Request, Slo, TraceLoad
from kvloop.app.benchmarks.load import add_arguments, compare, cpu_list, scale_trace, validate
from kvloop.app.benchmarks.load_stats import (
    busy_share,
    cpu_by_part,
    cpu_times,
    cpu_wait_by_part,
    descendants,
    knee,
    meets,
    point_figures,
    process_part,
    process_stat,
    router_steps,
)
from kvloop.app.benchmarks.multiturn import cores_record, role_binding
from kvloop.engines.config import role_cores
from kvloop.shared import headers as hdr
from kvloop.shared.errors import ConfigError
from kvloop.shared.vocabulary import Role

RECORD = {"metadata": {"conversation_id": "session_000001", "turn_index": 2, "request_start_ns": 1_000_000_000,
                       "request_end_ns": 1_500_000_000, "x_correlation_id": "87d90c9a"},
          "metrics": {"time_to_first_token": {"value": 120.5, "unit": "ms"},
                      "inter_token_latency": {"value": 8.0, "unit": "ms"},
                      "request_latency": {"value": 500.0, "unit": "ms"},
                      "output_token_count": {"value": 16, "unit": "tokens"},
                      "usage_prompt_tokens": {"value": 900, "unit": "tokens"},
                      "usage_prompt_cache_read_tokens": {"value": 768, "unit": "tokens"},
                      "inter_chunk_latency": {"value": [7.0, 9.0], "unit": "ms"}}}


def request(ttft: float | None, itl: float | None, start_s: float, end_s: float, error: str = "") -> Request:
    return Request("s", 0, int(start_s * 1e9), int(end_s * 1e9), ttft, itl, 1.0, 4, 10, 0, [1.0], error)


def test_a_record_is_read_with_its_session_turn_and_figures() -> None:
    (r,) = aiperf.read_records([json.dumps(RECORD), ""])
    assert (r.session, r.turn, r.ttft_ms, r.itl_ms, r.e2e_ms) == ("session_000001", 2, 120.5, 8.0, 500.0)
    assert (r.output_tokens, r.prompt_tokens, r.cached_tokens, r.gaps_ms, r.error) == (16, 900, 768, [7.0, 9.0], "")
    assert r.correlation_id == "87d90c9a"
    failed = aiperf.parse_record(json.dumps({**RECORD, "metrics": {}, "error": {"code": 500, "message": "x"}}))
    assert failed.ttft_ms is None and '"code": 500' in failed.error
    with pytest.raises(ValueError, match="metadata"):
        aiperf.parse_record(json.dumps({"metrics": {}}))


def test_the_command_carries_the_slo_the_session_header_and_the_workload(tmp_path: Path) -> None:
    slo = Slo(ttft_ms=800, itl_ms=40)
    argv = aiperf.command(Path("/x/aiperf"), model="m", tokenizer=tmp_path, url="http://h:1", concurrency=8,
                          load=AgentLoad(sessions=16, turns=4, system_tokens=1500), slo=slo, artifacts=tmp_path,
                          timeout_s=60)
    pairs = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert argv[:2] == ["/x/aiperf", "profile"] and "--streaming" in argv
    assert "time_to_first_token:800 inter_token_latency:40" in argv and hdr.SESSION_ID in argv
    assert argv[argv.index("--concurrency") + 1] == "8" and argv[argv.index("--conversation-num") + 1] == "16"
    assert argv[argv.index("--shared-system-prompt-length") + 1] == "1500" and pairs
    trace = aiperf.command(Path("a"), model="m", tokenizer=tmp_path, url="u", concurrency=64,
                           load=TraceLoad(tmp_path / "t.jsonl", 128), slo=slo, artifacts=tmp_path, timeout_s=60)
    assert "mooncake_trace" in trace and "--fixed-schedule" in trace and "--conversation-num" not in trace
    assert trace[trace.index("--isl-block-size") + 1] == "128"


def test_goodput_counts_requests_within_every_target_per_second_of_wall_time() -> None:
    slo = Slo(ttft_ms=100, itl_ms=10)
    reqs = [request(50, 5, 0.0, 1.0), request(150, 5, 0.5, 2.0), request(50, 20, 1.0, 3.0),
            request(None, None, 1.0, 4.0, error="boom")]
    assert [meets(r, slo) for r in reqs] == [True, False, False, False]
    fig = point_figures(reqs, slo)
    assert fig["requests"] == 4 and fig["errors"] == 1 and fig["wall_s"] == 4.0
    assert fig["goodput_rps"] == 0.25 and fig["throughput_rps"] == 0.75 and fig["slo_attainment"] == 0.25
    assert fig["ttft_ms"]["n"] == 3 and fig["ttft_ms"]["p99"] is None  # 3 samples cannot give a p99
    assert fig["error_samples"] == ["boom"] and point_figures([], slo)["goodput_rps"] == 0.0


def test_the_knee_is_the_highest_load_with_every_lower_load_within_the_fraction() -> None:
    points = {4: {"slo_attainment": 1.0}, 8: {"slo_attainment": 0.95}, 16: {"slo_attainment": 0.5},
              32: {"slo_attainment": 0.99}}
    assert knee(points, 0.90) == 8 and knee(points, 0.99) == 4
    assert knee({4: {"slo_attainment": 0.2}}, 0.9) is None


def test_busy_share_per_core_from_proc_stat() -> None:
    before = cpu_times("cpu  10 0 10 80 0 0 0 0\ncpu0 5 0 5 40 0 0 0 0\ncpu1 5 0 5 40 0 0 0 0\nintr 1 2\n")
    after = cpu_times("cpu  0\ncpu0 50 0 5 45 0 0 0 0\ncpu1 5 0 5 130 10 0 0 0\n")
    assert set(before) == {"cpu0", "cpu1"}
    assert busy_share(before, after) == {"cpu0": 0.9, "cpu1": 0.0}  # iowait is not busy


def test_a_trace_is_cut_scaled_and_keeps_its_hash_ids() -> None:
    lines = [json.dumps({"timestamp": t, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]})
             for t in (0, 30_000, 90_000)]
    out = [json.loads(x) for x in scale_trace(lines, length_scale=0.25, time_scale=3.0, seconds=60)]
    assert [r["timestamp"] for r in out] == [0, 90_000]
    assert out[0] == {"timestamp": 0, "input_length": 250, "output_length": 3, "hash_ids": [1, 2]}
    with pytest.raises(ConfigError, match="line 1: missing input_length") as err:
        scale_trace(['{"timestamp": 0}'], length_scale=1, time_scale=1, seconds=1)
    assert err.value.field == "input_length"


def test_ratios_against_the_aggregated_engine_are_withheld_where_a_side_is_unhealthy() -> None:
    def point(load: float, goodput: float, healthy: bool) -> dict[str, object]:
        return {"load": load, "goodput_rps": goodput, "ttft_ms": {"p99": 200.0}, "itl_ms": {"p99": 20.0},
                "health": {"healthy": healthy, "reason": "ok" if healthy else "2 request(s) failed"}}

    configs = {"aggregated": {"points": [point(4, 2.0, True), point(8, 4.0, True)]},
               "kvloop": {"points": [point(4, 1.8, True), point(8, 5.0, False)]}}
    out = compare(configs)
    assert out["kvloop_over_aggregated@4"] == {"goodput": 0.9, "ttft_p99": 1.0, "itl_p99": 1.0}
    assert "failed" in out["kvloop_over_aggregated@8"]["withheld"]


@pytest.mark.parametrize(("argv", "field"), [
    (["--configs", "kvloop,nope"], "--configs"), (["--loads", "8,4"], "--loads"), (["--loads", "x"], "--loads"),
    (["--loads", "1.5"], "--loads"), (["--ttft-slo-ms", "0"], "--ttft-slo-ms"), (["--turns", "0"], "--turns"),
    (["--trace", "/no/such/file"], "--trace"), (["--prefill-engines", "0"], "--prefill-engines"),
    (["--trace", __file__, "--trace-length-scale", "0.125"], "--trace-block-size"),  # 128 where 64 fits
    (["--engine-cores", "one"], "--engine-cores"), (["--engine-cores", "3-1"], "--engine-cores"),
    (["--engine-cores", "0-4095"], "--engine-cores"),  # every core: nothing left for the rest
    (["--engine-cores", "0", "--configs", "kvloop,aggregated"], "--engine-cores"),  # P/D has more than one engine
])
def test_bad_arguments_are_named(argv: list[str], field: str) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert validate(parser.parse_args(argv)).startswith(field)
    assert validate(parser.parse_args([])) == ""


def test_engine_cores_are_read_as_a_cpu_list() -> None:
    assert cpu_list("1") == {1}
    assert cpu_list("0-2,5") == {0, 1, 2, 5}
    with pytest.raises(ValueError):
        cpu_list("2-")


def test_engine_cores_leave_the_rest_to_everything_else() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    mine = sorted(os.sched_getaffinity(0))
    argv = ["--engine-cores", str(mine[-1]), "--configs", "kvloop_single,aggregated"]
    if len(mine) < 2:
        assert validate(parser.parse_args(argv)).startswith("--engine-cores")
        return
    assert validate(parser.parse_args(argv)) == ""


def test_the_tokenizer_is_named_as_a_cached_hub_repo_linked_to_the_model(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    name = aiperf.hub_tokenizer(model, tmp_path / "hf")
    repo = tmp_path / "hf" / "hub" / "models--kvloop--tiny"
    assert name == "kvloop/tiny" and (repo / "refs" / "main").read_text() == "local"
    assert (repo / "snapshots" / "local" / "tokenizer.json").read_text() == "{}"
    assert aiperf.hub_tokenizer(model, tmp_path / "hf") == name  # again: the link is replaced, not an error


def test_the_cores_plan_binds_p_d_engines_by_role_or_to_every_core() -> None:
    assert [role_binding("split", r) for r in (Role.PREFILL, Role.DECODE)] == [role_cores(Role.PREFILL),
                                                                              role_cores(Role.DECODE)]
    assert cores_record("shared") == {"plan": "shared", "prefill": "auto", "decode": "auto"}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).cores == "split"
    with pytest.raises(SystemExit):
        parser.parse_args(["--cores", "half"])


def test_cpu_by_part_names_each_process_and_counts_only_this_point() -> None:
    assert process_part("VLLM::Worker_TP0") == "engine_worker"
    assert process_part("VLLM::EngineCore") == "engine_core"
    assert process_part("/v/python -m kvloop.engines.vllm_entry serve /m --port 1") == "engine_api"
    assert process_part("/v/python -m kvloop.engines.sidecar --engine-id d") == "sidecar"
    assert process_part("/v/python -m kvloop.app.cli broker serve --listen x") == "broker"
    assert process_part("aiperf timing_manager") is None
    # comm with a space and a parenthesis: the fields after the last ")" are what count
    assert process_stat("42 (VLLM::Work (x)) S 7 1 1 0 -1 0 0 0 0 0 150 50 0 0") == (7, 200)
    before = {10: ("engine_worker", 100), 11: ("sidecar", 40)}
    after = {10: ("engine_worker", 350), 11: ("sidecar", 50), 12: ("broker", 20)}  # the broker started meanwhile
    assert cpu_by_part(before, after, 100) == {"engine_worker": 2.5, "engine_core": 0.0, "engine_api": 0.0,
                                               "sidecar": 0.1, "broker": 0.2}


def test_cpu_wait_by_part_counts_this_point_and_never_goes_below_zero() -> None:
    before = {1: ("router", 2_000_000_000), 10: ("broker", 500_000_000)}
    # the broker lost a thread with its wait meanwhile: its live threads' sum fell; a sidecar started meanwhile
    after = {1: ("router", 3_500_000_000), 10: ("broker", 400_000_000), 11: ("sidecar", 250_000_000)}
    waits = cpu_wait_by_part(before, after)
    assert waits["router"] == 1.5 and waits["broker"] == 0.0 and waits["sidecar"] == 0.25
    assert waits["engine_worker"] == 0.0


def test_router_steps_tell_a_loop_that_waited_for_a_core_from_one_that_awaited_the_broker() -> None:
    records = [
        {"timings_ms": {"tokenize": 3.0, "tokenize_cpu": 2.0, "tokenize_cpu_wait": 0.5, "place": 12.0}},
        # 300 ms of place: 20 ms of the loop's CPU and 260 ms runnable without a core: explained
        {"timings_ms": {"tokenize": 80.0, "tokenize_cpu": 5.0, "tokenize_cpu_wait": 70.0,
                        "place": 300.0, "place_cpu": 20.0, "place_cpu_wait": 260.0}},
        # 200 ms of place with the loop idle and on a core: it awaited the broker
        {"timings_ms": {"tokenize": 2.0, "place": 200.0, "place_cpu": 10.0, "place_cpu_wait": 5.0}},
        # a record from before the fields existed: counted, not explained
        {"timings_ms": {"tokenize": 1.0, "place": 90.0}},
    ]
    steps = router_steps(records)
    assert steps["tokenize"] == {"n": 4, "over_bound": 1, "unexplained": 0, "over_bound_cpu_wait_ms": 70.0,
                                 "bound_ms": 50.0}
    assert steps["place"]["n"] == 4 and steps["place"]["over_bound"] == 3 and steps["place"]["unexplained"] == 2
    assert router_steps(records, bound_ms=400.0)["place"]["over_bound"] == 0


def test_descendants_follow_the_process_tree() -> None:
    parents = {2: 1, 3: 2, 4: 3, 5: 1, 6: 99}
    assert descendants(parents, 2) == {3, 4}
    assert descendants(parents, 1) == {2, 3, 4, 5}
    assert descendants(parents, 6) == set()
