"""``kvloop analyze RECORDS``: read, validate the flags (each error names its field), analyze, print and write."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from kvloop.app.analyze import load, queueing, report
from kvloop.app.analyze.analysis import DEFAULT_TTLS, Options, analyze
from kvloop.app.analyze.retention import LONGEST_TTL_S, UNLIMITED_BUDGET
from kvloop.app.benchmarks.aiperf import Slo
from kvloop.broker.core import POLICIES
from kvloop.shared import mooncake
from kvloop.shared.engine_model import EngineProfile, load_profile
from kvloop.shared.errors import ConfigError

DEFAULT_TOKENIZER = ".kvloop/models/tiny"
GIVEN = {  # flag -> (CostModel field, scale from the flag's unit)
    "prefill_tps": ("prefill_tokens_per_s", 1.0), "decode_tps": ("decode_tokens_per_s", 1.0),
    "hop_ms": ("hop_s", 1e-3), "decode_local_ms": ("decode_local_s", 1e-3),
    "bandwidth": ("bandwidth_bytes_per_s", 1.0), "bytes_per_block": ("bytes_per_block", 1.0),
    "pull_overhead_ms": ("pull_overhead_s", 1e-3)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("records", type=Path, help="JSONL: the router's per-turn records (records_path), "
                        "OpenAI-style conversations, one a line, or a Mooncake-format trace (see docs/analyze.md)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="write analysis.md and the PNGs here (default: RECORDS' folder / STEM-analysis)")
    parser.add_argument("--ttls", default=",".join(f"{t:g}" for t in DEFAULT_TTLS),
                        help="retention TTLs to replay, seconds, comma-separated (default %(default)s)")
    parser.add_argument("--budgets", default="", help="retention budgets to replay, blocks per decode engine, "
                        "comma-separated (default: 1/8, 1/4, 1/2 and all of the unbounded replay's peak)")
    parser.add_argument("--decode-engines", type=int, default=0, help="decode engines in the replay (default: as "
                        "many as the records name, at least 1)")
    parser.add_argument("--prefill-engines", type=int, default=0, help="prefill engines in the replay (default: as "
                        "many as the records name, at least 1)")
    parser.add_argument("--eviction-policy", default="lru", help=f"the broker's policy: {', '.join(POLICIES)}")
    parser.add_argument("--no-decode-local", action="store_true", help="replay with strict P/D (no DECODE_LOCAL)")
    parser.add_argument("--prefill-tps", type=float, default=None, help="prefill tokens/s (default: fitted to the "
                        "records' TTFT, else 5000)")
    parser.add_argument("--decode-tps", type=float, default=None, help="tokens/s of a tail computed on a decode "
                        "engine (default: fitted, else the prefill rate)")
    parser.add_argument("--hop-ms", type=float, default=None, help="fixed cost of a P/D turn (default: fitted, "
                        "else 80)")
    parser.add_argument("--decode-local-ms", type=float, default=None, help="fixed cost of a DECODE_LOCAL turn "
                        "(default: fitted, else 0)")
    parser.add_argument("--bandwidth", type=float, default=None, help="interconnect bytes/s (default: measured "
                        "from the records' pulls, else 1e9)")
    parser.add_argument("--bytes-per-block", type=int, default=None, help="KV bytes per block (default: measured, "
                        "else 262144)")
    parser.add_argument("--pull-overhead-ms", type=float, default=None, help="fixed cost of one pull (default 5)")
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="conversations: the served model's "
                        "directory or hub name, for its tokenizer and chat template (default %(default)s)")
    parser.add_argument("--block-size", type=int, default=16, help="conversations: tokens per KV block "
                        "(default %(default)s)")
    parser.add_argument("--turn-s", type=float, default=2.0, help="conversations without timestamps, and traces: "
                        "assumed seconds per turn (default %(default)s)")
    # A trace is cut and scaled as `kvloop bench load --trace` does, so that both see the same requests: the bench
    # at replay speed v with its --trace-slow S is this with --trace-slow S/v.
    parser.add_argument("--trace-seconds", type=float, default=0.0, help="trace: only its first this many seconds "
                        "(of its own clock; default 0: all of it)")
    parser.add_argument("--trace-length-scale", type=float, default=1.0, help="trace: lengths multiplied by this "
                        "(default %(default)s)")
    parser.add_argument("--trace-block-size", type=int, default=0, help="trace: tokens per hash id after scaling "
                        f"(default 0: {mooncake.MOONCAKE_BLOCK} times --trace-length-scale)")
    parser.add_argument("--trace-slow", type=float, default=1.0, help="trace: its clock slowed this many times "
                        "(default %(default)s)")
    parser.add_argument("--profile", type=Path, default=None, help="trace: also the fleet model's queueing "
                        "prediction of its TTFT, with this engine profile (kvloop bench profile, kvloop plan "
                        "roofline; docs/fleet-model.md)")


def _numbers(text: str, name: str, kind: type) -> tuple[float, ...]:
    try:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{name}: expected comma-separated numbers (got {text!r})", field=name) from None
    return values


def options(args: argparse.Namespace) -> Options:
    ttls = _numbers(args.ttls, "ttls", float)
    if not ttls or not all(0 < t <= LONGEST_TTL_S for t in ttls):
        raise ConfigError(f"ttls: each TTL must be within 0..{LONGEST_TTL_S:g} seconds", field="ttls")
    budgets = tuple(int(b) for b in _numbers(args.budgets, "budgets", int))
    if not all(0 < b <= UNLIMITED_BUDGET for b in budgets):
        raise ConfigError(f"budgets: each budget must be within 1..{UNLIMITED_BUDGET} blocks", field="budgets")
    for name in ("decode_engines", "prefill_engines"):
        if not 0 <= getattr(args, name) <= 10_000:
            raise ConfigError(f"{name}: must be within 0..10000 (0: from the records)", field=name)
    if args.eviction_policy not in POLICIES:
        raise ConfigError(f"eviction_policy: must be one of {', '.join(POLICIES)}", field="eviction_policy")
    given: dict[str, float] = {}
    for flag, (name, scale) in GIVEN.items():
        value = getattr(args, flag)
        if value is None:
            continue
        low = 0.0 if flag in ("hop_ms", "decode_local_ms", "pull_overhead_ms") else 1e-9
        if not (math.isfinite(value) and value >= low):
            raise ConfigError(f"{flag}: must be a finite number {'>= 0' if low == 0 else '> 0'}", field=flag)
        given[name] = value * scale
    if not 0 < args.block_size <= 4096:
        raise ConfigError("block_size: must be within 1..4096 tokens", field="block_size")
    if not (math.isfinite(args.turn_s) and args.turn_s >= 0):
        raise ConfigError("turn_s: must be a finite number >= 0", field="turn_s")
    return Options(ttls=ttls, budgets=budgets, decode_engines=args.decode_engines,
                   prefill_engines=args.prefill_engines, given=given, eviction_policy=args.eviction_policy,
                   decode_local=not args.no_decode_local)


def trace_block_size(args: argparse.Namespace) -> int:
    """The trace's tokens per hash id after scaling, with the trace flags checked (each error names its flag)."""
    for name in ("trace_length_scale", "trace_slow"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name}: must be a finite number > 0", field=name)
    if not (math.isfinite(args.trace_seconds) and args.trace_seconds >= 0):
        raise ConfigError("trace_seconds: must be a finite number >= 0 (0: all of it)", field="trace_seconds")
    size = args.trace_block_size or round(mooncake.MOONCAKE_BLOCK * args.trace_length_scale)
    if not 0 < size <= 4096:
        raise ConfigError(f"trace_block_size: must be within 1..4096 tokens (got {size})", field="trace_block_size")
    return size


