"""A small-scale ``kvloop bench multiturn`` (2 conversations, 3 turns) as a real subprocess. It checks the JSON's
shape and that every request was answered, not speed.

CI runs one kvloop configuration alone, ``kvloop_pressure_hints_tier`` (kvloop with a host tier on the decode
engine, its clients saying each tool pause and their sessions' ends: issue 53's CI-sized run) at a retention share
of 1, so nothing is evicted and every turn can reuse. Each configuration starts its own engines (about 45 s here);
the aggregated engine runs in the load benchmark's CI run (``tests/engines/test_load.py``), and the ratios between
configurations are tested on fakes in ``tests/unit/test_bench_stats.py``; ``kvloop bench multiturn`` with no
``--configs`` runs them all (the pressure scenario is opt-in). The bench's arithmetic is tested in
``tests/unit/test_bench_stats.py``."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvloop.app.benchmarks.workload import WorkloadSpec, replay, synthetic

ROOT = Path(__file__).resolve().parents[2]
QUANTILES = {"p50", "p95", "p99"}
HINTED = "kvloop_pressure_hints_tier"


def test_synthetic_workload_is_seeded_and_shaped() -> None:
    spec = WorkloadSpec(conversations=3, turns_min=2, turns_max=4, system_tokens=50, own_prefix_tokens=20,
                        new_min=5, new_max=9, output_tokens=4)
    a, b = synthetic(spec), synthetic(spec)
    assert [(c.prefix, c.new_tokens) for c in a] == [(c.prefix, c.new_tokens) for c in b]
    assert len(a) == 3 and all(2 <= c.turns <= 4 for c in a)
    assert all(c.prefix[:50] == a[0].prefix[:50] for c in a)  # the shared system prefix
    assert all(5 <= len(t) <= 9 for c in a for t in c.new_tokens)
    other_seed = synthetic(WorkloadSpec(seed=1, conversations=1))[0].prefix
    assert other_seed != synthetic(WorkloadSpec(conversations=1))[0].prefix
    with pytest.raises(ValueError, match="turns_max"):
        WorkloadSpec(turns_min=5, turns_max=2).validate()


def test_replay_splits_conversations_at_user_turns(tmp_path: Path) -> None:
    path = tmp_path / "convs.jsonl"
    conv = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    path.write_text(json.dumps({"messages": conv}) + "\n\n" + json.dumps(conv[:2]) + "\n")

    def tokenize(messages: list[dict[str, str]]) -> list[int]:  # a fake tokenizer: one id per character
        return [ord(ch) for m in messages for ch in m["role"] + m["content"]]

    out = replay(path, tokenize)
    assert [c.turns for c in out] == [2, 1]
    first = out[0]
    assert first.new_tokens[0] == tokenize(conv[:2])
    assert first.new_tokens[0] + first.new_tokens[1] == tokenize(conv)
    (tmp_path / "bad.jsonl").write_text('{"messages": [1, 2]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        replay(tmp_path / "bad.jsonl", tokenize)


@pytest.mark.slow
@pytest.mark.vllm
def test_small_multiturn_run_writes_the_promised_json(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "multiturn.json"
    result = subprocess.run(
        [sys.executable, "-m", "kvloop.app.cli", "bench", "multiturn", "--model", str(tiny_model), "--sessions", "2",
         "--turns-min", "3", "--turns-max", "3", "--system-tokens", "200", "--tool-median", "60", "--tool-max", "90",
         "--answer-min", "8", "--answer-max", "8", "--concurrency", "2", "--late-tokens", "300",
         "--timeout-s", "120", "--prefill-engines", "1",
         # Short tool pauses, each said to the broker before it is taken; a turn that follows its answer sooner
         # than the answer's lease is published waits for it (router/recent.py).
         "--think-min-s", "0.1", "--think-max-s", "0.4", "--think-dist", "loguniform", "--retention-share", "1",
         "--configs", HINTED, "--work-dir", str(tmp_path / "w"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1500, stdin=subprocess.DEVNULL, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data) >= {"configs", "ratios", "ratio_spreads", "withheld_ratios", "markdown", "workload", "machine",
                         "engines", "wall_seconds", "plots", "full_record"} and "turns" not in data
    with gzip.open(data["full_record"], "rt") as full:
        record = json.load(full)
    assert len(record["turns"]) == sum(c["requests"] for c in data["configs"].values()) and record["itl_gaps_ms"]
    assert set(data["configs"]) == {HINTED}
    for name, config in data["configs"].items():
        for key in ("ttft_ms", "late_ttft_ms", "itl_ms", "e2e_ms"):
            assert set(config[key]) == QUANTILES | {"n"}, (name, key)
        assert config["requests"] == 6 and config["errors"] == 0, (name, config)
        assert config["ttft_ms"]["p50"] > 0 and config["itl_ms"]["n"] > 0, (name, config)
        assert config["ttft_ms"]["p99"] is None  # 6 turns cannot give a p99: printed as n/a, not as the maximum
        assert isinstance(config["healthy"], bool) and config["health"][0]["reason"], (name, config)
        assert sum(config["decisions"].values()) == 6 and config["late_turns"] >= 1
    kvloop = data["configs"][HINTED]
    # Turns 2 and 3 of each conversation reuse the history: short tails run on the decode engine, or pull.
    assert kvloop["decisions"].get("DECODE_LOCAL", 0) + kvloop["decisions"].get("TRANSFER", 0) >= 2, kvloop
    assert abs(sum(kvloop["paths"].values()) - 1.0) < 0.01 and kvloop["reuse"]["available_tokens"] > 0, kvloop
    assert kvloop["reuse"]["reused_tokens"] > 0 and kvloop["reuse"]["plan_outcomes"], kvloop["reuse"]
    steps = kvloop["breakdown"]
    assert {"place", "prefill_compute", "decode_first", "router_other"} <= set(steps), steps
    assert data["ratios"] == {} and data["withheld_ratios"] == {}  # one configuration: nothing to compare
    assert data["workload"]["sessions"] == 2 and data["workload"]["sizing"]["pressure"]["decode_blocks"] > 0
    assert data["hint_tier_recovery"] is None  # no run without pressure to compare with
    assert all(Path(p).stat().st_size > 1000 for p in data["plots"]) and len(data["plots"]) == 2
    assert "| config | healthy |" in result.stdout and "wall time" in result.stdout
