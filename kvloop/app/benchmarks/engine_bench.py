"""``kvloop bench engines``: what the return path saves on one growing session, and what idle engines cost.

In one run, on this machine's CPUs (figures, not a test):

1. **Idle CPU, before the fix**: two prefill engines and one decode engine on upstream's connector in its
   decode-to-prefill mode (``--connector nixl``, ``bidirectional_kv_xfer``), one turn so the decode engine
   retains blocks, then each engine's CPU-seconds per second over ``--idle-seconds`` (its whole process
   group, from /proc).
2. **Idle CPU, after**: the same topology on kvloop's connector with sidecars and a broker; measured with
   nothing retained and again with retained blocks.
3. **One session of ``--turns`` turns** growing past 8k tokens (``--first-tokens``, then ``--new-tokens``
   per turn, ``--output-tokens`` generated), the turns alternating between the two prefill engines as
   under load: once with the return path on (the broker's plan, pulls from the decode engine) and once
   off (a session of the same shape and other tokens, the prefill engines' local prefix caches only).
   Per turn: tokens computed on prefill, blocks and bytes pulled, pull time, TTFT (the decode's first
   streamed token), and the off/on TTFT ratio.

``--out FILE`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvloop.app.benchmarks.pd_driver import PDDriver, post_json
from kvloop.app.engine_set import EngineSet, start_engines
from kvloop.engines.config import EngineConfig, default_work_dir, role_cores
from kvloop.engines.launcher import EngineProcess
from kvloop.engines.layout import engine_fingerprint
from kvloop.engines.model import ensure_tiny_model
from kvloop.shared import procs
from kvloop.shared.vocabulary import Role

BLOCK = 128
CLK_TCK = os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int, extra_pids: tuple[int, ...] = ()) -> float:
    """utime + stime of every live process in the group (and ``extra_pids``), in seconds."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid or int(entry.name) in extra_pids:
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def idle_cpu(engines: Iterable[EngineProcess], seconds: float, settle_s: float = 3.0) -> dict[str, float]:
    """CPU-seconds per second of each engine (with its sidecar) over the same ``seconds``, starting ``settle_s``
    after the last request (vLLM's CPU worker spins for a second after every step it runs: that is the
    step's cost, not idling)."""
    time.sleep(settle_s)

    def sample() -> dict[str, float]:
        return {e.engine_id: group_cpu_seconds(e.pgid, (e.sidecar.popen.pid,) if e.sidecar else ())
                for e in engines}

    t0, before = time.monotonic(), sample()
    time.sleep(seconds)  # the measurement window itself, not a wait for readiness
    t1, after = time.monotonic(), sample()
    return {k: round((after[k] - before[k]) / (t1 - t0), 3) for k in before}


def start_cluster(model: Path, work: Path, connector: str, broker: str) -> EngineSet:
    """Two prefill and one decode engine, each bound to its role's cores."""
    extra = json.dumps({"bidirectional_kv_xfer": True, "kv_lease_duration": 180})
    return start_engines([EngineConfig(role=role, model=model, max_model_len=16384, work_dir=work,
                                       connector=connector, broker=broker if connector == "kvloop" else "",
                                       engine_id=f"{role}-{i}", omp_threads_bind=role_cores(role),
                                       kv_connector_extra_config=extra, log_level="warning")
                          for i, role in enumerate((Role.PREFILL, Role.PREFILL, Role.DECODE))], timeout_s=900)


