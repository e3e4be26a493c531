"""``kvloop plan simulate``: ``kvloop bench load``'s agent run predicted by the fleet model; ``kvloop plan compare``: a
prediction beside a measurement.

``simulate`` takes the load bench's own workload flags (the same names and defaults, read from its parser) and builds
each point's sessions as the load bench asks AIPerf for them (:func:`kvloop.app.benchmarks.load.load_for`,
:mod:`.agent_load`), its fleet as the load bench starts it (``--prefill-engines`` prefill engines sized by its
:func:`~kvloop.app.benchmarks.load.sizing`, one decode engine, one aggregated engine), and writes the load bench's JSON
shape marked ``"predicted": true`` with the profile it used.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvloop.app.benchmarks import load as load_bench
from kvloop.app.benchmarks.aiperf import AgentLoad, Slo
from kvloop.app.benchmarks.load_stats import knee
from kvloop.app.benchmarks.multiturn import BLOCK
from kvloop.app.benchmarks.stats import markdown_table, show
from kvloop.app.fleet.agent_load import agent_conversations
from kvloop.app.fleet.compare import compare_runs, compare_table
from kvloop.app.fleet.sim import Config, FleetSpec, simulate_points, simulate_schedules
from kvloop.app.fleet.trace_load import trace_schedule
from kvloop.shared import mooncake
from kvloop.shared.engine_model import EngineProfile, HostSpec, load_profile, profile_to_dict
from kvloop.shared.errors import ConfigError, ResourceExhausted
from kvloop.shared.mooncake import TraceRow

CONFIGS = tuple(c.value for c in Config)
MIRRORED = ("loads", "ttft_slo_ms", "itl_slo_ms", "turns", "system_tokens", "user_tokens", "answer_tokens",
            "think_ms", "sessions_per_load", "min_requests", "prefill_engines", "seed", "trace", "trace_length_scale",
            "trace_block_size", "trace_slow", "trace_seconds", "trace_concurrency")
"""The load bench's flags ``simulate`` takes as they are: their names, types, defaults and help are the load bench's."""
NOT_MIRRORED = (
    "chat template tokens (role headers, end-of-turn markers) are not in the prompts",
    "an answer's tokens are the next prompt's exactly (the engine re-tokenizes the answer's text)",
    "the warm-up before a configuration's first point (it pays first-use costs the model does not have)",
    "each P/D engine computes at the profiled engine's speed (the load bench's two prefill engines share one core: "
    "modelled as sharing it); the aggregated engine at its own profile's (--aggregated-profile, measured on every "
    "core), or at the one-core profile's without it",
)
"""What the prediction leaves out. Modelled since b78629f: the points follow one another on the same engines, and
with ``--host-cores`` the CPU that AIPerf, the router, the API servers, the sidecars and the broker take from the
engines' cores."""


def load_bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    load_bench.add_arguments(parser)
    return parser


