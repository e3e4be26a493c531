"""kvloop bench gateway's comparison of the two front doors (pure)."""

from __future__ import annotations

from typing import Any

from kvloop.app.benchmarks.gateway_bench import compare_paths


def run(*turns: tuple[str, float]) -> list[dict[str, Any]]:
    return [{"decision": path, "ttft_ms": ttft} for path, ttft in turns]


def test_ttft_is_compared_per_path_over_reps_whose_paths_agree() -> None:
    runs = {"router": [run(("DECODE_LOCAL", 80.0), ("TRANSFER", 280.0)),
                       run(("DECODE_LOCAL", 100.0), ("TRANSFER", 300.0)),
                       run(("RECOMPUTE", 400.0), ("TRANSFER", 1.0))],
            "envoy": [run(("DECODE_LOCAL", 88.0), ("TRANSFER", 270.0)),
                      run(("DECODE_LOCAL", 110.0), ("TRANSFER", 290.0)),
                      run(("DECODE_LOCAL", 70.0), ("TRANSFER", 2.0))]}
    out = compare_paths(runs)
    assert out["reps_with_other_paths"] == [2]
    assert set(out["by_path"]) == {"DECODE_LOCAL", "TRANSFER"}  # the differing rep adds nothing
    local = out["by_path"]["DECODE_LOCAL"]
    assert local["router"]["n"] == local["envoy"]["n"] == 2
    assert local["router"]["median_ms"] == 90.0 and local["envoy"]["median_ms"] == 99.0
    assert local["envoy_over_router_median"] == 1.1
    assert local["router"]["p90_ms"] is None  # two samples make no p90
