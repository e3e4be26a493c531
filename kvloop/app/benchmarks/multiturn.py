"""``kvloop bench multiturn``: one multi-turn workload through each configuration, one after another, each with
only its own engines up, on the same engine settings except what is compared.

Configurations (``--configs``):

- ``one_way``: P/D without a return path; two prefill engines round-robin, their local prefix caches on;
- ``upstream``: vLLM's own decode-to-prefill mode driven as its example proxy does (cannot stream in 0.32);
- ``kvloop``: the broker, the sidecars and the router (streamed);
- ``ideal``: one aggregated engine with its prefix cache, on every core (the absolute limit);
- ``ideal_same_cores``: the same engine on the decode engine's cores only (the hardware a kvloop turn's decode
  side has), so ``kvloop / ideal_same_cores`` compares the detour, not the hardware.

What is equal (stated in the JSON's ``engines``): the model and dtype, the core split (prefill engines share
the first half of the cores, the decode engine the second), vLLM's queue-spin cap, the HTTP keep-alive, and
kvloop's connector on every P/D engine (its NIXL progress-thread delay and one-pull-then-recompute fix); the
baselines run it with ``kvloop_retain`` off and no broker. Every prefill engine has room for ``concurrency``
full-length prompts plus a quarter of the histories; every decode and aggregated engine the default KV space.

Each configuration's health is checked against its own figures (:mod:`kvloop.app.benchmarks.stats`): one with
errors, requests queued over ``STALL_S`` in an engine, a time to first token more than ``HEALTH_FACTOR``
times its engines' prefill time, or any turn whose time to first token or inter-token gap exceeds what its
engine's queue and compute explain by more than ``BOUND_S`` (:mod:`kvloop.app.benchmarks.stalls`) is marked
unhealthy, and ratios that involve it are withheld. The table counts each configuration's stalled turns.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gzip
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from kvloop.app.benchmarks.clients import (
    AggregatedClient,
    Client,
    OneWayClient,
    RouterClient,
    Served,
    UpstreamClient,
)
from kvloop.app.benchmarks.stalls import BOUND_S, StallReport, TurnTiming, find_stalls, prefill_rate
from kvloop.app.benchmarks.stats import (
    HEALTH_FACTOR,
    STALL_S,
    TURN_OVERHEAD_S,
    health,
    markdown_table,
    percentiles_ms,
    requests_above,
    show,
    spread,
)
from kvloop.app.benchmarks.workload import (
    THINK_DISTS,
    AgentSpec,
    Conversation,
    WorkloadSpec,
    agent,
    describe,
    replay,
    synthetic,
)
from kvloop.app.cluster import LocalCluster
from kvloop.app.engine_set import EngineSet, start_engines_async
from kvloop.engines.config import EngineConfig, default_work_dir, is_cpu_build, role_cores
from kvloop.engines.launcher import pick_port
from kvloop.engines.model import ensure_tiny_model
from kvloop.shared import headers as hdr
from kvloop.shared.http import engine_client_connector, metric_by_label, metric_total, read_metrics
from kvloop.shared.vocabulary import Role

BLOCK = 128
CONFIGS = ("one_way", "upstream", "kvloop", "kvloop_pd", "ideal", "ideal_same_cores")
PRESSURE = ("upstream_pressure", "kvloop_pressure", "kvloop_pressure_tier")
"""``--pressure``: the decode engine retains about half the working set; ``kvloop_pressure_tier`` is
``kvloop_pressure`` with a host tier as large as the decode engine's pool (its KV allocation doubled, vLLM's pool
the same), so evictions for room demote instead of dropping."""
HINTED = ("kvloop_hints", "kvloop_pressure_hints", "kvloop_pressure_hints_tier")
"""``kvloop`` (and ``kvloop_pressure``, ``kvloop_pressure_tier``) whose clients say what they will need
(docs/sessions.md): before each tool run the pause it will take (``x-session-pause-s``, the workload's own think
time), and the end with the session's last turn."""
TIERED = ("kvloop_pressure_tier", "kvloop_pressure_hints_tier")
LATE_TOKENS = 8000
BREAKDOWN_STEPS = ("tokenize", "place", "publication_wait", "pin", "prefill_queue", "pull", "prefill_compute",
                   "prefill_http", "decode_first", "router_other")


@dataclass
class TurnRecord:
    config: str
    repeat: int
    conversation: str
    turn: int
    context_tokens: int
    ttft_s: float
    decision: str
    e2e_s: float = 0.0
    itl_p50_ms: float | None = None
    itl_max_ms: float | None = None
    prefill_ttft_s: float | None = None
    error: str = ""
    report: dict[str, Any] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)
    """kvloop's turns: the router's x-kvloop-* reply headers (decision, reason, tokens, ``timing``)."""
    start_s: float | None = None
    """When the turn was sent, seconds since its run began (the stall check's queues)."""
    prefill_engine: str = ""
    decode_engine: str = ""
    cached_tokens: int | None = None
    """The aggregated engine's prefix-cache hit, from its usage."""


@dataclass
class Sizing:
    max_model_len: int
    prefill_blocks: int
    decode_blocks: int | None
    retention_fraction: float
    notes: dict[str, Any] = field(default_factory=dict)
    prefill_engines: int = 2
    """Prefill engines of every P/D configuration (``--prefill-engines``); the decode engine keeps the id
    ``decode-2`` whatever their number."""
    host_tier_blocks: int = 0
    """The decode engine's host tier in the ``_tier`` configurations (``--host-tier-blocks``; 0: as large as its
    pool)."""
    lease_ttl_s: float = 0.0
    """Every kvloop configuration's decode engine asks this TTL for its leases (``--lease-ttl-s``; 0: the
    broker's default): a pause longer than it outlives a lease no hint holds."""
    cores: str = "split"
    """``--cores``: ``split``, kvloop's engines on disjoint halves of the cores by role (:func:`role_cores`);
    ``shared``, every engine on every core (the OS shares them), so a saturated role can use the cores the other
    leaves idle."""

    @property
    def tier_blocks(self) -> int:
        """The ``_tier`` configurations' host tier: ``host_tier_blocks``, else as large as the decode pool."""
        return self.host_tier_blocks or self.decode_blocks or 0


PREFILL_ENGINES_HELP = "prefill engines of each P/D configuration (1..8; the CI run uses 1: fewer engines to start)"
CORES = ("split", "shared")
CORES_HELP = ("split: each role's engines on their own half of the cores (kvloop up's binding); shared: every "
              "engine on every core")


def role_binding(plan: str, role: Role) -> str:
    """The ``omp_threads_bind`` of a P/D engine of ``role`` under the ``--cores`` plan."""
    return "auto" if plan == "shared" else role_cores(role)


