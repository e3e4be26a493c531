"""``kvloop up --once``: the README's main job as a real subprocess. It starts a broker, one prefill and one decode
engine on the test model, their sidecars and the router, runs the demo session and stops everything. Its traces
go to a real OTLP receiver on loopback: every turn's tree (router, broker, engines) must arrive."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.vllm
def test_up_once_runs_the_demo_and_stops_everything(tiny_model: Path, tmp_path: Path) -> None:
    with OtlpReceiver() as otlp:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OTEL_BSP_SCHEDULE_DELAY": "200"}
        result = run_up(tiny_model, tmp_path, env)
        check_demo(result, tmp_path)
        check_traces(otlp)


def run_up(tiny_model: Path, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvloop.cli", "up", "--once", "--prefill", "1", "--decode", "1", "--demo-turns", "6",
         "--model", str(tiny_model), "--router-listen", "127.0.0.1:0", "--max-model-len", "4096",
         "--work-dir", str(tmp_path / "up")],
        cwd=ROOT, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL, env=env)


def check_demo(result: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"kvloop up: broker 127\.0\.0\.1:\d+", out) and "kvloop up: router http://127.0.0.1:" in out
    # turn, context, path, reason, local, pulled, computed, engines, TTFT
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\s+[A-Z_]+\s", line)]
    assert [r[0] for r in rows] == ["1", "2", "3", "4", "5", "6"], out
    # The scripted session shows every path (kvloop/demo.py says which turn should take which).
    assert [r[2] for r in rows] == ["RECOMPUTE", "DECODE_LOCAL", "TRANSFER", "DECODE_LOCAL", "PREFILL_LOCAL",
                                    "DECODE_LOCAL"], out
    assert rows[0][3] == "no_match" and int(rows[0][4]) == int(rows[0][5]) == 0
    for r in rows:
        local, pulled, computed = int(r[4]), int(r[5]), int(r[6])
        assert local + pulled + computed == int(r[1]), r
        assert (pulled > 0) == (r[2] == "TRANSFER"), r  # no TRANSFER without a pull, no pull without TRANSFER
        assert r[2] in ("RECOMPUTE",) or local + pulled > 0, r
    assert "kvloop up: stopped." in out
    # No library noise among kvloop's own lines (gRPC's fork handlers printed "Other threads are currently calling
    # into gRPC, skipping fork() handlers" each time an engine started).
    assert "fork() handlers" not in out + result.stderr, result.stderr[-2000:]
    # Nothing of the cluster is left running.
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "up")], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", leftovers.stdout


def check_traces(otlp: OtlpReceiver) -> None:
    """Each turn's ``kvloop.turn`` span (the router in ``kvloop up``'s process) with its decision, the broker's
    placement span in the same trace, and the engines' own spans (vLLM, through ``traceparent``) in it too."""
    deadline = time.monotonic() + 30  # the engines' exporters flush on their own schedule
    while True:
        spans = otlp.snapshot()
        turns = [s for s in spans if s.name == "kvloop.turn"]
        trees = {t.trace_id: [s for s in spans if s.trace_id == t.trace_id] for t in turns}
        if (len(turns) == 6 and all(engine_spans(tree) for tree in trees.values())) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(turns) == 6, sorted({(s.service, s.name) for s in spans})
    paths = {t.attributes["kvloop.path"] for t in turns}
    assert paths == {"RECOMPUTE", "DECODE_LOCAL", "TRANSFER", "PREFILL_LOCAL"}, paths
    for turn in turns:
        tree = trees[turn.trace_id]
        assert turn.service == "kvloop-up" and turn.scope == "kvloop.router"
        for key in ("kvloop.planned", "kvloop.reason", "kvloop.plan_vs_actual", "kvloop.local_tokens",
                    "kvloop.pulled_tokens", "kvloop.recomputed_tokens", "kvloop.decode_engine"):
            assert key in turn.attributes, (key, turn.attributes)
        placements = [s for s in tree if s.scope == "kvloop.broker" and s.name.endswith("/PlaceStream")]
        assert placements and "kvloop.decision" in placements[0].attributes, sorted((s.scope, s.name) for s in tree)
        assert engine_spans(tree), sorted((s.service, s.name) for s in tree)


def engine_spans(tree: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return [s for s in tree if s.service not in ("kvloop-up", "")]
