"""The ``kvloop`` command: ``broker serve|status``, ``up``, ``demo``, ``analyze``, ``router``,
``model tiny|fingerprint``, ``engine``, ``sidecar``, ``gateway config``,
``bench broker|broker-scale|engines|multiturn|load|gateway|stripped|chaos|profile``,
``plan simulate|compare|roofline``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from kvloop.shared.config import join_dashed_values
from kvloop.shared.errors import ConfigError
from kvloop.shared.serving import run_service


def _broker_serve(args: argparse.Namespace) -> int:
    from kvloop.broker.config import BrokerConfig
    from kvloop.broker.server import serve

    config = BrokerConfig.load(args)
    config.require_auth()
    return run_service("kvloop-broker", config, serve, console_spans=config.console_spans)


def format_status(reply: Any) -> str:
    """Human-readable ``Inspect`` reply."""
    from kvloop.v1 import broker_pb2 as pb

    now = reply.now_unix
    lines = [f"broker replica {reply.replica_id}  store={reply.store}  leader={'yes' if reply.leader else 'no'}"]
    lines.append(f"engines: {len(reply.engines)}")
    for e in reply.engines:
        role = pb.EngineRole.Name(e.engine.role).removeprefix("ENGINE_ROLE_").lower()
        lines.append(
            f"  {e.engine.engine_id:<16} {role:<8} retained {e.retained_blocks}/{e.engine.retention_budget_blocks}"
            f" blocks  leases {e.leases}  block_size {e.engine.block_size}  load r{e.load.running_requests}"
            f"/w{e.load.waiting_requests} kv {e.load.kv_usage:.0%}  seen {now - e.last_seen_unix:.1f}s ago"
            f"  eviction_seq {e.last_eviction_seq}  cached {e.cached_blocks} blocks (resets {e.cache_resets})")
    lines.append(f"leases: {len(reply.leases)}")
    for lease in reply.leases:
        pending = pb.EvictionReason.Name(lease.pending_eviction).removeprefix("EVICTION_REASON_").lower()
        lines.append(
            f"  {lease.lease_id[:12]}  engine {lease.engine_id:<12} session {lease.session_id or '-':<12}"
            f" blocks {len(lease.block_ids):>4}  tokens {lease.num_tokens:>6}"
            f"  expires in {lease.expires_at_unix - now:7.1f}s  pins {lease.pins}"
            + (f"  pending {pending}" if lease.pending_eviction else ""))
    lines.append(f"pins: {len(reply.pins)}")
    for pin in reply.pins:
        lines.append(f"  {pin.pin_id[:12]}  lease {pin.lease_id[:12]}  reader {pin.reader_engine_id}"
                     f"  blocks {pin.num_blocks}  expires in {pin.expires_at_unix - now:.1f}s")
    return "\n".join(lines)


async def _inspect(addresses: str, timeout_s: float, tls: Any = None, token: str | None = None) -> Any:
    from kvloop.shared.client import BrokerClient
    from kvloop.v1 import broker_pb2 as pb

    async with BrokerClient(addresses, timeout_s=timeout_s, tls=tls, token=token) as client:
        # A follower answers Inspect with its own empty view: ask until the leader answers.
        return await client.call("Inspect", pb.InspectRequest(), from_leader=True)


def _broker_status(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    from kvloop.shared.auth import read_token
    from kvloop.shared.tls import TlsFiles, check_files

    check_files(args, "tls_", server=False)
    tls = TlsFiles.of(args, "tls_")
    token = read_token(args.token_file) if args.token_file else None
    try:
        reply = asyncio.run(_inspect(args.broker, args.timeout, tls, token))
    except grpc.aio.AioRpcError as exc:
        print(f"kvloop: broker {args.broker}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json_format.MessageToJson(reply, preserving_proto_field_name=True))
    else:
        print(format_status(reply))
    return 0


def _auth_secret(args: argparse.Namespace) -> int:
    from kvloop.shared.auth import new_secret, write_private

    print(write_private(args.out, new_secret()))
    return 0


def _auth_token(args: argparse.Namespace) -> int:
    import time

    from kvloop.shared.auth import mint, read_secrets, write_private

    token = mint(read_secrets(args.secret_file)[0], args.role, args.subject, time.time(), args.ttl_s)
    print(write_private(args.out, token))
    return 0


def _auth_init(args: argparse.Namespace) -> int:
    """Keeps an existing secret (a restarted init container must not lock the running callers out); mints every
    token again with it."""
    import time

    from kvloop.shared.auth import mint, new_secret, read_secrets, write_private

    secret = args.dir / "broker" / "secret"
    if not secret.is_file():
        write_private(secret, new_secret())
    key = read_secrets(secret)[0]
    names = [(role, name) for role, given in (("engine", args.engine), ("router", args.router),
                                              ("operator", args.operator)) for name in given]
    if len({name for _, name in names} | {"broker"}) != len(names) + 1:
        raise ConfigError("names: every caller needs its own name, and none may be 'broker'", field="names")
    written = [secret]
    for role, name in names:
        written.append(write_private(args.dir / name / "token", mint(key, role, name, time.time())))
    if args.owner:
        uid, _, gid = args.owner.partition(":")
        for path in written:
            for node in (path, path.parent):
                os.chown(node, int(uid), int(gid or uid))
    print(f"{secret} and {len(names)} tokens under {args.dir}")
    return 0


def _up(args: argparse.Namespace) -> int:
    from kvloop.app.cluster import up_main

    return up_main(args)


def _demo(args: argparse.Namespace) -> int:
    from kvloop.app.demo import demo_main

    return demo_main(args)


def _bench_broker(args: argparse.Namespace) -> int:
    from kvloop.app.benchmarks.broker_bench import main as bench_main

    return bench_main(args)


def _analyze(args: argparse.Namespace) -> int:
    from kvloop.app.analyze.main import main as analyze_main

    return analyze_main(args)


def _bench_broker_scale(args: argparse.Namespace) -> int:
    from kvloop.app.benchmarks.broker_scale import main as bench_main

    return bench_main(args)


def _router(args: argparse.Namespace) -> int:
    from kvloop.router.config import RouterConfig
    from kvloop.router.server import serve

    config = RouterConfig.load(args)
    return run_service("kvloop-router", config, serve, console_spans=config.console_spans)


def _sidecar(args: argparse.Namespace) -> int:
    from kvloop.engines.sidecar import SidecarConfig, serve

    config = SidecarConfig.load(args)
    return run_service("kvloop-sidecar", config, serve)


def _model_fingerprint(args: argparse.Namespace) -> int:
    """The layout fingerprint an engine of this model, dtype and block size registers with (what a sidecar in its
    own container needs as ``layout_fingerprint``); ``--out`` writes it as a sidecar ``--config`` YAML file."""
    from kvloop.engines.config import DTYPES, EngineConfig
    from kvloop.engines.layout import engine_fingerprint

    if not (args.model / "config.json").is_file():
        raise ConfigError(f"model: {args.model} has no config.json", field="model")
    if args.block_size is not None and (args.block_size <= 0 or args.block_size % 16):
        raise ConfigError(f"block_size: must be a positive multiple of 16 (got {args.block_size})", field="block_size")
    if args.dtype not in DTYPES:
        raise ConfigError(f"dtype: must be one of {list(DTYPES)} (got {args.dtype!r})", field="dtype")
    # The launcher's rule for the block size in the fingerprint: the configured one, else the platform's, else 16.
    block_size = args.block_size or EngineConfig().resolved_block_size() or 16
    fingerprint = engine_fingerprint(args.model, dtype=args.dtype, block_size=block_size)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # Quoted: never a YAML number. The served name is the engine's default, the model directory's name.
        served = args.served_model_name or args.model.resolve().name
        args.out.write_text(f"layout_fingerprint: \"{fingerprint}\"\nserved_model: {json.dumps(served)}\n")
    print(fingerprint)
    return 0


def _bench_engines(args: argparse.Namespace) -> int:
    from kvloop.app.benchmarks.engine_bench import main as bench_main

    return bench_main(args)


def _bench_multiturn(args: argparse.Namespace) -> int:
    from kvloop.app.benchmarks.multiturn import main as bench_main

    return bench_main(args)


def _bench_load(args: argparse.Namespace) -> int:
    from kvloop.app.benchmarks.load import main as bench_main

    return bench_main(args)


def _bench_gateway(args: argparse.Namespace) -> int:
    from kvloop.app.benchmarks.gateway_bench import main as bench_main

    return bench_main(args)


def _bench_stripped(args: argparse.Namespace) -> int:
    from kvloop.app.benchmarks.stripped_bench import main as bench_main

    return bench_main(args)


def _bench_chaos(args: argparse.Namespace) -> int:
    from kvloop.app.benchmarks.chaos import main as bench_main

    return bench_main(args)


def _bench_profile(args: argparse.Namespace) -> int:
    from kvloop.app.benchmarks.profile import main as bench_main

    return bench_main(args)


def _plan_simulate(args: argparse.Namespace) -> int:
    from kvloop.app.fleet.cli import simulate_main

    return simulate_main(args)


def _plan_roofline(args: argparse.Namespace) -> int:
    from kvloop.app.fleet.roofline_cli import roofline_main

    return roofline_main(args)


def _plan_compare(args: argparse.Namespace) -> int:
    from kvloop.app.fleet.cli import compare_main

    return compare_main(args)


def build_parser() -> argparse.ArgumentParser:
    from kvloop.broker.config import BrokerConfig
    from kvloop.engines.config import EngineConfig
    from kvloop.shared.auth import ROLES as CALLER_ROLES

    parser = argparse.ArgumentParser(prog="kvloop", description="Close the KV-cache loop in P/D vLLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    broker = sub.add_parser("broker", help="the KV-cache broker").add_subparsers(dest="broker_command",
                                                                                 required=True)
    serve = broker.add_parser("serve", help="run a broker replica")
    BrokerConfig.add_arguments(serve)
    serve.set_defaults(func=_broker_serve)
    status = broker.add_parser("status", help="engines, leases, retained blocks and pins of a broker")
    status.add_argument("--broker", default=BrokerConfig.listen, help="broker address(es), comma-separated")
    status.add_argument("--json", action="store_true", help="print the Inspect reply as JSON")
    status.add_argument("--timeout", type=float, default=5.0, help="RPC deadline in seconds")
    status.add_argument("--tls-ca", default=None, help="PEM CA of the broker's certificate: TLS to the broker")
    status.add_argument("--tls-cert", default=None, help="PEM certificate to present (a broker with mutual TLS)")
    status.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    status.add_argument("--tls-server-name", default="", help="name the broker's certificate must carry")
    status.add_argument("--token-file", type=Path, default=os.environ.get("KVLOOP_TOKEN_FILE") or None,
                        help="file holding an operator's bearer token (env KVLOOP_TOKEN_FILE; `kvloop up` writes "
                             "one to WORK/auth/operator-operator.token)")
    status.set_defaults(func=_broker_status)

    auth = sub.add_parser("auth", help="cluster secrets and callers' tokens (kvloop.shared.auth)").add_subparsers(
        dest="auth_command", required=True)
    secret = auth.add_parser("secret", help="write a new cluster secret to a file (mode 0600)")
    secret.add_argument("--out", type=Path, required=True, help="the secret file (the broker's auth_secret_file)")
    secret.set_defaults(func=_auth_secret)
    token = auth.add_parser("token", help="mint a caller's token with the cluster secret, into a file (mode 0600)")
    token.add_argument("--secret-file", type=Path, required=True, help="the cluster secret (its first line signs)")
    token.add_argument("--role", required=True, choices=CALLER_ROLES)
    token.add_argument("--subject", required=True, help="the engine id for an engine; a name for the others")
    token.add_argument("--ttl-s", type=float, default=0.0, help="seconds the token is valid (0 = until the secret "
                                                                  "is rotated)")
    token.add_argument("--out", type=Path, required=True, help="the token file (a *_token_file setting)")
    token.set_defaults(func=_auth_token)
    init = auth.add_parser("init", help="a cluster's secret and every caller's token, one folder per caller "
                                        "(DIR/broker/secret, DIR/NAME/token): what the compose cluster and the "
                                        "Kubernetes Secrets are made from")
    init.add_argument("--dir", type=Path, required=True)
    init.add_argument("--engine", action="append", default=[], help="an engine id (repeat)")
    init.add_argument("--router", action="append", default=[], help="a router's name (repeat)")
    init.add_argument("--operator", action="append", default=[], help="an operator's name (repeat)")
    init.add_argument("--owner", default="", help="UID:GID to hand every file to (an init container run as root "
                                                  "for the services' user)")
    init.set_defaults(func=_auth_init)

    from kvloop.app.cluster import add_arguments as add_up_arguments
    from kvloop.app.demo import add_arguments as demo_add_arguments

    up = sub.add_parser("up", help="the local cluster: broker, 2 prefill + 1 decode engines with sidecars, router; "
                                   "then a demo session")
    add_up_arguments(up)
    up.set_defaults(func=_up)
    demo = sub.add_parser("demo", help="a scripted agent session through a running router, turn by turn")
    demo_add_arguments(demo)
    demo.set_defaults(func=_demo)

    gateway = sub.add_parser("gateway", help="Envoy in front of the endpoint picker (docs/gateway.md)").add_subparsers(
        dest="gateway_command", required=True)
    from kvloop.app.gateway import add_config_arguments as add_gateway_config_arguments
    add_gateway_config_arguments(gateway.add_parser("config", help="write Envoy's bootstrap for a picker (and the "
                                                                     "ext_proc token, when there is none yet)"))

    model = sub.add_parser("model", help="local models").add_subparsers(dest="model_command", required=True)
    tiny = model.add_parser("tiny", help="build (and briefly train) a tiny causal LM with a tokenizer, no downloads")
    from kvloop.engines.model import add_arguments as add_model_arguments
    from kvloop.engines.model import main as model_main

    add_model_arguments(tiny)
    tiny.set_defaults(func=model_main)
    fingerprint = model.add_parser("fingerprint", help="print the layout fingerprint of an engine serving this "
                                                       "model (for a sidecar in its own container)")
    fingerprint.add_argument("--model", type=Path, required=True, help="the model directory the engine serves")
    fingerprint.add_argument("--dtype", default=EngineConfig.dtype, help="the engine's --dtype (default %(default)s)")
    fingerprint.add_argument("--block-size", type=int, default=None,
                             help="the engine's --block-size (default: the platform's, as the launcher: 128 on "
                                  "the CPU build, else 16)")
    fingerprint.add_argument("--served-model-name", default="",
                             help="the engine's --served-model-name (default: the model directory's name)")
    fingerprint.add_argument("--out", type=Path, default=None,
                             help="also write `layout_fingerprint: ...` and `served_model: ...` here, a YAML file "
                                  "for the sidecar's --config")
    fingerprint.set_defaults(func=_model_fingerprint)

    from kvloop.app.analyze.main import add_arguments as add_analyze_arguments

    analyze = sub.add_parser("analyze", help="will the return path pay on this traffic? prefix shares, retention "
                                             "replayed through the broker's core, bytes, predicted TTFT, a verdict")
    add_analyze_arguments(analyze)
    analyze.set_defaults(func=_analyze)

    from kvloop.router.config import RouterConfig

    router = sub.add_parser("router", help="run the KV-aware OpenAI-compatible router")
    RouterConfig.add_arguments(router)
    router.set_defaults(func=_router)

    engine = sub.add_parser("engine", help="run a vLLM engine with the kvloop connector (and its sidecar)")
    from kvloop.engines.launcher import add_arguments as add_engine_arguments
    from kvloop.engines.launcher import main as engine_main

    add_engine_arguments(engine)
    engine.set_defaults(func=engine_main)

    from kvloop.engines.sidecar import SidecarConfig

    sidecar = sub.add_parser("sidecar", help="run an engine's sidecar on its own (a container of the engine's pod; the "
                                             "engine then runs without --broker, its connector given the socket as "
                                             "kvloop_sidecar_socket in --kv-connector-extra-config)")
    SidecarConfig.add_arguments(sidecar)
    sidecar.set_defaults(func=_sidecar)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    bench_broker = bench.add_parser("broker", help="placement/publish/pin cycles against a real broker")
    from kvloop.app.benchmarks.broker_bench import add_arguments as add_bench_arguments

    add_bench_arguments(bench_broker)
    bench_broker.set_defaults(func=_bench_broker)
    bench_scale = bench.add_parser("broker-scale", help="1,000 engines and 1,000,000 retained blocks through the "
                                                        "real core and gRPC service: placement, memory, store writes")
    from kvloop.app.benchmarks.broker_scale import add_arguments as add_scale_arguments

    add_scale_arguments(bench_scale)
    bench_scale.set_defaults(func=_bench_broker_scale)
    bench_engines = bench.add_parser("engines", help="return path on/off on one growing session, and idle CPU "
                                                     "of engines before/after kvloop's fix (real vLLM engines)")
    from kvloop.app.benchmarks.engine_bench import add_arguments as add_engines_bench_arguments

    add_engines_bench_arguments(bench_engines)
    bench_engines.set_defaults(func=_bench_engines)
    bench_multiturn = bench.add_parser("multiturn", help="one multi-turn workload through one_way, upstream, kvloop "
                                                         "and ideal configurations, with TTFT percentiles and ratios")
    from kvloop.app.benchmarks.multiturn import add_arguments as add_multiturn_arguments

    add_multiturn_arguments(bench_multiturn)
    bench_multiturn.set_defaults(func=_bench_multiturn)
    bench_load = bench.add_parser("load", help="goodput at an SLO over a sweep of load, kvloop beside the aggregated "
                                               "engine, driven by AIPerf")
    from kvloop.app.benchmarks.load import add_arguments as add_load_arguments

    add_load_arguments(bench_load)
    bench_load.set_defaults(func=_bench_load)
    bench_gateway = bench.add_parser("gateway", help="the demo session and streamed answers through the router and "
                                                     "through Envoy with the router as its endpoint picker")
    from kvloop.app.benchmarks.gateway_bench import add_arguments as add_gateway_arguments

    add_gateway_arguments(bench_gateway)
    bench_gateway.set_defaults(func=_bench_gateway)
    bench_stripped = bench.add_parser("stripped", help="a reasoning model's sessions, whose next turn drops the last "
                                                       "answer, with and without keep_generated: false")
    from kvloop.app.benchmarks.stripped_bench import add_arguments as add_stripped_arguments

    add_stripped_arguments(bench_stripped)
    bench_stripped.set_defaults(func=_bench_stripped)
    bench_chaos = bench.add_parser("chaos", help="agent sessions through the router while seeded faults hit the "
                                                 "cluster: hangs, wrong answers, books, recovery times")
    from kvloop.app.benchmarks.chaos import add_arguments as add_chaos_arguments

    add_chaos_arguments(bench_chaos)
    bench_chaos.set_defaults(func=_bench_chaos)
    bench_profile = bench.add_parser("profile", help="measure one engine (prefill, decode steps, pool) and fit the "
                                                     "fleet model's profile of it")
    from kvloop.app.benchmarks.profile import add_arguments as add_profile_arguments

    add_profile_arguments(bench_profile)
    bench_profile.set_defaults(func=_bench_profile)

    plan = sub.add_parser("plan", help="the fleet model (docs/fleet-model.md)").add_subparsers(dest="plan_command",
                                                                                             required=True)
    from kvloop.app.fleet.cli import add_compare_arguments, add_simulate_arguments

    plan_simulate = plan.add_parser("simulate", help="kvloop bench load's agent run predicted by the fleet model "
                                                     "from an engine profile (kvloop, one_way, aggregated)")
    add_simulate_arguments(plan_simulate)
    plan_simulate.set_defaults(func=_plan_simulate)
    plan_compare = plan.add_parser("compare", help="a prediction beside a measurement: each figure, its relative "
                                                   "error and n, per configuration and load point")
    add_compare_arguments(plan_compare)
    plan_compare.set_defaults(func=_plan_compare)
    from kvloop.app.fleet.roofline_cli import add_roofline_arguments

    plan_roofline = plan.add_parser("roofline", help="an engine profile for hardware this machine lacks, from public "
                                                     "figures (a datasheet, a model's shape, a published TTFT)")
    add_roofline_arguments(plan_roofline)
    plan_roofline.set_defaults(func=_plan_roofline)
    return parser


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    # gRPC's fork handlers print "Other threads are currently calling into gRPC, skipping fork() handlers" each
    # time this process starts an engine while a gRPC thread is busy; kvloop never uses gRPC across a fork (its
    # children exec at once), so they are off. Set before anything imports grpc.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from kvloop.engines.config import EngineConfig

    parser = build_parser()
    args = parser.parse_args(join_dashed_values(sys.argv[1:] if argv is None else argv,
                                                EngineConfig.dashed_value_flags()))
    if getattr(args, "bench_command", None):
        # A benchmark's engines and brokers are stopped in its finally blocks, which SIGTERM's default action skips
        # (the engines, started from worker threads, would outlive it). SIGTERM stops a benchmark as Ctrl-C does.
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"kvloop: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
