"""``kvloop bench profile``: one vLLM engine measured on this machine, written as an
:class:`~kvloop.shared.engine_model.EngineProfile` (the fleet model's input) with its raw samples beside it.

What it measures, against one engine and nothing else running on it:

1. **Prefill**: single requests of token-id prompts at several lengths (a few repeats, interleaved), ``max_tokens=1``,
   a fresh ``cache_salt`` each (no prefix-cache hit): the latency at the client.
2. **Prefix cache**: one prompt sent twice with the same salt; the second's latency beside the first's (recorded,
   not fitted: the model takes a cached block as free).
3. **Decode**: ``S`` concurrent streams of a context ``C`` (``ignore_eos``): the time per token in the window
   where every stream decodes, one decode step.
4. **Scheduler and pool**: the step budget and seat count the engine was started with, its KV pool from vLLM's
   ``/metrics`` (``vllm:cache_config_info``), the bytes of a block from the model's shape.

The step-time coefficients and the API server's per-request cost are fitted jointly
(:mod:`kvloop.app.benchmarks.profile_fit`). A pull is not measured here (it needs two engines): its figures are
fitted from router records holding measured pulls (``--pull-records``, by default the ones published with
docs/analyze.md), or stated as not measured. The router's per-turn cost is an argument (default 0, said so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvloop.app.benchmarks.clients import post_json
from kvloop.app.benchmarks.profile_fit import (
    MIN_PREFILL_LENGTHS,
    DecodeSample,
    EngineFacts,
    FitError,
    GivenFigures,
    GroupFit,
    PrefillSample,
    ProfileFit,
    PullSample,
    decode_sample,
    figures_table,
    fit_profile,
    fit_pull,
    samples_json,
)
from kvloop.app.benchmarks.stats import markdown_table
from kvloop.engines.config import DTYPES, EngineConfig, default_work_dir, is_cpu_build, role_cores
from kvloop.engines.launcher import EngineProcess
from kvloop.engines.layout import resolved_dtype
from kvloop.router.records import TurnRecord
from kvloop.shared.engine_model import EngineProfile, dump_profile
from kvloop.shared.errors import ConfigError
from kvloop.shared.http import aiter_sse, engine_client_connector, metric_labels, read_metrics
from kvloop.shared.paths import checkout_root
from kvloop.shared.vocabulary import Path as TurnPath
from kvloop.shared.vocabulary import Role

VLLM_CPU_STEP_TOKENS = 2048
VLLM_CPU_MAX_NUM_SEQS = 128
"""vLLM 0.32's defaults for its OpenAI server on the CPU build (``EngineArgs.get_batch_defaults``, one rank): what an
engine started without ``--max-num-batched-tokens`` / ``--max-num-seqs`` schedules with."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PROMPT_IDS = (300, 4000)
"""Token ids prompts are drawn from, as the other benches draw them: inside any vocabulary kvloop runs."""
PREFILL_SHARE = 0.4
"""Of the time budget, what prefill may take before decode starts (after one full pass over the lengths)."""
REQUEST_TIMEOUT_S = 300.0
NO_PULLS = ("derived: not measured: this bench measures no pull (it needs two engines with the kvloop connector) "
            "and was given no router records with pulls; a pull is modelled as free (latency 0, unbounded "
            "bandwidth), which favours the return path")
PUBLISHED_PULLS = Path("docs/bench/analyze/kvloop-0.jsonl")
"""Router records of a ``kvloop bench multiturn`` run on the development machine, published with docs/analyze.md:
the measured NIXL pulls this bench fits the pull figures to unless told otherwise."""


@dataclass(frozen=True, slots=True)
class ProfilePlan:
    """What to measure, and the time it may take (the engine's start excepted)."""

    lengths: tuple[int, ...]
    repeats: int = 3
    streams: tuple[int, ...] = (1, 2, 4, 8)
    contexts: tuple[int, ...] = (128, 2048)
    decode_tokens: int = 64
    prefix_tokens: int = 1024
    budget_s: float = 180.0
    seed: int = 0


@dataclass
class Samples:
    prefill: list[PrefillSample] = field(default_factory=list)
    decode: list[DecodeSample] = field(default_factory=list)
    prefix_cache: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    """Runs measured but not usable (a decode run without a steady window), and why."""
    seconds: float = 0.0


