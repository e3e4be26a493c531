"""``kvloop bench broker-scale``: the broker at fleet scale, through the real core, runtime and gRPC service
(loopback) on a store that counts its writes.

Each size (the largest is ``--engines`` engines and ``--blocks`` retained blocks; each smaller one halves both,
``--steps`` sizes in all) runs in a process of its own, the broker's, on one core. It registers the engines (one in
eight prefill, the rest decode), fills the decode engines with leases of ``--blocks-per-lease`` blocks through the
core (the fill is set-up, not measured), then serves the turns a client process on the other core plays over gRPC
(``broker_scale_client``): ``--turns`` turns with unary ``Place``, then ``--turns`` over ``PlaceStream`` (the
router's path), with ``--concurrency`` clients, each turn the router's and a decode engine's calls: ``Place``
(strict P/D, pinned, so the plan is a TRANSFER of a session's lease), ``CompleteTransfer``, and ``PublishLease`` of
the session grown by one block (which supersedes the old lease). It reports:

- a new leader's rebuild time (:func:`rebuild`): the store's records decoded and loaded, and the soft index
  from the engines' re-sent mirrors;
- placement p50/p99 as the client process sees it over gRPC (unary and over the stream, with n), and of the
  core's ``place`` alone;
- broker memory per retained block: the size's process's RSS growth over the fill, divided by the blocks (a fresh
  process, so no size reuses memory another freed);
- store writes per turn: the records the runtime hands the store (puts and deletes) and the transactions an etcd
  store would run for them (100 operations each, as ``broker/store/etcd.py`` splits them); and the records one
  keep-alive round of every engine writes (each ``KeepAlive`` rewrites its engine's record);
- how each figure grows from one size to the next (the engines and blocks double).

No etcd is started: the counting store stands in for it, as the runtime writes to any store through the same
``Store.apply``. Keys are random, not token hashes: the broker never sees tokens, only keys.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvloop.app.analyze.stats import quantile
from kvloop.app.benchmarks.broker_bench import broker_and_client_cpus
from kvloop.app.benchmarks.broker_scale_client import ClientResult, ClientWork, answer, drive, in_a_process
from kvloop.broker.core import Changes, Lease, PlaceInput
from kvloop.broker.store.base import Snapshot
from kvloop.shared.serving import run_async

BLOCK_SIZE = 16
FINGERPRINT = "scale-bench"
ETCD_OPS_PER_TRANSACTION = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=1000, help="engines at the largest size")
    parser.add_argument("--blocks", type=int, default=1_000_000, help="retained blocks at the largest size")
    parser.add_argument("--steps", type=int, default=4, help="sizes, each half the next (default %(default)s: "
                        "1/8, 1/4, 1/2 and all of --engines and --blocks)")
    parser.add_argument("--blocks-per-lease", type=int, default=128)
    parser.add_argument("--turns", type=int, default=500, help="measured turns per size")
    parser.add_argument("--concurrency", type=int, default=1, help="concurrent gRPC clients (default 1: more measure "
                        "queueing behind each other on the broker's one core; more also let the runtime's group "
                        "commit merge writes)")
    parser.add_argument("--etcd-load", action=argparse.BooleanOptionalAction, default=False,
                        help="also write the state's records into a real etcd this run starts (loopback, a temporary "
                             "directory) and time a replica's load of them (the new leader's read; ~10 s of writes "
                             "per million blocks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")


@dataclass
class CountingStore:
    """A durable store that keeps nothing and counts what it is asked to write."""

    kind: str = "counting"
    durable: bool = True
    applies: int = 0
    puts: int = 0
    deletes: int = 0
    transactions: int = 0

    async def load(self) -> Snapshot:
        return Snapshot()

    async def apply(self, changes: Changes, hold_until: Callable[[Lease], float], now: float) -> None:
        ops = 0
        for records in (changes.engines, changes.leases, changes.pins):
            for record in records.values():
                self.puts += record is not None
                self.deletes += record is None
                ops += 1
        self.applies += 1
        self.transactions += -(-ops // ETCD_OPS_PER_TRANSACTION)

    async def close(self) -> None:
        return None

    def snapshot(self) -> tuple[int, int, int]:
        return self.puts, self.deletes, self.transactions


def _rss() -> int:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class SizeResult:
    engines: int
    blocks: int
    fill_s: float = 0.0
    bytes_per_block: float = 0.0
    place_ms: dict[str, float] = field(default_factory=dict)
    """Unary ``Place`` as the client process sees it."""
    place_stream_ms: dict[str, float] = field(default_factory=dict)
    """``Place`` over ``PlaceStream``, the router's path, as the client process sees it."""
    turns: dict[str, int] = field(default_factory=dict)
    """Measured turns (the n of each placement figure): unary, and over the stream."""
    core_place_ms: dict[str, float] = field(default_factory=dict)
    turn_ms: dict[str, float] = field(default_factory=dict)
    writes_per_turn: dict[str, float] = field(default_factory=dict)
    keepalive_writes_per_engine: float = 0.0
    publish_blocks_per_s: float = 0.0
    """Retained blocks published per second of the fill (the core's ``publish``, leases of ``--blocks-per-lease``)."""
    cache_events_per_s: float = 0.0
    """Block events (stored keys, then as many removed) applied per second by the core's ``report_cache_events``,
    in batches of 512 keys over up to 64 engines."""
    rebuild_s: dict[str, float] = field(default_factory=dict)
    """A new leader's rebuild after the old one died (:func:`rebuild`): decoding the store's records, loading
    them into a fresh state, the soft index from every decode engine's re-sent mirror, and their total."""
    store_mb: float = 0.0
    """The engine and lease records as the etcd store encodes them (``broker/store/codec.py``), in MB."""
    decisions: dict[str, int] = field(default_factory=dict)
    errors: int = 0


