"""``kvloop bench load``'s arithmetic, pure: a load point's figures from its requests, the knee of a sweep, and
each core's busy share from two ``/proc/stat`` readings. No I/O; unit-tested in ``tests/unit/test_load_bench.py``.

Goodput is DistServe's: requests that met every target of the SLO, per second of the point's wall time (first
request sent to last answer received). A failed request meets no target. Percentiles admit their sample size
(:func:`kvloop.benchmarks.stats.percentiles_ms`: a p99 needs 100 samples)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvloop.benchmarks.aiperf import Request, Slo
from kvloop.benchmarks.stats import percentiles_ms


def meets(r: Request, slo: Slo) -> bool:
    return (not r.error and r.ttft_ms is not None and r.ttft_ms <= slo.ttft_ms
            and (r.itl_ms is None or r.itl_ms <= slo.itl_ms))


def point_figures(requests: Sequence[Request], slo: Slo) -> dict[str, Any]:
    """One load point: goodput, throughput, the share of requests within the SLO, and TTFT, per-request ITL,
    gaps between chunks and end-to-end latency (p50/p95/p99 with n)."""
    ok = [r for r in requests if not r.error]
    if requests:
        wall_s = max(1e-9, (max(r.end_ns for r in requests) - min(r.start_ns for r in requests)) / 1e9)
    else:
        wall_s = 0.0
    good = sum(1 for r in requests if meets(r, slo))

    def ms(values: Sequence[float | None]) -> dict[str, Any]:
        return percentiles_ms([v / 1e3 for v in values if v is not None])

    return {
        "requests": len(requests), "errors": len(requests) - len(ok), "wall_s": round(wall_s, 2),
        "goodput_rps": round(good / wall_s, 3) if wall_s else 0.0,
        "throughput_rps": round(len(ok) / wall_s, 3) if wall_s else 0.0,
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / wall_s, 1) if wall_s else 0.0,
        "slo_attainment": round(good / len(requests), 4) if requests else 0.0,
        "ttft_ms": ms([r.ttft_ms for r in ok]), "itl_ms": ms([r.itl_ms for r in ok]),
        "gap_ms": ms([g for r in ok for g in r.gaps_ms]), "e2e_ms": ms([r.e2e_ms for r in ok]),
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "cached_tokens": sum(r.cached_tokens for r in ok),
        "error_samples": [r.error for r in requests if r.error][:3],
    }


def knee(points: Mapping[int, Mapping[str, Any]], fraction: float) -> int | None:
    """The highest load (concurrency) at which at least ``fraction`` of the requests met the SLO, with every
    lower load meeting it too; None when even the lowest did not."""
    best = None
    for load in sorted(points):
        if points[load]["slo_attainment"] < fraction:
            break
        best = load
    return best


def cpu_times(stat_text: str) -> dict[str, tuple[int, int]]:
    """Per core (``cpu0``, ``cpu1``, ...): (busy, total) jiffies from ``/proc/stat``; idle and iowait are not busy."""
    out: dict[str, tuple[int, int]] = {}
    for line in stat_text.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or not fields:
            continue
        values = [int(v) for v in fields]
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        total = sum(values[:8])  # guest time is already inside user and nice
        out[name] = (total - idle, total)
    return out


def busy_share(before: Mapping[str, tuple[int, int]], after: Mapping[str, tuple[int, int]]) -> dict[str, float]:
    """Each core's busy share between two :func:`cpu_times` readings (0..1)."""
    out = {}
    for core, (busy, total) in after.items():
        b0, t0 = before.get(core, (0, 0))
        span = total - t0
        out[core] = round((busy - b0) / span, 3) if span > 0 else 0.0
    return out


PARTS = ("engine_worker", "engine_core", "engine_api", "sidecar", "broker")
"""The long-lived processes of a configuration whose CPU a point splits out (AIPerf and this process, with kvloop's
router, are counted from ``getrusage``)."""


def process_part(cmdline: str) -> str | None:
    """Which part of a configuration a process is, from its command line (vLLM's children rename theirs with
    ``setproctitle``); None for anything else."""
    if cmdline.startswith("VLLM::Worker"):
        return "engine_worker"
    if cmdline.startswith("VLLM::EngineCore"):
        return "engine_core"
    if "kvloop.engines.vllm_entry" in cmdline:
        return "engine_api"
    if "kvloop.engines.sidecar" in cmdline:
        return "sidecar"
    if "broker serve" in cmdline:
        return "broker"
    return None


def process_stat(stat_text: str) -> tuple[int, int]:
    """(parent pid, utime + stime jiffies of the process and its exited threads) from ``/proc/PID/stat``."""
    fields = stat_text[stat_text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def descendants(parents: Mapping[int, int], root: int) -> set[int]:
    """The pids below ``root`` in a pid -> parent pid map."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    out: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def cpu_by_part(before: Mapping[int, tuple[str, int]], after: Mapping[int, tuple[str, int]], hz: int
                ) -> dict[str, float]:
    """CPU seconds per :data:`PARTS` between two readings of pid -> (part, jiffies); a process that started between
    them counts from zero, one that ended is not seen (engines, sidecars and brokers outlive a point)."""
    out = dict.fromkeys(PARTS, 0.0)
    for pid, (part, ticks) in after.items():
        out[part] += (ticks - before[pid][1] if pid in before else ticks) / hz
    return {k: round(v, 2) for k, v in out.items()}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None
