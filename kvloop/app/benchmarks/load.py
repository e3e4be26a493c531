"""``kvloop bench load``: goodput at a stated SLO over a sweep of load, each configuration on its own engines,
one after another, driven by NVIDIA AIPerf (:mod:`kvloop.app.benchmarks.aiperf`).

Configurations (``--configs``), on the same engine settings as ``kvloop bench multiturn`` (its
:func:`~kvloop.app.benchmarks.multiturn.engine_config`: model, dtype, core split, queue-spin cap):

- ``kvloop``: ``kvloop up``'s topology (2 prefill engines on the first half of the cores, 1 decode engine on
  the second), broker and router;
- ``kvloop_pd``: the same, the router asking for strict P/D (no DECODE_LOCAL);
- ``one_way``: the same cluster with retention off (``kvloop_retain: false``) and the router asking for strict
  P/D: without a return path, nothing computed on the decode engine (its prefix cache would otherwise still
  serve DECODE_LOCAL turns), the router still using each prefill engine's prefix cache;
- ``kvloop_dp``: a data-parallel fleet: one aggregated engine (role ``both``, kvloop's connector) per half of
  the cores behind kvloop's broker and router, which keep each session where its history is and move it (a
  pull) when that engine is busy: llm-d's recommended setup before P/D, with kvloop's return path;
- ``kvloop_single``: a fleet of one: the aggregated engine (role ``both``, every core) with kvloop's connector,
  sidecar, broker and router in front: what kvloop's own parts cost a turn, beside the bare engine;
- ``kvloop_single_chat``: the same fleet of one with the router asking the engine by chat
  (``chat_as_tokens: false``: the engine renders and tokenizes each turn again): what one rendering a turn saves;
- ``kvloop_single_direct``: the same fleet of one with the load sent to the engine itself, past the router (which
  stays up, idle): the engine with kvloop's connector, sidecar and broker, so that the router's share of
  ``kvloop_single``'s cost and the rest's are told apart (a diagnostic: without the router nothing is retained);
- ``kvloop_single_gateway``: the same fleet of one behind Envoy, the router serving as its endpoint picker
  (docs/gateway.md): the router places and Envoy relays the stream, as a service mesh would run kvloop;
- ``aggregated``: one engine with its prefix cache on every core: the engine kvloop must match;
- ``aggregated_steps``: the same engine taking the steps kvloop's decode engine takes (``DECODE_STEP_TOKENS``
  instead of vLLM's default): whether a difference is kvloop's or the step size's;
- ``aggregated_one_core``: the same engine computing on one core (the decode role's, one OpenMP thread), everything
  else floating as with the others: on a small model two OpenMP threads decode slower than one (this machine's
  profiles: 0.39 against 0.084 ms a stream-step), so the aggregated engine's better setting, beside the default.

Workloads: ``agent`` (AIPerf's synthetic multi-turn chat: sessions sharing one system prompt, every turn the
whole history) swept over concurrent sessions; ``trace`` (a Mooncake-format JSONL, scaled by
:func:`scale_trace`) swept over replay speed. Per point: goodput (DistServe), the SLO attainment, TTFT,
per-request ITL, chunk gaps and end-to-end p50/p95/p99 with n, throughput, each core's busy share from
``/proc/stat`` and the CPU seconds split between the load generator, this process (with kvloop's router, which
runs in it) and the rest (engines, sidecars, broker), with the rest's engine processes (worker, EngineCore, API
server), sidecars and broker each counted from ``/proc/PID/stat`` (``cpu_s_by_part``: what kvloop's parts cost beside
the bare engine), the paths kvloop's router took, and the engines' queue stalls; per configuration the knees (the
highest load with 90% and 99% of requests within the SLO).

Health: a configuration whose point has errors, a request queued over ``STALL_S`` in an engine, or a request
whose time to first token or largest gap between chunks exceeds what its engine's queue and compute explain by
more than ``BOUND_S`` (:mod:`kvloop.app.benchmarks.stalls`, from AIPerf's per-request records and the router's, always
written) is unhealthy there; at its lowest load its time to first token is also held
against its engines' prefill time as in the multi-turn bench (under load, queueing is what is measured, so the
factor check applies only where there is none). Ratios against ``aggregated`` are withheld where either side is
unhealthy. The table counts each point's stalled requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import resource
import shutil
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvloop.app.benchmarks import aiperf
from kvloop.app.benchmarks.aiperf import AgentLoad, Slo, TraceLoad
from kvloop.app.benchmarks.load_stats import (
    PARTS,
    busy_share,
    cpu_by_part,
    cpu_times,
    cpu_wait_by_part,
    descendants,
    knee,
    point_figures,
    process_part,
    process_stat,
    ratio,
    request_turns,
    router_steps,
)
from kvloop.app.benchmarks.multiturn import (
    BASELINE_EXTRA,
    BLOCK,
    Sizing,
    add_topology_arguments,
    cores_record,
    engine_config,
    engine_cores,
    engine_snapshot,
    prefill_engines_problem,
    start_config,
    step_budgets,
)
from kvloop.app.benchmarks.shapes import SHAPES, parse_shapes, shaped
from kvloop.app.benchmarks.stalls import BOUND_S, StallReport, find_stalls, prefill_rate
from kvloop.app.benchmarks.stats import STALL_S, health, markdown_table, show
from kvloop.app.benchmarks.warmup import WarmUp, warm_up
from kvloop.app.cluster import LocalCluster, picker_settings, start_gateway
from kvloop.app.engine_set import EngineSet, start_engines_async
from kvloop.engines.config import DECODE_STEP_TOKENS, default_work_dir, role_cores, split_cores
from kvloop.engines.model import ensure_tiny_model
from kvloop.shared import cpu_wait, mooncake
from kvloop.shared.http import metric_by_label, read_metrics
from kvloop.shared.vocabulary import Role

CONFIGS = ("kvloop", "kvloop_pd", "kvloop_dp", "kvloop_single", "kvloop_single_chat", "kvloop_single_direct",
           "kvloop_single_gateway", "one_way", "aggregated", "aggregated_steps", "aggregated_one_core")
SINGLE_FLEETS = ("kvloop_dp", "kvloop_single", "kvloop_single_chat", "kvloop_single_direct", "kvloop_single_gateway")
BASELINE = "aggregated"
ONE_ENGINE = ("kvloop_single", "kvloop_single_chat", "kvloop_single_direct", "kvloop_single_gateway", BASELINE,
              "aggregated_steps")
"""Configurations of one engine: the ones ``--engine-cores`` can give cores of their own."""


def cpu_list(text: str) -> set[int]:
    """The cores of a CPU list such as ``1`` or ``0-3,6``; ValueError when it is not one."""
    cpus: set[int] = set()
    for part in text.split(","):
        if not re.fullmatch(r"\d+(-\d+)?", part):
            raise ValueError(part)
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if last < first:
            raise ValueError(part)
        cpus.update(range(first, last + 1))
    return cpus


def engine_cores_problem(text: str, configs: list[str]) -> str:
    """What is wrong with ``--engine-cores`` for these configurations; "" when nothing (or it is not given)."""
    if not text:
        return ""
    try:
        cpus = cpu_list(text)
    except ValueError:
        return f"--engine-cores: {text!r} is not a CPU list such as 1 or 2-3"
    mine = os.sched_getaffinity(0)
    if not cpus < mine:
        return f"--engine-cores: must be some, not all, of this process's cores {sorted(mine)}"
    if others := [c for c in configs if c not in ONE_ENGINE]:
        return f"--engine-cores: only for configurations of one engine {list(ONE_ENGINE)}, not {others}"
    return ""


def pin_to_other_cores(engine_cores: str) -> list[int]:
    """Keep this thread (and every thread and process it starts from now on: the router, broker, sidecars, the
    engines' API servers and EngineCores, AIPerf) off ``engine_cores``; the cores it keeps."""
    rest = sorted(os.sched_getaffinity(0) - cpu_list(engine_cores))
    os.sched_setaffinity(0, rest)
    return rest


def scale_trace(lines: list[str], *, length_scale: float, time_scale: float, seconds: float) -> list[str]:
    """A Mooncake-format trace cut and scaled (:func:`kvloop.shared.mooncake.scaled`), as JSONL lines for AIPerf.
    Raises :class:`ConfigError` naming the line and field that is not a request."""
    rows = mooncake.scaled(mooncake.parse_lines(lines), length_scale=length_scale, time_scale=time_scale,
                           seconds=seconds)
    return [r.to_json() for r in rows]


def sizing(max_prompt: int, concurrency: int) -> Sizing:
    """Every prefill engine has room for ``concurrency`` longest prompts; decode and aggregated engines vLLM's
    default KV space."""
    max_len = int(math.ceil((max_prompt + BLOCK) / BLOCK) * BLOCK)
    one = max_len // BLOCK + 2
    notes = {"max_model_len": max_len, "prefill_blocks": one * concurrency}
    return Sizing(max_len, one * concurrency, None, 0.5, notes)


async def start(name: str, model: Path, work: Path, size: Sizing, timeout_s: float, records: Path | None = None,
                worker_cores: str = "") -> tuple[EngineSet, LocalCluster | None, str]:
    """One configuration's engines (and cluster); the OpenAI URL the load goes to. ``records``: the per-turn
    records file of the configuration's kvloop router (none for the aggregated engine, which has no router).
    ``worker_cores``: the one engine's OpenMP cores (``--engine-cores``; default every core, "auto")."""
    whole = worker_cores or "auto"
    # Every kvloop router tokenizes with the model's own tokenizer, as `kvloop up` starts it (without it, each turn
    # waited for an engine's /tokenize on the busy cores: 100 ms on average at 16 sessions, up to 1 s).
    routing: dict[str, Any] = {"tokenizer": str(model)}
    if records is not None:
        routing["records_path"] = str(records)
    if name == "kvloop_single_chat":
        routing["chat_as_tokens"] = False
    token = picker_settings(routing, work) if name == "kvloop_single_gateway" else ""
    if name in SINGLE_FLEETS:
        shares = split_cores(2) if name == "kvloop_dp" else [whole]

        def fleet(broker: str) -> list[Any]:
            return [engine_config(model, work, Role.BOTH, i, connector="kvloop", broker=broker, size=size,
                                  blocks=None, extra={}, cores=cores) for i, cores in enumerate(shares)]

        cluster = await LocalCluster.start(fleet, work, separate_broker=True, broker={"engine_ttl_s": 10.0},
                                           router={"request_timeout_s": timeout_s, **routing})
        engines: EngineSet = cluster.engines
        if name == "kvloop_single_direct":
            return engines, cluster, engines.by_id("both-0").url
        if token:
            try:
                return engines, cluster, (await start_gateway(cluster, token, work)).extra["url"]
            except BaseException:
                await cluster.stop()
                raise
    elif name == "one_way":
        def configs(broker: str) -> list[Any]:
            prefills = [engine_config(model, work, Role.PREFILL, i, connector="kvloop", broker=broker, size=size,
                                      blocks=size.prefill_blocks, extra=BASELINE_EXTRA)
                        for i in range(size.prefill_engines)]
            return [*prefills, engine_config(model, work, Role.DECODE, 2, connector="kvloop", broker=broker,
                                             size=size, blocks=None, extra=BASELINE_EXTRA)]

        cluster = await LocalCluster.start(configs, work, separate_broker=True, broker={"engine_ttl_s": 10.0},
                                           # Nothing is retained, so there is no publication to wait for
                                           # (router/recent.py): without this, a turn that follows its answer
                                           # within publication_wait_s waited for a lease that never comes.
                                           router={"request_timeout_s": timeout_s, "decode_local": False,
                                                   "publication_wait_s": 0.0, **routing})
        engines = cluster.engines
    elif name in ("aggregated_steps", "aggregated_one_core"):
        config = engine_config(model, work, Role.BOTH, 0, connector="none", broker="", size=size, blocks=None, extra={},
                               cores=role_cores(Role.DECODE) if name == "aggregated_one_core" else whole)
        if name == "aggregated_steps":
            config = replace(config, step_tokens=DECODE_STEP_TOKENS)
        engines = await start_engines_async([config])
        return engines, None, engines.by_id("both-0").url
    else:
        engines, maybe = await start_config("ideal" if name == BASELINE else name, model, work, size, timeout_s,
                                            records, ideal_cores=worker_cores)
        if maybe is None:
            return engines, None, engines.by_id("both-0").url
        cluster = maybe
    assert cluster.router is not None
    return engines, cluster, cluster.router.url


def parts_cpu() -> dict[int, tuple[str, int]]:
    """pid -> (part, jiffies) of this process's descendants that are one of :data:`PARTS` (blocking)."""
    parents, seen = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent, ticks = process_stat((entry / "stat").read_text())
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        parents[int(entry.name)] = parent
        if (part := process_part(cmdline)) is not None:
            seen[int(entry.name)] = (part, ticks)
    mine = descendants(parents, os.getpid())
    return {pid: v for pid, v in seen.items() if pid in mine}


def parts_cpu_wait(parts: dict[int, tuple[str, int]]) -> dict[int, tuple[str, int]]:
    """pid -> (part, ns its live threads waited runnable for a core) of this process (``router``) and ``parts``
    (:func:`parts_cpu`'s) (blocking)."""
    out = {}
    for pid, part in ((os.getpid(), "router"), *((pid, v[0]) for pid, v in parts.items())):
        if (ns := cpu_wait.process_wait_ns(pid)) is not None:
            out[pid] = (part, ns)
    return out


def snapshot(urls: list[str], serving: list[str], router: str | None
             ) -> tuple[dict[str, tuple[int, int]], dict[str, float], dict[str, float], tuple[float, float],
                        dict[int, tuple[str, int]], dict[int, tuple[str, int]]]:
    """Each core's jiffies, the engines' figures, the router's turns by path, the CPU seconds of this process
    (the bench and kvloop's in-process router) and of its finished children (AIPerf runs), the jiffies of each
    engine process, sidecar and broker (:func:`parts_cpu`) and their and this process's wait for a core
    (:func:`parts_cpu_wait`) (blocking: run in a thread)."""
    paths = {} if router is None else metric_by_label(read_metrics(router), "kvloop_router_decisions_total",
                                                       "decision")
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    parts = parts_cpu()
    return (cpu_times(Path("/proc/stat").read_text()), engine_snapshot(urls, serving), paths,
            (own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime), parts, parts_cpu_wait(parts))


def cpu_split(before: tuple[Any, ...], after: tuple[Any, ...]) -> dict[str, float]:
    """CPU seconds of the point: the load generator (AIPerf), the bench with kvloop's router (in this process),
    and the rest (engines, sidecars, broker, anything else on the machine), from the cores' busy jiffies."""
    hz = os.sysconf("SC_CLK_TCK")
    busy = sum(a[0] - before[0].get(core, (0, 0))[0] for core, a in after[0].items()) / hz
    own, aiperf_s = after[3][0] - before[3][0], after[3][1] - before[3][1]
    return {"aiperf": round(aiperf_s, 1), "bench_and_router": round(own, 1),
            "engines_and_rest": round(max(0.0, busy - own - aiperf_s), 1)}


def read_router_records(path: Path | None) -> list[dict[str, Any]]:
    """The router's per-turn records so far (JSON objects; a line cut short by a write in progress is skipped)."""
    if path is None or not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        if isinstance(raw, dict):
            out.append(raw)
    return out


def point_stalls(requests: list[aiperf.Request], engine_figures: dict[str, float], engines: EngineSet,
                 records: list[dict[str, Any]]) -> StallReport:
    """A point's stall check: its requests, the engines' prefill rate over the point, their step budgets."""
    gaps = [g / 1e3 for r in requests if not r.error for g in r.gaps_ms]
    ids = [e.engine_id for e in engines]
    turns = request_turns(requests, records, only_engine=ids[0] if len(ids) == 1 else "")
    rate = prefill_rate(engine_figures.get("computed_all", 0.0),
                        engine_figures.get("vllm:request_prefill_time_seconds_sum", 0.0))
    return find_stalls(turns, prefill_tokens_per_s=rate, median_gap_s=statistics.median(gaps) if gaps else None,
                       step_tokens=step_budgets(engines), cores=engine_cores(engines))


async def run_point(name: str, load_value: float, url: str, router: str | None, engines: EngineSet,
                    load: AgentLoad | TraceLoad, args: argparse.Namespace, model: Path, exe: Path,
                    out_dir: Path) -> tuple[dict[str, Any], StallReport]:
    """One load point's figures, and its stall check (its count and worst turn are in the figures too)."""
    urls = [e.url for e in engines]
    serving = [e.url for e in engines if e.plan.config.role != Role.DECODE]
    concurrency = int(load_value) if isinstance(load, AgentLoad) else args.trace_concurrency
    hf_home = out_dir.parent.parent / "hf-home"
    tokenizer = aiperf.hub_tokenizer(model, hf_home)
    argv = aiperf.command(exe, model=model.name, tokenizer=tokenizer, url=url, concurrency=concurrency, load=load,
                          slo=args.slo, artifacts=out_dir, timeout_s=args.timeout_s)
    before = await asyncio.to_thread(snapshot, urls, serving, router)
    t0, started = time.monotonic(), time.time()
    records = await asyncio.to_thread(aiperf.run, argv, out_dir, args.point_timeout_s, hf_home)
    seconds = time.monotonic() - t0
    after = await asyncio.to_thread(snapshot, urls, serving, router)
    figures = point_figures(records, args.slo)
    eng = {k: after[1].get(k, 0.0) - before[1].get(k, 0.0) for k in after[1]}
    paths = {k: int(v - before[2].get(k, 0.0)) for k, v in after[2].items() if v - before[2].get(k, 0.0) > 0}
    figures.update(load=load_value, concurrency=concurrency, aiperf_seconds=round(seconds, 1),
                   cores_busy=busy_share(before[0], after[0]), cpu_s=cpu_split(before, after),
                   cpu_s_by_part=cpu_by_part(before[4], after[4], os.sysconf("SC_CLK_TCK")),
                   cpu_wait_s_by_part=cpu_wait_by_part(before[5], after[5]), paths=paths,
                   stalled_requests=int(eng.get("stalled", 0)),
                   prefill_time_s=round(eng.get("vllm:request_prefill_time_seconds_sum", 0.0), 3),
                   ttft_sum_s=round(sum(r.ttft_ms or 0.0 for r in records if not r.error) / 1e3, 3))
    routed = await asyncio.to_thread(read_router_records, args.router_records / f"{name}.jsonl"
                                     if args.router_records else None)
    stalls = point_stalls(records, eng, engines, routed)
    figures["stalls"] = stalls.to_dict()
    if routed:
        figures["router_steps"] = router_steps([r for r in routed if r.get("t", 0.0) >= started])
    return figures, stalls


def point_health(point: dict[str, Any], lowest: bool, stalls: StallReport | None = None) -> dict[str, Any]:
    """``stalls``: the point's stall check (:func:`point_stalls`); any stall makes the point unhealthy."""
    if lowest:
        h = health(errors=point["errors"], turns=point["requests"] - point["errors"],
                   ttft_sum_s=point["ttft_sum_s"], prefill_sum_s=point["prefill_time_s"],
                   stalled_requests=point["stalled_requests"], stalls=stalls)
        return {"healthy": h.healthy, "reason": h.reason, "stalled_turns": h.stalled_turns}
    reasons = []
    if point["errors"]:
        reasons.append(f"{point['errors']} request(s) failed")
    if point["stalled_requests"]:
        reasons.append(f"{point['stalled_requests']} request(s) queued over {STALL_S:g} s in an engine")
    if stalls is not None and stalls.count:
        reasons.append(stalls.reason())
    return {"healthy": not reasons, "reason": "; ".join(reasons) or "no errors, no engine stall",
            "stalled_turns": stalls.count if stalls is not None else 0}


def loads_of(args: argparse.Namespace) -> list[float]:
    return [float(v) for v in str(args.loads).split(",") if v]


def load_for(args: argparse.Namespace, value: float, trace_file: Path | None) -> AgentLoad | TraceLoad:
    if trace_file is not None:
        return TraceLoad(trace_file.with_name(f"trace-x{value:g}.jsonl"), block_size=args.trace_block_size)
    sessions = max(args.sessions_per_load * int(value), math.ceil(args.min_requests / args.turns))
    base = AgentLoad(sessions=sessions, turns=args.turns, system_tokens=args.system_tokens,
                     user_tokens=args.user_tokens, answer_tokens=args.answer_tokens, think_ms=args.think_ms,
                     seed=args.seed)
    return shaped(SHAPES[getattr(args, "shape", "agent")], base)


def compare(configs: dict[str, Any]) -> dict[str, Any]:
    """Per configuration and load: goodput, TTFT p99 and ITL p99 over the aggregated engine's, where both sides
    are healthy."""
    base = configs.get(BASELINE)
    out: dict[str, Any] = {}
    if base is None:
        return out
    base_points = {p["load"]: p for p in base["points"]}
    for name, config in configs.items():
        if name == BASELINE:
            continue
        for p in config["points"]:
            b = base_points.get(p["load"])
            if b is None:
                continue
            key = f"{name}_over_{BASELINE}@{p['load']:g}"
            if not (p["health"]["healthy"] and b["health"]["healthy"]):
                out[key] = {"withheld": f"{name}: {p['health']['reason']}; {BASELINE}: {b['health']['reason']}"}
                continue
            out[key] = {"goodput": ratio(p["goodput_rps"], b["goodput_rps"]),
                        "ttft_p99": ratio(p["ttft_ms"]["p99"], b["ttft_ms"]["p99"]),
                        "itl_p99": ratio(p["itl_ms"]["p99"], b["itl_ms"]["p99"])}
    return out


def parts_table(configs: dict[str, Any]) -> str:
    """CPU seconds of each point by part, and per request: where one configuration's cores go beside another's."""
    rows = []
    for name, config in configs.items():
        for p in config["points"]:
            parts = p.get("cpu_s_by_part") or {}
            served = max(1, p["requests"] - p["errors"])
            own = {"router": p["cpu_s"]["bench_and_router"], **parts}
            waits = p.get("cpu_wait_s_by_part") or {}
            steps = p.get("router_steps") or {}
            rows.append([name, f"{p['load']:g}", *(f"{own.get(k, 0.0):g}" for k in ("router", *PARTS)),
                         f"{1000 * sum(own.values()) / served:.0f}",
                         "/".join(f"{waits.get(k, 0.0):g}" for k in ("router", "broker", "sidecar", "engine_worker")),
                         "/".join(f"{steps[k]['over_bound']} ({steps[k]['unexplained']})" for k in steps) or "-"])
    return markdown_table(["config", "load", "CPU s router", "engine worker", "engine core", "engine API server",
                           "sidecar", "broker", "ms per request", "waited for a core s router/broker/sidecar/worker",
                           "router steps > 50 ms tokenize/place (unexplained)"], rows)


def table(configs: dict[str, Any]) -> str:
    rows = []
    for name, config in configs.items():
        for p in config["points"]:
            rows.append([name, f"{p['load']:g}", p["requests"], f"{p['goodput_rps']:.2f}",
                         f"{p['slo_attainment']:.0%}", show(p["ttft_ms"], "p50"), show(p["ttft_ms"], "p99"),
                         show(p["itl_ms"], "p50"), show(p["itl_ms"], "p99"), show(p["gap_ms"], "p99"),
                         f"{p['throughput_rps']:.2f}", "/".join(f"{v:.2f}" for v in p["cores_busy"].values()),
                         "/".join(f"{v:g}" for v in p["cpu_s"].values()),
                         ",".join(f"{k}:{v}" for k, v in sorted(p["paths"].items())) or "-",
                         p.get("stalls", {}).get("count", "-"), "yes" if p["health"]["healthy"] else "NO"])
    return markdown_table(["config", "load", "n", "goodput/s", "in SLO", "TTFT p50", "TTFT p99", "ITL p50",
                           "ITL p99", "gap p99", "req/s", "cores busy", "CPU s aiperf/router/engines", "paths",
                           "stalls", "healthy"], rows)


def plot(configs: dict[str, Any], path: Path, xlabel: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, config in configs.items():
        xs = [p["load"] for p in config["points"]]
        for ax, (title, get) in zip(axes, (("goodput (req/s within the SLO)", lambda p: p["goodput_rps"]),
                                           ("TTFT p99 (ms)", lambda p: p["ttft_ms"]["p99"]),
                                           ("ITL p99 (ms)", lambda p: p["itl_ms"]["p99"])), strict=True):
            ax.plot(xs, [get(p) for p in config["points"]], marker="o", label=name)
            ax.set_title(title)
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    # Absolute: AIPerf's workers take a relative tokenizer path for a Hugging Face repo id.
    model = (await asyncio.to_thread(ensure_tiny_model, args.model)).absolute()
    work = (args.work_dir or default_work_dir() / "bench-load").absolute()
    # The stall check needs each turn's engines, computed and pulled tokens and the router's waits: without the
    # router's records it under-explained turns (a run at 8 sessions: 2 "stalls" without them, 0 with them, the same
    # requests), so a kvloop configuration always writes them, to the work folder unless asked elsewhere.
    if args.router_records is None:
        args.router_records = work / "router-records"
        shutil.rmtree(args.router_records, ignore_errors=True)  # a former run's records, not this one's
    exe = await asyncio.to_thread(aiperf.ensure, args.aiperf_root or default_work_dir())
    loads = loads_of(args)
    trace_file = None
    if args.trace:
        lines = args.trace.read_text().splitlines()
        for value in loads:  # one file per replay speed: timestamps divided by the speed
            scaled = scale_trace(lines, length_scale=args.trace_length_scale, time_scale=args.trace_slow / value,
                                 seconds=args.trace_seconds)
            trace_file = work / "trace.jsonl"
            trace_file.parent.mkdir(parents=True, exist_ok=True)
            trace_file.with_name(f"trace-x{value:g}.jsonl").write_text("\n".join(scaled) + "\n")
        rows = [json.loads(x) for x in scale_trace(lines, length_scale=args.trace_length_scale, time_scale=1.0,
                                                    seconds=args.trace_seconds)]
        max_prompt = max(r["input_length"] + r["output_length"] for r in rows)
        concurrency = args.trace_concurrency
    else:
        max_prompt = load_for(args, max(loads), None).history_tokens()  # type: ignore[union-attr]
        concurrency = int(max(loads))
    size = replace(sizing(max_prompt, concurrency), prefill_engines=args.prefill_engines, cores=args.cores)
    configs: dict[str, Any] = {}
    for name in [n for n in args.configs.split(",") if n]:
        print(f"== {name}: engines starting", flush=True)
        records = args.router_records / f"{name}.jsonl" if args.router_records else None
        engines, cluster, url = await start(name, model, work / name, size, args.timeout_s, records,
                                            args.engine_cores)
        router = cluster.router.url if cluster is not None and cluster.router is not None else None
        points = []
        try:
            warm_s = None
            if args.warmup_sessions:
                spec = WarmUp(sessions=args.warmup_sessions, prompt_words=args.system_tokens,
                              turn_words=args.user_tokens)
                warm_s = round(await warm_up(url, model.name, spec, args.timeout_s), 1)
                print(f"   {name}: warmed up in {warm_s:g} s ({spec.rounds} x {spec.sessions} sessions of "
                      f"{spec.turns} turns)", flush=True)
            for i, value in enumerate(loads):
                load = load_for(args, value, trace_file)
                point, stalls = await run_point(name, value, url, router, engines, load, args, model, exe,
                                                work / name / f"load-{value:g}")
                point["health"] = point_health(point, lowest=i == 0, stalls=stalls)
                points.append(point)
                print(f"   {name} @ {value:g}: {point['requests']} requests, goodput {point['goodput_rps']:.2f}/s, "
                      f"{point['slo_attainment']:.0%} in SLO, TTFT p50 {show(point['ttft_ms'], 'p50')} ms, "
                      f"{stalls.count} stalled, "
                      f"{'healthy' if point['health']['healthy'] else 'UNHEALTHY: ' + point['health']['reason']}",
                      flush=True)
        finally:
            if cluster is not None:
                await cluster.stop()
            else:
                await asyncio.to_thread(engines.stop)
        by_load = {p["load"]: p for p in points}
        configs[name] = {"points": points, "knee_90": knee(by_load, 0.90), "knee_99": knee(by_load, 0.99),
                         "healthy": all(p["health"]["healthy"] for p in points), "warmup_s": warm_s,
                         "stalled_turns": sum(p["stalls"]["count"] for p in points)}
    workload: dict[str, Any] = ({"kind": "trace", "file": str(args.trace), "length_scale": args.trace_length_scale,
                                 "slowed": args.trace_slow, "seconds": args.trace_seconds,
                                 "block_size": args.trace_block_size, "load_axis": "replay speed"}
                                if args.trace else
                                {"kind": "agent", "shape": getattr(args, "shape", "agent"),
                                 **asdict(load_for(args, loads[0], None)),
                                 "sessions_per_load": args.sessions_per_load, "load_axis": "concurrent sessions"})
    result: dict[str, Any] = {
              "configs": configs, "ratios": compare(configs),
              "markdown": table(configs) + "\n\n" + parts_table(configs), "workload": workload,
              "slo": asdict(args.slo), "turn_stall_bound_s": BOUND_S, "loads": loads, "aiperf": aiperf.VERSION,
              "sizing": size.notes,
              "engines": {"cores": {**cores_record(size.cores), BASELINE: args.engine_cores or "auto",
                                    "engine_cores": args.engine_cores or None,
                                    "everything_else": getattr(args, "other_cores", None)},
                          "one_way_connector": BASELINE_EXTRA,
                          "step_tokens": {"decode engines and aggregated_steps": DECODE_STEP_TOKENS,
                                          "the others": "vLLM's default"}},
              "machine": {"cpus": len(os.sched_getaffinity(0)), "model": str(model)},
              "wall_seconds": round(time.monotonic() - started, 1)}
    if args.out:
        result["plots"] = plot(configs, Path(args.out).with_suffix(".png"),
                               "replay speed" if args.trace else "concurrent sessions")
    print("\n" + result["markdown"])
    print("\nagainst the aggregated engine: " + json.dumps(result["ratios"]))
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, from " + ",".join(CONFIGS))
    parser.add_argument("--loads", default="4,8,16", help="concurrent sessions per point (agent), or replay speeds "
                        "(trace: 1 = the trace's own pace after --trace-slow)")
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--itl-slo-ms", type=float, default=50.0, help="per-request mean inter-token latency")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1500, help="the system prompt every session shares")
    parser.add_argument("--user-tokens", type=int, default=200, help="new user tokens a turn")
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--think-ms", type=float, default=500.0, help="delay between a session's turns")
    parser.add_argument("--shapes", default="agent", help="workload shapes, comma-separated, run one after another and "
                        "laid side by side (kvloop.app.benchmarks.shapes): " + ", ".join(
                            f"{s.name} ({s.stresses})" for s in SHAPES.values()).replace("%", "%%"))
    parser.add_argument("--sessions-per-load", type=int, default=2, help="sessions per point: this times the "
                        "concurrency, at least enough for --min-requests")
    parser.add_argument("--min-requests", type=int, default=100, help="requests per point (a p99 needs 100)")
    parser.add_argument("--trace", type=Path, default=None, help="a Mooncake-format JSONL to replay instead")
    parser.add_argument("--trace-length-scale", type=float, default=0.25)
    parser.add_argument("--trace-block-size", type=int, default=128, help="the trace's block size after scaling")
    parser.add_argument("--trace-slow", type=float, default=3.0, help="the trace's clock slowed this many times")
    parser.add_argument("--trace-seconds", type=float, default=60.0, help="the first this many seconds of it")
    parser.add_argument("--trace-concurrency", type=int, default=64, help="most requests in flight in a replay")
    add_topology_arguments(parser)
    parser.add_argument("--warmup-sessions", type=int, default=4, help="chat sessions of the bench's own text sent "
                        "together (three rounds) to each configuration before its first point, so that no point pays "
                        "what a new cluster pays once (kvloop.app.benchmarks.warmup); 0: none")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="a request's deadline")
    parser.add_argument("--point-timeout-s", type=float, default=1200.0, help="one load point's deadline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-cores", default="", help="a CPU list (e.g. 1): the one engine's OpenMP workers on "
                        "these cores and everything else the bench starts (kvloop's router, broker and sidecar, the "
                        "engine's API server and EngineCore, AIPerf) on the other cores, in every configuration: "
                        "kvloop's parts priced off the engine's cores, as on a machine with cores to spare; only for "
                        "configurations of one engine (default: every process on every core)")
    parser.add_argument("--aiperf-root", type=Path, default=None, help="where AIPerf's environment lives "
                        "(default .kvloop/)")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the figures here (JSON; plot beside it)")
    parser.add_argument("--router-records", type=Path, default=None, help="a folder for each configuration's kvloop "
                        "router's per-turn records (<config>.jsonl: plan, path, timings; kvloop analyze reads them, "
                        "the stall check needs them; the aggregated engine has no router; default: the work folder's "
                        "router-records)")


def validate(args: argparse.Namespace) -> str:
    """The first bad argument, named; "" when all are good."""
    unknown = [c for c in args.configs.split(",") if c and c not in CONFIGS]
    if unknown or not [c for c in args.configs.split(",") if c]:
        return f"--configs: unknown {unknown}; choose from {list(CONFIGS)}"
    try:
        loads = loads_of(args)
    except ValueError:
        return "--loads: comma-separated numbers"
    if not loads or any(v <= 0 for v in loads) or loads != sorted(set(loads)):
        return "--loads: positive, increasing, no repeats"
    if not args.trace and any(v != int(v) for v in loads):
        return "--loads: whole numbers of concurrent sessions"
    if problem := prefill_engines_problem(args.prefill_engines):
        return problem
    if problem := engine_cores_problem(args.engine_cores, [c for c in args.configs.split(",") if c]):
        return problem
    if args.trace is not None and not args.trace.is_file():
        return f"--trace: no file {args.trace}"
    if args.warmup_sessions < 0:
        return "--warmup-sessions: 0 (none) or more"
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as exc:
        return str(exc)
    if args.trace and [s.name for s in shapes] != ["agent"]:
        return "--shapes: a trace replay has its own shape; shapes are for the agent workload"
    if args.ttft_slo_ms <= 0 or args.itl_slo_ms <= 0:
        return "--ttft-slo-ms, --itl-slo-ms: must be positive"
    if min(args.turns, args.system_tokens, args.user_tokens, args.answer_tokens, args.sessions_per_load,
           args.min_requests) < 1:
        return "--turns, --system-tokens, --user-tokens, --answer-tokens, --sessions-per-load, --min-requests: " \
               "at least 1"
    if args.think_ms < 0 or args.trace_length_scale <= 0 or args.trace_slow <= 0 or args.trace_seconds <= 0:
        return "--think-ms at least 0; --trace-length-scale, --trace-slow, --trace-seconds positive"
    if args.trace and args.trace_block_size != round(mooncake.MOONCAKE_BLOCK * args.trace_length_scale):
        # AIPerf builds each hash id's block of --trace-block-size tokens and refuses a prompt shorter than its ids.
        return (f"--trace-block-size: must be {mooncake.MOONCAKE_BLOCK} x --trace-length-scale "
                f"({round(mooncake.MOONCAKE_BLOCK * args.trace_length_scale)}), so that a hash id stays one block")
    return ""


def main(args: argparse.Namespace) -> int:
    problem = validate(args)
    if problem:
        print(f"kvloop bench load: {problem}", file=sys.stderr)
        return 2
    args.slo = Slo(ttft_ms=args.ttft_slo_ms, itl_ms=args.itl_slo_ms)
    if args.engine_cores:
        args.other_cores = pin_to_other_cores(args.engine_cores)
        print(f"engines' workers on cores {args.engine_cores}, everything else on {args.other_cores}", flush=True)
    shapes = parse_shapes(args.shapes)
    results = {}
    for shape in shapes:
        run = argparse.Namespace(**vars(args))
        run.shape = shape.name
        if len(shapes) > 1:
            print(f"==== shape {shape.name}: {shape.stresses}", flush=True)
            run.work_dir = (args.work_dir or default_work_dir() / "bench-load") / shape.name
            run.router_records = args.router_records / shape.name if args.router_records else None
            run.out = args.out.with_name(f"{args.out.stem}-{shape.name}{args.out.suffix}") if args.out else None
        result = asyncio.run(bench(run))
        results[shape.name] = result
        if run.out:
            run.out.parent.mkdir(parents=True, exist_ok=True)
            run.out.write_text(json.dumps(result, indent=1, default=str))
            print(f"wrote {run.out}")
        unhealthy = [n for n, c in result["configs"].items() if not c["healthy"]]
        if unhealthy:
            print(f"unhealthy: {', '.join(unhealthy)} (see each point's health)", file=sys.stderr)
    if len(shapes) > 1:
        side = side_by_side(results)
        print("\n" + side["markdown"])
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(side, indent=1, default=str))
            print(f"wrote {args.out}")
    return 0


def side_by_side(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each shape's goodput per configuration and load, and its ratio to the aggregated engine where both points are
    healthy (the ratios of :func:`compare`): one row per shape and load."""
    rows, table_rows = [], []
    for shape, result in results.items():
        for config, figures in result["configs"].items():
            for p in figures["points"]:
                ratio = result["ratios"].get(f"{config}_over_{BASELINE}@{p['load']:g}", {}).get("goodput")
                rows.append({"shape": shape, "config": config, "load": p["load"], "goodput_rps": p["goodput_rps"],
                             "healthy": p["health"]["healthy"], "goodput_over_aggregated": ratio,
                             "requests": p["requests"]})
                table_rows.append([shape, config, f"{p['load']:g}", p["requests"], f"{p['goodput_rps']:.2f}",
                                   "yes" if p["health"]["healthy"] else "no",
                                   "-" if ratio is None else f"{ratio:.2f}"])
    return {"shapes": list(results), "rows": rows,
            "markdown": markdown_table(["shape", "config", "load", "n", "goodput/s", "healthy",
                                        f"goodput / {BASELINE}"], table_rows)}
