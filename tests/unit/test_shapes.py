"""The load bench's workload shapes (kvloop.app.benchmarks.shapes, issue 52): each shape changes the base agent workload
as it says, AIPerf is asked for it (spreads, a private context), sizing sees its longest history, unknown shapes are
refused by name, and a sweep lays each shape's goodput ratios side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvloop.app.benchmarks import aiperf
from kvloop.app.benchmarks.aiperf import AgentLoad, Slo
from kvloop.app.benchmarks.load import add_arguments, load_for, side_by_side, validate
from kvloop.app.benchmarks.shapes import SHAPES, parse_shapes, shaped

BASE = AgentLoad(sessions=16, turns=8, system_tokens=1500, user_tokens=200, answer_tokens=64, think_ms=500.0)


def argv_of(load: AgentLoad, tmp_path: Path) -> list[str]:
    return aiperf.command(Path("aiperf"), model="m", tokenizer=tmp_path, url="http://h:1", concurrency=8, load=load,
                          slo=Slo(ttft_ms=1000, itl_ms=50), artifacts=tmp_path, timeout_s=60)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_base_shape_is_the_workload_the_knobs_were_set_on(tmp_path: Path) -> None:
    assert shaped(SHAPES["agent"], BASE) == BASE
    argv = argv_of(BASE, tmp_path)
    assert flag(argv, "--prompt-input-tokens-stddev") == "0" and "--user-context-prompt-length" not in argv
    assert "--conversation-turn-delay-stddev" not in argv


def test_each_shape_asks_aiperf_for_what_it_says(tmp_path: Path) -> None:
    varied = argv_of(shaped(SHAPES["varied"], BASE), tmp_path)
    assert (flag(varied, "--prompt-input-tokens-stddev"), flag(varied, "--output-tokens-stddev"),
            flag(varied, "--conversation-turn-stddev")) == ("100", "32", "2")  # AIPerf takes whole turns
    bursty = argv_of(shaped(SHAPES["bursty"], BASE), tmp_path)
    assert flag(bursty, "--conversation-turn-delay-stddev") == "500"
    private = shaped(SHAPES["private"], BASE)
    argv = argv_of(private, tmp_path)
    assert (private.system_tokens, private.private_tokens) == (450, 1050)  # the first prompt keeps its length
    assert flag(argv, "--user-context-prompt-length") == "1050" and flag(argv, "--num-dataset-entries") == "16"
    assert flag(argv, "--shared-system-prompt-length") == "450"
    assert flag(argv_of(shaped(SHAPES["many"], BASE), tmp_path), "--conversation-num") == "64"


def test_sizing_sees_a_spread_shapes_longest_history() -> None:
    assert shaped(SHAPES["varied"], BASE).history_tokens() > BASE.history_tokens() * 2
    assert shaped(SHAPES["private"], BASE).history_tokens() == BASE.history_tokens()


def test_the_load_bench_takes_shapes_by_name_and_refuses_others() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--shapes", "agent,varied"])
    assert validate(args) == "" and [s.name for s in parse_shapes(args.shapes)] == ["agent", "varied"]
    args.shape = "private"
    assert load_for(args, 4, None).private_tokens == 1050  # type: ignore[union-attr]
    for bad in ("agent,odd", "agent,agent", ""):
        assert validate(parser.parse_args(["--shapes", bad])).startswith("--shapes:")
    with pytest.raises(ValueError, match="odd"):
        parse_shapes("odd")


def test_a_sweep_lays_each_shapes_goodput_ratio_side_by_side() -> None:
    def result(goodput: float, healthy: bool) -> dict:
        point = {"load": 4.0, "goodput_rps": goodput, "requests": 104, "health": {"healthy": healthy}}
        return {"configs": {"kvloop": {"points": [point]}, "aggregated": {"points": [dict(point, goodput_rps=1.0)]}},
                "ratios": {"kvloop_over_aggregated@4": {"goodput": goodput} if healthy else {"withheld": "x"}}}

    side = side_by_side({"agent": result(0.9, True), "varied": result(0.5, False)})
    kvloop = [r for r in side["rows"] if r["config"] == "kvloop"]
    assert [(r["shape"], r["goodput_over_aggregated"]) for r in kvloop] == [("agent", 0.9), ("varied", None)]
    assert "| varied | kvloop | 4 | 104 | 0.50 | no | - |" in side["markdown"]
