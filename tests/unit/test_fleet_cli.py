"""``kvloop plan simulate`` and ``kvloop plan compare`` (kvloop.app.fleet.cli): the load bench's flags and defaults,
bad values named with exit 2, the load bench's sessions as AIPerf sends them, a tiny prediction in the load bench's
JSON shape, and the comparison's arithmetic."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvloop.app.benchmarks.aiperf import AgentLoad
from kvloop.app.benchmarks.load import load_for
from kvloop.app.cli import main
from kvloop.app.fleet.agent_load import agent_conversations, think_seconds
from kvloop.app.fleet.cli import CONFIGS, MIRRORED, add_simulate_arguments, load_bench_parser, validate_simulate
from kvloop.app.fleet.compare import compare_runs, compare_table, relative_error
from kvloop.shared.engine_model import FIGURE_GROUPS, EngineProfile, dump_profile

FAKE_CLI_PROFILE = EngineProfile(
    name="FAKE_cli", step_base_s=0.005, prefill_token_s=1e-4, attention_token_s=1e-5, decode_stream_s=5e-4,
    decode_context_s=1e-7, max_num_batched_tokens=512, max_num_seqs=32, block_size=16, kv_pool_blocks=4000,
    bytes_per_block=65536, pull_latency_s=0.004, pull_bytes_per_s=2e9, router_turn_s=0.003, api_request_s=0.002,
    source={g: "fake: the plan command's tests" for g in FIGURE_GROUPS})
"""A fake engine for the command's tests, from no machine."""

TINY = ["--loads", "1,2", "--turns", "2", "--system-tokens", "64", "--user-tokens", "40", "--answer-tokens", "8",
        "--think-ms", "20", "--sessions-per-load", "1", "--min-requests", "4"]
"""A workload of a few short sessions: 2 sessions of 2 turns at each point (4 requests, --min-requests)."""


def simulate_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    return parser.parse_args(["--profile", "p.json", *argv])


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "fake-profile.json"
    dump_profile(FAKE_CLI_PROFILE, path)
    return path


def test_the_workload_flags_are_the_load_benchs_with_its_defaults() -> None:
    ours, theirs = simulate_args([]), load_bench_parser().parse_args([])
    for dest in MIRRORED:
        assert getattr(ours, dest) == getattr(theirs, dest), dest
    assert ours.configs.split(",") == list(CONFIGS) == ["kvloop", "one_way", "aggregated"]
    assert ours.decode_engines == 1 and ours.out is None


@pytest.mark.parametrize(("argv", "flag"), [
    (["--configs", "kvloop,kvloop_dp"], "--configs"), (["--configs", ","], "--configs"),
    (["--loads", "8,4"], "--loads"), (["--loads", "x"], "--loads"), (["--loads", "1.5"], "--loads"),
    (["--ttft-slo-ms", "0"], "--ttft-slo-ms"),
    (["--turns", "0"], "--turns"), (["--user-tokens", "0"], "--turns"), (["--think-ms", "-1"], "--think-ms"),
    (["--prefill-engines", "0"], "--prefill-engines"), (["--decode-engines", "0"], "--decode-engines"),
])
def test_bad_arguments_are_named(argv: list[str], flag: str) -> None:
    assert validate_simulate(simulate_args(argv)).startswith(flag)
    assert validate_simulate(simulate_args([])) == ""