def cores_record(plan: str) -> dict[str, str]:
    """What the benchmark's JSON says about the P/D engines' cores."""
    return {"plan": plan, **{str(role): role_binding(plan, role) for role in (Role.PREFILL, Role.DECODE)}}


def add_topology_arguments(parser: argparse.ArgumentParser) -> None:
    """``--prefill-engines`` and ``--cores``, the P/D topology flags both benchmarks take."""
    parser.add_argument("--prefill-engines", type=int, default=2, help=PREFILL_ENGINES_HELP)
    parser.add_argument("--cores", choices=CORES, default="split", help=CORES_HELP)


def prefill_engines_problem(n: int) -> str:
    """``--prefill-engines`` checked for both benchmarks: "" when within 1..8, else the message naming the flag."""
    return "" if 1 <= n <= 8 else "--prefill-engines: must be within 1..8"


def sizing(conversations: list[Conversation], answer: int, concurrency: int, pressure: bool,
           retention_share: float = 0.5, decode_room: int = 0, prefill_room: int = 0) -> Sizing:
    """Prefill engines: room for ``prefill_room`` longest prompts (0: ``concurrency``, so none waits for blocks only a
    timeout frees; fewer: agents pausing for tools leave room, and the prefill engines' prefix caches no longer hold
    every session's history), and at least a quarter of the histories (their prefix caches churn as in
    production). Under pressure the decode engine can retain ``retention_share`` of the working set, and its pool
    holds that beside ``decode_room`` longest prompts running (0: ``concurrency``; fewer: agents pausing for tools
    leave room, and freed blocks leave vLLM's prefix cache sooner)."""
    lengths = [len(c.prefix) + sum(map(len, c.new_tokens)) + sum(c.answer(t, answer) for t in range(c.turns))
               for c in conversations]
    max_len = int(math.ceil((max(lengths) + answer + BLOCK) / BLOCK) * BLOCK)
    one = max_len // BLOCK + 2
    total = sum(math.ceil(n / BLOCK) for n in lengths)
    prefill = max(one * (prefill_room or concurrency), math.ceil(total / 4))
    decode, fraction = None, 0.5
    if pressure:
        decode = one * (decode_room or concurrency) + math.ceil(total * retention_share)
        fraction = max(0.05, min(1.0, (total * retention_share) / decode))
    return Sizing(max_len, prefill, decode, fraction, {
        "history_blocks_total": total, "prefill_blocks_each": prefill, "longest_prompt_blocks": one,
        "prefill_room_for_longest_prompts": prefill // one, "decode_blocks": decode,
        "decode_retention_budget_blocks": int(decode * fraction) if decode else None,
        "decode_host_tier_blocks_kvloop_pressure_tier": decode})


class Progress:
    def __init__(self, total: int, label: str) -> None:
        self.total, self.done, self.label, self.t0 = total, 0, label, time.monotonic()

    def step(self) -> None:
        self.done += 1
        width = 30
        filled = int(width * self.done / max(1, self.total))
        sys.stderr.write(f"\r  {self.label:<24} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
                         f"  {time.monotonic() - self.t0:5.0f}s")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


# Engines ---------------------------------------------------------------------------------------------------

def engine_config(model: Path, work: Path, role: Role, index: int, *, connector: str, broker: str, size: Sizing,
                  blocks: int | None, extra: dict[str, Any], cores: str | None = None,
                  host_tier: int = 0) -> EngineConfig:
    """``blocks``: vLLM's pool (None: as the KV cache size gives); ``host_tier``: blocks added to the allocation
    as the engine's host tier (the pool stays ``blocks``)."""
    allocation = blocks + host_tier if blocks else None
    return EngineConfig(role=role, model=model, engine_id=f"{role}-{index}", work_dir=work, connector=connector,
                        broker=broker, max_model_len=size.max_model_len, host_tier_blocks=host_tier,
                        extra_vllm_args=f"--num-gpu-blocks-override {allocation}" if allocation else "",
                        retention_fraction=size.retention_fraction, lease_ttl_s=size.lease_ttl_s,
                        omp_threads_bind=cores or role_binding(size.cores, role),
                        kv_connector_extra_config=json.dumps(extra), log_level="warning")


BASELINE_EXTRA = {"kvloop_retain": False, "bidirectional_kv_xfer": False}
"""one_way: kvloop's connector with its engine fixes, retaining nothing, upstream's one-way P->D."""
UPSTREAM_EXTRA = {"kvloop_retain": False, "bidirectional_kv_xfer": True, "kv_lease_duration": 120}
"""upstream: the same, with vLLM's own decode-to-prefill mode on (its decode holds blocks for the next turn)."""


async def start_config(name: str, model: Path, work: Path, size: Sizing, timeout_s: float,
                       records: Path | None = None, ideal_cores: str = "") -> tuple[EngineSet, LocalCluster | None]:
    """``records``: the kvloop router's per-turn records file (``kvloop analyze``); ``ideal_cores``: the ideal
    engine's OpenMP cores in place of its own (``kvloop bench load --engine-cores``)."""
    tier = size.tier_blocks if name in TIERED else 0

    def pd(connector: str, broker: str, extra: dict[str, Any]) -> list[EngineConfig]:
        prefills = [engine_config(model, work, Role.PREFILL, i, connector=connector, broker=broker, size=size,
                                  blocks=size.prefill_blocks, extra=extra) for i in range(size.prefill_engines)]
        return [*prefills, engine_config(model, work, Role.DECODE, 2, connector=connector, broker=broker, size=size,
                                         blocks=size.decode_blocks, extra=extra, host_tier=tier)]

    if name in ("ideal", "ideal_same_cores"):
        # No KV connector: nothing is transferred, and the engine pays for no NIXL agent.
        cores = ideal_cores or ("auto" if name == "ideal" else role_cores(Role.DECODE))
        config = engine_config(model, work, Role.BOTH, 0, connector="none", broker="", size=size,
                               blocks=size.decode_blocks, extra={}, cores=cores)
        return await start_engines_async([config]), None
    if name.startswith("kvloop"):
        # kvloop_pd: the same cluster, its router asking for strict P/D (no DECODE_LOCAL): the decode engine's
        # inter-token latency without tails computed on it, and what DECODE_LOCAL adds to TTFT.
        # The router tokenizes with the model's own tokenizer, as `kvloop up` starts it (no /tokenize round trip).
        router: dict[str, Any] = {"request_timeout_s": timeout_s, "decode_local": name != "kvloop_pd",
                                  "tokenizer": str(model)}
        if records is not None:
            router["records_path"] = str(records)
        cluster = await LocalCluster.start(lambda broker: pd("kvloop", broker, {}), work, separate_broker=True,
                                           broker={"engine_ttl_s": 10.0,
                                                   "metrics_listen": f"127.0.0.1:{pick_port()}"}, router=router)
        return cluster.engines, cluster
    extra = UPSTREAM_EXTRA if name.startswith("upstream") else BASELINE_EXTRA
    return await start_engines_async(pd("kvloop", "", extra)), None


