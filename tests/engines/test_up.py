"""``kvloop up --once``: the README's main job as a real subprocess. It starts a broker, one prefill and one decode
engine on the test model, their sidecars and the router, runs the demo session and stops everything."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.vllm
def test_up_once_runs_the_demo_and_stops_everything(tiny_model: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvloop.cli", "up", "--once", "--prefill", "1", "--decode", "1", "--demo-turns", "3",
         "--model", str(tiny_model), "--router-listen", "127.0.0.1:0", "--max-model-len", "4096",
         "--work-dir", str(tmp_path / "up")],
        cwd=ROOT, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL, env=dict(os.environ))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"kvloop up: broker 127\.0\.0\.1:\d+", out) and "kvloop up: router http://127.0.0.1:" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\s+[A-Z]+\s", line)]
    assert [r[0] for r in rows] == ["1", "2", "3"], out
    assert rows[0][2] == "RECOMPUTE" and {r[2] for r in rows[1:]} == {"TRANSFER"}, out
    assert all(int(r[1]) > 0 for r in rows) and int(rows[2][1]) > int(rows[0][1])
    assert "kvloop up: stopped." in out
    # No library noise among kvloop's own lines (gRPC's fork handlers printed "Other threads are currently calling
    # into gRPC, skipping fork() handlers" each time an engine started).
    assert "fork() handlers" not in out + result.stderr, result.stderr[-2000:]
    # Nothing of the cluster is left running.
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "up")], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", leftovers.stdout
