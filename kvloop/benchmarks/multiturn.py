"""``kvloop bench multiturn``: one multi-turn workload through four configurations, one after another, each with
only its own engines up (so none pays for another's idle processes), on the same engine settings.

- ``one_way``: P/D without a return path; two prefill engines with their local prefix caches, placement
  round-robin over them (the honest baseline).
- ``upstream``: vLLM's own decode-to-prefill mode (``bidirectional_kv_xfer``), driven the way its multi-turn
  example proxy does it, written here from the documented protocol: the decode's returned
  ``kv_transfer_params`` kept per conversation id and used once on its next turn, a fixed TTL, no broker.
  vLLM 0.32 returns those params only on non-streamed replies, so this proxy cannot stream the decode: its
  client's first token arrives with the whole answer, and that is the TTFT recorded.
- ``kvloop``: the broker, the sidecars and the router (the real front door, streamed).
- ``ideal``: one aggregated engine with its local prefix cache; the limit that no transfer can beat.

Sizing (stated in the JSON): each prefill engine's KV space holds at most a quarter of the conversations'
histories (``--num-gpu-blocks-override``), so its local prefix cache churns as in production. The
retention-pressure scenario reruns ``upstream`` and ``kvloop`` with a decode engine that can retain about
half of the working set (kvloop: its retention budget; upstream: the decode's KV space), so eviction decides
what the next turn finds; it is reported separately. TTFT is client-side, to the first streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from kvloop.benchmarks.workload import Conversation, WorkloadSpec, describe, replay, synthetic
from kvloop.cluster import LocalCluster
from kvloop.engine_set import EngineSet, role_cores, start_engines
from kvloop.engines.config import EngineConfig, default_work_dir
from kvloop.engines.model import ensure_tiny_model
from kvloop.shared.http import aiter_sse, metric_by_label, read_metrics

BLOCK = 128
CONFIGS = ("one_way", "upstream", "kvloop", "ideal")
LATE_TOKENS = 8000


@dataclass
class TurnRecord:
    config: str
    conversation: str
    turn: int
    context_tokens: int
    ttft_s: float
    decision: str
    error: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    """kvloop's turns: the router's x-kvloop-* reply headers (matched, pulled, local and computed tokens, pull ms)."""


@dataclass
class Sizing:
    max_model_len: int
    prefill_blocks: int
    decode_blocks: int | None
    retention_fraction: float
    notes: dict[str, Any] = field(default_factory=dict)


def sizing(spec: WorkloadSpec, conversations: list[Conversation], pressure: bool) -> Sizing:
    longest = max(len(c.prefix) + sum(map(len, c.new_tokens)) + c.turns * spec.output_tokens for c in conversations)
    max_len = int(math.ceil((longest + spec.output_tokens + BLOCK) / BLOCK) * BLOCK)
    one = max_len // BLOCK + 2
    total = sum(math.ceil((len(c.prefix) + sum(map(len, c.new_tokens)) + c.turns * spec.output_tokens) / BLOCK)
                for c in conversations)
    prefill = max(one, math.ceil(total / 4))
    decode = None
    fraction = 0.5
    if pressure:
        # The decode engine can retain about half of the working set: blocks for the active requests plus half.
        decode = one * spec.concurrency + math.ceil(total / 2)
        fraction = max(0.05, min(1.0, (total / 2) / decode))
    return Sizing(max_len, prefill, decode, fraction, {
        "history_blocks_total": total, "prefill_blocks_each": prefill,
        "prefill_share_of_histories": round(prefill / max(1, total), 3), "decode_blocks": decode,
        "decode_retention_budget_blocks": int(decode * fraction) if decode else None})


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * 1e3, 1)

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99)}


class Progress:
    def __init__(self, total: int, label: str) -> None:
        self.total, self.done, self.label = total, 0, label

    def step(self) -> None:
        self.done += 1
        width = 30
        filled = int(width * self.done / max(1, self.total))
        sys.stderr.write(f"\r  {self.label:<18} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


# Engines and clients -------------------------------------------------------------------------------------

def _engine_config(model: Path, work: Path, role: str, index: int, *, connector: str, broker: str, size: Sizing,
                   blocks: int | None, extra: dict[str, Any]) -> EngineConfig:
    args = f"--num-gpu-blocks-override {blocks}" if blocks else ""
    cores = role_cores(role)
    return EngineConfig(role=role, model=model, engine_id=f"{role}-{index}", work_dir=work, connector=connector,
                        broker=broker, max_model_len=size.max_model_len, extra_vllm_args=args,
                        retention_fraction=size.retention_fraction, omp_threads_bind=cores,
                        kv_role={"prefill": "kv_producer", "decode": "kv_consumer"}.get(role, "kv_both"),
                        kv_connector_extra_config=json.dumps({"kv_lease_duration": 120, **extra}),
                        log_level="warning")


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
        data: dict[str, Any] = await reply.json(content_type=None)
        if reply.status >= 400:
            raise RuntimeError(f"{url} answered {reply.status}: {str(data)[:200]}")
        return data


async def _stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any], t0: float, timeout_s: float,
                  headers: dict[str, str] | None = None) -> tuple[list[int], float, dict[str, str]]:
    """A streamed completion: its token ids, TTFT (first token since ``t0``) and the reply's headers."""
    ids: list[int] = []
    ttft = 0.0
    async with http.post(url, json={**body, "stream": True, "return_token_ids": True}, headers=headers,
                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
        if reply.status >= 400:
            raise RuntimeError(f"{url} answered {reply.status}: {(await reply.text())[:200]}")
        headers = dict(reply.headers)
        async for chunk in aiter_sse(reply.content):
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"])[:200])
            for choice in chunk.get("choices", []):
                new = list(choice.get("token_ids") or [])
                if new and not ttft:
                    ttft = time.perf_counter() - t0
                ids += new
    return ids, ttft or time.perf_counter() - t0, headers


class Client:
    """One configuration's way of serving a turn: returns (output ids, TTFT, decision)."""

    def __init__(self, http: aiohttp.ClientSession, model: str, timeout_s: float) -> None:
        self.http, self.model, self.timeout_s = http, model, timeout_s
        self.turns = 0
        self.last_detail: dict[str, str] = {}
        """The last turn's extra figures; read right after ``turn`` returns, with no await in between, so
        concurrent conversations sharing this client cannot mix them up."""

    def body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}

    async def turn(self, conv: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float, str]:
        raise NotImplementedError