def client_for(name: str, http: aiohttp.ClientSession, model: str, timeout_s: float, engines: EngineSet,
               cluster: LocalCluster | None) -> Client:
    if cluster is not None:
        assert cluster.router is not None
        return RouterClient(http, model, timeout_s, cluster.router.url, hints=name in HINTED)
    if name.startswith("ideal"):
        return AggregatedClient(http, model, timeout_s, engines.by_id("both-0").url)
    prefills = [e.url for e in engines.of_role(Role.PREFILL)]
    cls = UpstreamClient if name.startswith("upstream") else OneWayClient
    return cls(http, model, timeout_s, prefills, engines.by_id("decode-2").url)


# Running ---------------------------------------------------------------------------------------------------

async def run_workload(config: str, repeat: int, client: Client, conversations: list[Conversation],
                       answer: int, think_s: float, concurrency: int) -> tuple[list[TurnRecord], list[float]]:
    """Every conversation's turns in order, ``concurrency`` conversations at a time. Returns the turn records and
    every inter-token gap (seconds)."""
    records: list[TurnRecord] = []
    gaps: list[float] = []
    progress = Progress(sum(c.turns for c in conversations), f"{config} #{repeat + 1}")
    gate = asyncio.Semaphore(concurrency)
    began = time.perf_counter()

    async def one(conv: Conversation) -> None:
        async with gate:
            history = list(conv.prefix)
            for i, new in enumerate(conv.new_tokens):
                prompt = history + new
                base: dict[str, Any] = {"config": config, "repeat": repeat, "conversation": conv.conversation_id,
                                        "turn": i + 1, "context_tokens": len(prompt)}
                sent = time.perf_counter() - began
                try:
                    served: Served = await client.turn(conv.conversation_id, prompt, conv.answer(i, answer),
                                                       session_hints(conv, i, think_s))
                    gaps.extend(served.itl_s)
                    itl = sorted(served.itl_s)
                    records.append(TurnRecord(
                        **base, ttft_s=served.ttft_s, decision=served.decision, e2e_s=served.e2e_s,
                        itl_p50_ms=round(itl[len(itl) // 2] * 1e3, 2) if itl else None,
                        itl_max_ms=round(itl[-1] * 1e3, 2) if itl else None, prefill_ttft_s=served.prefill_ttft_s,
                        report=served.report.to_params() if served.report else {}, detail=served.headers,
                        start_s=round(sent, 6), prefill_engine=served.prefill_engine,
                        decode_engine=served.decode_engine, cached_tokens=served.cached_tokens))
                    history = prompt + served.output_ids
                except Exception as exc:
                    records.append(TurnRecord(**base, ttft_s=0.0, decision="ERROR",
                                              error=f"{type(exc).__name__}: {exc}"[:300]))
                    history = prompt
                progress.step()
                await asyncio.sleep(conv.think(i, think_s))  # the agent's tool run: part of the workload

    await asyncio.gather(*(one(c) for c in conversations))
    return records, gaps


def session_hints(conv: Conversation, turn: int, think_s: float) -> dict[str, str]:
    """What an agent that knows its plan says with ``turn`` (0-based): the tool run that follows it, or the end."""
    if turn + 1 >= len(conv.new_tokens):
        return {hdr.SESSION_END: "true"}
    return {hdr.SESSION_PAUSE: f"{conv.think(turn, think_s):.3f}"}


def engine_snapshot(urls: list[str], token_urls: list[str]) -> dict[str, float]:
    """The figures the health check needs, summed over the engines, and the prompt tokens by source over the
    engines that serve prompts (``token_urls``: prefill and aggregated engines; a decode engine's whole-prompt
    read from its prefill engine is the P/D hand-off, not reuse); ``computed_all``: the tokens every engine
    computed, decode engines' included (the prefill rate of :mod:`kvloop.app.benchmarks.stalls`)."""
    totals: dict[str, float] = {}
    for url in urls:
        samples = read_metrics(url)
        by_source = metric_by_label(samples, "vllm:prompt_tokens_by_source_total", "source")
        # Every engine's computed prompt tokens, over its prefill time: the stall check's prefill rate.
        totals["computed_all"] = totals.get("computed_all", 0.0) + by_source.get("local_compute", 0.0)
        if url in token_urls:
            for source, value in by_source.items():
                totals[f"tokens.{source}"] = totals.get(f"tokens.{source}", 0.0) + value
        for name in ("vllm:request_prefill_time_seconds_sum", "vllm:request_queue_time_seconds_sum"):
            totals[name] = totals.get(name, 0.0) + metric_total(samples, name)
        totals["stalled"] = totals.get("stalled", 0.0) + requests_above(samples, "vllm:request_queue_time_seconds",
                                                                        STALL_S)
    return totals


async def run_config(name: str, repeat: int, model: Path, work: Path, conversations: list[Conversation],
                     size: Sizing, args: argparse.Namespace) -> dict[str, Any]:
    records_path = args.router_records / f"{name}-{repeat}.jsonl" if args.router_records else None
    engines, cluster = await start_config(name, model, work / f"{name}-{repeat}", size, args.timeout_s,
                                          records_path)
    try:
        urls = [e.url for e in engines]
        serving = [e.url for e in engines if e.plan.config.role != Role.DECODE]
        before = await asyncio.to_thread(engine_snapshot, urls, serving)
        t0 = time.monotonic()
        async with aiohttp.ClientSession(connector=engine_client_connector(64)) as http:
            client = client_for(name, http, model.name, args.timeout_s, engines, cluster)
            records, gaps = await run_workload(name, repeat, client, conversations, args.answer_tokens,
                                               args.think_time_s, args.concurrency)
        seconds = time.monotonic() - t0
        after = await asyncio.to_thread(engine_snapshot, urls, serving)
        tiers = await asyncio.to_thread(broker_tier_figures, cluster) if cluster is not None else {}
    finally:
        if cluster is not None:
            await cluster.stop()
        else:
            await asyncio.to_thread(engines.stop)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {"records": records, "gaps": gaps, "engines": delta, "seconds": seconds,
            "step_tokens": step_budgets(engines), "cores": engine_cores(engines), "broker": tiers}


def broker_tier_figures(cluster: LocalCluster) -> dict[str, dict[str, float]]:
    """What the broker counted of the host tier over the run: demotions and prefetches by outcome (its metrics)."""
    metrics = cluster.broker_process.extra.get("metrics_url") if cluster.broker_process else None
    if not metrics:
        return {}
    samples = read_metrics(metrics)
    return {name: metric_by_label(samples, f"kvloop_broker_{name}_total", "outcome")
            for name in ("demotions", "prefetches")}


def step_budgets(engines: EngineSet) -> dict[str, int]:
    """Each engine's step budget (``--max-num-batched-tokens``) by its id and its URL, where kvloop sets one
    (vLLM's default is not known here: the stall check then caps nothing)."""
    out: dict[str, int] = {}
    for e in engines:
        budget = e.plan.config.resolved_step_tokens()
        if budget:
            out[e.engine_id] = out[e.url] = budget
    return out


def engine_cores(engines: EngineSet) -> dict[str, str]:
    """Each engine's cores (its CPU binding) by its id and its URL: engines bound alike share a queue in the stall
    check. A GPU engine's binding says nothing of where its steps run: none is given for it."""
    if not is_cpu_build():
        return {}
    out: dict[str, str] = {}
    for e in engines:
        out[e.engine_id] = out[e.url] = e.plan.config.resolved_omp_threads_bind()
    return out


def stall_turns(records: list[TurnRecord]) -> list[TurnTiming]:
    """A run's answered turns as the stall check reads them: TTFT (upstream's prefill-side TTFT: its answer is
    not streamed), the largest gap, the engines, and the computed tokens by the engines' own account (the prefill
    report, the router's headers, or the aggregated engine's cache hit)."""
    out = []
    for r in records:
        if r.error:
            continue
        computed: int | None = None
        if r.report:
            computed = int(r.report.get("computed_tokens", 0))
        elif "computed-tokens" in r.detail:
            computed = int(float(r.detail["computed-tokens"]))
        elif r.cached_tokens is not None:
            computed = max(0, r.context_tokens - r.cached_tokens)
        pulled = int(r.report.get("pulled_tokens", 0)) if r.report else int(float(r.detail.get("pulled-tokens", 0)))
        ttft = r.prefill_ttft_s if r.prefill_ttft_s is not None else r.ttft_s
        out.append(TurnTiming(
            name=f"{r.conversation} turn {r.turn}", ttft_s=ttft,
            max_gap_s=r.itl_max_ms / 1e3 if r.itl_max_ms is not None else None, start_s=r.start_s,
            end_s=r.start_s + r.e2e_s if r.start_s is not None else None, prompt_tokens=r.context_tokens,
            computed_tokens=computed, pulled_tokens=pulled, wait_s=timing(r).get("publication_wait", 0.0) / 1e3,
            prefill_engine=r.prefill_engine, decode_engine=r.decode_engine))
    return out


def run_stalls(run: dict[str, Any]) -> StallReport:
    """One run's stall check, from its turns, every gap, and its engines' counters."""
    engines = run["engines"]
    gaps = run["gaps"]
    return find_stalls(stall_turns(run["records"]),
                       prefill_tokens_per_s=prefill_rate(engines.get("computed_all", 0.0),
                                                         engines.get("vllm:request_prefill_time_seconds_sum", 0.0)),
                       median_gap_s=statistics.median(gaps) if gaps else None,
                       step_tokens=run.get("step_tokens") or {}, cores=run.get("cores") or {})


# Summaries -------------------------------------------------------------------------------------------------

def timing(record: TurnRecord) -> dict[str, float]:
    """kvloop's per-step milliseconds from the router's ``x-kvloop-timing`` header, with what is left over."""
    raw = record.detail.get("timing", "")
    steps = {k: float(v) for k, _, v in (part.partition("=") for part in raw.split(",") if "=" in part)}
    if not steps:
        return {}
    engine_side = sum(steps.get(k, 0.0) for k in ("prefill_queue", "pull", "prefill_compute"))
    if "prefill" in steps:
        steps["prefill_http"] = max(0.0, steps.pop("prefill") - engine_side)
    router_steps = sum(steps.get(k, 0.0) for k in ("tokenize", "place", "pin", "decode_first")) + engine_side + \
        steps.get("prefill_http", 0.0)
    steps["router_other"] = max(0.0, record.ttft_s * 1e3 - router_steps)
    return steps


def breakdown(records: list[TurnRecord]) -> dict[str, dict[str, float | None]]:
    """Per step: median and p90 milliseconds over the turns (``publication_wait`` is inside ``place``)."""
    per_step: dict[str, list[float]] = {}
    for r in records:
        for step, ms in timing(r).items():
            per_step.setdefault(step, []).append(ms)
    out: dict[str, dict[str, float | None]] = {}
    for step in BREAKDOWN_STEPS:
        values = sorted(per_step.get(step, []))
        if values:
            out[step] = {"p50": round(statistics.median(values), 2),
                         "p90": round(values[min(len(values) - 1, math.ceil(0.9 * len(values)) - 1)], 2),
                         "n": len(values)}
    return out


def summarize(name: str, runs: list[dict[str, Any]], late_tokens: int) -> dict[str, Any]:
    """A configuration over its repeats: pooled percentiles, health per repeat, tokens, decisions."""
    records = [r for run in runs for r in run["records"]]
    ok = [r for r in records if not r.error]
    late = [r for r in ok if r.context_tokens >= late_tokens]
    gaps = [g for run in runs for g in run["gaps"]]
    checks = []
    stalls = []
    for run in runs:
        errors = sum(1 for r in run["records"] if r.error)
        first = [r.prefill_ttft_s if r.prefill_ttft_s is not None else r.ttft_s for r in run["records"] if not r.error]
        stalls.append(run_stalls(run))
        checks.append(health(errors=errors, turns=len(first), ttft_sum_s=sum(first),
                             prefill_sum_s=run["engines"].get("vllm:request_prefill_time_seconds_sum", 0.0),
                             stalled_requests=int(run["engines"].get("stalled", 0)), stalls=stalls[-1]))
    healthy = all(c.healthy for c in checks)
    engines = [run["engines"] for run in runs]
    summary: dict[str, Any] = {
        "ttft_ms": percentiles_ms([r.ttft_s for r in ok]), "late_ttft_ms": percentiles_ms([r.ttft_s for r in late]),
        "resumed_ttft_ms": percentiles_ms([r.ttft_s for r in ok if r.turn > 1]),
        "e2e_ms": percentiles_ms([r.e2e_s for r in ok]), "itl_ms": percentiles_ms(gaps),
        "requests": len(records), "errors": len(records) - len(ok), "late_turns": len(late),
        "decisions": dict(Counter(r.decision for r in records)),
        "tokens": {"reused": int(sum(e.get("tokens.local_cache_hit", 0) + e.get("tokens.external_kv_transfer", 0)
                                     for e in engines)),
                   "computed": int(sum(e.get("tokens.local_compute", 0) for e in engines))},
        "healthy": healthy,
        "health": [{"healthy": c.healthy, "reason": c.reason, "ttft_over_prefill": c.ttft_over_prefill,
                    "stalled_requests": c.stalled_requests, "stalled_turns": c.stalled_turns} for c in checks],
        # Each run's engine bindings and step budgets beside its stalls: what a later check of its turns needs.
        "stalls": {"count": sum(s.count for s in stalls),
                   "runs": [{**s.to_dict(), "cores": run.get("cores", {}), "step_tokens": run.get("step_tokens", {})}
                            for s, run in zip(stalls, runs, strict=True)]},
        "seconds": [round(run["seconds"], 1) for run in runs],
        "error_samples": [r.error for r in records if r.error][:3]}
    if name.startswith("upstream"):
        summary["prefill_ttft_ms"] = percentiles_ms([r.prefill_ttft_s for r in ok if r.prefill_ttft_s is not None])
        summary["late_prefill_ttft_ms"] = percentiles_ms([r.prefill_ttft_s for r in late
                                                          if r.prefill_ttft_s is not None])
    if name.startswith("kvloop"):
        summary["breakdown"] = breakdown(ok)
        summary["paths"] = {path: round(n / max(1, len(ok)), 3) for path, n in
                            sorted(Counter(r.decision for r in ok).items())}
        # The reuse the router could have had (the longest prefix any engine held, per the broker) and what the
        # engines report they reused (found local or pulled), over all turns.
        summary["reuse"] = {
            "available_tokens": sum(int(r.detail.get("available-tokens", 0)) for r in ok),
            "reused_tokens": sum(int(r.detail.get("local-tokens", 0)) + int(r.detail.get("pulled-tokens", 0))
                                 for r in ok),
            "computed_tokens": sum(int(r.detail.get("computed-tokens", 0)) for r in ok),
            "plan_outcomes": dict(Counter(str(r.detail.get("plan-outcome", "?")) for r in ok))}
        # The broker's own counts: demotions to the host tier and prefetches (commanded, loaded, used, unused).
        summary["host_tier"] = {kind: dict(sum((Counter(run.get("broker", {}).get(kind, {})) for run in runs),
                                               Counter())) for kind in ("demotions", "prefetches")}
    return summary


RATIOS = {  # name: (numerator config, denominator config, metric, quantile)
    "one_way_over_kvloop_late_p50": ("one_way", "kvloop", "late_ttft_ms", "p50"),
    "one_way_over_kvloop_late_p99": ("one_way", "kvloop", "late_ttft_ms", "p99"),
    "upstream_over_kvloop_late_p50": ("upstream", "kvloop", "late_ttft_ms", "p50"),
    "upstream_over_kvloop_late_p99": ("upstream", "kvloop", "late_ttft_ms", "p99"),
    "kvloop_over_ideal_late_p50": ("kvloop", "ideal", "late_ttft_ms", "p50"),
    "kvloop_over_ideal_late_p99": ("kvloop", "ideal", "late_ttft_ms", "p99"),
    "kvloop_over_ideal_same_cores_late_p50": ("kvloop", "ideal_same_cores", "late_ttft_ms", "p50"),
    "kvloop_over_ideal_same_cores_late_p99": ("kvloop", "ideal_same_cores", "late_ttft_ms", "p99"),
    "kvloop_over_ideal_same_cores_itl_p99": ("kvloop", "ideal_same_cores", "itl_ms", "p99"),
    "kvloop_over_kvloop_pd_itl_p99": ("kvloop", "kvloop_pd", "itl_ms", "p99"),
    "kvloop_over_kvloop_pd_late_p50": ("kvloop", "kvloop_pd", "late_ttft_ms", "p50"),
    "pressure_upstream_over_kvloop_late_p50": ("upstream_pressure", "kvloop_pressure", "late_ttft_ms", "p50"),
    "pressure_upstream_over_kvloop_late_p99": ("upstream_pressure", "kvloop_pressure", "late_ttft_ms", "p99"),
    "pressure_over_no_pressure_late_p50": ("kvloop_pressure", "kvloop", "late_ttft_ms", "p50"),
    "pressure_tier_over_no_pressure_late_p50": ("kvloop_pressure_tier", "kvloop", "late_ttft_ms", "p50"),
    "pressure_tier_over_no_pressure_late_p99": ("kvloop_pressure_tier", "kvloop", "late_ttft_ms", "p99"),
    "pressure_over_no_pressure_resumed_p99": ("kvloop_pressure", "kvloop", "resumed_ttft_ms", "p99"),
    "pressure_hints_tier_over_no_pressure_resumed_p99": ("kvloop_pressure_hints_tier", "kvloop", "resumed_ttft_ms",
                                                         "p99"),
    "pressure_hints_tier_over_hints_resumed_p99": ("kvloop_pressure_hints_tier", "kvloop_hints", "resumed_ttft_ms",
                                                   "p99"),
}


def tier_recovery(records: list[TurnRecord], block: int = BLOCK, fix: str = "kvloop_pressure_tier",
                  label: str = "tier") -> dict[str, Any] | None:
    """What retention pressure cost and what the host tier (or ``fix``) won back, turn by turn: each turn measured
    in ``kvloop`` (no pressure), ``kvloop_pressure`` and ``fix`` in the same repeat is *recomputed under pressure*
    when pressure made it compute at least one block more than without it (its history's lease was evicted), and
    *served by reuse* with ``fix`` when that run computed less than a block more than without pressure. Counts come
    from the router's ``computed-tokens`` header. None when the run lacks a configuration."""
    runs = ("kvloop", "kvloop_pressure", fix)
    by = {(r.config, r.repeat, r.conversation, r.turn): r for r in records if not r.error and r.config in runs}
    keys = {k[1:] for k in by}
    complete = sorted(k for k in keys if all((c, *k) in by for c in runs))
    if not complete:
        return None

    def computed(config: str, key: tuple[Any, ...]) -> int:
        return int(by[(config, *key)].detail.get("computed-tokens", 0))

    lost = [k for k in complete if computed("kvloop_pressure", k) - computed("kvloop", k) >= block]
    won = [k for k in lost if computed(fix, k) - computed("kvloop", k) < block]
    fix_lost = [k for k in complete if computed(fix, k) - computed("kvloop", k) >= block]
    return {"turns_compared": len(complete), "recomputed_under_pressure": len(lost),
            f"served_by_reuse_with_{label}": len(won),
            "share_served_by_reuse": round(len(won) / len(lost), 3) if lost else None,
            f"recomputed_with_{label}": len(fix_lost),
            "extra_tokens_computed": {c: sum(computed(c, k) - computed("kvloop", k) for k in complete)
                                      for c in runs[1:]},
            "resumed": resumed_turns(complete, lost, fix_lost, lambda c, k: by[(c, *k)].ttft_s, runs)}


def resumed_turns(complete: list[tuple[Any, ...]], lost: list[tuple[Any, ...]], fix_lost: list[tuple[Any, ...]],
                  ttft_s: Callable[[str, tuple[Any, ...]], float], runs: tuple[str, ...]) -> dict[str, Any]:
    """The turns after a tool pause (every turn but a session's first; keys are (repeat, conversation, turn)):
    the share pressure made recompute their history (issue 53's workload asks at least 30%), the share ``fix``
    served by reuse all the same (it asks 90%), per session how many each recomputed, and their time to first token
    per configuration, with each p99 over the run without pressure (it asks at most 1.2x)."""
    resumed = [k for k in complete if k[2] > 1]
    lost_set, fix_set = set(lost), set(fix_lost)
    ttft = {c: percentiles_ms([ttft_s(c, k) for k in resumed]) for c in runs}
    base = ttft["kvloop"]["p99"]
    # Which sessions kept their KV: per session, its resumed turns and how many each run recomputed.
    by_session: dict[str, dict[str, int]] = {}
    for k in resumed:
        row = by_session.setdefault(str(k[1]), {"resumed": 0, runs[1]: 0, runs[2]: 0})
        row["resumed"] += 1
        row[runs[1]] += k in lost_set
        row[runs[2]] += k in fix_set
    return {"turns": len(resumed), "by_session": dict(sorted(by_session.items())),
            "share_recomputed_under_pressure": round(sum(k in lost_set for k in resumed) / len(resumed), 3)
            if resumed else None,
            "share_served_by_reuse_with_fix": round(sum(k not in fix_set for k in resumed) / len(resumed), 3)
            if resumed else None,
            "ttft_ms": ttft,
            "p99_over_no_pressure": {c: round(ttft[c]["p99"] / base, 3) if ttft[c]["p99"] and base else None
                                     for c in runs[1:]}}


def ratios(per_repeat: list[dict[str, dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each ratio per repeat (both sides measured in that repeat), as median and range; a ratio whose side was
    unhealthy in a repeat, or whose percentile had too few samples, is withheld with the reason."""
    out: dict[str, Any] = {}
    withheld: dict[str, str] = {}
    for name, (a, b, metric, q) in RATIOS.items():
        values: list[float | None] = []
        for rep in per_repeat:
            if a not in rep or b not in rep:
                break
            x, y = rep[a], rep[b]
            sick = [c for c, s in ((a, x), (b, y)) if not s["healthy"]]
            if sick:
                withheld[name] = f"unhealthy: {', '.join(sick)}"
                break
            vx, vy = x[metric][q], y[metric][q]
            if vx is None or vy is None:
                withheld[name] = f"too few samples for {q} (n={min(x[metric]['n'], y[metric]['n'])})"
                break
            values.append(vx / vy)
        else:
            if values:
                out[name] = spread(values)
    return out, withheld


def table(summary: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, s in summary.items():
        t, late, itl = s["ttft_ms"], s["late_ttft_ms"], s["itl_ms"]
        rows.append([name, "yes" if s["healthy"] else "**no**: " + "; ".join(h["reason"] for h in s["health"]
                                                                           if not h["healthy"]),
                     show(t, "p50"), show(t, "p99"), show(late, "p50"), show(late, "p95"), show(late, "p99"),
                     late["n"], show(itl, "p50"), show(itl, "p99"), show(s["e2e_ms"], "p50"), s["requests"],
                     s["errors"], s.get("stalls", {}).get("count", "-"), s["tokens"]["reused"], s["tokens"]["computed"],
                     " ".join(f"{k} {v}" for k, v in sorted(s["decisions"].items()))])
    return markdown_table(["config", "healthy", "TTFT p50", "TTFT p99", "late p50", "late p95", "late p99",
                           "late n", "ITL p50", "ITL p99", "e2e p50", "turns", "errors", "stalls", "reused", "computed",
                           "decisions"], rows)


def breakdown_table(steps: dict[str, dict[str, float | None]]) -> str:
    return markdown_table(["step", "p50 ms", "p90 ms", "n"],
                          [[k, v["p50"], v["p90"], v["n"]] for k, v in steps.items()])


def plot(records: list[TurnRecord], gaps: dict[str, list[float]], path: Path) -> list[str]:
    """TTFT against turn (median over sessions and repeats), and the ITL distribution, per configuration."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    itl_path = path.with_name(path.stem + "-itl.png")
    for out, xlabel, ylabel, log_axis in ((path, "turn", "TTFT, median over sessions (ms)", "y"),
                                          (itl_path, "inter-token latency (ms)", "share of gaps at or below", "x")):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for config in sorted({r.config for r in records}):
            if out == path:
                by_turn: dict[int, list[float]] = {}
                for r in records:
                    if r.config == config and not r.error:
                        by_turn.setdefault(r.turn, []).append(r.ttft_s * 1e3)
                turns = sorted(by_turn)
                ax.plot(turns, [statistics.median(by_turn[t]) for t in turns], marker="o", markersize=3, label=config)
            elif gaps.get(config):
                ordered = sorted(v * 1e3 for v in gaps[config])
                ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))],
                        label=f"{config} (n={len(ordered)})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        (ax.set_yscale if log_axis == "y" else ax.set_xscale)("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out, dpi=100)
        plt.close(fig)
    return [str(path), str(itl_path)]


# The command -----------------------------------------------------------------------------------------------

def workload(args: argparse.Namespace, model: Path) -> tuple[Any, list[Conversation]]:
    if args.replay:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model))
        spec: Any = WorkloadSpec(conversations=args.sessions, output_tokens=args.answer_tokens,
                                 concurrency=args.concurrency, seed=args.seed)
        return spec, replay(args.replay, lambda m: tok.apply_chat_template(m, add_generation_prompt=True),
                            limit=args.sessions)
    if args.workload == "long":
        spec = WorkloadSpec(conversations=args.sessions, turns_min=args.turns_min, turns_max=args.turns_max,
                            system_tokens=args.system_tokens, own_prefix_tokens=args.own_prefix_tokens,
                            new_min=args.new_min, new_max=args.new_max, output_tokens=args.answer_tokens,
                            think_time_s=args.think_time_s, concurrency=args.concurrency, seed=args.seed)
        return spec, synthetic(spec)
    spec = AgentSpec(sessions=args.sessions, turns_min=args.turns_min, turns_max=args.turns_max,
                     system_tokens=args.system_tokens, tool_median=args.tool_median, tool_max=args.tool_max,
                     answer_min=args.answer_min, answer_max=args.answer_max, think_min_s=args.think_min_s,
                     think_max_s=args.think_max_s, think_dist=args.think_dist,
                     concurrency=args.concurrency, seed=args.seed)
    return spec, agent(spec)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    model = await asyncio.to_thread(ensure_tiny_model, args.model)
    work = (args.work_dir or default_work_dir() / "bench-multiturn").absolute()
    names = [n for n in args.configs.split(",") if n]
    names += [n for n in PRESSURE if args.pressure and n not in names]
    per_repeat: list[dict[str, dict[str, Any]]] = []
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    shape: dict[str, Any] = {}
    sizes: dict[str, Any] = {}

    def result(partial: bool) -> dict[str, Any]:
        """The figures so far: every finished configuration run; ratios over the finished repeats only."""
        done = [n for n in names if runs[n]]
        summary = {name: summarize(name, runs[name], args.late_tokens) for name in done}
        ratio_spreads, withheld = ratios(per_repeat)
        records = [r for name in done for run in runs[name] for r in run["records"]]
        gaps = {n: [g for run in runs[n] for g in run["gaps"]] for n in done}
        return {"partial": partial, "repeats_done": len(per_repeat), "configs": summary,
                "ratios": {k: v["median"] for k, v in ratio_spreads.items()}, "ratio_spreads": ratio_spreads,
                "withheld_ratios": withheld, "markdown": table(summary), "tier_recovery": tier_recovery(records),
                "hint_recovery": tier_recovery(records, fix="kvloop_pressure_hints", label="hints"),
                "hint_tier_recovery": tier_recovery(records, fix="kvloop_pressure_hints_tier", label="hints_tier"),
                "workload": {**shape, "sizing": sizes, "late_turn_tokens": args.late_tokens, "repeats": args.repeat,
                             "replay": str(args.replay) if args.replay else None,
                             "ttft": "client-side, to the first streamed token; upstream cannot stream (whole "
                                     "answer), its prefill-side TTFT is prefill_ttft_ms"},
                "engines": {"baseline_connector": BASELINE_EXTRA, "upstream_connector": UPSTREAM_EXTRA,
                            "cores": {**cores_record(args.cores), "ideal": "auto",
                                      "ideal_same_cores": role_cores(Role.DECODE)},
                            "health": {"factor": HEALTH_FACTOR, "turn_overhead_s": TURN_OVERHEAD_S,
                                       "stall_s": STALL_S, "turn_stall_bound_s": BOUND_S}},
                "machine": {"cpus": len(os.sched_getaffinity(0)), "model": str(model)},
                "wall_seconds": round(time.monotonic() - started, 1), "turns": [asdict(r) for r in records],
                "itl_gaps_ms": {n: [round(g * 1e3, 2) for g in v] for n, v in gaps.items()},
                "_records": records, "_gaps": gaps}

    for repeat in range(args.repeat):
        seed_args = argparse.Namespace(**{**vars(args), "seed": args.seed + repeat})
        spec, conversations = workload(seed_args, model)
        shape = describe(spec, conversations, args.answer_tokens, args.late_tokens)
        print(f"== repeat {repeat + 1}/{args.repeat}: {shape['sessions']} sessions, {shape['turns_total']} turns, "
              f"contexts {shape['context_tokens']['min']}-{shape['context_tokens']['max']} tokens, "
              f"{shape['late_turns']} late (>= {args.late_tokens})", flush=True)
        this: dict[str, dict[str, Any]] = {}
        for name in names:
            pressure = "pressure" in name
            size = replace(sizing(conversations, args.answer_tokens, args.concurrency, pressure,
                                  args.retention_share, args.decode_room, args.prefill_room),
                           prefill_engines=args.prefill_engines, cores=args.cores, lease_ttl_s=args.lease_ttl_s,
                           host_tier_blocks=args.host_tier_blocks)
            sizes["pressure" if pressure else "default"] = {
                **size.notes, "decode_host_tier_blocks_kvloop_pressure_tier": size.tier_blocks or size.decode_blocks}
            print(f"== {name}: engines starting", flush=True)
            run = await run_config(name, repeat, model, work, conversations, size, args)
            runs[name].append(run)
            this[name] = summarize(name, [run], args.late_tokens)
            h = this[name]["health"][0]
            print(f"   {name}: {run['seconds']:.0f} s, {h['stalled_turns']} stalled turn(s), "
                  f"{'healthy' if h['healthy'] else 'UNHEALTHY'} ({h['reason']})", flush=True)
            if args.out:  # a run stopped early keeps what it measured
                write_json(Path(args.out), result(partial=True))
        per_repeat.append(this)
    final = result(partial=False)
    print("\n" + final["markdown"])
    breakdown_steps = final["configs"].get("kvloop", {}).get("breakdown")
    if breakdown_steps:
        print("\nkvloop: where a turn's time to first token went\n\n" + breakdown_table(breakdown_steps))
    print("\nratios (median [min, max] over repeats): " + ", ".join(
        f"{k} {v['median']} [{v['min']}, {v['max']}]" for k, v in final["ratio_spreads"].items()))
    if final["withheld_ratios"]:
        print("withheld: " + "; ".join(f"{k}: {v}" for k, v in final["withheld_ratios"].items()))
    print(f"\nwall time {final['wall_seconds'] / 60:.1f} min", flush=True)
    return final