def one_way_turn(model: str, prefill: EngineProcess, decode: EngineProcess, prompt: list[int], max_tokens: int
                 ) -> None:
    """A plain P->D turn with no broker (upstream's flow), so a decode engine retains blocks."""
    p = post_json(f"{prefill.url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1,
                                                     "kv_transfer_params": {"do_remote_decode": True}})
    post_json(f"{decode.url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                               "kv_transfer_params": p["kv_transfer_params"]})


def run_session(driver: PDDriver, prefills: list[str], *, seed: int, turns: int, first: int, new: int, out: int,
                transfer: bool, session: str) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    history: list[int] = []
    rows = []
    for i in range(turns):
        prompt = history + [rng.randrange(300, 4000) for _ in range(first if i == 0 else new)]
        turn = driver.turn(prompt, max_tokens=out, session=session, prefill=prefills[i % len(prefills)],
                           transfer=transfer, stream=True)
        rows.append({"turn": i + 1, "context_tokens": len(prompt), "decision": turn.decision, "reason": turn.reason,
                     "prefill": turn.prefill_engine, "computed_tokens": turn.report.get("computed_tokens"),
                     "local_tokens": turn.report.get("local_tokens"), "pulled_blocks": turn.report.get("pulled_blocks"),
                     "pulled_bytes": turn.report.get("pulled_bytes"), "pull_ms": turn.report.get("pull_ms"),
                     "ttft_ms": round(turn.ttft_s * 1e3, 1)})
        history = turn.all_ids
    return rows


def wait_registered(broker: str, engine_ids: set[str], timeout_s: float = 60.0) -> None:
    import grpc

    from kvloop.v1 import broker_pb2 as pb
    from kvloop.v1 import broker_pb2_grpc

    with grpc.insecure_channel(broker) as channel:
        stub = broker_pb2_grpc.KVBrokerStub(channel)
        deadline = time.monotonic() + timeout_s
        while {e.engine.engine_id for e in stub.Inspect(pb.InspectRequest(), timeout=5).engines} < engine_ids:
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines {sorted(engine_ids)} not all registered with the broker")
            time.sleep(0.1)


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(f"{'turn':>4} {'context':>7} {'decision':<9} {'reason':<16} {'prefill':<9} {'computed':>8} "
          f"{'local':>6} {'pulled':>6} {'bytes':>9} {'pull ms':>8} {'TTFT ms':>8}")
    for r in rows:
        print(f"{r['turn']:>4} {r['context_tokens']:>7} {r['decision']:<9} {r['reason']:<16} {r['prefill']:<9} "
              f"{r['computed_tokens']!s:>8} {r['local_tokens']!s:>6} {r['pulled_blocks']!s:>6} "
              f"{r['pulled_bytes']!s:>9} {r['pull_ms']!s:>8} {r['ttft_ms']:>8}")


def main(args: argparse.Namespace) -> int:
    work = Path(args.work_dir or default_work_dir() / "bench-engines").absolute()
    model = ensure_tiny_model(args.model)
    name = model.name
    rng = random.Random(0)
    warm_prompt = [rng.randrange(300, 4000) for _ in range(1024)]
    result: dict[str, Any] = {"machine": {"cpus": len(os.sched_getaffinity(0))}, "idle_cpu": {}}

    print("== before: upstream connector (bidirectional), 2 prefill + 1 decode", flush=True)
    engines = start_cluster(model, work / "before", "nixl", "")
    try:
        result["idle_cpu"]["before_nothing_retained"] = idle_cpu(engines, args.idle_seconds)
        one_way_turn(name, engines.by_id("prefill-0"), engines.by_id("decode-2"), warm_prompt, 16)
        result["idle_cpu"]["before_retained"] = idle_cpu(engines, args.idle_seconds)
    finally:
        engines.stop()

    print("== after: kvloop connector, sidecars, broker", flush=True)
    broker = procs.start_broker("bench-broker", ("--keepalive-interval-s", "1", "--engine-ttl-s", "5"), work / "broker")
    engines = start_cluster(model, work / "after", "kvloop", broker.extra["address"])
    try:
        fp = engine_fingerprint(model, dtype="auto", block_size=BLOCK)
        driver = PDDriver(broker.extra["address"], fingerprint=fp, block_size=BLOCK, model=name,
                          engines={e.engine_id: e.url for e in engines})
        wait_registered(broker.extra["address"], {e.engine_id for e in engines})
        result["idle_cpu"]["after_nothing_retained"] = idle_cpu(engines, args.idle_seconds)
        driver.turn(warm_prompt, max_tokens=16, session="warm", stream=True)
        result["idle_cpu"]["after_retained"] = idle_cpu(engines, args.idle_seconds)
        prefills = [e.engine_id for e in engines.of_role(Role.PREFILL)]
        shape = {"turns": args.turns, "first": args.first_tokens, "new": args.new_tokens, "out": args.output_tokens}
        on = run_session(driver, prefills, seed=1, transfer=True, session="on", **shape)
        off = run_session(driver, prefills, seed=2, transfer=False, session="off", **shape)
        driver.close()
    finally:
        engines.stop()
        broker.stop()

    print_rows("return path ON (kvloop)", on)
    print_rows("return path OFF (one-way P/D, local prefix caches only)", off)
    ratios = [round(b["ttft_ms"] / a["ttft_ms"], 2) for a, b in zip(on, off, strict=True)]
    late = [r for r, a in zip(ratios, on, strict=True) if a["context_tokens"] >= 8000] or ratios[-1:]
    result.update(on=on, off=off, ttft_ratio_off_over_on_per_turn=ratios,
                  ttft_ratio_off_over_on_late_median=statistics.median(late), workload=shape)
    print(f"\nTTFT off/on per turn: {ratios}; late turns (>= 8k tokens) median {statistics.median(late):.2f}x")
    print("\nidle CPU-seconds per second, per engine (process group + sidecar):")
    for phase, figures in result["idle_cpu"].items():
        print(f"  {phase:<24} " + "  ".join(f"{k} {v:.3f}" for k, v in figures.items())
              + f"  (total {sum(figures.values()):.3f})")
    b, a = result["idle_cpu"]["before_retained"], result["idle_cpu"]["after_retained"]
    result["idle_cpu_total_before_over_after_retained"] = round(sum(b.values()) / max(1e-3, sum(a.values())), 1)
    print(f"  retained blocks, before/after: {result['idle_cpu_total_before_over_after_retained']}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: build the tiny model)")
    parser.add_argument("--work-dir", type=Path, default=None, help="engines' work folder (default .kvloop/...)")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first-tokens", type=int, default=1500)
    parser.add_argument("--new-tokens", type=int, default=1400)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="kvloop bench engines", description=__doc__.split("\n", 1)[0] if __doc__ else "")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