class OneWayClient(Client):
    def __init__(self, http: aiohttp.ClientSession, model: str, timeout_s: float, prefills: list[str], decode: str
                 ) -> None:
        super().__init__(http, model, timeout_s)
        self.prefills, self.decode = prefills, decode

    async def prefill(self, conv: str, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
        url = self.prefills[self.turns % len(self.prefills)]
        self.turns += 1
        body = {**self.body(prompt, 1), "kv_transfer_params": params}
        return dict((await _post(self.http, f"{url}/v1/completions", body, self.timeout_s)).get(
            "kv_transfer_params") or {})

    async def turn(self, conv: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float, str]:
        t0 = time.perf_counter()
        params = await self.prefill(conv, prompt, {"do_remote_decode": True, "do_remote_prefill": False})
        ids, ttft, _ = await _stream(self.http, f"{self.decode}/v1/completions",
                                     {**self.body(prompt, max_tokens), "kv_transfer_params": params}, t0,
                                     self.timeout_s)
        return ids, ttft, "RECOMPUTE"


class UpstreamClient(OneWayClient):
    """The decode's returned params per conversation id, used once on its next turn (upstream's example proxy)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.retained: dict[str, dict[str, Any]] = {}

    async def turn(self, conv: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float, str]:
        t0 = time.perf_counter()
        params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
        kept = self.retained.pop(conv, None)
        decision = "RECOMPUTE"
        if kept and kept.get("remote_block_ids"):
            params.update({k: kept[k] for k in ("remote_block_ids", "remote_engine_id", "remote_request_id",
                                                 "remote_host", "remote_port", "remote_num_tokens", "tp_size",
                                                 "remote_blocks_expiry_time") if k in kept})
            decision = "TRANSFER"
        p_params = await self.prefill(conv, prompt, params)
        reply = await _post(self.http, f"{self.decode}/v1/completions",
                            {**self.body(prompt, max_tokens), "kv_transfer_params": p_params,
                             "return_token_ids": True}, self.timeout_s)
        ttft = time.perf_counter() - t0  # not streamable: the first token arrives with the whole answer
        if reply.get("kv_transfer_params"):
            self.retained[conv] = reply["kv_transfer_params"]
        return list(reply["choices"][0].get("token_ids") or []), ttft, decision


class RouterClient(Client):
    def __init__(self, http: aiohttp.ClientSession, model: str, timeout_s: float, router: str) -> None:
        super().__init__(http, model, timeout_s)
        self.router = router

    async def turn(self, conv: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float, str]:
        ids, ttft, headers = await _stream(self.http, f"{self.router}/v1/completions", self.body(prompt, max_tokens),
                                           time.perf_counter(), self.timeout_s, headers={"x-session-id": conv})
        self.last_detail = {k.lower().removeprefix("x-kvloop-"): v for k, v in headers.items()
                            if k.lower().startswith("x-kvloop-")}
        return ids, ttft, headers.get("x-kvloop-decision", headers.get("X-Kvloop-Decision", "?"))


class AggregatedClient(Client):
    def __init__(self, http: aiohttp.ClientSession, model: str, timeout_s: float, engine: str) -> None:
        super().__init__(http, model, timeout_s)
        self.engine = engine

    async def turn(self, conv: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float, str]:
        t0 = time.perf_counter()
        ids, ttft, _ = await _stream(self.http, f"{self.engine}/v1/completions", self.body(prompt, max_tokens), t0,
                                     self.timeout_s)
        return ids, ttft, "LOCAL"


async def run_workload(config: str, client: Client, conversations: list[Conversation], spec: WorkloadSpec
                       ) -> list[TurnRecord]:
    records: list[TurnRecord] = []
    progress = Progress(sum(c.turns for c in conversations), config)
    gate = asyncio.Semaphore(spec.concurrency)

    async def one(conv: Conversation) -> None:
        async with gate:
            history = list(conv.prefix)
            for i, new in enumerate(conv.new_tokens):
                prompt = history + new
                try:
                    out, ttft, decision = await client.turn(conv.conversation_id, prompt, spec.output_tokens)
                    records.append(TurnRecord(config, conv.conversation_id, i + 1, len(prompt), ttft, decision,
                                              detail=dict(client.last_detail)))
                    history = prompt + out
                except Exception as exc:
                    records.append(TurnRecord(config, conv.conversation_id, i + 1, len(prompt), 0.0, "ERROR",
                                              str(exc)[:300]))
                    history = prompt
                progress.step()
                if spec.think_time_s:
                    await asyncio.sleep(spec.think_time_s)  # the client's think time, part of the workload

    await asyncio.gather(*(one(c) for c in conversations))
    return records


def source_tokens(urls: list[str]) -> dict[str, float]:
    """Prompt tokens by source (local_compute, local_cache_hit, external_kv_transfer) over the engines."""
    totals: dict[str, float] = {}
    for url in urls:
        for source, value in metric_by_label(read_metrics(url), "vllm:prompt_tokens_by_source_total",
                                             "source").items():
            totals[source] = totals.get(source, 0.0) + value
    return totals


async def run_config(name: str, model: Path, work: Path, spec: WorkloadSpec, conversations: list[Conversation],
                     size: Sizing, timeout_s: float) -> tuple[list[TurnRecord], dict[str, float]]:
    work = work / name
    extra_up = {"bidirectional_kv_xfer": True, "kv_lease_duration": 120}
    cluster: LocalCluster | None = None
    engines = EngineSet()

    def pd(connector: str, broker: str, extra: dict[str, Any]) -> list[EngineConfig]:
        configs = [_engine_config(model, work, "prefill", i, connector=connector, broker=broker, size=size,
                                  blocks=size.prefill_blocks, extra=extra) for i in range(2)]
        return [*configs, _engine_config(model, work, "decode", 2, connector=connector, broker=broker, size=size,
                                         blocks=size.decode_blocks, extra=extra)]

    try:
        if name == "ideal":
            # No KV connector: nothing is transferred, and the engine pays for no NIXL agent.
            engines = await asyncio.to_thread(start_engines, [_engine_config(
                model, work, "both", 0, connector="none", broker="", size=size, blocks=None, extra={})])
        elif name.startswith("kvloop"):
            cluster = await LocalCluster.start(lambda broker: pd("kvloop", broker, {}), work,
                                               separate_broker=True, broker={"engine_ttl_s": 10.0},
                                               router={"request_timeout_s": timeout_s})
            engines = cluster.engines
        else:
            engines = await asyncio.to_thread(start_engines, pd("nixl", "", extra_up if name.startswith("upstream")
                                                                else {}))
        urls = {e.engine_id: e.url for e in engines}
        prefill_urls = [u for k, u in urls.items() if not k.startswith("decode")]
        before = await asyncio.to_thread(source_tokens, prefill_urls)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
            mname = model.name
            client: Client
            if name == "ideal":
                client = AggregatedClient(http, mname, timeout_s, urls["both-0"])
            elif cluster is not None:
                assert cluster.router is not None
                client = RouterClient(http, mname, timeout_s, cluster.router.url)
            else:
                cls = UpstreamClient if name.startswith("upstream") else OneWayClient
                client = cls(http, mname, timeout_s, [urls["prefill-0"], urls["prefill-1"]], urls["decode-2"])
            records = await run_workload(name, client, conversations, spec)
        after = await asyncio.to_thread(source_tokens, prefill_urls)
        return records, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    finally:
        if cluster is not None:
            await cluster.stop()
        else:
            await asyncio.to_thread(engines.stop)


def summarize(records: list[TurnRecord], tokens: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in records if not r.error]
    late = [r for r in ok if r.context_tokens >= LATE_TOKENS]
    if not late:  # a small run never reaches 8k tokens: its second half of turns stands in for "late"
        cut = sorted(r.context_tokens for r in ok)[len(ok) // 2] if ok else 0
        late = [r for r in ok if r.context_tokens >= cut]
    return {"ttft_ms": percentiles([r.ttft_s for r in ok]), "late_ttft_ms": percentiles([r.ttft_s for r in late]),
            "requests": len(records), "errors": len(records) - len(ok),
            "decisions": dict(Counter(r.decision for r in records)),
            "tokens": {"reused": int(tokens.get("local_cache_hit", 0) + tokens.get("external_kv_transfer", 0)),
                       "computed": int(tokens.get("local_compute", 0))},
            "late_turns": len(late), "error_samples": [r.error for r in records if r.error][:3]}


def ratio(a: dict[str, Any], b: dict[str, Any], key: str, q: str) -> float | None:
    x, y = a[key][q], b[key][q]
    return round(x / y, 2) if x and y else None


def plot(records: list[TurnRecord], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for config in sorted({r.config for r in records}):
        by_turn: dict[int, list[float]] = {}
        for r in records:
            if r.config == config and not r.error:
                by_turn.setdefault(r.turn, []).append(r.ttft_s * 1e3)
        turns = sorted(by_turn)
        ax.plot(turns, [statistics.median(by_turn[t]) for t in turns], marker="o", label=config)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT, median over conversations (ms)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def print_table(summary: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'config':<18} {'p50':>8} {'p95':>8} {'p99':>8} | {'late p50':>8} {'late p95':>8} {'late p99':>8} | "
          f"{'req':>4} {'err':>4} {'reused':>8} {'computed':>9}  decisions")
    for name, s in summary.items():
        t, late = s["ttft_ms"], s["late_ttft_ms"]
        print(f"{name:<18} {t['p50']!s:>8} {t['p95']!s:>8} {t['p99']!s:>8} | {late['p50']!s:>8} "
              f"{late['p95']!s:>8} {late['p99']!s:>8} | {s['requests']:>4} {s['errors']:>4} "
              f"{s['tokens']['reused']:>8} {s['tokens']['computed']:>9}  {s['decisions']}")


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = await asyncio.to_thread(ensure_tiny_model, args.model)
    spec = WorkloadSpec(conversations=args.conversations, turns_min=args.turns_min, turns_max=args.turns_max,
                        system_tokens=args.system_tokens, own_prefix_tokens=args.own_prefix_tokens,
                        new_min=args.new_min, new_max=args.new_max, output_tokens=args.output_tokens,
                        think_time_s=args.think_time_s, concurrency=args.concurrency, seed=args.seed)
    if args.replay:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model))
        conversations = replay(args.replay, lambda m: tok.apply_chat_template(m, add_generation_prompt=True),
                               limit=args.conversations)
    else:
        conversations = synthetic(spec)
    work = (args.work_dir or default_work_dir() / "bench-multiturn").absolute()
    runs = [(name, False) for name in args.configs.split(",")]
    if not args.no_pressure:
        runs += [("upstream_pressure", True), ("kvloop_pressure", True)]
    summary: dict[str, Any] = {}
    records: list[TurnRecord] = []
    sizes = {}
    for name, pressure in runs:
        size = sizing(spec, conversations, pressure)
        sizes["pressure" if pressure else "default"] = size.notes
        print(f"== {name}: {'retention pressure, ' if pressure else ''}engines starting", flush=True)
        recs, tokens = await run_config(name, Path(model), work, spec, conversations, size, args.timeout_s)
        records += recs
        summary[name] = summarize(recs, tokens)
    main = {k: v for k, v in summary.items() if not k.endswith("_pressure")}
    print_table(summary)
    ratios: dict[str, float | None] = {}
    if "one_way" in main and "kvloop" in main:
        ratios["one_way_over_kvloop_late_p50"] = ratio(main["one_way"], main["kvloop"], "late_ttft_ms", "p50")
        ratios["one_way_over_kvloop_late_p99"] = ratio(main["one_way"], main["kvloop"], "late_ttft_ms", "p99")
    if "kvloop" in main and "ideal" in main:
        ratios["kvloop_over_ideal_late_p50"] = ratio(main["kvloop"], main["ideal"], "late_ttft_ms", "p50")
    if "upstream" in main and "kvloop" in main:
        ratios["upstream_over_kvloop_late_p50"] = ratio(main["upstream"], main["kvloop"], "late_ttft_ms", "p50")
        ratios["upstream_over_kvloop_late_p99"] = ratio(main["upstream"], main["kvloop"], "late_ttft_ms", "p99")
    if "upstream_pressure" in summary and "kvloop_pressure" in summary:
        up, kv = summary["upstream_pressure"], summary["kvloop_pressure"]
        ratios["pressure_upstream_over_kvloop_late_p50"] = ratio(up, kv, "late_ttft_ms", "p50")
        ratios["pressure_upstream_over_kvloop_late_p99"] = ratio(up, kv, "late_ttft_ms", "p99")
    print("\nratios: " + ", ".join(f"{k} {v}" for k, v in ratios.items()))
    result: dict[str, Any] = {"configs": summary, "ratios": ratios,
              "workload": {**describe(spec, conversations), "replay": str(args.replay) if args.replay else None,
                           "sizing": sizes, "late_turn_tokens": LATE_TOKENS,
                           "ttft": "client-side, to the first streamed token; upstream cannot stream (see docs)"},
              "machine": {"cpus": len(os.sched_getaffinity(0)), "model": str(model)},
              "turns": [vars(r) for r in records]}
    result["_records"] = records
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = WorkloadSpec()
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, from " + ",".join(CONFIGS))
    parser.add_argument("--no-pressure", action="store_true", help="skip the retention-pressure scenario")
    parser.add_argument("--conversations", type=int, default=d.conversations)
    parser.add_argument("--turns-min", type=int, default=d.turns_min)
    parser.add_argument("--turns-max", type=int, default=d.turns_max)
    parser.add_argument("--system-tokens", type=int, default=d.system_tokens)
    parser.add_argument("--own-prefix-tokens", type=int, default=d.own_prefix_tokens)
    parser.add_argument("--new-min", type=int, default=d.new_min)
    parser.add_argument("--new-max", type=int, default=d.new_max)
    parser.add_argument("--output-tokens", type=int, default=d.output_tokens)
    parser.add_argument("--think-time-s", type=float, default=d.think_time_s)
    parser.add_argument("--concurrency", type=int, default=d.concurrency)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--replay", type=Path, default=None, help="JSONL of OpenAI chat conversations to replay")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per request; past it the turn is an error")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON figures here (and a PNG beside it)")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of TTFT against turn (default: beside --out)")


def main(args: argparse.Namespace) -> int:
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        print(f"kvloop bench multiturn: --configs: unknown {unknown}; choose from {list(CONFIGS)}", file=sys.stderr)
        return 2
    try:
        replace(WorkloadSpec(), conversations=args.conversations, turns_min=args.turns_min,
                turns_max=args.turns_max, new_min=args.new_min, new_max=args.new_max,
                output_tokens=args.output_tokens, concurrency=args.concurrency).validate()
    except ValueError as exc:
        print(f"kvloop bench multiturn: {exc}", file=sys.stderr)
        return 2
    result = asyncio.run(bench(args))
    records = result.pop("_records")
    png = Path(args.plot) if args.plot else (Path(args.out).with_suffix(".png") if args.out else None)
    if png is not None and plot(records, png):
        print(f"wrote {png}")
        result["plot"] = str(png)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0
