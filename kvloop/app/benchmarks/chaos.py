"""``kvloop bench chaos``: concurrent agent sessions through the router while a seeded schedule of faults hits the
cluster (:mod:`.chaos_faults`, :mod:`.chaos_cluster`), and what must hold afterwards:

- every request ends, answered or with an OpenAI-style error, within the client's deadline (a request past it is a
  hang); with two engines of each role, none should error at all;
- every answer equals a reference engine's (float32, prefix cache off, temperature 0) token for token, or parts
  from it at a near-tie of the reference (top two log-probabilities within ``NEAR_TIE``);
- the books agree once the traffic settles: the blocks the broker's leases name on each decode engine are the
  blocks the engine holds (vLLM's own count), and each sidecar holds the leases the broker lists; no engine freed
  blocks the broker had pinned (``lease.freed_while_pinned`` in any sidecar log); after the leases' TTL, every
  engine holds nothing and the broker lists nothing;
- figures: requests, errors by class and by fault, TTFT p50/p99 inside fault windows and outside, recovery time per
  fault (from the fault to the first good turn using the repaired part), and, with ``--baseline``, the same
  workload without faults first.

Everything runs on loopback, bounded in count (sessions x turns, rounds of faults) and time (``--deadline-s``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from kvloop.app.benchmarks.chaos_cluster import ChaosCluster, ChaosSettings
from kvloop.app.benchmarks.chaos_faults import (
    KINDS,
    Fault,
    FaultRecord,
    RequestRecord,
    first_divergence,
    in_window,
    recovered_at,
    schedule,
)
from kvloop.app.benchmarks.stats import percentile
from kvloop.app.benchmarks.workload import AgentSpec, Conversation, agent
from kvloop.app.engine_set import EngineSet, start_engines
from kvloop.engines.config import EngineConfig, default_work_dir
from kvloop.engines.model import ensure_tiny_model
from kvloop.shared import headers as hdr
from kvloop.shared.http import sse_data, sse_measured
from kvloop.shared.vocabulary import Role
from kvloop.v1 import broker_pb2 as pb

REFERENCE_CONCURRENCY = 16
SPARE_AGENTS = 4
SAMPLE_S = 10.0
SOAK_MIN_SERIES_S = 300.0
SOAK_MAX_MB_PER_MIN = 1.0
"""A broker process whose memory grew faster than this over at least SOAK_MIN_SERIES_S of traffic fails the run: a
leak of even a few hundred bytes per turn shows (the scale benchmark puts a retained block at 280-420 B)."""
RECOVERY_WAIT_S = 120.0
"""After the last fault, spare sessions keep coming for at most this long (``--recovery-wait-s``) until every
repaired part has served a good turn (its recovery time is measured, not blank). A repaired engine the placement
does not choose (a restarted decode engine holds no prefix while its peer holds every live session's) is recorded
with no recovery time: placement, not a failure, and the CI run waits less for it."""
NEAR_TIE = 0.05
"""Nats between the reference's top two choices at the first differing token: where greedy paths may part in
float32 (the engine tests' tolerance)."""


class Run:
    """One phase: the cluster, the sessions, the faults, and their records."""

    def __init__(self, cluster: ChaosCluster, args: argparse.Namespace, faults: list[Fault]) -> None:
        self.cluster, self.args, self.faults = cluster, args, faults
        self.t0 = time.monotonic()
        self.requests: list[RequestRecord] = []
        self.fault_records: list[FaultRecord] = []
        self.streaming: dict[int, str] = {}
        """In-flight streams: id(record) -> the decode engine serving it (a fault's moment inside a turn)."""
        self.faults_done = asyncio.Event()
        self.faults_done_at = 0.0
        self.soak_s = 0.0
        """Traffic lasts at least this long (spare sessions keep coming), for the soak's samples."""
        self.samples: list[dict[str, Any]] = []
        self.restarted = asyncio.Event()
        """Clear while an engine is restarting; set otherwise (``--outage-turns`` gates turns on it)."""
        self.restarted.set()
        self.outage_turns = 0
        """Turns started since the current restart began."""

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    # Traffic.

    async def request(self, http: aiohttp.ClientSession, session: str, turn: int, attempt: int, prompt: list[int],
                      max_tokens: int) -> RequestRecord:
        assert self.cluster.router is not None
        rec = RequestRecord(session, turn, attempt, start=self.now(), prompt=prompt, max_tokens=max_tokens)
        body = {"model": self.args.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        ids: list[int] = []
        try:
            async with http.post(f"{self.cluster.router.url}/v1/completions", json=body,
                                 headers={hdr.SESSION_ID: session},
                                 timeout=aiohttp.ClientTimeout(total=self.args.client_timeout_s)) as reply:
                rec.path = reply.headers.get(hdr.DECISION, "")
                rec.reason = reply.headers.get(hdr.REASON, "")
                rec.prefill_engine = reply.headers.get(hdr.PREFILL_ENGINE, "")
                rec.decode_engine = reply.headers.get(hdr.DECODE_ENGINE, "")
                if reply.status >= 400:
                    rec.status, rec.error = f"http_{reply.status}", (await reply.text())[:300]
                    return rec
                self.streaming[id(rec)] = rec.decode_engine
                async for line in reply.content:
                    measured = sse_measured(line)
                    if measured is not None:
                        rec.path = str(measured.get("decision", rec.path))
                    chunk = sse_data(line)
                    if chunk is None:
                        continue
                    if "error" in chunk:
                        rec.status, rec.error = "stream_error", json.dumps(chunk["error"])[:300]
                        return rec
                    for choice in chunk.get("choices", []):
                        new = list(choice.get("token_ids") or [])
                        if new and rec.ttft_s is None:
                            rec.ttft_s = round(self.now() - rec.start, 4)
                        ids += new
            rec.status = "ok" if len(ids) == max_tokens else "short_answer"
            rec.error = "" if rec.ok else f"{len(ids)} of {max_tokens} tokens"
        except TimeoutError:
            rec.status, rec.error = "timeout", f"no complete answer in {self.args.client_timeout_s}s"
        except aiohttp.ClientError as exc:
            rec.status, rec.error = "client_error", f"{type(exc).__name__}: {exc}"[:300]
        finally:
            self.streaming.pop(id(rec), None)
            rec.output, rec.end = ids, self.now()
            self.requests.append(rec)
        return rec

    async def session(self, http: aiohttp.ClientSession, conv: Conversation) -> None:
        history = list(conv.prefix)
        for turn, new in enumerate(conv.new_tokens):
            prompt = history + new
            answer = conv.answer(turn, 32)
            for attempt in range(self.args.attempts):
                await self.outage_gate()
                rec = await self.request(http, conv.conversation_id, turn + 1, attempt, prompt, answer)
                if rec.ok:
                    history = prompt + (rec.output or [])
                    break
                await asyncio.sleep(1.0)  # a client's retry pause; the failure is already counted
            else:
                history = prompt
            await asyncio.sleep(conv.think(turn, 0.5))

    async def outage_gate(self) -> None:
        """With ``--outage-turns N``: once N turns have started while an engine restarts, further turns wait for the
        restart to end. Serving through the outage is shown by those N; beyond them, traffic only slows the restart
        (three single-threaded process starts in a row) and adds answers to check."""
        limit = self.args.outage_turns
        while limit and not self.restarted.is_set() and self.outage_turns >= limit:
            await self.restarted.wait()
        if not self.restarted.is_set():
            self.outage_turns += 1

    async def restart_engine(self, engine_id: str) -> None:
        self.restarted.clear()
        self.outage_turns = 0
        try:
            await self.cluster.restart_engine(engine_id)
        finally:
            self.restarted.set()

    def recoveries_seen(self) -> bool:
        """Whether every fired fault has had its first good turn on the repaired part, or ``--recovery-wait-s``
        passed since the last fault: a recovery is measured, not left blank because traffic ran out."""
        if self.now() > self.faults_done_at + self.args.recovery_wait_s:
            return True
        return all(recovered_at(f, self.requests) is not None for f in self.fault_records if f.fired)

    async def traffic(self, conversations: list[Conversation], extra: list[Conversation]) -> None:
        """The sessions, ``concurrency`` at a time; then, while faults remain or a repaired part has not served a
        good turn yet, more sessions from ``extra`` (a fault must land inside traffic), up to the deadline."""
        queue = list(conversations)
        spare = list(extra)

        async def worker(http: aiohttp.ClientSession) -> None:
            while True:
                if not queue:
                    if not spare or self.now() > self.args.deadline_s:
                        return
                    if self.faults_done.is_set() and self.recoveries_seen() and self.now() >= self.soak_s:
                        return
                    queue.append(spare.pop(0))
                await self.session(http, queue.pop(0))

        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(worker(http) for _ in range(self.args.concurrency)))

    async def sample_forever(self, period_s: float = SAMPLE_S) -> None:
        """Every ``period_s``: each broker replica's resident memory (and pid: a restart starts a new series) and
        the blocks each decode engine holds. The soak's figures come from these."""
        c = self.cluster
        while True:
            row: dict[str, Any] = {"t": round(self.now(), 1), "rss": c.rss_bytes(),
                                   "pids": {k: p.popen.pid for k, p in c.brokers.items()}, "blocks": {}}
            for eid in c.roles(Role.DECODE):
                with contextlib.suppress(Exception):  # an engine down for a fault has no figure
                    row["blocks"][eid] = (await asyncio.to_thread(c.engine_blocks, eid))[0]
            self.samples.append(row)
            await asyncio.sleep(period_s)

    # Faults.

    async def fault_loop(self, deadline_s: float) -> None:
        try:
            for fault in self.faults:
                if self.now() > deadline_s:
                    self.fault_records.append(FaultRecord(fault.kind, "", self.now(), fired=False,
                                                          note="not fired: the run's deadline passed"))
                    continue
                await asyncio.sleep(fault.delay_s)
                record = await self.inject(fault)
                self.fault_records.append(record)
                print(f"  fault {record.kind} on {record.target or '-'} at {record.injected:.1f}s, repaired at "
                      f"{record.repaired:.1f}s{' (' + record.note + ')' if record.note else ''}", flush=True)
        finally:
            self.faults_done_at = self.now()
            self.faults_done.set()

    async def streaming_decode(self, engines: list[str], pick: int, timeout_s: float = 60.0) -> str | None:
        """Wait (bounded) until a stream is in flight on one of ``engines``, and name one that has a stream (``pick``
        chooses among them): the fault then lands mid-answer. None when none streamed in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = sorted({e for e in self.streaming.values() if e in engines})
            if busy:
                return busy[pick % len(busy)]
            await asyncio.sleep(0.02)
        return None

    async def on_next_transfer(self, pick: str, timeout_s: float = 90.0) -> str | None:
        """Arm the router's hook: at the next TRANSFER's prefill, kill its prefill engine (``pick`` = "prefill") or
        its source (``"source"``) a few milliseconds into the pull. Returns the killed engine, None if no TRANSFER
        came in time."""
        assert self.cluster.router is not None
        runner = self.cluster.router.runner
        loop = asyncio.get_running_loop()
        chosen: asyncio.Future[str] = loop.create_future()

        def hook(plan: Any, prefill: Any) -> None:
            if chosen.done():
                return
            target = prefill.engine_id if pick == "prefill" else plan.source_engine_id
            if target not in self.cluster.engines:
                return
            runner.before_transfer = None
            chosen.set_result(target)
            loop.call_later(0.005, self.cluster.signal_engine, target, signal.SIGKILL)

        runner.before_transfer = hook
        try:
            return await asyncio.wait_for(chosen, timeout_s)
        except TimeoutError:
            return None
        finally:
            runner.before_transfer = None

    async def inject(self, fault: Fault) -> FaultRecord:
        c = self.cluster
        decodes = c.roles(Role.DECODE)
        target = decodes[fault.target % len(decodes)]
        note = ""
        if fault.kind in ("decode_kill", "decode_stop"):
            streaming = await self.streaming_decode(decodes, fault.target)
            if streaming is None:
                note = "no stream was in flight on it"
            target = streaming or target
            record = FaultRecord(fault.kind, target, self.now(), note=note)
            c.signal_engine(target, signal.SIGKILL if fault.kind == "decode_kill" else signal.SIGSTOP)
            await asyncio.sleep(fault.down_s)
            if fault.kind == "decode_kill":
                await self.restart_engine(target)
            else:
                c.signal_engine(target, signal.SIGCONT)
                await c.wait_engine(target)
        elif fault.kind in ("prefill_kill_mid_pull", "pull_source_kill"):
            killed = await self.on_next_transfer("prefill" if fault.kind == "prefill_kill_mid_pull" else "source")
            if killed is None:
                return FaultRecord(fault.kind, "", self.now(), self.now(), fired=False, note="no TRANSFER turn came")
            record = FaultRecord(fault.kind, killed, self.now())
            await asyncio.sleep(fault.down_s)
            await self.restart_engine(killed)
        elif fault.kind == "sidecar_kill":
            record = FaultRecord(fault.kind, target, self.now())
            c.kill_sidecar(target)
            await asyncio.sleep(fault.down_s)
            await c.restart_sidecar(target)
        elif fault.kind == "broker_leader_kill":
            leader, _ = await c.wait_leader()
            record = FaultRecord(fault.kind, f"broker-{leader}", self.now())
            c.kill_broker(leader)
            await asyncio.sleep(fault.down_s)
            await c.start_broker(leader)
            await asyncio.gather(*(c.wait_engine(eid) for eid in c.engines))
        else:  # etcd_stop
            record = FaultRecord(fault.kind, "etcd", self.now())
            c.signal_etcd(signal.SIGSTOP)
            await asyncio.sleep(fault.down_s)
            c.signal_etcd(signal.SIGCONT)
            await asyncio.gather(*(c.wait_engine(eid) for eid in c.engines))
        record.repaired = self.now()
        return record


async def check_books(cluster: ChaosCluster, lease_ttl_s: float) -> dict[str, Any]:
    """Once settled, the broker's leases against the engines' held blocks and the sidecars' books; then, after
    the leases' TTL, every engine back to holding nothing and the broker to listing nothing."""
    await asyncio.gather(*(cluster.wait_engine(eid) for eid in cluster.engines))
    decodes = cluster.roles(Role.DECODE)

    async def compare() -> dict[str, Any]:
        _, reply = await cluster.wait_leader()
        per: dict[str, Any] = {}
        for eid in decodes:
            leases = [lease for lease in reply.leases if lease.engine_id == eid]
            pool = [lease for lease in leases if lease.tier != pb.TIER_HOST]
            host = [lease for lease in leases if lease.tier == pb.TIER_HOST]
            held, total = await asyncio.to_thread(cluster.engine_blocks, eid)
            sidecar = await asyncio.to_thread(cluster.sidecar_metrics, eid)
            # Per tier: vLLM's pool holds exactly the pool leases' blocks; the sidecar books as many pool leases,
            # and as many tier leases, as the broker lists; no two tier leases share a slot; none mid-copy.
            slots = [b for le in host for b in le.block_ids]
            per[eid] = {"broker_leases": len(pool), "broker_blocks": len({b for le in pool for b in le.block_ids}),
                        "engine_blocks": held, "engine_total_blocks": total,
                        "sidecar_leases": int(sidecar.get("kvloop_sidecar_leases", -1)),
                        "broker_host_leases": len(host), "broker_host_slots": len(slots),
                        "host_slots_shared": len(slots) - len(set(slots)),
                        "demoting": sum(1 for le in host if le.demoting),
                        "sidecar_host_leases": int(sidecar.get("kvloop_sidecar_host_tier_leases", 0)),
                        "engine_requests": await asyncio.to_thread(cluster.engine_requests, eid)}
        agree = all(v["broker_blocks"] == v["engine_blocks"] and v["broker_leases"] == v["sidecar_leases"]
                    and v["broker_host_leases"] == v["sidecar_host_leases"] and not v["host_slots_shared"]
                    and not v["demoting"] for v in per.values())
        return {"agree": agree, "engines": per, "leases": len(reply.leases)}

    settled = await compare()
    for _ in range(20):  # a publication or a release may still be on its way: a few looks, a second apart
        if settled["agree"]:
            break
        await asyncio.sleep(1.0)
        settled = await compare()
    deadline = time.monotonic() + lease_ttl_s + 60
    empty = await compare()
    while time.monotonic() < deadline:
        held = {eid: (await asyncio.to_thread(cluster.engine_blocks, eid))[0] for eid in cluster.engines}
        if empty["leases"] == 0 and not any(held.values()):
            break
        await asyncio.sleep(2.0)
        empty = await compare()
    held = {eid: (await asyncio.to_thread(cluster.engine_blocks, eid))[0] for eid in cluster.engines}
    return {"settled": settled, "after_ttl": {"broker_leases": empty["leases"], "engine_blocks": held,
                                              "baseline": empty["leases"] == 0 and not any(held.values())}}


def start_reference(model: Path, work: Path) -> EngineSet:
    """The reference engine: float32, prefix cache off, no connector (blocking; minutes on a loaded machine)."""
    config = EngineConfig(role=Role.BOTH, model=model, engine_id="reference", work_dir=work / "reference",
                          connector="none", dtype="float32", max_model_len=16384, log_level="warning",
                          extra_vllm_args="--no-enable-prefix-caching")
    return start_engines([config])


async def check_answers(engines: EngineSet, model_name: str, requests: list[RequestRecord]) -> dict[str, Any]:
    """Every good answer against the reference engine's (temperature 0); stops the reference engine."""
    (engine,) = list(engines)
    wrong: list[dict[str, Any]] = []
    near_ties = 0
    # Many at a time: the reference batches them (float32: a batch's rounding differs from a lone request's by far
    # less than the near-tie margin). Here about 0.35 s an answer at 4, 0.8 s one by one.
    gate = asyncio.Semaphore(REFERENCE_CONCURRENCY)

    async def check(http: aiohttp.ClientSession, r: RequestRecord) -> None:
        nonlocal near_ties
        body = {"model": model_name, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 2, "return_token_ids": True}
        async with gate, http.post(f"{engine.url}/v1/completions", json=body) as reply:
            choice = (await reply.json())["choices"][0]
        want = list(choice.get("token_ids") or [])
        at = first_divergence(r.output or [], want)
        if at is None:
            return
        tops = sorted((choice["logprobs"]["top_logprobs"][at] or {}).values(), reverse=True) if at < len(want) else []
        if len(tops) >= 2 and tops[0] - tops[1] < NEAR_TIE:
            near_ties += 1
            return
        wrong.append({"session": r.session, "turn": r.turn, "position": at, "path": r.path, "reason": r.reason,
                      "prefill": r.prefill_engine, "decode": r.decode_engine})

    try:
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(check(http, r) for r in requests if r.ok))
    finally:
        await asyncio.to_thread(engines.stop)
    checked = sum(1 for r in requests if r.ok)
    return {"checked": checked, "equal_or_near_tie": checked - len(wrong), "near_ties": near_ties, "wrong": wrong}


def figures(run: Run) -> dict[str, Any]:
    reqs, faults = run.requests, run.fault_records
    for f in faults:
        if f.fired:
            f.recovered = recovered_at(f, reqs)
    errors: dict[str, int] = {}
    by_fault: dict[str, int] = {}
    for r in reqs:
        if not r.ok:
            errors[r.status] = errors.get(r.status, 0) + 1
            hit = [f.kind for f in faults if f.fired and r.start <= f.repaired and r.end >= f.injected]
            for kind in hit or ["none"]:
                by_fault[kind] = by_fault.get(kind, 0) + 1
    inside = [r.ttft_s * 1e3 for r in reqs if r.ok and r.ttft_s is not None and in_window(r, faults)]
    outside = [r.ttft_s * 1e3 for r in reqs if r.ok and r.ttft_s is not None and not in_window(r, faults)]
    recovery: dict[str, list[float]] = {}
    for f in faults:
        if f.fired and f.recovery_s is not None:
            recovery.setdefault(f.kind, []).append(f.recovery_s)
    paths: dict[str, int] = {}
    for r in reqs:
        if r.ok:
            paths[r.path] = paths.get(r.path, 0) + 1
    return {
        "requests": len(reqs), "ok": sum(r.ok for r in reqs), "errors": errors, "errors_by_fault": by_fault,
        "hangs": errors.get("timeout", 0), "paths": paths,
        "error_samples": [{"session": r.session, "turn": r.turn, "attempt": r.attempt, "start": r.start, "end": r.end,
                           "status": r.status, "error": r.error, "path": r.path, "reason": r.reason,
                           "prefill": r.prefill_engine, "decode": r.decode_engine} for r in reqs if not r.ok][:40],
        "ttft_ms": {name: {"n": len(v), "p50": percentile(v, 0.50), "p99": percentile(v, 0.99)}
                    for name, v in (("in_fault_windows", inside), ("outside", outside))},
        "recovery_s": {k: {"n": len(v), "max": max(v), "median": percentile(v, 0.50)} for k, v in recovery.items()},
        "faults": [asdict(f) | {"recovery_s": f.recovery_s} for f in faults],
        "requests_timeline": [[r.session, r.turn, r.attempt, r.start, r.end, r.status, r.path, r.reason,
                               r.prefill_engine, r.decode_engine, r.ttft_s] for r in reqs],
        "faults_fired": sorted({f.kind for f in faults if f.fired}),
        "faults_not_fired": [f"{f.kind}: {f.note}" for f in faults if not f.fired],
        "wall_s": run.now(),
    }


async def run_phase(name: str, model: Path, work: Path, args: argparse.Namespace, settings: ChaosSettings,
                    conversations: list[Conversation], extra: list[Conversation], faults: list[Fault],
                    on_quiet: Callable[[], None] = lambda: None) -> tuple[dict[str, Any], list[RequestRecord]]:
    """One phase on its own cluster; ``on_quiet`` is called when the traffic and the faults are over, before the
    books are checked (which waits out the leases' TTL), so the caller can use that wait."""
    print(f"== {name}: starting the cluster (etcd, 2 brokers, {settings.prefill} prefill and {settings.decode} "
          f"decode engines, router)", flush=True)
    cluster = await ChaosCluster.start(model, work / name, settings)
    try:
        rss_before = cluster.rss_bytes()
        run = Run(cluster, args, faults)
        print(f"== {name}: {len(conversations)} sessions, {len(faults)} faults", flush=True)
        run.soak_s = args.soak_s if faults or not args.baseline else 0.0
        fault_task = asyncio.create_task(run.fault_loop(args.deadline_s))
        sampler = asyncio.create_task(run.sample_forever())
        if not faults:
            run.faults_done.set()
        await run.traffic(conversations, extra)
        await fault_task
        sampler.cancel()
        on_quiet()
        out = figures(run)
        out["soak"] = soak_figures(run.samples)
        print(f"== {name}: {out['requests']} requests, {out['ok']} answered, errors {out['errors'] or 'none'}; "
              "checking the books", flush=True)
        out["books"] = await check_books(cluster, settings.lease_ttl_s)
        out["freed_while_pinned"] = cluster.log_lines("lease.freed_while_pinned")
        # Counted, not a failure: a restarted sidecar releasing a lease it never knew that a reader had pinned
        # (the engine still held its blocks; engines/sidecar/service.py says why).
        out["unknown_released_while_pinned"] = len(cluster.log_lines("lease.unknown_released_while_pinned"))
        out["hold_lapses"] = len(cluster.log_lines("safety hold ran out"))
        out["demotions"] = {"started": len(cluster.log_lines("lease.demoting")),
                            "refused": len(cluster.log_lines("lease.demotion_refused")),
                            "report_failed": len(cluster.log_lines("lease.demotion_report_failed")),
                            "host_tier_drops": len(cluster.log_lines("lease.dropped_from_host_tier"))}
        out["broker_rss_bytes"] = {"before": rss_before, "after": cluster.rss_bytes()}
        out["cluster"] = cluster.describe()
        return out, run.requests
    finally:
        await cluster.stop()


def soak_figures(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Growth of each broker process's memory over its own samples (a restarted replica starts a new series; only
    series of at least ``SOAK_MIN_SERIES_S`` count), and the decode engines' held blocks over the run."""
    series: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for row in samples:
        for replica, rss in row["rss"].items():
            series.setdefault((replica, row["pids"].get(replica, 0)), []).append((row["t"], rss))
    growth = []
    for (replica, _), points in series.items():
        span = points[-1][0] - points[0][0]
        if span >= SOAK_MIN_SERIES_S:
            # From the end of the first minute (imports and caches warm) to the last sample.
            warm = next((p for p in points if p[0] >= points[0][0] + 60.0), points[0])
            growth.append({"replica": replica, "span_s": round(span), "rss_warm_mb": round(warm[1] / 2**20, 1),
                           "rss_last_mb": round(points[-1][1] / 2**20, 1),
                           "mb_per_min": round((points[-1][1] - warm[1]) / 2**20 / max(1.0, points[-1][0] - warm[0])
                                               * 60, 3)})
    blocks = [sum(row["blocks"].values()) for row in samples if row["blocks"]]
    return {"samples": len(samples), "span_s": samples[-1]["t"] - samples[0]["t"] if samples else 0.0,
            "broker_rss": growth,
            "decode_blocks": {"max": max(blocks, default=0), "last": blocks[-1] if blocks else 0,
                              "timeline": [[row["t"], row["blocks"]] for row in samples]}}


def verdict(phase: dict[str, Any], answers: dict[str, Any]) -> list[str]:
    """What failed, in words; empty when the phase passed every check."""
    problems = []
    if phase["hangs"]:
        problems.append(f"{phase['hangs']} request(s) hung past the client's deadline")
    if phase["errors"]:
        problems.append(f"errors with an engine of each role alive: {phase['errors']}")
    if answers["wrong"]:
        problems.append(f"{len(answers['wrong'])} answer(s) differ from the reference: {answers['wrong'][:3]}")
    if not phase["books"]["settled"]["agree"]:
        problems.append(f"the books disagree: {phase['books']['settled']}")
    if not phase["books"]["after_ttl"]["baseline"]:
        problems.append(f"not back to baseline after the leases' TTL: {phase['books']['after_ttl']}")
    growing = [g for g in phase.get("soak", {}).get("broker_rss", []) if g["mb_per_min"] > SOAK_MAX_MB_PER_MIN]
    if growing:
        problems.append(f"broker memory grew over the soak: {growing}")
    if phase["freed_while_pinned"]:
        problems.append(f"blocks freed while pinned: {phase['freed_while_pinned'][:3]}")
    return problems


def spare_sessions(spec: AgentSpec, args: argparse.Namespace) -> list[Conversation]:
    """Sessions that keep traffic going while faults remain, a repaired part has not served yet, or the soak runs.

    They come from ``SPARE_AGENTS`` kinds of agent, each with its own system prompt, taken in turn: with one shared
    prompt every new session followed it to the decode engine that held it, and a restarted decode engine served no
    turn for the rest of the run (no recovery time to measure). Enough for the deadline at a turn a second."""
    per_agent = max(8, math.ceil(args.deadline_s / SPARE_AGENTS / max(1, args.turns)))
    kinds = [agent(AgentSpec(**{**asdict(spec), "seed": args.seed + 7919 + k, "sessions": per_agent}))
             for k in range(SPARE_AGENTS)]
    out = []
    for i in range(per_agent):
        for k, sessions in enumerate(kinds):
            conv = sessions[i]
            conv.conversation_id = f"spare-{k}-{i}"
            out.append(conv)
    return out


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = await asyncio.to_thread(ensure_tiny_model, args.model)
    args.model_name = model.name
    work = (args.work_dir or default_work_dir() / "bench-chaos").absolute()
    settings = ChaosSettings(prefill=args.prefill, decode=args.decode, host_tier_blocks=args.host_tier_blocks,
                             retention_fraction=args.retention_fraction)
    # Tool outputs of a median 300 tokens: about a third exceed decode_local_max_tokens (512), so TRANSFER turns
    # (and the faults that wait for one) come often among the DECODE_LOCAL ones.
    spec = AgentSpec(sessions=args.sessions, turns_min=args.turns, turns_max=args.turns, system_tokens=500,
                     tool_median=300, tool_max=1500, answer_min=16, answer_max=64, think_min_s=0.1, think_max_s=1.0,
                     seed=args.seed)
    # Spare sessions keep traffic going while faults remain (engine restarts take minutes on a loaded machine);
    # the deadline bounds them.
    extra = spare_sessions(spec, args)
    faults = schedule(args.seed, args.rounds, hold_s=settings.hold_s, unresponsive_s=settings.engine_unresponsive_s,
                      kinds=args.faults.split(","))
    result: dict[str, Any] = {"workload": asdict(spec) | {"concurrency": args.concurrency}, "seed": args.seed}
    requests: list[RequestRecord] = []
    if args.baseline:
        result["baseline"], reqs = await run_phase("baseline", model, work, args, settings, agent(spec), extra, [])
        requests += reqs
    # The reference engine starts while the last phase waits out its leases' TTL, when the cluster is idle.
    reference: list[asyncio.Future[EngineSet]] = []
    try:
        result["chaos"], reqs = await run_phase(
            "chaos", model, work, args, settings, agent(spec), extra, faults,
            on_quiet=lambda: reference.append(asyncio.ensure_future(asyncio.to_thread(start_reference, model, work))))
        requests += reqs
        engines = await (reference[0] if reference else asyncio.to_thread(start_reference, model, work))
    except BaseException:
        if reference:
            started = await asyncio.gather(reference[0], return_exceptions=True)
            if isinstance(started[0], EngineSet):
                await asyncio.to_thread(started[0].stop)
        raise
    print(f"== checking {sum(r.ok for r in requests)} answers against a reference engine", flush=True)
    result["answers"] = await check_answers(engines, model.name, requests)
    result["problems"] = {name: verdict(result[name], result["answers"]) for name in ("baseline", "chaos")
                          if name in result}
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--sessions", type=int, default=16, help="agent sessions (at most 64)")
    parser.add_argument("--turns", type=int, default=12, help="turns per session (at most 16)")
    parser.add_argument("--concurrency", type=int, default=4, help="sessions in flight at once")
    parser.add_argument("--rounds", type=int, default=2, help="every fault kind this many times")
    parser.add_argument("--faults", default=",".join(KINDS), help=f"comma-separated kinds (default all: {KINDS})")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="first the same workload without faults, side by side")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--attempts", type=int, default=3, help="tries per turn before a session moves on")
    parser.add_argument("--client-timeout-s", type=float, default=180.0, help="a request past this is a hang")
    parser.add_argument("--deadline-s", type=float, default=1800.0, help="no fault or extra session after this")
    parser.add_argument("--recovery-wait-s", type=float, default=RECOVERY_WAIT_S,
                        help="after the last fault, keep traffic coming at most this long until every repaired part "
                             "has served a good turn")
    parser.add_argument("--outage-turns", type=int, default=0,
                        help="while an engine restarts, at most this many turns start (then traffic waits for the "
                             "restart); 0: traffic keeps coming at --concurrency throughout")
    parser.add_argument("--soak-s", type=float, default=0.0,
                        help="the chaos phase's traffic lasts at least this long (a soak: broker memory and held "
                             "blocks sampled every 10 s, growth checked); 600 for the 10-minute soak")
    parser.add_argument("--host-tier-blocks", type=int, default=0,
                        help="each decode engine's host tier in KV blocks (0: none); evictions for room demote into "
                             "it, so kills and freezes interrupt demotions too")
    parser.add_argument("--retention-fraction", type=float, default=0.5,
                        help="each decode engine's retention budget as a share of its KV pool; small values make "
                             "evictions for room (and with a tier, demotions) frequent")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")