@pytest.mark.parametrize(("argv", "flag"), [
    (["--loads", "8,4"], "--loads"), (["--decode-engines", "0"], "--decode-engines"),
    (["--profile", "/no/such/profile.json"], "--profile"),
])
def test_the_command_exits_2_naming_the_flag(argv: list[str], flag: str, profile_file: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "simulate", "--profile", str(profile_file), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvloop plan simulate: " + flag), err


def test_a_profile_that_names_no_sources_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = json.loads(_dumped(tmp_path))
    raw["source"]["prefill"] = "a guess"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    assert main(["plan", "simulate", "--profile", str(bad)]) == 2
    assert "--profile: profile.source['prefill']" in capsys.readouterr().err


def _dumped(tmp_path: Path) -> str:
    path = tmp_path / "ok.json"
    dump_profile(FAKE_CLI_PROFILE, path)
    return path.read_text()


def test_the_sessions_are_the_ones_the_load_bench_asks_aiperf_for() -> None:
    """Sessions per point by the load bench's own rule; one shared system prompt; turns of exactly the user and answer
    tokens; the think time before every turn but the first, none after the last (its return frees the slot)."""
    args = simulate_args([])
    load = load_for(args, 4.0, None)
    assert isinstance(load, AgentLoad) and (load.sessions, load.turns) == (13, 8)  # 104 requests, as measured
    sessions = agent_conversations(load)
    assert len(sessions) == 13 and len({c.conversation_id for c in sessions}) == 13
    assert all(c.prefix == sessions[0].prefix and len(c.prefix) == 1500 for c in sessions)
    assert all(c.turns == 8 and {len(n) for n in c.new_tokens} == {200} for c in sessions)
    assert sessions[0].new_tokens[0] != sessions[1].new_tokens[0]
    assert sessions[0].answer_tokens == [64] * 8
    assert sessions[0].think_s == [0.5] * 7 + [0.0]
    assert agent_conversations(load)[3].new_tokens == sessions[3].new_tokens  # seeded


@pytest.mark.parametrize(("think_ms", "seconds"), [(0.0, 0.0), (500.0, 0.5), (500.9, 0.5), (0.4, 0.001)])
def test_the_think_time_is_aiperfs_whole_milliseconds(think_ms: float, seconds: float) -> None:
    assert think_seconds(AgentLoad(think_ms=think_ms)) == seconds


def test_a_tiny_prediction_has_the_load_benchs_shape(profile_file: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "predicted.json"
    assert main(["plan", "simulate", "--profile", str(profile_file), *TINY, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["predicted"] is True
    assert result["profile"]["name"] == "FAKE_cli" and result["profile"]["file"] == str(profile_file)
    assert set(result["profile"]["source"].values()) == {"fake: the plan command's tests"}
    assert list(result["configs"]) == list(CONFIGS) and result["loads"] == [1.0, 2.0]
    assert result["workload"]["kind"] == "agent" and result["workload"]["sessions_by_load"] == {"1": 2, "2": 2}
    assert result["slo"] == {"ttft_ms": 1000.0, "itl_ms": 50.0}
    # The load bench's prefill pools: 2 sessions' longest prompts of 5 blocks of 128 tokens, in the profile's 16.
    assert result["fleet"]["prefill_pool_blocks"] == 2 * 5 * 128 // 16
    for name, config in result["configs"].items():
        assert [p["load"] for p in config["points"]] == [1.0, 2.0]
        assert "knee_90" in config and "knee_99" in config
        for p in config["points"]:
            assert p["predicted"] is True and p["config"] == name
            assert (p["requests"], p["errors"]) == (4, 0)
            assert p["goodput_rps"] > 0 and p["ttft_ms"]["n"] == 4 and p["itl_ms"]["n"] == 4
    assert set(result["configs"]["one_way"]["points"][0]["paths"]) <= {"RECOMPUTE", "PREFILL_LOCAL"}
    printed = capsys.readouterr().out
    assert "| config | load | n | goodput/s |" in printed and printed.count("| aggregated | ") == 2
    assert result["markdown"] in printed


def test_the_aggregated_engine_computes_at_its_own_profile(profile_file: Path, tmp_path: Path) -> None:
    fast = tmp_path / "fast-profile.json"
    dump_profile(replace(FAKE_CLI_PROFILE, name="FAKE_fast", prefill_token_s=FAKE_CLI_PROFILE.prefill_token_s / 4,
                         step_base_s=FAKE_CLI_PROFILE.step_base_s / 4), fast)
    runs = {}
    for label, extra in (("one", []), ("own", ["--aggregated-profile", str(fast)])):
        out = tmp_path / f"{label}.json"
        assert main(["plan", "simulate", "--profile", str(profile_file), *TINY, "--configs", "aggregated,one_way",
                     *extra, "--out", str(out)]) == 0
        runs[label] = json.loads(out.read_text())
    p50 = {label: [p["ttft_ms"]["p50"] for c in ("aggregated", "one_way") for p in r["configs"][c]["points"]]
           for label, r in runs.items()}
    assert p50["own"][:2] < p50["one"][:2]  # the aggregated engine sped up
    assert p50["own"][2:] == p50["one"][2:]  # one-way P/D did not
    assert runs["own"]["aggregated_profile"]["name"] == "FAKE_fast" and "aggregated_profile" not in runs["one"]


def test_an_aggregated_profile_of_another_block_size_is_refused(profile_file: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other.json"
    dump_profile(replace(FAKE_CLI_PROFILE, block_size=32), other)
    assert main(["plan", "simulate", "--profile", str(profile_file), *TINY, "--aggregated-profile", str(other)]) == 2
    assert "--aggregated-profile: block size 32" in capsys.readouterr().err


def point(load: float, goodput: float, ttft_p50: float | None, n: int = 100, healthy: bool = True) -> dict[str, Any]:
    return {"load": load, "requests": n, "goodput_rps": goodput, "throughput_rps": goodput + 1.0,
            "ttft_ms": {"p50": ttft_p50, "p99": None if n < 100 else 900.0, "n": n},
            "itl_ms": {"p50": 20.0, "n": n},
            "health": {"healthy": healthy, "reason": "ok" if healthy else "2 request(s) failed"}}


def test_relative_errors_are_against_the_measurement() -> None:
    assert relative_error(1.1, 1.0) == 0.1 and relative_error(0.5, 2.0) == -0.75
    assert relative_error(None, 1.0) is None and relative_error(1.0, None) is None and relative_error(1.0, 0.0) is None


def test_points_in_both_runs_are_compared_and_unhealthy_measurements_flagged() -> None:
    predicted = {"predicted": True, "profile": {"name": "FAKE_cli"}, "workload": {"turns": 8, "not_mirrored": []},
                 "slo": {"ttft_ms": 1000.0}, "configs": {
                     "kvloop": {"points": [point(4, 3.0, 110.0, n=75), point(8, 6.0, 150.0), point(16, 8.0, 300.0)]},
                     "one_way": {"points": [point(4, 2.0, 100.0)]}}}
    measured = {"workload": {"turns": 8}, "slo": {"ttft_ms": 2000.0}, "configs": {
        "kvloop": {"points": [point(4.0, 2.5, 100.0, n=75), point(8.0, 5.0, 200.0, healthy=False)]},
        "aggregated": {"points": [point(4.0, 2.0, 90.0)]}}}
    result = compare_runs(predicted, measured)
    assert [(r["config"], r["load"]) for r in result["rows"]] == [("kvloop", 4.0), ("kvloop", 8.0)]
    four, eight = result["rows"]
    assert four["figures"]["goodput_rps"] == {"predicted": 3.0, "measured": 2.5, "error": 0.2, "n_predicted": 75,
                                              "n_measured": 75}
    assert four["figures"]["throughput_rps"]["error"] == round((4.0 - 3.5) / 3.5, 3)
    assert four["figures"]["ttft_p50_ms"]["error"] == 0.1
    assert four["figures"]["ttft_p99_ms"] == {"predicted": None, "measured": None, "error": None, "n_predicted": 75,
                                              "n_measured": 75}  # too few for a p99: no error
    assert four["measured_healthy"] and not four["flag"]
    assert not eight["measured_healthy"] and "failed" in eight["flag"]
    assert eight["figures"]["ttft_p50_ms"]["error"] == -0.25
    assert result["mismatches"] == ["slo.ttft_ms: predicted 1000.0, measured 2000.0"]
    table = compare_table(result)
    assert "| kvloop | 4 | yes | 3 / 2.5 (+20%) |" in table
    assert "| kvloop | 8 | NO (flagged) |" in table and "150 / 200 (-25%)" in table and "- / - (-)" in table


def test_the_compare_command_refuses_runs_of_the_wrong_kind_and_writes_its_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    predicted, measured, out = tmp_path / "p.json", tmp_path / "m.json", tmp_path / "c.json"
    predicted.write_text(json.dumps({"predicted": True, "configs": {"kvloop": {"points": [point(4, 3.0, 110.0)]}}}))
    measured.write_text(json.dumps({"configs": {"kvloop": {"points": [point(4.0, 2.5, 100.0)]}}}))
    assert main(["plan", "compare", "--predicted", str(measured), "--measured", str(measured)]) == 2
    assert capsys.readouterr().err.startswith("kvloop plan compare: --predicted:")
    assert main(["plan", "compare", "--predicted", str(predicted), "--measured", str(predicted)]) == 2
    assert capsys.readouterr().err.startswith("kvloop plan compare: --measured:")
    assert main(["plan", "compare", "--predicted", str(predicted), "--measured", str(tmp_path / "none.json")]) == 2
    assert main(["plan", "compare", "--predicted", str(predicted), "--measured", str(measured), "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["rows"][0]["figures"]["goodput_rps"]["error"] == 0.2
    assert written["markdown"] in capsys.readouterr().out
