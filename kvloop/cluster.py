"""``kvloop up``: the whole kvloop cluster on one machine, and ``kvloop demo``: a scripted agent session through it.

``up`` starts, in order, and waits for each to be healthy: the broker (memory store, in this process; with
``--etcd``, a local etcd from Debian's package and the etcd store), ``--prefill N`` prefill and ``--decode M``
decode engines on ``--model DIR`` (default: the tiny model, built on first use) with their sidecars, and the
router (in this process). It prints the endpoints, runs the demo (unless ``--no-demo``) and serves until
Ctrl-C or SIGTERM (or stops at once with ``--once``), then stops everything in reverse order.

The demo plays an agent loop: a long system prompt, then turns that each add a tool result and a question,
with the assistant's answers kept in the history. Per turn it prints the context length, what the router
decided and why, tokens pulled versus computed on prefill, and TTFT (first streamed token).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvloop import procs
from kvloop.serving import wait_for_stop

DEMO_SYSTEM = ("You are a coding agent. You read files, run tools and keep short notes. " * 60).strip()
TOOLS = ("ls src/", "grep -n retain engines/*.py", "pytest -q tests/unit", "cat broker/core/placement.py",
         "git log --oneline | head", "du -sh .kvloop")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: .kvloop/models/tiny)")
    parser.add_argument("--prefill", type=int, default=2, help="prefill engines")
    parser.add_argument("--decode", type=int, default=1, help="decode engines")
    parser.add_argument("--etcd", action="store_true", help="start a local etcd and use the etcd store")
    parser.add_argument("--router-listen", default="127.0.0.1:8080", help="router HTTP address (port 0 = free)")
    parser.add_argument("--broker-listen", default="127.0.0.1:0", help="broker gRPC address")
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache per engine (CPU build)")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: .kvloop/up")
    parser.add_argument("--demo-turns", type=int, default=6)
    parser.add_argument("--no-demo", action="store_true", help="do not run the demo session")
    parser.add_argument("--once", action="store_true", help="stop after the demo instead of serving")


def demo_add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", default="http://127.0.0.1:8080", help="router base URL")
    parser.add_argument("--model", default="", help="model name (default: the router's first)")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool-time-s", type=float, default=0.5, help="the agent's tool run between turns")


async def run_demo(router_url: str, *, model: str = "", turns: int = 6, max_tokens: int = 24, seed: int = 0,
                   tool_time_s: float = 0.5) -> list[dict[str, Any]]:
    import aiohttp

    rng = random.Random(seed)
    rows = []
    async with aiohttp.ClientSession() as http:
        if not model:
            async with http.get(f"{router_url}/v1/models") as reply:
                model = (await reply.json())["data"][0]["id"]
        messages = [{"role": "system", "content": DEMO_SYSTEM}]
        print(f"\nkvloop demo: an agent session of {turns} turns through {router_url} (model {model})")
        print(f"{'turn':>4} {'context':>8} {'decision':<9} {'reason':<22} {'pulled':>7} {'local':>6} "
              f"{'computed':>8} {'TTFT ms':>8}")
        for turn in range(turns):
            tool = TOOLS[turn % len(TOOLS)]
            output = " ".join(f"{rng.choice(['ok', 'file', 'line', 'pass', 'note'])}{rng.randrange(999)}"
                              for _ in range(120))
            messages.append({"role": "user", "content": f"Tool `{tool}` returned: {output}\nWhat next?"})
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            t0 = time.perf_counter()
            ttft, text = 0.0, []
            async with http.post(f"{router_url}/v1/chat/completions", json=body,
                                 headers={"x-session-id": "demo-agent"}) as reply:
                if reply.status != 200:
                    raise RuntimeError(f"turn {turn + 1}: router answered {reply.status}: {await reply.text()}")
                h = reply.headers
                async for raw in reply.content:
                    line = raw.decode().strip()
                    if line.startswith("data: {"):
                        ttft = ttft or time.perf_counter() - t0
                        for choice in json.loads(line[6:]).get("choices", []):
                            text.append((choice.get("delta") or {}).get("content") or "")
            row = {"turn": turn + 1, "context_tokens": int(h.get("x-kvloop-prompt-tokens", 0)),
                   "decision": h.get("x-kvloop-decision", "?"), "reason": h.get("x-kvloop-reason", ""),
                   "pulled_tokens": int(h.get("x-kvloop-pulled-tokens", 0)),
                   "local_tokens": int(h.get("x-kvloop-local-tokens", 0)),
                   "computed_tokens": int(h.get("x-kvloop-computed-tokens", 0)), "ttft_ms": round(ttft * 1e3, 1)}
            rows.append(row)
            print(f"{row['turn']:>4} {row['context_tokens']:>8} {row['decision']:<9} {row['reason']:<22} "
                  f"{row['pulled_tokens']:>7} {row['local_tokens']:>6} {row['computed_tokens']:>8} "
                  f"{row['ttft_ms']:>8}", flush=True)
            messages.append({"role": "assistant", "content": "".join(text)})
            # The agent runs its next tool before it asks again. (The decode engine's sidecar publishes the
            # turn's KV a few milliseconds after the answer; a turn sent before that would recompute, correctly.)
            await asyncio.sleep(tool_time_s)
    return rows


def demo_main(args: argparse.Namespace) -> int:
    asyncio.run(run_demo(args.router.rstrip("/"), model=args.model, turns=args.turns, max_tokens=args.max_tokens,
                         seed=args.seed, tool_time_s=args.tool_time_s))
    return 0


def _start_engines(model: Path, work: Path, broker: str, args: argparse.Namespace) -> list[Any]:
    from engines.config import EngineConfig, split_cores
    from engines.launcher import plan_engine, spawn_engine

    engines = []
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    cores = dict(zip(("prefill", "decode"), split_cores(2), strict=True))  # prefill and decode on their own cores
    try:
        for i, role in enumerate(roles):
            config = EngineConfig(role=role, model=model, engine_id=f"{role}-{i}", work_dir=work, broker=broker,
                                  max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
                                  kv_role="kv_producer" if role == "prefill" else "kv_consumer", log_level="warning",
                                  omp_threads_bind=cores[role])
            engines.append(spawn_engine(plan_engine(config), die_with_parent=False))
        for engine in engines:
            engine.wait_ready(engine.plan.config.startup_timeout_s)
            print(f"  engine {engine.engine_id:<10} {engine.plan.config.role:<8} {engine.url}  "
                  f"(NIXL {engine.plan.config.resolved_nixl_host()}:{engine.nixl_port}, log {engine.log_path})",
                  flush=True)
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


async def _up(args: argparse.Namespace) -> None:
    from broker.config import BrokerConfig
    from broker.server import SERVICE_NAME, start_broker
    from engines.config import default_work_dir
    from engines.launcher import sidecar_address
    from kvloop.client import wait_serving
    from router.config import RouterConfig
    from router.server import start_router

    work = (args.work_dir or default_work_dir() / "up").absolute()
    model = args.model or default_work_dir() / "models" / "tiny"
    if not (Path(model) / "config.json").exists():
        from engines.model import build_tiny_model

        print(f"kvloop up: building the tiny model in {model} (once; a few minutes) ...", flush=True)
        await asyncio.to_thread(build_tiny_model, Path(model))
    etcd = None
    broker_values: dict[str, Any] = {"listen": args.broker_listen, "metrics_listen": "127.0.0.1:0",
                                     "log_level": "warning", "keepalive_interval_s": 1.0, "engine_ttl_s": 5.0}
    if args.etcd:
        etcd = procs.start_etcd(work / "etcd" / "data", work / "etcd")
        broker_values.update(store="etcd", etcd_endpoint=etcd.extra["endpoint"].removeprefix("http://"))
    broker = await start_broker(BrokerConfig.load(broker_values))
    broker_address = f"127.0.0.1:{broker.port}"
    engines: list[Any] = []
    router = None
    try:
        await wait_serving(broker_address, SERVICE_NAME, timeout_s=30)
        print(f"kvloop up: broker {broker_address} (store {'etcd' if etcd else 'memory'}), metrics "
              f"http://127.0.0.1:{broker.metrics_port}/metrics", flush=True)
        print(f"kvloop up: starting {args.prefill} prefill and {args.decode} decode engines on {model} "
              "(about a minute on 2 cores) ...", flush=True)
        engines = await asyncio.to_thread(_start_engines, Path(model), work, broker_address, args)
        for engine in engines:
            print(f"  sidecar {engine.engine_id:<10} {sidecar_address(engine)}", flush=True)
        router = await start_router(RouterConfig.load({"listen": args.router_listen, "broker": broker_address,
                                                       "refresh_s": 1.0, "log_level": "warning"}))
        while not (router.runner.directory.of_role("prefill") and router.runner.directory.of_role("decode")
                   and len(router.runner.directory.engines) == len(engines)):
            await router.runner.refresh()
            await asyncio.sleep(0.1)
        print(f"kvloop up: router {router.url}  (OpenAI API: {router.url}/v1/chat/completions, metrics "
              f"{router.url}/metrics)", flush=True)
        if not args.no_demo:
            await run_demo(router.url, turns=args.demo_turns)
        if args.once:
            return
        print("\nkvloop up: serving; Ctrl-C to stop.", flush=True)
        await wait_for_stop()
    finally:
        print("kvloop up: stopping router, engines, broker ...", flush=True)
        if router is not None:
            await router.stop()
        threads = [threading.Thread(target=e.stop) for e in engines]
        for t in threads:
            t.start()
        for t in threads:
            await asyncio.to_thread(t.join)
        await broker.stop()
        if etcd is not None:
            etcd.stop()
        print("kvloop up: stopped.", flush=True)


def up_main(args: argparse.Namespace) -> int:
    from kvloop.telemetry import configure_logging

    configure_logging("console" if sys.stderr.isatty() else "json", "warning")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_up(args))
    return 0
