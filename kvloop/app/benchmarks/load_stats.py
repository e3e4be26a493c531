"""``kvloop bench load``'s arithmetic, pure: a load point's figures from its requests, the knee of a sweep, and
each core's busy share from two ``/proc/stat`` readings. No I/O; unit-tested in ``tests/unit/test_load_bench.py``.

Goodput is DistServe's: requests that met every target of the SLO, per second of the point's wall time (first
request sent to last answer received). A failed request meets no target. Percentiles admit their sample size
(:func:`kvloop.app.benchmarks.stats.percentiles_ms`: a p99 needs 100 samples).

The stall check (:mod:`kvloop.app.benchmarks.stalls`) reads each request as AIPerf timed it (wall-clock send and end,
TTFT, every gap between chunks), what it computed from its usage (prompt less cached tokens), and, where the
router wrote per-turn records (``--router-records``), the engines that served it, their own computed-token
account and the router's deliberate waits (:func:`request_turns`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvloop.app.benchmarks.aiperf import Request, Slo
from kvloop.app.benchmarks.stalls import TurnTiming
from kvloop.app.benchmarks.stats import percentiles_ms

MATCH_SLACK_S = 0.5
"""A router record is a request's when it arrived between this long before the request was sent and this long
after its first token, with the same prompt length and, where both name it, the same session (the nearest to the
send time wins, each record once). Without the session, the first turns of sessions sent together (one prompt
length) were matched in send order, not as served: a turn's queue and engine were another's."""


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
    return _by_part(before, after, hz, PARTS)


def _by_part(before: Mapping[int, tuple[str, int]], after: Mapping[int, tuple[str, int]], unit: float,
             parts: Sequence[str]) -> dict[str, float]:
    """Per part, the sum over its processes of their counter's growth between two readings of pid -> (part,
    counter), in ``unit`` per second; a process first seen in ``after`` counts from zero, and a counter that fell
    (a sum over live threads that lost one) counts 0."""
    out = dict.fromkeys(parts, 0.0)
    for pid, (part, value) in after.items():
        out[part] += max(0, value - before[pid][1] if pid in before else value) / unit
    return {k: round(v, 2) for k, v in out.items()}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _match(r: Request, records: Sequence[Mapping[str, Any]], used: set[int]) -> Mapping[str, Any] | None:
    start = r.start_ns / 1e9
    first = start + (r.ttft_ms or 0.0) / 1e3
    best, best_d = None, 0.0
    for i, rec in enumerate(records):
        t = rec.get("t")
        if i in used or rec.get("error") or not isinstance(t, (int, float)):
            continue
        if r.prompt_tokens and rec.get("prompt_tokens") != r.prompt_tokens:
            continue
        if r.correlation_id and rec.get("session") and rec.get("session") != r.correlation_id:
            continue
        if start - MATCH_SLACK_S <= t <= first + MATCH_SLACK_S and (best is None or abs(t - start) < best_d):
            best, best_d = i, abs(t - start)
    if best is None:
        return None
    used.add(best)
    return records[best]


def request_turns(requests: Sequence[Request], records: Sequence[Mapping[str, Any]] = (), only_engine: str = ""
                  ) -> list[TurnTiming]:
    """A load point's answered requests as the stall check reads them. ``records``: the router's per-turn records
    (``kvloop.router.records``, as JSON objects) around the point, matched to requests by :data:`MATCH_SLACK_S`;
    ``only_engine``: the configuration's engine when it has one (every request's, records or none)."""
    used: set[int] = set()
    out = []
    for r in sorted((r for r in requests if not r.error), key=lambda r: r.start_ns):
        rec = _match(r, records, used) if records else None
        computed = max(0, r.prompt_tokens - r.cached_tokens) if r.prompt_tokens else None
        pulled, wait_s, prefill, decode = 0, 0.0, only_engine, only_engine
        if rec is not None:
            computed = int(rec.get("computed_tokens", computed or 0))
            pulled = int(rec.get("pulled_tokens", 0))
            timings = rec.get("timings_ms") or {}
            wait_s = float(timings.get("publication_wait", 0.0)) / 1e3
            prefill = str(rec.get("prefill_engine") or only_engine)
            decode = str(rec.get("decode_engine") or only_engine)
        out.append(TurnTiming(
            name=f"{r.session} turn {r.turn}", ttft_s=r.ttft_ms / 1e3 if r.ttft_ms is not None else None,
            max_gap_s=max(r.gaps_ms) / 1e3 if r.gaps_ms else None, start_s=r.start_ns / 1e9 if r.start_ns else None,
            end_s=r.end_ns / 1e9 if r.start_ns and r.end_ns else None, prompt_tokens=r.prompt_tokens,
            computed_tokens=computed, pulled_tokens=pulled, wait_s=wait_s, prefill_engine=prefill,
            decode_engine=decode))
    return out


STEP_BOUND_MS = 50.0
"""A router step (``tokenize``, ``place``) longer than this is counted, and checked against its loop's own time."""

ROUTER_STEPS = ("tokenize", "place")


def router_steps(records: Sequence[Mapping[str, Any]], bound_ms: float = STEP_BOUND_MS) -> dict[str, dict[str, Any]]:
    """Per router step in the turns' records: n, the steps over ``bound_ms``, and of those how many the router's
    loop thread does not explain: wall time less the thread's CPU (its own and the other turns' work) and its wait
    for a core (``<step>_cpu``, ``<step>_cpu_wait``) still over ``bound_ms``, so it awaited something else (the
    broker's reply for ``place``). A step whose record lacks those fields counts as unexplained."""
    out: dict[str, dict[str, Any]] = {}
    for step in ROUTER_STEPS:
        walls, over, unexplained, waited = 0, 0, 0, 0.0
        for r in records:
            t = r.get("timings_ms") or {}
            if step not in t:
                continue
            walls += 1
            if t[step] <= bound_ms:
                continue
            over += 1
            wait = t.get(f"{step}_cpu_wait")
            if wait is None:
                unexplained += 1
                continue
            waited += wait
            if t[step] - t.get(f"{step}_cpu", 0.0) - wait > bound_ms:
                unexplained += 1
        out[step] = {"n": walls, "over_bound": over, "unexplained": unexplained,
                     "over_bound_cpu_wait_ms": round(waited, 1), "bound_ms": bound_ms}
    return out


WAIT_PARTS = ("router", *PARTS)
"""The processes whose wait for a core a point reports: this process (``router``: the bench with kvloop's
in-process router) and :data:`PARTS`."""


def cpu_wait_by_part(before: Mapping[int, tuple[str, int]], after: Mapping[int, tuple[str, int]]) -> dict[str, float]:
    """Seconds each of :data:`WAIT_PARTS` waited runnable for a core between two readings of pid -> (part, ns summed
    over its live threads); a thread that ended between them takes its wait with it (so a process's delta is at
    least 0, and the figure a lower bound)."""
    return _by_part(before, after, 1e9, WAIT_PARTS)