def _percentiles(samples: list[float]) -> dict[str, float]:
    return {q: round(quantile(samples, v), 3) for q, v in (("p50", 0.5), ("p99", 0.99))} if samples else {}


async def _play_in_a_process(work: ClientWork) -> ClientResult:
    """``work``'s turns played by a spawned client process; this process's event loop serves them meanwhile."""
    result: ClientResult = await asyncio.to_thread(in_a_process, drive, (work,), "broker-scale client")
    return result


def measure_size(engines: int, blocks: int, args: argparse.Namespace, conn: Any) -> None:
    """A spawned process's entry: one size, measured in a process of its own (so its memory growth is its own, not
    memory a previous size freed), on the broker's core; the :class:`SizeResult` (or the error) goes to ``conn``.
    On the event loop the broker serves on (uvloop where installed), so Place over gRPC costs what it does in the
    service."""
    answer(conn, args.broker_cpus, lambda: run_async(run_size(engines, blocks, args)))


async def run_size(engines: int, blocks: int, args: argparse.Namespace) -> SizeResult:
    import grpc

    from kvloop.broker.access import Access
    from kvloop.broker.config import BrokerConfig
    from kvloop.broker.core import Addresses, EngineInfo, Role
    from kvloop.broker.metrics import BrokerMetrics
    from kvloop.broker.runtime import BrokerRuntime
    from kvloop.broker.service import BrokerService
    from kvloop.broker.store import SoloElection
    from kvloop.v1 import broker_pb2 as pb
    from kvloop.v1 import broker_pb2_grpc

    rng = random.Random(args.seed)
    result = SizeResult(engines, blocks)
    config = BrokerConfig(engine_ttl_s=86400.0, log_level="warning")
    store = CountingStore()
    runtime = BrokerRuntime(config, store, SoloElection("127.0.0.1:0"), BrokerMetrics())
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", config.max_message_bytes)])
    broker_pb2_grpc.add_KVBrokerServicer_to_server(BrokerService(runtime, Access(config)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await runtime.start()
    await asyncio.wait_for(runtime.leader_changed.wait(), 10)
    state = runtime.require_state()
    n_prefill = max(1, engines // 8)
    decodes = [f"d{i}" for i in range(engines - n_prefill)]
    budget = min(state.limits.max_retention_budget_blocks, 4 * -(-blocks // len(decodes)) + 4096)
    now = time.time()
    for i in range(engines):
        eid, role = (f"p{i}", Role.PREFILL) if i < n_prefill else (decodes[i - n_prefill], Role.DECODE)
        state.register(EngineInfo(eid, role, BLOCK_SIZE, FINGERPRINT, 0 if role is Role.PREFILL else budget,
                                  Addresses(grpc="127.0.0.1:1", http="http://127.0.0.1:2", nixl="127.0.0.1:3"),
                                  "scale"), now)
    state.take_changes()

    # Fill: sessions of blocks_per_lease random keys, spread over the decode engines (set-up, not measured). The
    # benchmark keeps nothing of its own over the fill, so the memory it grows by is the broker's.
    before = _rss()
    started = time.perf_counter()
    next_id: dict[str, int] = dict.fromkeys(decodes, 0)
    per = args.blocks_per_lease
    for n in range(blocks // per):
        eid = decodes[n % len(decodes)]
        raw = rng.randbytes(32 * per)
        keys = [raw[j:j + 32] for j in range(0, len(raw), 32)]
        ids = list(range(next_id[eid], next_id[eid] + per))
        next_id[eid] += per
        state.publish(eid, f"s{n}", keys, ids, per * BLOCK_SIZE, 0, time.time())
        del raw, keys, ids
    state.take_changes()
    fill_s = time.perf_counter() - started
    result.fill_s = round(fill_s, 2)
    result.publish_blocks_per_s = round((blocks // per) * per / max(fill_s, 1e-9))
    result.bytes_per_block = round((_rss() - before) / max(1, blocks), 1)
    sessions = [(lease.engine_id, lease.session_id, list(lease.keys), list(lease.block_ids))
                for lease in state.leases.values()]

    # The core's place alone, on the measured turns' kind of request.
    samples = []
    for _eid, session, keys, _ in rng.sample(sessions, min(len(sessions), args.turns)):
        query = [*keys, rng.randbytes(32)]
        t0 = time.perf_counter()
        state.place(PlaceInput(query, len(query) * BLOCK_SIZE + 1, FINGERPRINT, BLOCK_SIZE, session, False),
                    time.time())
        samples.append((time.perf_counter() - t0) * 1e3)
    result.core_place_ms = {q: round(quantile(samples, v), 3) for q, v in (("p50", 0.5), ("p99", 0.99))}

    # Ingestion: KV cache events of up to 64 engines, 512 keys a batch, stored then removed (the soft index's work).
    batch_keys = 512
    feeders = decodes[:64]
    batches = [[rng.randbytes(32) for _ in range(batch_keys)] for _ in range(8)]
    events, t0 = 0, time.perf_counter()
    for round_ in range(8):
        for eid in feeders:
            state.report_cache_events(eid, "scale", 2 * round_ + 1, reset=False, cleared=False,
                                      stored=batches[round_], removed=[])
            state.report_cache_events(eid, "scale", 2 * round_ + 2, reset=False, cleared=False, stored=[],
                                      removed=batches[round_])
            events += 2 * batch_keys
    result.cache_events_per_s = round(events / (time.perf_counter() - t0))
    result.store_mb, result.rebuild_s = rebuild(runtime, state, decodes)
    if args.etcd_load:
        result.rebuild_s["etcd_load"] = await etcd_load(state)

    # The measured turns, from a client process of its own (broker_scale_client): unary Place on one half of the
    # sampled sessions, then PlaceStream (the router's path) on the other.
    picked = rng.sample(range(len(sessions)), min(len(sessions), 2 * args.turns))
    half = -(-len(picked) // 2)
    work = ClientWork(port, [sessions[i] for i in picked[:half]], [sessions[i] for i in picked[half:]], next_id,
                      args.concurrency, BLOCK_SIZE, FINGERPRINT, args.seed, cpus=args.client_cpus)
    del sessions
    writes_before = store.snapshot()
    client = await _play_in_a_process(work)
    puts, deletes, transactions = (a - b for a, b in zip(store.snapshot(), writes_before, strict=True))
    done = max(1, len(client.turn_ms))
    result.writes_per_turn = {"puts": round(puts / done, 2), "deletes": round(deletes / done, 2),
                              "etcd_transactions": round(transactions / done, 2)}
    result.place_ms = _percentiles(client.place_ms)
    result.place_stream_ms = _percentiles(client.place_stream_ms)
    result.turn_ms = _percentiles(client.turn_ms)
    result.turns = {"unary": len(client.place_ms), "stream": len(client.place_stream_ms)}
    result.decisions = client.decisions
    result.errors += client.errors

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = broker_pb2_grpc.KVBrokerStub(channel)
    # One keep-alive round: every engine's KeepAlive rewrites its engine record.
    before_ka = store.puts
    for eid in decodes[:200]:
        await stub.KeepAlive(pb.KeepAliveRequest(engine_id=eid, load=pb.EngineLoad()), timeout=30)
    result.keepalive_writes_per_engine = round((store.puts - before_ka) / min(200, len(decodes)), 2)
    await channel.close()
    await server.stop(None)
    await runtime.stop()
    return result


def store_records(state: Any) -> dict[str, dict[str, bytes]]:
    """The records an etcd store holds for ``state``'s engines and leases: kind -> id -> ``broker/store/codec.py``
    JSON, laid out as ``broker/store/etcd.py`` keys them (``engines/<id>``, ``leases/<id>``)."""
    from kvloop.broker.store import codec

    return {"engines": {rec.info.engine_id: codec.encode_engine(rec) for rec in state.engines.values()},
            "leases": {lease.lease_id: codec.encode_lease(lease) for lease in state.leases.values()}}


def rebuild(runtime: Any, state: Any, decodes: list[str]) -> tuple[float, dict[str, float]]:
    """What a new leader does before it places again, timed: decode the records an etcd store holds (every engine
    and lease, encoded as ``broker/store/codec.py`` writes them), load them into a fresh state (the leases'
    key-to-holders index is built here), then take every decode engine's re-sent prefix-cache mirror (a reset
    holding the keys it retains, as its sidecar re-sends them on a resync) into the soft index. Not timed: etcd's
    range read itself, and the mirrors' gRPC calls (each a ``ReportCacheEvents``; per-call cost as Place's)."""
    from kvloop.broker.store.codec import decode_engine, decode_lease

    records = store_records(state)
    engine_records, lease_records = list(records["engines"].values()), list(records["leases"].values())
    del records
    mirrors: dict[str, list[bytes]] = {}
    for lease in state.leases.values():
        mirrors.setdefault(lease.engine_id, []).extend(lease.keys)
    size_mb = round((sum(map(len, engine_records)) + sum(map(len, lease_records))) / 2**20, 1)
    t0 = time.perf_counter()
    engines = [decode_engine(raw) for raw in engine_records]
    leases = [decode_lease(raw) for raw in lease_records]
    t1 = time.perf_counter()
    fresh = runtime.new_state()
    fresh.load(engines, leases, [])
    t2 = time.perf_counter()
    for eid in decodes:
        fresh.report_cache_events(eid, "scale", 1, reset=True, cleared=False, stored=mirrors.get(eid, []),
                                  removed=[])
    t3 = time.perf_counter()
    if len(fresh.leases) != len(state.leases):
        raise AssertionError(f"rebuild: {len(fresh.leases)} leases loaded of {len(state.leases)}")
    del engine_records, lease_records, engines, leases, mirrors, fresh
    # Four decimals: a tiny run's rebuild takes milliseconds, and a zero would read as "not measured".
    return size_mb, {"decode_records": round(t1 - t0, 4), "load": round(t2 - t1, 4),
                     "soft_index": round(t3 - t2, 4), "total": round(t3 - t0, 4)}


async def etcd_load(state: Any) -> float:
    """Seconds a replica's ``EtcdStore.load`` takes (paged range reads at one revision, then decoding) for the
    state's engine and lease records, written first into a real etcd on loopback that this call starts and stops."""
    import tempfile

    from kvloop.broker.store.etcd import EtcdStore, connect
    from kvloop.shared import procs

    with tempfile.TemporaryDirectory(prefix="kvloop-scale-etcd-") as tmp:
        etcd = await asyncio.to_thread(procs.start_etcd, Path(tmp) / "data", Path(tmp))
        client = connect(etcd.extra["endpoint"], 60.0)
        try:
            for kind, records in store_records(state).items():
                for key, raw in records.items():
                    await client.put(f"/kvloop/{kind}/{key}".encode(), raw)
            t0 = time.perf_counter()
            snapshot = await EtcdStore(client, "/kvloop/", "scale-bench").load()
            took = round(time.perf_counter() - t0, 4)
            if len(snapshot.leases) != len(state.leases):
                raise AssertionError(f"etcd load: {len(snapshot.leases)} leases of {len(state.leases)}")
            return took
        finally:
            await client.close()
            await asyncio.to_thread(etcd.stop)


def growth(results: list[SizeResult]) -> list[dict[str, Any]]:
    """Each size's figures over the previous size's."""
    out = []
    for a, b in itertools.pairwise(results):
        out.append({"from": f"{a.engines} engines, {a.blocks} blocks", "to": f"{b.engines} engines, {b.blocks} blocks",
                    "place_p50": round(b.place_ms["p50"] / max(a.place_ms["p50"], 1e-9), 2),
                    "place_p99": round(b.place_ms["p99"] / max(a.place_ms["p99"], 1e-9), 2),
                    "place_stream_p50": round(b.place_stream_ms["p50"] / max(a.place_stream_ms["p50"], 1e-9), 2),
                    "place_stream_p99": round(b.place_stream_ms["p99"] / max(a.place_stream_ms["p99"], 1e-9), 2),
                    "core_place_p50": round(b.core_place_ms["p50"] / max(a.core_place_ms["p50"], 1e-9), 2),
                    "memory": round(b.bytes_per_block * b.blocks / max(a.bytes_per_block * a.blocks, 1e-9), 2)})
    return out


def validate(args: argparse.Namespace) -> None:
    from kvloop.shared.errors import ConfigError

    for name, low in (("engines", 2), ("blocks", 1), ("steps", 1), ("blocks_per_lease", 1), ("turns", 1),
                      ("concurrency", 1)):
        if getattr(args, name) < low:
            raise ConfigError(f"{name}: must be at least {low}", field=name)
    smallest = args.engines >> (args.steps - 1)
    if smallest < 2 or (args.blocks >> (args.steps - 1)) < args.blocks_per_lease:
        raise ConfigError("steps: the smallest size needs 2 engines and one lease of blocks", field="steps")
    if args.blocks_per_lease > 4096:
        raise ConfigError("blocks_per_lease: at most 4096", field="blocks_per_lease")


def main(args: argparse.Namespace) -> int:
    validate(args)
    # One broker core: the size's process (the broker) on one, the client process on the rest.
    args.broker_cpus, args.client_cpus = broker_and_client_cpus()
    results = []
    for step in reversed(range(args.steps)):
        engines, blocks = args.engines >> step, args.blocks >> step
        print(f"size {engines} engines, {blocks} blocks: filling ...", flush=True)
        results.append(in_a_process(measure_size, (engines, blocks, args), f"broker-scale size {engines}"))
        r = results[-1]
        print(f"  fill {r.fill_s}s, {r.bytes_per_block} B/block; Place over PlaceStream p50 "
              f"{r.place_stream_ms['p50']} ms p99 {r.place_stream_ms['p99']} ms, unary p50 {r.place_ms['p50']} ms "
              f"p99 {r.place_ms['p99']} ms, n {r.turns} (core alone p50 {r.core_place_ms['p50']} "
              f"p99 {r.core_place_ms['p99']}); "
              f"turn p50 {r.turn_ms['p50']} p99 {r.turn_ms['p99']} ms; writes/turn {r.writes_per_turn}; "
              f"keep-alive writes/engine {r.keepalive_writes_per_engine}; "
              f"publish {r.publish_blocks_per_s:.0f} blocks/s, cache events {r.cache_events_per_s:.0f}/s; "
              f"new leader's rebuild {r.rebuild_s} s from {r.store_mb} MB of records; "
              f"{r.decisions}; errors {r.errors}",
              flush=True)
    report: dict[str, Any] = {"workload": {
        "blocks_per_lease": args.blocks_per_lease, "block_size": BLOCK_SIZE, "turns": args.turns,
        "concurrency": args.concurrency, "turn": "Place(pin, strict P/D) + CompleteTransfer + "
                           "PublishLease(+1 block, supersedes)"},
              "sizes": [r.__dict__ for r in results], "growth": growth(results)}
    for g in report["growth"]:
        print(f"growth {g['from']} -> {g['to']}: Place p50 x{g['place_p50']}, p99 x{g['place_p99']}, over the "
              f"stream p50 x{g['place_stream_p50']}, p99 x{g['place_stream_p99']}, core p50 "
              f"x{g['core_place_p50']}, memory x{g['memory']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