RAW_KEYS = ("turns", "itl_gaps_ms")
"""The per-turn records and every inter-token gap: megabytes per run, kept gzipped beside the summary."""


def write_json(path: Path, result: dict[str, Any]) -> None:
    """The summary at ``path``, small enough to keep in a repository; the whole record (every turn and gap) in
    ``<path stem>.full.json.gz`` beside it, named by the summary's ``full_record``."""
    record = {k: v for k, v in result.items() if not k.startswith("_")}
    full = path.with_name(f"{path.stem}.full.json.gz")
    with gzip.open(full, "wt") as out:
        json.dump(record, out)
    summary = {k: v for k, v in record.items() if k not in RAW_KEYS}
    path.write_text(json.dumps({**summary, "full_record": str(full)}, indent=2))


def recheck(full: dict[str, Any]) -> dict[str, list[StallReport]]:
    """The stall check of today's rules over a written run's turns (its ``.full.json.gz``), per configuration and
    repeat: the run's own prefill rate, gaps and, where it kept them, engine bindings and step budgets. A run written
    before it kept bindings gets them from its core plan: an engine that only prefilled another's turns had the
    prefill cores, the rest the decode cores (or the aggregated engine's)."""
    fields = {f.name for f in dataclasses.fields(TurnRecord)}
    plan = full.get("engines", {}).get("cores", {})
    out: dict[str, list[StallReport]] = {}
    for name, summary in full["configs"].items():
        reports = []
        for repeat, run in enumerate(summary["stalls"]["runs"]):
            records = [TurnRecord(**{k: v for k, v in t.items() if k in fields}) for t in full["turns"]
                       if t["config"] == name and t.get("repeat", 0) == repeat]
            turns = stall_turns(records)
            cores = run.get("cores") or _planned_cores(turns, plan, name)
            gaps = [g / 1e3 for g in full["itl_gaps_ms"].get(name, [])]
            reports.append(find_stalls(turns, prefill_tokens_per_s=run.get("prefill_tokens_per_s"),
                                       median_gap_s=statistics.median(gaps) if gaps else None,
                                       step_tokens=run.get("step_tokens") or {}, cores=cores))
        out[name] = reports
    return out


