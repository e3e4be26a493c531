"""``kvloop bench gateway``: the same cluster asked through its router and through Envoy with the router as the
endpoint picker (docs/gateway.md), side by side.

One cluster (``kvloop up --gateway``'s, 1 prefill and 1 decode engine by default) serves both sides, so the engines,
broker and picker are the same; only the front door differs. Two parts:

1. **The demo session, repeated**: ``--reps`` times through each side, alternating which side goes first, each run
   a conversation of its own (its own seed: neither side finds the other's history cached). Per rep the paths must
   be the same turn by turn; per path, TTFT through Envoy against the router (median and p90, n stated).
2. **Streamed answers**: ``--requests`` streamed chat requests (temperature 0) through the router, then the same
   through Envoy: errors on each side, and how many answers are equal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvloop.app.benchmarks.stats import percentile
from kvloop.app.cluster import LocalCluster, pd_configs, picker_settings, start_gateway
from kvloop.app.demo import run_demo
from kvloop.engines.config import default_work_dir
from kvloop.engines.model import ensure_tiny_model
from kvloop.shared.http import sse_data

SIDES = ("router", "envoy")


def compare_paths(runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per path, TTFT of each side (n, median, p90 in ms) and Envoy's median over the router's; the reps whose
    paths differed turn by turn. Pure: ``runs[side][rep]`` is a demo run's rows."""
    by_path: dict[str, dict[str, list[float]]] = {}
    differing = []
    for rep, (a, b) in enumerate(zip(runs["router"], runs["envoy"], strict=True)):
        if [r["decision"] for r in a] != [r["decision"] for r in b]:
            differing.append(rep)
            continue
        for side, rows in (("router", a), ("envoy", b)):
            for row in rows:
                by_path.setdefault(row["decision"], {s: [] for s in SIDES})[side].append(row["ttft_ms"])
    out: dict[str, Any] = {}
    for path, sides in sorted(by_path.items()):
        medians = {s: statistics.median(v) for s, v in sides.items()}
        figures = {s: {"n": len(v), "median_ms": round(medians[s], 1),
                       "p90_ms": percentile(v, 0.90)} for s, v in sides.items()}  # None: too few for a p90
        out[path] = {**figures, "envoy_over_router_median": round(medians["envoy"] / medians["router"], 3)}
    return {"by_path": out, "reps_with_other_paths": differing}


async def streamed_answers(url: str, model: str, prompts: list[str], concurrency: int) -> list[str | None]:
    """Each prompt's streamed answer through ``url`` (None where the request failed)."""
    import aiohttp

    gate = asyncio.Semaphore(concurrency)

    async def one(http: aiohttp.ClientSession, prompt: str) -> str | None:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
                "temperature": 0, "stream": True}
        async with gate, http.post(f"{url}/v1/chat/completions", json=body) as reply:
            if reply.status != 200:
                return None
            parts = []
            async for line in reply.content:
                event = sse_data(line)
                for choice in (event or {}).get("choices", []):
                    parts.append((choice.get("delta") or {}).get("content") or "")
            return "".join(parts)

    async with aiohttp.ClientSession() as http:
        return list(await asyncio.gather(*(one(http, p) for p in prompts)))


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    work = (args.work_dir or default_work_dir() / "bench-gateway").absolute()
    model_dir = await asyncio.to_thread(ensure_tiny_model, args.model)
    router: dict[str, Any] = {"listen": "127.0.0.1:0", "tokenizer": str(model_dir)}
    token = picker_settings(router, work)
    cluster = await LocalCluster.start(
        lambda broker: pd_configs(model_dir, work, broker, prefill=args.prefill, decode=args.decode,
                                  max_model_len=args.max_model_len, log_level="warning"),
        work, router=router)
    try:
        assert cluster.router is not None
        urls = {"router": cluster.router.url, "envoy": (await start_gateway(cluster, token, work)).extra["url"]}
        model = next(iter(sorted(cluster.router.runner.directory.models())), "")
        runs: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in SIDES}
        # One run not counted: the first session of a cold cluster finds even the system prompt uncached.
        with contextlib.redirect_stdout(io.StringIO()):
            await run_demo(urls["router"], model=model, turns=args.turns, seed=1000 * args.seed + 999)
        started = time.monotonic()
        for rep in range(args.reps):
            order = SIDES if rep % 2 == 0 else SIDES[::-1]
            for i, side in enumerate(order):
                seed = 1000 * args.seed + 2 * rep + i  # a conversation of its own (--reps is at most 499)
                with contextlib.redirect_stdout(io.StringIO()):
                    rows = await run_demo(urls[side], model=model, turns=args.turns, seed=seed)
                runs[side].append(rows)
            print(f"rep {rep + 1}/{args.reps}: " + "  ".join(
                f"{s} {[r['decision'][:2] for r in runs[s][-1]]} {[r['ttft_ms'] for r in runs[s][-1]]}"
                for s in SIDES), flush=True)
        paths = compare_paths(runs)
        rng = random.Random(args.seed)
        prompts = [f"Request {i}: " + " ".join(rng.choice(("note", "file", "line", "pass")) for _ in range(40))
                   for i in range(args.requests)]
        answers = {s: await streamed_answers(urls[s], model, prompts, args.concurrency) for s in SIDES}
        equal = sum(1 for a, b in zip(answers["router"], answers["envoy"], strict=True) if a is not None and a == b)
        streamed = {"n": args.requests, "errors": {s: sum(a is None for a in answers[s]) for s in SIDES},
                    "equal_answers": equal, "concurrency": args.concurrency, "order": "router first"}
    finally:
        await cluster.stop()
    return {"cluster": f"{args.prefill} prefill + {args.decode} decode engines (tiny model), one broker, the router "
                       "serving its endpoint picker behind Envoy", "reps": args.reps, "turns": args.turns,
            "demo": paths, "streamed": streamed, "runs": runs, "wall_s": round(time.monotonic() - started, 1)}


def table(result: dict[str, Any]) -> str:
    lines = ["| path | router n | router median ms | envoy n | envoy median ms | envoy / router | p90 router / envoy |",
             "|---|---|---|---|---|---|---|"]
    for path, f in result["demo"]["by_path"].items():
        lines.append(f"| {path} | {f['router']['n']} | {f['router']['median_ms']} | {f['envoy']['n']} | "
                     f"{f['envoy']['median_ms']} | {f['envoy_over_router_median']:.2f}x | "
                     f"{f['router']['p90_ms'] or '-'} / {f['envoy']['p90_ms'] or '-'} |")
    s = result["streamed"]
    lines.append(f"\nstreamed: n = {s['n']}, errors {s['errors']}, equal answers {s['equal_answers']} of {s['n']}; "
                 f"reps with other paths: {result['demo']['reps_with_other_paths']}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--prefill", type=int, default=1, help="prefill engines")
    parser.add_argument("--decode", type=int, default=1, help="decode engines")
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=20, help="demo sessions through each side")
    parser.add_argument("--turns", type=int, default=6, help="turns of each demo session")
    parser.add_argument("--requests", type=int, default=200, help="streamed requests through each side")
    parser.add_argument("--concurrency", type=int, default=4, help="streamed requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")


def main(args: argparse.Namespace) -> int:
    if min(args.prefill, args.decode, args.reps, args.turns, args.requests, args.concurrency) < 1 or args.reps > 499:
        print("kvloop bench gateway: --prefill, --decode, --reps, --turns, --requests, --concurrency: at least 1; "
              "--reps at most 499 (each run's seed is its own)", file=sys.stderr)
        return 2
    result = asyncio.run(bench(args))
    print("\n" + table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0
