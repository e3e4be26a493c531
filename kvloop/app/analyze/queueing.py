"""``kvloop analyze --profile``: a trace's TTFT as the fleet model predicts it (:mod:`kvloop.app.fleet`), queues
included, beside the analysis's own per-turn prices, which queue nothing (on the Mooncake replay they were 3.4x under
the load bench at p50: docs/fleet-model.md). The trace is the one the analysis read, cut and scaled the same way,
sent open-loop at its timestamps as ``kvloop bench load --trace`` sends it. Pure but for reading the profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvloop.app.benchmarks.aiperf import Slo
from kvloop.app.benchmarks.stats import markdown_table, show
from kvloop.shared.engine_model import EngineProfile
from kvloop.shared.mooncake import TraceRow

CONFIGS = ("kvloop", "one_way")
TRACE_CONCURRENCY = 64
"""Requests in flight at most, as ``kvloop bench load --trace-concurrency``'s default."""


def predict(rows: Sequence[TraceRow], trace_block: int, profile: EngineProfile, prefill_engines: int,
            decode_engines: int, slo: Slo) -> dict[str, dict[str, Any]]:
    """kvloop's and one-way P/D's figures for the trace through a fleet of these engines."""
    from kvloop.app.fleet.sim import FleetSpec, simulate_schedules  # the fleet model imports this package's replay
    from kvloop.app.fleet.trace_load import trace_schedule

    schedule = trace_schedule(rows, trace_block, profile.block_size)
    fleet = FleetSpec(prefill_engines=prefill_engines, decode_engines=decode_engines)
    return {c: simulate_schedules(c, [schedule], TRACE_CONCURRENCY, fleet, profile, slo)[0] for c in CONFIGS}


def section(predicted: dict[str, dict[str, Any]], profile: EngineProfile, profile_file: str) -> str:
    """The report's section: each configuration's predicted TTFT with n, labelled predicted, with its profile."""
    rows = [[name, p["requests"], show(p["ttft_ms"], "p50"), show(p["ttft_ms"], "p95"), show(p["ttft_ms"], "p99"),
             f"{p['throughput_rps']:.2f}", ",".join(f"{k}:{v}" for k, v in sorted(p["paths"].items()))]
            for name, p in predicted.items()]
    sources = "; ".join(f"{group}: {text}" for group, text in sorted(profile.source.items()))
    return "\n".join([
        "## Queueing prediction (fleet model)", "",
        f"Predicted, not measured: the trace sent at its timestamps (at most {TRACE_CONCURRENCY} in flight) through "
        f"modelled engines of the profile `{profile_file}` ({profile.name}), every placement by the broker's core. "
        "The model's error on this project's machines is in docs/fleet-model.md; no figure here has been held "
        "against a measurement of this trace.", "",
        markdown_table(["config", "n", "TTFT p50 ms", "TTFT p95 ms", "TTFT p99 ms", "req/s", "paths"], rows), "",
        f"Profile sources: {sources}", ""])