def validate(args: argparse.Namespace) -> str:
    """The first bad argument, named; "" when all are good."""
    if not 1 <= args.sessions <= 64:
        return "--sessions: must be within 1..64"
    if not 1 <= args.turns <= 16:
        return "--turns: must be within 1..16"
    if not 1 <= args.concurrency <= args.sessions:
        return "--concurrency: must be within 1..--sessions"
    if not 0 <= args.rounds <= 8:
        return "--rounds: must be within 0..8"
    if args.prefill < 2 or args.decode < 2:
        return "--prefill/--decode: at least 2 each (a fault must leave one of each role alive)"
    unknown = set(args.faults.split(",")) - set(KINDS)
    if unknown:
        return f"--faults: unknown {sorted(unknown)}; choose from {list(KINDS)}"
    if not 0 <= args.soak_s <= args.deadline_s:
        return "--soak-s: must be within 0..--deadline-s"
    if args.outage_turns < 0:
        return "--outage-turns: must be at least 0"
    if args.recovery_wait_s < 0:
        return "--recovery-wait-s: must be at least 0"
    if not 0 <= args.host_tier_blocks <= 1 << 20:
        return "--host-tier-blocks: must be within 0..1048576"
    if not 0 < args.retention_fraction <= 1:
        return "--retention-fraction: must be in (0, 1]"
    if args.attempts < 1 or args.client_timeout_s <= 0 or args.deadline_s <= 0:
        return "--attempts, --client-timeout-s, --deadline-s: must be positive"
    return ""


def main(args: argparse.Namespace) -> int:
    problem = validate(args)
    if problem:
        print(f"kvloop bench chaos: {problem}", file=sys.stderr)
        return 2
    result = asyncio.run(bench(args))
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    summary: dict[str, Any] = {k: result[k] for k in ("problems", "answers") if k in result}
    for name in ("baseline", "chaos"):
        if name in result:
            summary[name] = {k: result[name][k] for k in ("requests", "ok", "errors", "hangs", "ttft_ms", "recovery_s",
                                                          "faults_fired", "faults_not_fired", "wall_s", "books")}
            soak = result[name].get("soak", {})
            summary[name]["soak"] = {k: v for k, v in soak.items() if k != "decode_blocks"} | {
                "decode_blocks": {k: v for k, v in soak.get("decode_blocks", {}).items() if k != "timeline"}}
    print(json.dumps(summary, indent=1, default=str))
    return 1 if any(result["problems"].values()) else 0