def read_profile(path: Path) -> EngineProfile:
    try:
        return load_profile(path)
    except OSError as exc:
        raise ConfigError(f"profile: cannot read {path} ({exc.strerror})", field="profile") from None


def main(args: argparse.Namespace) -> int:
    opts = options(args)
    block_size = trace_block_size(args)
    path: Path = args.records
    lines = load.read_lines(path)
    profile = read_profile(args.profile) if args.profile is not None else None
    queued = ""
    if profile is not None and not load.is_trace(lines):
        raise ConfigError("profile: the queueing prediction replays a trace; records and conversations have none",
                          field="profile")
    if load.is_trace(lines):
        rows = [mooncake.parse_row(raw, f"{path}:{n}") for n, raw in lines]
        rows = mooncake.scaled(rows, length_scale=args.trace_length_scale, time_scale=args.trace_slow,
                               seconds=args.trace_seconds or math.inf)
        records = load.trace_records(rows, block_size, args.turn_s)
        if profile is not None:
            predicted = queueing.predict(rows, block_size, profile, max(1, args.prefill_engines),
                                         max(1, args.decode_engines), Slo())
            queued = queueing.section(predicted, profile, str(args.profile))
    elif load.is_conversations(lines):
        tokenize, count = load.model_tokenizer(args.tokenizer)
        records = load.conversation_records(lines, tokenize, count, args.block_size, args.turn_s, str(path))
    else:
        records = load.records_from(lines, path)
    if not records:
        raise ConfigError(f"records: {path} holds no turns", field="records")
    result = analyze(records, opts)
    out_dir = args.out_dir or path.parent / f"{path.stem}-analysis"
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = report.plot(result, out_dir)
    text = report.markdown(result, path.name, plots) + ("\n" + queued if queued else "")
    (out_dir / "analysis.md").write_text(text)
    print(text)
    print(f"wrote {out_dir / 'analysis.md'} and {len(plots)} plots")
    return 0