def mirror_load_flags(parser: argparse.ArgumentParser, dests: Iterable[str]) -> None:
    """Adds the load bench's flags for ``dests`` to ``parser``: one definition, so one default, for both commands."""
    wanted = set(dests)
    for action in load_bench_parser()._actions:
        if action.dest in wanted:
            # No type is argparse's str: the text as given.
            parser.add_argument(*action.option_strings, type=action.type or str, default=action.default,
                                help=action.help)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", type=Path, required=True, help="the engine profile (kvloop bench profile's JSON)")
    parser.add_argument("--aggregated-profile", type=Path, default=None,
                        help="the aggregated engine's own profile (kvloop bench profile --cores on the cores the load "
                             "bench gives it, every core); default: --profile's")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, from " + ",".join(CONFIGS))
    mirror_load_flags(parser, MIRRORED)
    parser.add_argument("--decode-engines", type=int, default=FleetSpec().decode_engines,
                        help="decode engines of each P/D configuration (the load bench starts one)")
    host = HostSpec()
    parser.add_argument("--host-cores", type=int, default=host.cores,
                        help="CPU engines: the cores they share with the client, router and the rest (0: engines on "
                             "hardware of their own, as GPUs)")
    parser.add_argument("--host-client-cores", type=float, default=host.client_cores,
                        help="the load generator's constant share of the host, in cores (AIPerf polls)")
    parser.add_argument("--host-engine-process-cores", type=float, default=host.engine_process_cores,
                        help="each engine's API server and EngineCore beside its worker, in cores (constant)")
    parser.add_argument("--host-turn-cpu-s", type=float, default=host.turn_cpu_s,
                        help="CPU seconds of the router, sidecars and broker per routed turn")
    parser.add_argument("--host-source", default="",
                        help="where the --host-* figures came from (required with --host-cores; begins 'measured "
                             "here:' or 'public:')")
    parser.add_argument("--out", type=Path, default=None, help="write the prediction here (JSON)")


def validate_simulate(args: argparse.Namespace) -> str:
    """The first bad argument, named, by the load bench's own rules where the flag is its; "" when all are good."""
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or not names:
        return f"--configs: unknown {unknown}; choose from {list(CONFIGS)}"
    # The load bench's validate reads flags simulate does not take: they keep the load bench's defaults.
    as_load_bench = {**vars(load_bench_parser().parse_args([])), **vars(args), "configs": load_bench.BASELINE}
    if problem := load_bench.validate(argparse.Namespace(**as_load_bench)):
        return problem
    if args.decode_engines < 1:
        return "--decode-engines: at least 1"
    try:
        host_spec(args)
    except ConfigError as exc:
        return f"--host-{(exc.field or 'cores').replace('_', '-')}: {exc}"
    if args.host_cores and not args.host_source.startswith(("measured here:", "public:")):
        return "--host-source: say where the --host-* figures came from ('measured here: ...' or 'public: ...')"
    return ""


def host_spec(args: argparse.Namespace) -> HostSpec:
    return HostSpec(cores=args.host_cores, client_cores=args.host_client_cores,
                    engine_process_cores=args.host_engine_process_cores, turn_cpu_s=args.host_turn_cpu_s,
                    source=args.host_source)


def agent_load(args: argparse.Namespace, value: float) -> AgentLoad:
    load = load_bench.load_for(args, value, None)
    assert isinstance(load, AgentLoad)
    return load


def trace_rows(args: argparse.Namespace, value: float) -> list[TraceRow]:
    """The trace's requests at replay speed ``value``, cut and scaled as the load bench hands them to AIPerf."""
    rows = mooncake.parse_lines(Path(args.trace).read_text().splitlines(), str(args.trace))
    return mooncake.scaled(rows, length_scale=args.trace_length_scale, time_scale=args.trace_slow / value,
                           seconds=args.trace_seconds)


def fleet_for(args: argparse.Namespace, loads: list[float], profile: EngineProfile) -> tuple[FleetSpec, dict[str, Any]]:
    """The load bench's fleet: its prefill engines hold its highest concurrency's longest prompts (its ``sizing``,
    counted in its 128-token blocks, here in the profile's), the decode and aggregated engines the profile's pool."""
    highest = max(loads)
    if args.trace:
        rows = trace_rows(args, highest)
        size = load_bench.sizing(max(r.input_length + r.output_length for r in rows), args.trace_concurrency)
    else:
        size = load_bench.sizing(agent_load(args, highest).history_tokens(), int(highest))
    prefill_blocks = math.ceil(size.prefill_blocks * BLOCK / profile.block_size)
    fleet = FleetSpec(prefill_engines=args.prefill_engines, decode_engines=args.decode_engines,
                      prefill_pool_blocks=prefill_blocks, host=host_spec(args))
    return fleet, {**size.notes, "prefill_pool_blocks": prefill_blocks, "block_size": profile.block_size}


def simulate_config(name: str, args: argparse.Namespace, loads: list[float], fleet: FleetSpec,
                    profile: EngineProfile, slo: Slo) -> dict[str, Any]:
    """One configuration over the load points, one after another on the same fleet as the load bench runs them,
    with the load bench's knees."""
    if args.trace:
        schedules = [trace_schedule(trace_rows(args, value), args.trace_block_size, profile.block_size,
                                    salt=f"point-{i}/") for i, value in enumerate(loads)]
        points = simulate_schedules(name, schedules, args.trace_concurrency, fleet, profile, slo)
    else:
        sweep = [(agent_conversations(agent_load(args, value)), int(value)) for value in loads]
        points = simulate_points(name, sweep, fleet, profile, slo)
    for value, point in zip(loads, points, strict=True):
        point.update(load=value)
        if not args.trace:
            point["sessions"] = agent_load(args, value).sessions
        print(f"   {name} @ {value:g}: {point['requests']} requests, predicted goodput {point['goodput_rps']:.2f}/s, "
              f"{point['slo_attainment']:.0%} in SLO, TTFT p50 {show(point['ttft_ms'], 'p50')} ms", flush=True)
    by_load = {p["load"]: p for p in points}
    return {"points": points, "knee_90": knee(by_load, 0.90), "knee_99": knee(by_load, 0.99)}


def workload_record(args: argparse.Namespace, loads: list[float]) -> dict[str, Any]:
    """The load bench's ``workload`` object for the same flags, and what the prediction does not mirror."""
    if args.trace:
        return {"kind": "trace", "file": str(args.trace), "length_scale": args.trace_length_scale,
                "slowed": args.trace_slow, "seconds": args.trace_seconds, "block_size": args.trace_block_size,
                "load_axis": "replay speed", "not_mirrored": list(NOT_MIRRORED)}
    return {"kind": "agent", **asdict(agent_load(args, loads[0])), "sessions_per_load": args.sessions_per_load,
            "load_axis": "concurrent sessions",
            "sessions_by_load": {f"{v:g}": agent_load(args, v).sessions for v in loads},
            "not_mirrored": list(NOT_MIRRORED)}


def run_simulation(args: argparse.Namespace, profile: EngineProfile,
                   aggregated: EngineProfile | None = None) -> dict[str, Any]:
    """Every configuration at every load point: ``kvloop bench load``'s JSON, predicted. ``aggregated``: the aggregated
    engine's own profile (default: ``profile``)."""
    slo = Slo(ttft_ms=args.ttft_slo_ms, itl_ms=args.itl_slo_ms)
    loads = load_bench.loads_of(args)
    fleet, sizing = fleet_for(args, loads, profile)
    configs = {name: simulate_config(name, args, loads, fleet,
                                     aggregated if name == "aggregated" and aggregated else profile, slo)
               for name in [n for n in args.configs.split(",") if n]}
    extra = ({"aggregated_profile": {"file": str(args.aggregated_profile), **profile_to_dict(aggregated)}}
             if aggregated else {})
    return {"predicted": True, "profile": {"file": str(args.profile), **profile_to_dict(profile)}, **extra,
            "configs": configs, "markdown": predicted_table(configs), "workload": workload_record(args, loads),
            "slo": asdict(slo), "loads": loads, "sizing": sizing,
            "fleet": {"prefill_engines": fleet.prefill_engines, "decode_engines": fleet.decode_engines,
                      "aggregated_engines": fleet.aggregated_engines, "decode_step_tokens": fleet.decode_step_tokens,
                      "prefill_pool_blocks": fleet.prefill_pool_blocks, "host": asdict(fleet.host)}}


def predicted_table(configs: dict[str, Any]) -> str:
    """The load bench's table's columns that a model has (no cores, CPU seconds or stalls), and what only it counts."""
    rows = []
    for name, config in configs.items():
        for p in config["points"]:
            moved = p["bytes_moved"]["transfer"] + p["bytes_moved"]["hop"]
            rows.append([name, f"{p['load']:g}", p["requests"], f"{p['goodput_rps']:.2f}", f"{p['slo_attainment']:.0%}",
                         show(p["ttft_ms"], "p50"), show(p["ttft_ms"], "p90"), show(p["ttft_ms"], "p99"),
                         show(p["itl_ms"], "p50"), show(p["itl_ms"], "p99"), f"{p['throughput_rps']:.2f}",
                         ",".join(f"{k}:{v}" for k, v in sorted(p["paths"].items())) or "-",
                         p["blocks_retained"]["peak"], f"{moved / 1e6:.1f}"])
    return markdown_table(["config", "load", "n", "goodput/s", "in SLO", "TTFT p50", "TTFT p90", "TTFT p99",
                           "ITL p50", "ITL p99", "req/s", "paths", "retained blocks peak", "MB moved"], rows)


def read_profile(path: Path, flag: str = "--profile") -> tuple[EngineProfile | None, str]:
    """The profile, or the reason it cannot be read, naming the flag."""
    try:
        return load_profile(path), ""
    except OSError as exc:
        return None, f"{flag}: cannot read {path} ({exc.strerror})"
    except ConfigError as exc:
        return None, f"{flag}: {exc}"


def simulate_main(args: argparse.Namespace) -> int:
    problem = validate_simulate(args)
    profile, unreadable = (None, "") if problem else read_profile(args.profile)
    aggregated = None
    if profile is not None and args.aggregated_profile is not None:
        aggregated, unreadable = read_profile(args.aggregated_profile, "--aggregated-profile")
        if aggregated is not None and aggregated.block_size != profile.block_size:
            unreadable = (f"--aggregated-profile: block size {aggregated.block_size}, the profile's is "
                          f"{profile.block_size}")
    if problem or profile is None or unreadable:
        print(f"kvloop plan simulate: {problem or unreadable}", file=sys.stderr)
        return 2
    print(f"kvloop plan simulate: predicted with profile {profile.name!r} ({args.profile})", flush=True)
    try:
        result = run_simulation(args, profile, aggregated)
    except ResourceExhausted as exc:
        print(f"kvloop plan simulate: the modelled fleet cannot serve the workload: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:  # a trace line that is not a request
        print(f"kvloop plan simulate: --trace: {exc}", file=sys.stderr)
        return 2
    print("\n" + result["markdown"])
    write_json(result, args.out)
    return 0


def write_json(result: dict[str, Any], out: Path | None) -> None:
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--predicted", type=Path, required=True, help="kvloop plan simulate's JSON")
    parser.add_argument("--measured", type=Path, required=True, help="kvloop bench load's JSON")
    parser.add_argument("--out", type=Path, default=None, help="write the comparison here (JSON)")


def read_run(path: Path, flag: str, predicted: bool) -> tuple[dict[str, Any] | None, str]:
    """A run's JSON, or why it is not the kind ``flag`` takes."""
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        return None, f"{flag}: cannot read {path} ({exc.strerror})"
    except ValueError:
        return None, f"{flag}: {path} is not JSON"
    if not isinstance(raw, dict) or not isinstance(raw.get("configs"), dict):
        return None, f"{flag}: {path} has no 'configs' object (not a kvloop bench load or plan simulate JSON)"
    if bool(raw.get("predicted")) is not predicted:
        return None, f"{flag}: {path} is {'a measurement' if predicted else 'a prediction'}"
    return raw, ""


def compare_main(args: argparse.Namespace) -> int:
    predicted, problem = read_run(args.predicted, "--predicted", predicted=True)
    measured, problem_m = read_run(args.measured, "--measured", predicted=False)
    if predicted is None or measured is None:
        print(f"kvloop plan compare: {problem or problem_m}", file=sys.stderr)
        return 2
    result = compare_runs(predicted, measured)
    if not result["rows"]:
        print("kvloop plan compare: --predicted, --measured: no configuration and load point in both",
              file=sys.stderr)
        return 2
    for mismatch in result["mismatches"]:
        print(f"kvloop plan compare: not the same run: {mismatch}", file=sys.stderr)
    result["markdown"] = compare_table(result)
    print(result["markdown"])
    write_json(result, args.out)
    return 0
