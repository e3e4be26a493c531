"""The CI-sized ``kvloop bench load``: two load points, kvloop beside the aggregated engine, AIPerf driving both,
as a real subprocess. It checks that every request was answered and the figures' shape, not speed (the sweep's
figures are in docs/benchmarks.md). The arithmetic is tested in ``tests/unit/test_load_bench.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
SESSIONS = {1: 3, 2: 4}
"""Sessions per point: at least 2 per concurrent one and enough for --min-requests (9 / 3 turns)."""


def test_two_load_points_kvloop_beside_the_aggregated_engine(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    argv = [sys.executable, "-m", "kvloop.app.cli", "bench", "load", "--model", str(tiny_model),
            "--configs", "kvloop,aggregated", "--loads", "1,2", "--turns", "3", "--system-tokens", "300",
            "--user-tokens", "100", "--answer-tokens", "16", "--min-requests", "9", "--sessions-per-load", "2",
            "--think-ms", "100", "--prefill-engines", "1", "--warmup-sessions", "1", "--work-dir", str(tmp_path / "w"),
            "--out", str(out)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL,
                          env=dict(os.environ))
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["configs"]) == {"kvloop", "aggregated"} and data["aiperf"] == "0.13.0"
    for name, config in data["configs"].items():
        assert [p["load"] for p in config["points"]] == [1.0, 2.0], name
        for p in config["points"]:
            assert p["errors"] == 0 and p["requests"] == SESSIONS[int(p["load"])] * 3, (name, p)
            assert p["ttft_ms"]["n"] == p["requests"] and p["ttft_ms"]["p50"] > 0 and p["ttft_ms"]["p99"] is None
            # Goodput may be 0 on a slow or contended machine (no request within the SLO): figures, not a speed test.
            assert 0 <= p["goodput_rps"] <= p["throughput_rps"] and 0 <= p["slo_attainment"] <= 1
            assert set(p["cores_busy"]) == {f"cpu{i}" for i in range(len(p["cores_busy"]))} and p["gap_ms"]["n"]
            assert p["health"]["reason"], (name, p)
            assert p["cpu_s"]["aiperf"] > 0 and p["cpu_s"]["engines_and_rest"] > 0, (name, p["cpu_s"])
        assert "knee_90" in config and "knee_99" in config and config["warmup_s"] > 0, name
    kvloop = data["configs"]["kvloop"]["points"]
    # The stall check's inputs: the router's records, written without being asked for.
    assert (tmp_path / "w" / "router-records" / "kvloop.jsonl").stat().st_size > 0
    assert all(sum(p["paths"].values()) == p["requests"] for p in kvloop), kvloop  # the router's own count
    assert all(p["cpu_s"]["bench_and_router"] > 0 for p in kvloop)  # the router runs in the bench's process
    # Each part counted from its own process: kvloop's sidecars and broker are there, the bare engine has none.
    assert all(p["cpu_s_by_part"]["engine_worker"] > 0 and p["cpu_s_by_part"]["engine_api"] > 0 for p in kvloop)
    assert sum(p["cpu_s_by_part"]["sidecar"] + p["cpu_s_by_part"]["broker"] for p in kvloop) > 0, kvloop
    bare = data["configs"]["aggregated"]["points"]
    assert all(p["cpu_s_by_part"]["engine_worker"] > 0 and p["cpu_s_by_part"]["sidecar"] == 0 for p in bare), bare
    assert data["configs"]["aggregated"]["points"][0]["paths"] == {}
    assert set(data["ratios"]) == {"kvloop_over_aggregated@1", "kvloop_over_aggregated@2"}
    assert all(Path(p).stat().st_size > 1000 for p in data["plots"]) and "| config | load |" in done.stdout
    assert "| config | load | CPU s router |" in done.stdout