@dataclass
class ProfileRun:
    """One profiling run's evidence: the samples, the fit's errors per group, and what it was given."""

    samples: Samples
    errors: dict[str, GroupFit]
    facts: EngineFacts
    plan: ProfilePlan

    def to_json(self) -> dict[str, Any]:
        return {"samples": samples_json(self.samples.prefill, self.samples.decode,
                                        {"prefix_cache": self.samples.prefix_cache, "skipped": self.samples.skipped,
                                         "seconds": round(self.samples.seconds, 1)}),
                "errors": {g: asdict(e) for g, e in self.errors.items()}, "facts": asdict(self.facts),
                "plan": asdict(self.plan)}


# ---------------------------------------------------------------------------------------------- the engine's facts
def default_lengths(max_model_len: int, cap: int = 8192, first: int = 64) -> tuple[int, ...]:
    """Prompt lengths doubling from ``first``, then the longest the engine takes (under ``cap``, room for the one
    generated token)."""
    top = min(cap, max_model_len - 2)
    out = []
    n = first
    while n < top:
        out.append(n)
        n *= 2
    return (*out, top)


def kv_bytes_per_block(model_dir: Path, dtype: str, block_size: int) -> tuple[int, str]:
    """One block's K and V over every layer, from the model's config.json; and how, for the source."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    try:
        layers, heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{model_dir}/config.json: no attention shape to size a KV block ({exc})",
                          field="model") from None
    kv_dtype = resolved_dtype(model_dir, dtype)
    if kv_dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype {kv_dtype}: its size is not known here", field="dtype")
    size = DTYPE_BYTES[kv_dtype]
    how = (f"2 (K, V) x {layers} layers x {kv_heads} KV heads x {head_dim} x {block_size} tokens x {size} bytes "
           f"({kv_dtype}), from {Path(model_dir).name}/config.json")
    return 2 * layers * kv_heads * head_dim * block_size * size, how


def cache_config(url: str) -> dict[str, str]:
    """The labels of vLLM's ``vllm:cache_config_info`` on the engine's ``/metrics``."""
    labels = metric_labels(read_metrics(url, timeout_s=30.0), "vllm:cache_config_info")
    if labels is None:
        raise RuntimeError(f"{url}/metrics has no vllm:cache_config_info")
    return labels


def read_engine_facts(url: str, *, model_dir: Path, dtype: str, step_tokens: int, max_num_seqs: int,
                      settings_from: str) -> EngineFacts:
    """The scheduler's settings as the caller knows them (``settings_from`` says how), the pool as the engine
    reports it."""
    info = cache_config(url)
    try:
        blocks, block_size = int(float(info["num_gpu_blocks"])), int(float(info["block_size"]))
    except (KeyError, ValueError):
        raise RuntimeError(f"{url}: vllm:cache_config_info lacks num_gpu_blocks or block_size: {info}") from None
    nbytes, how = kv_bytes_per_block(model_dir, dtype, block_size)
    return EngineFacts(
        max_num_batched_tokens=step_tokens, max_num_seqs=max_num_seqs, block_size=block_size, kv_pool_blocks=blocks,
        bytes_per_block=nbytes,
        scheduler_source=f"derived: the engine's settings ({settings_from}): --max-num-batched-tokens {step_tokens}, "
                         f"--max-num-seqs {max_num_seqs}",
        pool_source=f"measured here: vllm:cache_config_info on the engine's /metrics (num_gpu_blocks {blocks}, "
                    f"block_size {block_size}; a kvloop host tier, if any, is part of it); bytes_per_block {how}")


def launch_settings(config: EngineConfig) -> tuple[int, int]:
    """(step budget, seats) an engine started from ``config`` schedules with."""
    args = config.extra_args()
    seqs = next((int(a.split("=", 1)[1]) if "=" in a else int(args[i + 1]) for i, a in enumerate(args)
                 if a.split("=", 1)[0] == "--max-num-seqs"), 0)
    step = config.resolved_step_tokens()
    if not is_cpu_build() and (not step or not seqs):
        raise ConfigError("vLLM's default step budget and seats on this build are not known here: set step_tokens "
                          "and --max-num-seqs", field="step_tokens")
    return step or VLLM_CPU_STEP_TOKENS, seqs or VLLM_CPU_MAX_NUM_SEQS


def facts_of(engine: EngineProcess) -> EngineFacts:
    """An engine started by kvloop's launcher: its settings from its config, its pool from its metrics."""
    config = engine.plan.config
    step, seqs = launch_settings(config)
    return read_engine_facts(engine.url, model_dir=Path(str(config.model)), dtype=config.dtype, step_tokens=step,
                             max_num_seqs=seqs, settings_from=f"kvloop's launcher config of {engine.engine_id}")