def _planned_cores(turns: list[TurnTiming], plan: dict[str, str], name: str) -> dict[str, str]:
    prefill = {t.prefill_engine for t in turns if t.prefill_engine and t.prefill_engine != t.decode_engine}
    engines = prefill | {t.decode_engine for t in turns if t.decode_engine}
    single = plan.get(name, plan.get("decode", ""))
    return {e: plan.get("prefill", "") if e in prefill else (plan.get("decode", "") if prefill else single)
            for e in engines}


def recheck_main(path: Path) -> int:
    try:
        with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
            full = json.load(f)
        reports = recheck(full)
    except (OSError, ValueError, KeyError) as exc:
        print(f"kvloop bench multiturn: --recheck: {path} is not a run's full JSON ({exc})", file=sys.stderr)
        return 2
    for name, runs in reports.items():
        for repeat, report in enumerate(runs):
            print(f"{name} #{repeat + 1}: {report.count} stalled turn(s) of {report.checked}"
                  + (f"; worst {report.worst.describe()}" if report.worst else ""))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = AgentSpec()
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, from "
                        + ",".join(CONFIGS + PRESSURE + HINTED))
    parser.add_argument("--pressure", action=argparse.BooleanOptionalAction, default=False,
                        help="also the retention-pressure scenario (upstream and kvloop with a decode engine that "
                             "retains about half the working set)")
    parser.add_argument("--host-tier-blocks", type=int, default=0,
                        help="the _tier configurations: the decode engine's host tier in blocks (default: as large as "
                             "its pool under pressure)")
    parser.add_argument("--prefill-room", type=int, default=0,
                        help="every configuration: the longest prompts each prefill engine has room for (default: "
                             "--concurrency); fewer, and the prefill engines' prefix caches churn")
    parser.add_argument("--decode-room", type=int, default=0,
                        help="pressure configurations: the longest prompts the decode pool has room for beside what "
                             "it retains (default: --concurrency)")
    parser.add_argument("--retention-share", type=float, default=0.5,
                        help="pressure configurations: the share of the working set the decode engine can retain "
                             "(0.05..1)")
    parser.add_argument("--repeat", type=int, default=1, help="run every configuration N times (seed, seed+1, ...)")
    parser.add_argument("--workload", choices=("agent", "long"), default="agent",
                        help="agent sessions that start small and grow (default), or long chats that start big")
    parser.add_argument("--sessions", type=int, default=a.sessions)
    parser.add_argument("--turns-min", type=int, default=a.turns_min)
    parser.add_argument("--turns-max", type=int, default=a.turns_max)
    parser.add_argument("--system-tokens", type=int, default=a.system_tokens)
    parser.add_argument("--tool-median", type=int, default=a.tool_median, help="agent: median tool-output tokens")
    parser.add_argument("--tool-max", type=int, default=a.tool_max, help="agent: longest tool output")
    parser.add_argument("--answer-min", type=int, default=a.answer_min)
    parser.add_argument("--answer-max", type=int, default=a.answer_max)
    parser.add_argument("--think-min-s", type=float, default=a.think_min_s)
    parser.add_argument("--think-max-s", type=float, default=a.think_max_s)
    parser.add_argument("--think-dist", choices=THINK_DISTS, default=a.think_dist,
                        help="agent: how tool pauses are drawn between --think-min-s and --think-max-s")
    parser.add_argument("--lease-ttl-s", type=float, default=0.0,
                        help="kvloop configurations: the TTL the decode engine asks for its leases (0: the broker's "
                             "default, 480 s); a shorter one scales the workload's pauses against it")
    parser.add_argument("--own-prefix-tokens", type=int, default=6000, help="long: each chat's own first prompt")
    parser.add_argument("--new-min", type=int, default=100, help="long: new tokens per turn, at least")
    parser.add_argument("--new-max", type=int, default=200, help="long: new tokens per turn, at most")
    parser.add_argument("--answer-tokens", type=int, default=32, help="long and replay: answer tokens per turn")
    parser.add_argument("--think-time-s", type=float, default=0.0, help="long and replay: pause between turns")
    parser.add_argument("--concurrency", type=int, default=a.concurrency, help="sessions in flight at once")
    add_topology_arguments(parser)
    parser.add_argument("--late-tokens", type=int, default=LATE_TOKENS, help="a turn is late from this context")
    parser.add_argument("--seed", type=int, default=a.seed)
    parser.add_argument("--replay", type=Path, default=None, help="JSONL of OpenAI chat conversations to replay")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per request; past it the turn is an error")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON figures here (and PNGs beside it)")
    parser.add_argument("--router-records", type=Path, default=None,
                        help="folder: each kvloop configuration's router writes its per-turn records here as "
                             "CONFIG-REPEAT.jsonl (for kvloop analyze)")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of TTFT against turn (default: beside --out)")
    parser.add_argument("--recheck", type=Path, default=None,
                        help="run nothing: the stall check of this version over a written run's FILE.full.json.gz")


