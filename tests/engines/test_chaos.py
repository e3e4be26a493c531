"""The CI-sized chaos run: every fault kind once, with a fixed seed, on real engines, brokers and etcd.

``kvloop bench chaos`` itself checks what must hold (no hang, no error with an engine of each role alive, answers
equal to a reference engine's up to near-ties, books in agreement, back to baseline after the leases' TTL, no
block freed while pinned) and exits 1 when anything failed; this test runs it small, on the engine tests' model
(the reference engine starts while the run waits out the leases' TTL), with a host tier on every decode engine,
and reads its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvloop.app.benchmarks.chaos_faults import KINDS

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]


def test_every_fault_kind_once_loses_nothing(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    argv = [sys.executable, "-m", "kvloop.app.cli", "bench", "chaos", "--model", str(tiny_model), "--sessions", "4",
            "--turns", "5", "--concurrency", "2", "--rounds", "1", "--no-baseline", "--seed", "1",
            "--client-timeout-s", "120",
            # A restarted engine the placement does not choose again is waited for 10 s, not 120: its recovery
            # time is then blank, which this test does not check (the full run measures it).
            "--recovery-wait-s", "10",
            # While an engine restarts, 3 turns show serving goes on; more would only slow the restart (which must
            # import vLLM in three processes one after another) and add answers to check.
            "--outage-turns", "3",
            # A host tier on each decode engine and a budget of 2% of its pool (about 40 blocks: two or three
            # sessions' histories), so evictions for room demote all through the run and the faults interrupt some.
            "--host-tier-blocks", "128", "--retention-fraction", "0.02",
            "--deadline-s", "900", "--work-dir", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1500, stdin=subprocess.DEVNULL)
    print(done.stdout[-6000:])
    assert out.exists(), done.stderr[-4000:]
    result = json.loads(out.read_text())
    chaos = result["chaos"]
    assert chaos["faults_fired"] == sorted(KINDS), chaos["faults_not_fired"]
    assert chaos["hangs"] == 0 and not chaos["errors"], chaos["errors"]
    assert not result["answers"]["wrong"] and result["answers"]["checked"] == chaos["ok"] > 0
    assert chaos["books"]["settled"]["agree"] and chaos["books"]["after_ttl"]["baseline"], chaos["books"]
    assert chaos["freed_while_pinned"] == []
    assert chaos["demotions"]["started"] > 0, chaos["demotions"]
    assert result["problems"] == {"chaos": []} and done.returncode == 0, done.stderr[-4000:]