# ---------------------------------------------------------------------------------------------- measuring
class _Measurer:
    """Requests to one engine, timed at the client."""

    def __init__(self, http: aiohttp.ClientSession, url: str, model: str, seed: int) -> None:
        self.http, self.url, self.model = http, url.rstrip("/"), model
        self.rng = random.Random(seed)

    def prompt(self, tokens: int) -> list[int]:
        return [self.rng.randrange(*PROMPT_IDS) for _ in range(tokens)]

    def body(self, prompt: list[int], max_tokens: int, salt: str | None = None) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "cache_salt": salt or uuid.uuid4().hex}

    async def max_model_len(self) -> int:
        async with self.http.get(f"{self.url}/v1/models") as reply:
            models = (await reply.json())["data"]
        served = next((m for m in models if m.get("id") == self.model), None)
        if served is None:
            raise ConfigError(f"{self.url} does not serve {self.model!r} (it serves "
                              f"{[m.get('id') for m in models]})", field="served_model")
        return int(served["max_model_len"])

    async def prefill(self, prompt: list[int], salt: str | None = None) -> float:
        """One request alone, one token generated: its latency."""
        t0 = time.perf_counter()
        reply = await post_json(self.http, f"{self.url}/v1/completions", self.body(prompt, 1, salt), REQUEST_TIMEOUT_S)
        seconds = time.perf_counter() - t0
        got = (reply.get("usage") or {}).get("prompt_tokens", len(prompt))
        if got != len(prompt):  # the fit's rows assume the engine computed exactly these tokens
            raise RuntimeError(f"{self.url}: a prompt of {len(prompt)} token ids counted as {got}")
        return seconds

    async def arrivals(self, prompt: list[int], max_tokens: int) -> list[tuple[float, int]]:
        """A streamed completion: (time, tokens received so far) at each chunk."""
        out: list[tuple[float, int]] = []
        body = {**self.body(prompt, max_tokens), "stream": True, "return_token_ids": True}
        async with self.http.post(f"{self.url}/v1/completions", json=body,
                                  timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as reply:
            if reply.status >= 400:
                raise RuntimeError(f"{self.url} answered {reply.status}: {(await reply.text())[:200]}")
            async for event in aiter_sse(reply.content):
                if "error" in event:
                    raise RuntimeError(str(event["error"])[:200])
                got = sum(len(c.get("token_ids") or []) for c in event.get("choices", []))
                if got:
                    out.append((time.perf_counter(), got + (out[-1][1] if out else 0)))
        return out


async def measure_prefill(m: _Measurer, plan: ProfilePlan, deadline: float, out: Samples) -> None:
    """Passes over the lengths, each in a new order (drift spreads over every length); a pass is cut at the
    deadline once the first is whole."""
    for rep in range(plan.repeats):
        order = list(plan.lengths)
        m.rng.shuffle(order)
        for tokens in order:
            if rep > 0 and time.monotonic() > deadline:
                return
            out.prefill.append(PrefillSample(tokens, round(await m.prefill(m.prompt(tokens)), 6)))


async def measure_prefix_cache(m: _Measurer, tokens: int, out: Samples) -> None:
    prompt, salt = m.prompt(tokens), uuid.uuid4().hex
    first = await m.prefill(prompt, salt)
    second = await m.prefill(prompt, salt)
    out.prefix_cache = {"prompt_tokens": tokens, "first_s": round(first, 6), "second_s": round(second, 6),
                        "second_faster": second < first}


async def measure_decode(m: _Measurer, plan: ProfilePlan, deadline: float, out: Samples) -> None:
    """Every (streams, context) run, stream counts outermost, until the deadline once two of each are in."""
    for s in plan.streams:
        for c in plan.contexts:
            if time.monotonic() > deadline and len({d.streams for d in out.decode}) >= 2 \
                    and len({d.prompt_tokens for d in out.decode}) >= 2:
                out.skipped.append(f"decode S={s} C={c}: over the time budget")
                continue
            arrivals = await asyncio.gather(*(m.arrivals(m.prompt(c), plan.decode_tokens) for _ in range(s)))
            sample = decode_sample(c, arrivals)
            if sample is None:
                out.skipped.append(f"decode S={s} C={c}: no window where every stream decoded")
            else:
                out.decode.append(sample)


def check_plan(plan: ProfilePlan, facts: EngineFacts) -> None:
    """Refuse a plan the engine cannot run as the fit assumes (every stream of a run decoding at once)."""
    for name in ("lengths", "streams", "contexts"):
        if not getattr(plan, name) or min(getattr(plan, name)) < 1:
            raise ConfigError(f"{name}: needs positive numbers (got {getattr(plan, name)})", field=name)
    if len(set(plan.lengths)) < MIN_PREFILL_LENGTHS or len(set(plan.streams)) < 2 or len(set(plan.contexts)) < 2:
        raise ConfigError(f"the fit needs {MIN_PREFILL_LENGTHS} or more prompt lengths, 2 or more stream counts and 2 "
                          f"or more contexts (got {plan.lengths}, {plan.streams}, {plan.contexts})", field="lengths")
    if max(plan.streams) > facts.max_num_seqs:
        raise ConfigError(f"streams: {max(plan.streams)} is over the engine's {facts.max_num_seqs} seats",
                          field="streams")
    if plan.repeats < 1 or plan.decode_tokens < 8 or plan.budget_s <= 0:
        raise ConfigError("repeats >= 1, decode_tokens >= 8 and budget_s > 0, please", field="plan")


async def _measure(url: str, model: str, plan: ProfilePlan) -> Samples:
    out, t0 = Samples(), time.monotonic()
    async with aiohttp.ClientSession(connector=engine_client_connector()) as http:
        m = _Measurer(http, url, model, plan.seed)
        longest = await m.max_model_len()
        too_long = [n for n in plan.lengths if n + 1 > longest] + [
            c for c in plan.contexts if c + plan.decode_tokens > longest]
        if too_long:
            raise ConfigError(f"prompts of {too_long} tokens and what they generate exceed the engine's max_model_len "
                              f"{longest}", field="lengths")
        await m.prefill(m.prompt(64))  # warm-up, not recorded: the first request of a run pays for code paths
        await measure_prefill(m, plan, t0 + PREFILL_SHARE * plan.budget_s, out)
        await measure_prefix_cache(m, min(plan.prefix_tokens, longest - 2), out)
        await measure_decode(m, plan, t0 + plan.budget_s, out)
    out.seconds = time.monotonic() - t0
    return out


def measure_engine(url: str, model_name: str, plan: ProfilePlan) -> Samples:
    """The samples of one engine (blocking; not from inside an event loop)."""
    return asyncio.run(_measure(url, model_name, plan))


# ---------------------------------------------------------------------------------------------- given figures
def pull_figures(records: Path | None) -> tuple[float, float, str, GroupFit | None]:
    """(latency s, bytes per s, source, fit) of a pull: fitted to the measured pulls in router records, or, with
    none, free and said to be unmeasured."""
    if records is None or not Path(records).is_file():
        return 0.0, float("inf"), NO_PULLS, None
    samples = []
    for n, line in enumerate(Path(records).read_text().splitlines(), 1):
        if line.strip():
            r = TurnRecord.from_dict(json.loads(line), f"records: {records}:{n}")
            if r.path == TurnPath.TRANSFER and r.pulled_bytes > 0 and r.pull_ms > 0 and not r.error:
                samples.append(PullSample(r.pulled_bytes, r.pull_ms / 1e3))
    latency, rate, fit = fit_pull(samples)
    root = checkout_root()
    shown = Path(os.path.relpath(records, root)) if root and Path(records).resolve().is_relative_to(root) else records
    source = (f"measured here: {len(samples)} NIXL pulls (pull_ms against pulled_bytes) in the router records "
              f"{shown} (kvloop bench multiturn's; docs/analyze.md names the commit and machine of the published "
              f"ones, {PUBLISHED_PULLS}), fitted by non-negative least squares on relative residuals "
              f"(R² {fit.r2}, worst {fit.max_rel_error:.0%})")
    return latency, rate, source, fit


def given_figures(records: Path | None, router_turn_s: float) -> tuple[GivenFigures, GroupFit | None]:
    latency, rate, source, fit = pull_figures(records)
    router = (f"derived: given as {router_turn_s * 1e3:g} ms (--router-turn-ms); this bench does not measure the router"
              if router_turn_s else "derived: not measured by this bench; 0 (the bare engine, no router in front)")
    return GivenFigures(latency, rate, source, router_turn_s, router), fit


# ---------------------------------------------------------------------------------------------- provenance
def machine_description() -> str:
    """CPU model, cores (and those this process may use), and whether it has AVX-512, from /proc/cpuinfo."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.processor())
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{model or 'unknown CPU'}, {os.cpu_count()} cores ({usable} usable), "
            f"AVX-512 {'yes' if 'avx512f' in flags else 'no'}")


def git_commit() -> str:
    root = checkout_root()
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root or Path.cwd(), capture_output=True,
                              text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "an unknown commit"
    return f"commit {done.stdout.strip()}"


def profile_engine(url: str, model_name: str, *, facts: EngineFacts, plan: ProfilePlan, name: str = "",
                   given: GivenFigures | None = None, measured: str = "") -> tuple[EngineProfile, ProfileRun]:
    """Measure the engine at ``url`` and fit its profile: the profile, and the run (samples and fit errors).
    ``FitError`` when the samples cannot determine it."""
    check_plan(plan, facts)
    pull_fit = None
    if given is None:
        given, pull_fit = given_figures(_published_pulls(), 0.0)
    samples = measure_engine(url, model_name, plan)
    measured = measured or f"measured here: profile_engine({url}) at {git_commit()} on {machine_description()}"
    fit = fit_profile(samples.prefill, samples.decode, facts, given, name=name or model_name, measured=measured)
    return fit.profile, ProfileRun(samples, fit.errors | ({"pull": pull_fit} if pull_fit else {}), facts, plan)


def _published_pulls() -> Path | None:
    root = checkout_root()
    return root / PUBLISHED_PULLS if root is not None else None


# ---------------------------------------------------------------------------------------------- the command
def write_run(out: Path, profile: EngineProfile | None, run: ProfileRun) -> Path:
    """The profile at ``out`` (None: the fit was refused) and its evidence beside it (``*.samples.json``); the
    evidence's path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if profile is not None:
        dump_profile(profile, out)
    evidence = out.with_suffix(".samples.json")
    evidence.write_text(json.dumps(run.to_json() | {"profile": out.name if profile else None}, indent=1) + "\n")
    return evidence


def start_profiled_engine(args: argparse.Namespace, model: Path, work: Path) -> EngineProcess:
    from kvloop.app.engine_set import start_engines

    config = EngineConfig(role=Role.BOTH, model=model, engine_id="profile-0", dtype=args.dtype, connector="none",
                          max_model_len=args.max_model_len, work_dir=work, omp_threads_bind=args.cores,
                          step_tokens=args.step_tokens, extra_vllm_args=f"--max-num-seqs {args.max_num_seqs}",
                          log_level="warning")
    print(f"== starting one engine (connector none, {args.dtype}, cores {args.cores})", flush=True)
    return start_engines([config], timeout_s=900).by_id("profile-0")


def plan_of(args: argparse.Namespace, max_model_len: int) -> ProfilePlan:
    lengths = tuple(args.lengths) if args.lengths else default_lengths(max_model_len, args.max_prompt_tokens)
    return ProfilePlan(lengths=lengths, repeats=args.repeats, streams=tuple(args.streams),
                       contexts=tuple(args.contexts), decode_tokens=args.decode_tokens,
                       prefix_tokens=args.prefix_tokens, budget_s=args.budget_s, seed=args.seed)


def run_bench(args: argparse.Namespace, url: str, served: str, facts: EngineFacts, engine_note: str) -> int:
    """Measure, fit, write and print; 1 when the fit is refused (the samples are written all the same)."""
    plan = plan_of(args, asyncio.run(_served_max_model_len(url, served)))
    check_plan(plan, facts)
    given, pull_fit = given_figures(args.pull_records, args.router_turn_ms / 1e3)
    print(f"== measuring {url} ({served}): lengths {list(plan.lengths)} x{plan.repeats}, streams "
          f"{list(plan.streams)}, contexts {list(plan.contexts)}, budget {plan.budget_s:g} s", flush=True)
    samples = measure_engine(url, served, plan)
    command = "kvloop " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    measured = f"measured here: {command} at {git_commit()} on {machine_description()}; {engine_note}"
    out = Path(args.out)
    try:
        fit = fit_profile(samples.prefill, samples.decode, facts, given, name=args.name or served, measured=measured)
    except FitError as exc:
        evidence = write_run(out, None, ProfileRun(samples, {"pull": pull_fit} if pull_fit else {}, facts, plan))
        print(f"kvloop bench profile: cannot fit a profile: {exc} (samples in {evidence})", file=sys.stderr)
        return 1
    errors = fit.errors | ({"pull": pull_fit} if pull_fit else {})
    evidence = write_run(out, fit.profile, ProfileRun(samples, errors, facts, plan))
    print(markdown_table(("figure", "value", "fit error", "n"), figures_table(ProfileFit(fit.profile, errors))))
    print(f"prefix cache: {samples.prefix_cache}")
    print(f"wrote {out} and {evidence} ({samples.seconds:.0f} s of measurement)")
    return 0


async def _served_max_model_len(url: str, served: str) -> int:
    async with aiohttp.ClientSession() as http:
        return await _Measurer(http, url, served, 0).max_model_len()


def main(args: argparse.Namespace) -> int:
    from kvloop.engines.model import ensure_tiny_model

    model = ensure_tiny_model(args.model)
    args.cores = args.cores or role_cores(Role.DECODE)
    args.out = args.out or default_work_dir() / "profiles" / f"{model.name}.json"
    if args.url:
        facts = read_engine_facts(args.url, model_dir=model, dtype=args.dtype, step_tokens=args.step_tokens,
                                  max_num_seqs=args.max_num_seqs, settings_from="as given to kvloop bench profile")
        return run_bench(args, args.url, args.served_model or model.name, facts,
                         f"the engine at {args.url}, {resolved_dtype(model, args.dtype)}")
    work = Path(args.work_dir or default_work_dir() / "bench-profile").absolute()
    engine = start_profiled_engine(args, model, work)
    try:
        note = (f"one engine started by the bench: {model.name}, {resolved_dtype(model, args.dtype)}, connector none, "
                f"cores {args.cores}, max_model_len {args.max_model_len}")
        return run_bench(args, engine.url, model.name, facts_of(engine), note)
    finally:
        engine.stop()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: build the tiny model); "
                                                                 "with --url, the engine's model (its KV shape)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the profile JSON (default .kvloop/profiles/MODEL.json); its samples and fit errors go "
                             "beside it")
    parser.add_argument("--url", default="", help="profile this running engine instead of starting one")
    parser.add_argument("--served-model", default="", help="with --url: the served model name (default: --model's "
                                                           "directory name)")
    parser.add_argument("--name", default="", help="the profile's name (default: the served model name)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="the engine's dtype (auto: the model's, as the load bench runs it)")
    parser.add_argument("--cores", default="", help="the started engine's cores (default: the decode role's share, "
                                                    "one engine of a P/D pair; 'auto': all)")
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--step-tokens", type=int, default=VLLM_CPU_STEP_TOKENS,
                        help="--max-num-batched-tokens the engine runs with (started: passed to it)")
    parser.add_argument("--max-num-seqs", type=int, default=VLLM_CPU_MAX_NUM_SEQS,
                        help="--max-num-seqs the engine runs with (started: passed to it)")
    parser.add_argument("--budget-s", type=float, default=180.0, help="time for the whole measurement")
    parser.add_argument("--lengths", type=_ints, default=None, help="prefill prompt lengths, comma-separated "
                                                                    "(default: 64 doubling to --max-prompt-tokens)")
    parser.add_argument("--max-prompt-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=_ints, default=[1, 2, 4, 8])
    parser.add_argument("--contexts", type=_ints, default=[128, 2048])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--pull-records", type=lambda s: None if s == "none" else Path(s), default=_published_pulls(),
                        help=f"router records whose measured pulls give the pull figures (default {PUBLISHED_PULLS}; "
                             "'none': not measured, a pull modelled as free)")
    parser.add_argument("--router-turn-ms", type=float, default=0.0, help="the router's cost per turn (not measured)")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="kvloop bench profile", description=__doc__.split("\n", 1)[0] if __doc__ else "")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
