"""``kvloop bench broker``: concurrent asyncio clients against a real broker process.

The broker runs as its own process pinned to one core (core 0 when the machine has two); the clients
run here, pinned to the other. Each client plays one session of growing 16k-token prompts in 128-token
blocks and repeats a turn cycle: Place, then PublishLease (as the decode engine retaining the turn),
then PinBlocks and CompleteTransfer (as the prefill engine pulling it). A second phase runs Place alone.
Both phases run for the memory store and, with ``--store both``, for etcd (started here), in one run,
and the report gives their ratio.

Benchmark engines are the benchmark's own gRPC clients that register as engines; no vLLM is involved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvloop.shared.hashing import ExtraKeys, block_keys, layout_fingerprint

FINGERPRINT = layout_fingerprint(model="bench", layers=4, kv_heads=2, head_dim=64, dtype="bf16", block=128)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", choices=("memory", "etcd", "both"), default="both")
    parser.add_argument("--clients", type=int, default=32, help="concurrent asyncio clients")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per phase and store")
    parser.add_argument("--streams", type=int, default=4, help="PlaceStream calls shared by the clients")
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--bogus-sessions", type=int, default=0,
                        help="then open this many sessions with absurd hints (docs/sessions.md) and place again: "
                             "placement latency and the broker's memory before and after")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--work-dir", type=Path, default=None, help="logs and etcd data (default: a temp dir)")


@dataclass
class PhaseResult:
    name: str
    seconds: float
    ops: dict[str, list[float]] = field(default_factory=dict)
    errors: int = 0
    notes: dict[str, Any] = field(default_factory=dict)

    def rate(self, op: str) -> float:
        return len(self.ops.get(op, [])) / self.seconds if self.seconds else 0.0

    def pct(self, op: str, q: float) -> float:
        samples = sorted(self.ops.get(op, []))
        if not samples:
            return 0.0
        return samples[min(len(samples) - 1, int(q * len(samples)))] * 1000

    def summary(self) -> dict[str, Any]:
        return {op: {"per_s": round(self.rate(op), 1), "p50_ms": round(self.pct(op, 0.50), 3),
                     "p99_ms": round(self.pct(op, 0.99), 3), "count": len(v)} for op, v in self.ops.items()} | {
            "errors": self.errors, "seconds": round(self.seconds, 2)} | ({"notes": self.notes} if self.notes else {})


def broker_and_client_cpus() -> tuple[set[int] | None, set[int] | None]:
    """One core for the broker (the first of this process's), the rest for the clients; (None, None) on one core."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return {cpus[0]}, set(cpus[1:])


async def _run_phase(address: str, name: str, clients: int, duration: float, prompt_tokens: int,
                     block_size: int, full_cycle: bool, streams: int = 0) -> PhaseResult:
    """``streams`` > 0: placements go over that many PlaceStream calls instead of unary Place."""
    import grpc

    from kvloop.shared.client import PlacementStream
    from kvloop.v1 import broker_pb2 as pb
    from kvloop.v1 import broker_pb2_grpc

    channel = grpc.aio.insecure_channel(address)
    stub = broker_pb2_grpc.KVBrokerStub(channel)
    run = uuid.uuid4().hex[:6]
    engines = {f"bench-{run}-p0": pb.ENGINE_ROLE_PREFILL, f"bench-{run}-p1": pb.ENGINE_ROLE_PREFILL,
               f"bench-{run}-d0": pb.ENGINE_ROLE_DECODE}
    for engine_id, role in engines.items():
        await stub.RegisterEngine(pb.RegisterEngineRequest(engine=pb.Engine(
            engine_id=engine_id, role=role, block_size=block_size, layout_fingerprint=FINGERPRINT,
            retention_budget_blocks=10_000_000, incarnation=run,
            addresses=pb.EngineAddresses(grpc="127.0.0.1:1", http="http://127.0.0.1:2", nixl="127.0.0.1:3"))))
    decode, prefills = f"bench-{run}-d0", [f"bench-{run}-p0", f"bench-{run}-p1"]
    extra = ExtraKeys(FINGERPRINT)
    result = PhaseResult(name, 0.0, {op: [] for op in (
        ("place", "publish", "pin", "complete") if full_cycle else ("place",))})
    next_block = [0]
    placers = [PlacementStream(stub) for _ in range(streams)]

    async def timed(op: str, call: Any) -> Any:
        start = time.perf_counter()
        reply = await call
        result.ops[op].append(time.perf_counter() - start)
        return reply

    async def client(index: int, stop_at: float) -> None:
        # A session whose history is ~prompt_tokens; every turn adds one block of new tokens.
        base = [(index * 7919 + i) % 4000 for i in range(prompt_tokens)]
        keys_by_turn = [block_keys(base + [index % 4000] * block_size * turn, block_size, extra)
                        for turn in range(4)]
        turn = 0
        while time.perf_counter() < stop_at:
            keys = keys_by_turn[turn % len(keys_by_turn)]
            num_tokens = len(keys) * block_size
            try:
                request = pb.PlaceRequest(session_id=f"s{index}", block_keys=keys, num_tokens=num_tokens + 1,
                                          layout_fingerprint=FINGERPRINT, block_size=block_size)
                if placers:
                    plan = await timed("place", placers[index % len(placers)].place(request, 10))
                    if plan.error:
                        raise RuntimeError(plan.error)
                else:
                    plan = await timed("place", stub.Place(request, timeout=10))
                if full_cycle:
                    ids = list(range(next_block[0], next_block[0] + len(keys)))
                    next_block[0] += len(keys)
                    lease = (await timed("publish", stub.PublishLease(pb.PublishLeaseRequest(
                        engine_id=decode, session_id=f"s{index}", block_keys=keys, block_ids=ids,
                        num_tokens=num_tokens, ttl_s=60), timeout=10))).lease
                    pin = await timed("pin", stub.PinBlocks(pb.PinBlocksRequest(
                        reader_engine_id=prefills[turn % 2], lease_id=lease.lease_id,
                        num_blocks=max(1, plan.matched_blocks or len(keys) // 2)), timeout=10))
                    await timed("complete", stub.CompleteTransfer(pb.CompleteTransferRequest(
                        pin_id=pin.pin_id, success=True, bytes=len(keys) * 262144, duration_s=0.01), timeout=10))
            except (grpc.aio.AioRpcError, RuntimeError):
                result.errors += 1
            turn += 1

    start = time.perf_counter()
    stop_at = start + duration
    await asyncio.gather(*(client(i, stop_at) for i in range(clients)))
    result.seconds = time.perf_counter() - start
    for placer in placers:
        await placer.close()
    for engine_id in engines:
        await stub.DeregisterEngine(pb.DeregisterEngineRequest(engine_id=engine_id))
    await channel.close()
    return result


async def _bogus_sessions(address: str, n: int) -> dict[str, int]:
    """``n`` sessions from 10 owners, each hint absurd in its own way: the longest ids the broker takes, a day's pause
    (granted its bound), high priority for all (granted to 64 a owner), keep_generated false (refused), and every
    tenth a pause that is not a number (refused whole). Returns the replies by status."""
    import grpc

    from kvloop.v1 import broker_pb2 as pb
    from kvloop.v1 import broker_pb2_grpc

    statuses: dict[str, int] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = broker_pb2_grpc.KVBrokerStub(channel)
        for i in range(n):
            request = pb.HintSessionRequest(session_id=f"{i:08d}-" + "x" * 240, owner=f"bogus-{i % 10}",
                                            pause_s=float("nan") if i % 10 == 9 else 86400.0,
                                            priority=pb.SESSION_PRIORITY_HIGH, keep_generated=False)
            try:
                await stub.HintSession(request, timeout=10)
                status = "OK"
            except grpc.aio.AioRpcError as exc:
                status = exc.code().name
            statuses[status] = statuses.get(status, 0) + 1
    return statuses


def rss_bytes(pid: int) -> int:
    """A process's resident memory (``VmRSS`` of ``/proc/PID/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _bench_store(store: str, args: argparse.Namespace, work: Path) -> dict[str, PhaseResult]:
    from kvloop.shared import procs

    broker_cpus, client_cpus = broker_and_client_cpus()
    etcd = None
    broker_args = ["--store", store, "--log-level", "warning"]
    if store == "etcd":
        # etcd shares the clients' core: the broker's core stays the broker's alone.
        etcd = procs.start_etcd(work / "etcd-data", work, cpus=client_cpus)
        broker_args += ["--etcd-endpoint", etcd.extra["endpoint"], "--etcd-prefix", f"/bench-{uuid.uuid4().hex[:6]}/"]
    broker = procs.start_broker(f"broker-{store}", broker_args, work, cpus=broker_cpus)
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)
    try:
        from kvloop.broker.server import SERVICE_NAME
        from kvloop.shared.client import wait_serving
        from kvloop.shared.serving import run_async

        run_async(wait_serving(broker.extra["address"], SERVICE_NAME, timeout_s=30))
        results = {}
        for phase, full, streams in (("cycle", True, 0), ("place_unary", False, 0),
                                     ("place_stream", False, args.streams)):
            results[phase] = run_async(_run_phase(broker.extra["address"], phase, args.clients, args.duration,
                                                    args.prompt_tokens, args.block_size, full, streams))
        if args.bogus_sessions:
            before = rss_bytes(broker.popen.pid)
            statuses = run_async(_bogus_sessions(broker.extra["address"], args.bogus_sessions))
            after = rss_bytes(broker.popen.pid)
            results["place_stream_sessions"] = run_async(_run_phase(
                broker.extra["address"], "place_stream_sessions", args.clients, args.duration, args.prompt_tokens,
                args.block_size, False, args.streams))
            results["place_stream_sessions"].notes = {"sessions": args.bogus_sessions, "replies": statuses,
                                                      "rss_before_bytes": before, "rss_after_bytes": after}
        return results
    finally:
        broker.stop()
        if etcd is not None:
            etcd.stop()


def main(args: argparse.Namespace) -> int:
    stores = ["memory", "etcd"] if args.store == "both" else [args.store]
    with tempfile.TemporaryDirectory(prefix="kvloop-bench-") as tmp:
        work = args.work_dir or Path(tmp)
        report: dict[str, Any] = {"workload": {
            "clients": args.clients, "duration_s_per_phase": args.duration, "prompt_tokens": args.prompt_tokens,
            "block_size": args.block_size, "blocks_per_prompt": args.prompt_tokens // args.block_size,
            "cycle": "Place + PublishLease + PinBlocks + CompleteTransfer",
            "broker_cores": 1, "cpus": len(os.sched_getaffinity(0))}, "stores": {}}
        for store in stores:
            results = _bench_store(store, args, work)
            report["stores"][store] = {name: r.summary() for name, r in results.items()}
    print(f"kvloop bench broker: {args.clients} clients, {args.prompt_tokens}-token prompts "
          f"({args.prompt_tokens // args.block_size} blocks of {args.block_size}), {args.duration:.0f}s per phase, "
          "broker on one core")
    print(f"{'store':<8} {'phase':<11} {'op':<9} {'ops/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for store, phases in report["stores"].items():
        for phase, ops in phases.items():
            for op, figures in ops.items():
                if isinstance(figures, dict) and op != "notes":
                    print(f"{store:<8} {phase:<11} {op:<9} {figures['per_s']:>9.1f} {figures['p50_ms']:>8.3f}"
                          f" {figures['p99_ms']:>8.3f}")
            print(f"{store:<8} {phase:<11} {'errors':<9} {ops['errors']:>9}")
    report["ratios"] = {
        f"{store}_stream_over_unary_place_per_s": round(
            f["place_stream"]["place"]["per_s"] / max(f["place_unary"]["place"]["per_s"], 1e-9), 2)
        for store, f in report["stores"].items()}
    if len(report["stores"]) == 2:
        mem, etcd = report["stores"]["memory"], report["stores"]["etcd"]
        report["ratios"] |= {
            "memory_over_etcd_cycle_per_s": round(mem["cycle"]["place"]["per_s"] / max(etcd["cycle"]["place"]["per_s"],
                                                                                       1e-9), 2),
            "memory_over_etcd_place_stream_per_s": round(
                mem["place_stream"]["place"]["per_s"] / max(etcd["place_stream"]["place"]["per_s"], 1e-9), 2),
        }
    for store, f in report["stores"].items():
        if "place_stream_sessions" in f:
            after, before = f["place_stream_sessions"], f["place_stream"]
            notes = after["notes"]
            print(f"{store:<8} {notes['sessions']} bogus sessions: replies {notes['replies']}, broker RSS "
                  f"{notes['rss_before_bytes'] / 2**20:.1f} -> {notes['rss_after_bytes'] / 2**20:.1f} MiB")
            report["ratios"] |= {
                f"{store}_sessions_place_p50_after_over_before": round(
                    after["place"]["p50_ms"] / max(before["place"]["p50_ms"], 1e-9), 3),
                f"{store}_sessions_place_p99_after_over_before": round(
                    after["place"]["p99_ms"] / max(before["place"]["p99_ms"], 1e-9), 3),
                f"{store}_sessions_rss_after_over_before": round(
                    notes["rss_after_bytes"] / max(notes["rss_before_bytes"], 1), 3)}
    print("ratios:", json.dumps(report["ratios"]))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    errors = sum(p["errors"] for s in report["stores"].values() for p in s.values())
    return 1 if errors else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
