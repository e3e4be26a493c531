"""``kvloop bench broker-scale`` end to end at a tiny size: the real core, runtime and gRPC service on loopback, and
a real etcd for the new leader's load."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvloop.app.benchmarks import broker_scale

pytestmark = [pytest.mark.slow, pytest.mark.etcd]


def test_a_tiny_run_reports_every_figure(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    broker_scale.add_arguments(parser)
    out = tmp_path / "scale.json"
    args = parser.parse_args(["--engines", "16", "--blocks", "8192", "--steps", "2", "--blocks-per-lease", "64",
                              "--turns", "40", "--etcd-load", "--out", str(out)])
    assert broker_scale.main(args) == 0
    report = json.loads(out.read_text())
    sizes = report["sizes"]
    assert [(s["engines"], s["blocks"]) for s in sizes] == [(8, 4096), (16, 8192)]
    # Each phase plays 40 turns on sessions of its own; the smaller size holds only 64 sessions, 32 for each.
    assert [s["turns"] for s in sizes] == [{"unary": 32, "stream": 32}, {"unary": 40, "stream": 40}]
    for size in sizes:
        played = size["turns"]["unary"] + size["turns"]["stream"]
        assert size["errors"] == 0 and size["decisions"] == {"TRANSFER": played}  # strict P/D, pinned: a pull a turn
        assert 0 < size["core_place_ms"]["p50"] <= size["core_place_ms"]["p99"]
        assert 0 < size["place_ms"]["p50"] <= size["place_ms"]["p99"]
        assert 0 < size["place_stream_ms"]["p50"] <= size["place_stream_ms"]["p99"]
        assert size["bytes_per_block"] > 0
        assert size["publish_blocks_per_s"] > 0 and size["cache_events_per_s"] > 0
        assert size["writes_per_turn"]["etcd_transactions"] > 0
        rebuild = size["rebuild_s"]  # the rebuild itself checks it loaded every lease
        assert size["store_mb"] > 0 and rebuild["total"] >= max(rebuild["load"], rebuild["soft_index"]) >= 0
        assert rebuild["etcd_load"] > 0  # a real etcd's paged read of every record (it checks the lease count)
    assert len(report["growth"]) == 1