def main(args: argparse.Namespace) -> int:
    if args.recheck is not None:
        return recheck_main(args.recheck)
    for flag in ("decode_room", "prefill_room", "host_tier_blocks"):
        if getattr(args, flag) < 0:
            print(f"kvloop bench multiturn: --{flag.replace('_', '-')}: must not be negative", file=sys.stderr)
            return 2
    if not 0.05 <= args.retention_share <= 1:
        print("kvloop bench multiturn: --retention-share: must be within 0.05..1", file=sys.stderr)
        return 2
    if args.lease_ttl_s and not 1 <= args.lease_ttl_s <= 86400:
        print("kvloop bench multiturn: --lease-ttl-s: must be 0 (the broker's default) or within 1..86400",
              file=sys.stderr)
        return 2
    unknown = [c for c in args.configs.split(",") if c and c not in CONFIGS + PRESSURE + HINTED]
    if unknown or args.repeat < 1:
        print(f"kvloop bench multiturn: --configs: unknown {unknown}; choose from "
              f"{list(CONFIGS + PRESSURE + HINTED)}" if unknown else
              "kvloop bench multiturn: --repeat must be at least 1", file=sys.stderr)
        return 2
    if problem := prefill_engines_problem(args.prefill_engines):
        print(f"kvloop bench multiturn: {problem}", file=sys.stderr)
        return 2
    try:
        if not args.replay:
            workload(args, Path("."))  # the generators validate their spec
    except ValueError as exc:
        print(f"kvloop bench multiturn: {exc}", file=sys.stderr)
        return 2
    result = asyncio.run(bench(args))
    records, gaps = result["_records"], result["_gaps"]
    png = Path(args.plot) if args.plot else (Path(args.out).with_suffix(".png") if args.out else None)
    if png is not None:
        result["plots"] = plot(records, gaps, png)
        for p in result["plots"]:
            print(f"wrote {p}")
    if args.out:
        write_json(Path(args.out), result)
        print(f"wrote {args.out}")
    return 0
