"""The local cluster: a broker, prefill and decode engines with their sidecars, and the router, on one machine.

:class:`LocalCluster` is what ``kvloop up`` runs and what the multi-turn benchmark's kvloop configuration runs:
the broker and the router in this process (the broker on the memory store, or with ``etcd`` a local etcd from
Debian's package and the etcd store), the engines through :mod:`kvloop.app.engine_set`. Start-up waits on each
part's health; stop runs in reverse order and is safe after a partial start. The broker authenticates every
caller: the cluster makes a new secret in ``run_dir/auth`` and gives each sidecar and the router its own token.

``kvloop up`` starts one on the tiny model (built on first use), prints the endpoints, runs the demo
(:mod:`kvloop.app.demo`) and serves until Ctrl-C or SIGTERM (``--once``: stops after the demo).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import secrets
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvloop.app import gateway
from kvloop.app.demo import run_demo
from kvloop.app.engine_set import EngineSet, start_engines_async
from kvloop.broker.config import BrokerConfig
from kvloop.broker.server import SERVICE_NAME, RunningBroker, start_broker
from kvloop.engines.config import EngineConfig, default_work_dir
from kvloop.engines.launcher import sidecar_address
from kvloop.engines.model import ensure_tiny_model
from kvloop.router.config import RouterConfig
from kvloop.router.server import RunningRouter, start_router
from kvloop.shared import procs
from kvloop.shared.auth import ClusterCredentials
from kvloop.shared.client import wait_serving
from kvloop.shared.serving import wait_for_stop
from kvloop.shared.vocabulary import Role

MakeConfigs = Callable[[str], Sequence[EngineConfig]]
"""The engines of a cluster, given the broker's address."""


@dataclass
class LocalCluster:
    broker: RunningBroker | None = None
    broker_process: procs.Proc | None = None
    """The broker as a process of its own (``separate_broker``), instead of :attr:`broker` in this one."""
    engines: EngineSet = field(default_factory=EngineSet)
    router: RunningRouter | None = None
    etcd: procs.Proc | None = None
    credentials: ClusterCredentials | None = None
    """The cluster's secret and its callers' tokens (``run_dir/auth``): the broker refuses every other caller."""
    gateway: procs.Proc | None = None
    """An Envoy in front of the router's endpoint picker (:func:`start_gateway`), stopped first."""

    @property
    def broker_address(self) -> str:
        if self.broker_process is not None:
            return self.broker_process.extra["address"]
        assert self.broker is not None
        return f"127.0.0.1:{self.broker.port}"

    @classmethod
    async def start(cls, make_configs: MakeConfigs, run_dir: Path, *, etcd: bool = False,
                    broker: dict[str, Any] | None = None, router: dict[str, Any] | None = None,
                    separate_broker: bool = False,
                    on_step: Callable[[str, LocalCluster], None] = lambda step, cluster: None) -> LocalCluster:
        """Broker, then the engines (``make_configs(broker_address)``), then the router once it sees them all.
        ``broker`` and ``router`` override their configs' defaults; ``etcd``: a local etcd (in
        ``run_dir/etcd``) and the etcd store;
        ``separate_broker``: run the broker as its own process (a benchmark's router then shares its event loop
        with nothing but its clients, as in a deployment)."""
        cluster = cls()
        try:
            # Closed to every other local process: a new secret per run, a token per caller (kvloop.shared.auth).
            cluster.credentials = auth = ClusterCredentials(run_dir / "auth")
            values: dict[str, Any] = {"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0", "log_level": "warning",
                                      "keepalive_interval_s": 1.0, "engine_ttl_s": 5.0,
                                      "auth_secret_file": auth.secret_file, **(broker or {})}
            if etcd:
                cluster.etcd = await asyncio.to_thread(procs.start_etcd, run_dir / "etcd" / "data", run_dir / "etcd")
                values.update(store="etcd", etcd_endpoint=cluster.etcd.extra["endpoint"])
            if separate_broker:
                # The process binds ports of its own choosing, unless a caller named a metrics port to read.
                flags = [f"--{k.replace('_', '-')}={v}" for k, v in values.items()
                         if k != "listen" and not (k == "metrics_listen" and str(v).endswith(":0"))]
                cluster.broker_process = await asyncio.to_thread(procs.start_broker, "broker", flags,
                                                                 run_dir / "broker")
            else:
                cluster.broker = await start_broker(BrokerConfig.load(values))
            await wait_serving(cluster.broker_address, SERVICE_NAME, timeout_s=30)
            on_step("broker", cluster)
            configs = [with_token(c, auth) for c in make_configs(cluster.broker_address)]
            cluster.engines = await start_engines_async(configs)
            on_step("engines", cluster)
            cluster.router = await start_router(RouterConfig.load(
                {"listen": "127.0.0.1:0", "broker": cluster.broker_address, "refresh_s": 1.0, "log_level": "warning",
                 "broker_token_file": auth.token_file("router", "router"), **(router or {})}))
            directory = cluster.router.runner.directory
            while len(directory.engines) < len(configs):
                await cluster.router.runner.refresh()
                await asyncio.sleep(0.1)
            on_step("router", cluster)
        except BaseException:
            await cluster.stop()
            raise
        return cluster

    async def stop(self) -> None:
        if self.gateway is not None:
            await asyncio.to_thread(self.gateway.stop)
        if self.router is not None:
            await self.router.stop()
        await asyncio.to_thread(self.engines.stop)
        if self.broker is not None:
            await self.broker.stop()
        if self.broker_process is not None:
            await asyncio.to_thread(self.broker_process.stop)
        if self.etcd is not None:
            self.etcd.stop()


def with_token(config: EngineConfig, credentials: ClusterCredentials) -> EngineConfig:
    """``config`` with its sidecar's engine token (minted for its engine id) unless it has one."""
    if config.broker_token_file is not None or not config.broker:
        return config
    if not config.engine_id:
        raise ValueError("engine_id: a cluster engine needs its id before start, to mint its token")
    return dataclasses.replace(config, broker_token_file=credentials.token_file("engine", config.engine_id))


def pd_configs(model: Path, work: Path, broker: str, *, prefill: int, decode: int, **settings: Any
               ) -> list[EngineConfig]:
    """``prefill`` prefill and ``decode`` decode engines with kvloop's connector, ids ``prefill-0``, ...,
    each bound to its role's cores; ``settings`` are further :class:`EngineConfig` fields for all."""
    roles = [Role.PREFILL] * prefill + [Role.DECODE] * decode
    return [EngineConfig(role=role, model=model, engine_id=f"{role}-{i}", work_dir=work, broker=broker,
                         omp_threads_bind="role", **settings) for i, role in enumerate(roles)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: .kvloop/models/tiny)")
    parser.add_argument("--prefill", type=int, default=2, help="prefill engines")
    parser.add_argument("--decode", type=int, default=1, help="decode engines")
    parser.add_argument("--etcd", action="store_true", help="start a local etcd and use the etcd store")
    parser.add_argument("--router-listen", default=RouterConfig.listen, help="router HTTP address (port 0 = free)")
    parser.add_argument("--broker-listen", default="127.0.0.1:0", help="broker gRPC address")
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--kv-cache-gib", type=int, default=EngineConfig.kv_cache_gib,
                        help="KV cache per engine (CPU build)")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: .kvloop/up")
    parser.add_argument("--demo-turns", type=int, default=6)
    parser.add_argument("--no-demo", action="store_true", help="do not run the demo session")
    parser.add_argument("--once", action="store_true", help="stop after the demo instead of serving")
    parser.add_argument("--gateway", action="store_true",
                        help="also serve the router as a gateway's endpoint picker behind a local Envoy (installed "
                             "on first use; docs/gateway.md): the demo goes through Envoy")


async def _up(args: argparse.Namespace) -> None:
    work = (args.work_dir or default_work_dir() / "up").absolute()
    model = await asyncio.to_thread(ensure_tiny_model, args.model)

    def say(step: str, cluster: LocalCluster) -> None:
        if step == "broker":
            assert cluster.broker is not None
            print(f"kvloop up: broker {cluster.broker_address} (store {'etcd' if args.etcd else 'memory'}), metrics "
                  f"http://127.0.0.1:{cluster.broker.metrics_port}/metrics", flush=True)
            assert cluster.credentials is not None
            operator = cluster.credentials.token_file("operator", "operator")
            print(f"kvloop up: the broker authenticates every caller (secret {cluster.credentials.secret_file}); "
                  f"inspect it with: kvloop broker status --broker {cluster.broker_address} --token-file {operator}",
                  flush=True)
            print(f"kvloop up: starting {args.prefill} prefill and {args.decode} decode engines on {model} "
                  "(about a minute on 2 cores) ...", flush=True)

    router: dict[str, Any] = {"listen": args.router_listen, "tokenizer": str(model)}
    token = picker_settings(router, work) if args.gateway else ""
    cluster = await LocalCluster.start(
        lambda broker: pd_configs(model, work, broker, prefill=args.prefill, decode=args.decode,
                                  max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
                                  log_level="warning"),
        work, etcd=args.etcd, broker={"listen": args.broker_listen}, router=router, on_step=say)
    try:
        for engine in cluster.engines:
            print(f"  engine {engine.engine_id:<10} {engine.plan.config.role:<8} {engine.url}  "
                  f"(NIXL {engine.plan.config.resolved_nixl_host()}:{engine.nixl_port}, log {engine.log_path})",
                  flush=True)
            print(f"  sidecar {engine.engine_id:<10} {sidecar_address(engine)}", flush=True)
        assert cluster.router is not None
        url = cluster.router.url
        print(f"kvloop up: router {url}  (OpenAI API: {url}/v1/chat/completions, metrics {url}/metrics)", flush=True)
        if cluster.router.picker is not None:
            url = (await start_gateway(cluster, token, work)).extra["url"]
        if not args.no_demo:
            await run_demo(url, model=next(iter(sorted(cluster.router.runner.directory.models())), ""),
                           turns=args.demo_turns)
        if args.once:
            return
        print("\nkvloop up: serving; Ctrl-C to stop.", flush=True)
        await wait_for_stop()
    finally:
        print("kvloop up: stopping router, engines, broker ...", flush=True)
        await cluster.stop()
        print("kvloop up: stopped.", flush=True)


def picker_settings(router: dict[str, Any], work: Path) -> str:
    """Adds to a router's settings its endpoint picker, taking ext_proc streams only from the gateway that holds
    the token returned (written to a file of this cluster's)."""
    token = secrets.token_hex(24)
    token_file = work / "gateway" / "ext_proc.token"
    token_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token_file.touch(mode=0o600)
    token_file.write_text(token)
    router.update(ext_proc_listen="127.0.0.1:0", ext_proc_token_file=token_file)
    return token


async def start_gateway(cluster: LocalCluster, token: str, work: Path) -> procs.Proc:
    """A local Envoy in front of the router's endpoint picker (:mod:`kvloop.app.gateway`), stopped with the
    cluster."""
    assert cluster.router is not None and cluster.router.picker is not None
    picker = f"127.0.0.1:{cluster.router.picker.port}"
    exe = await asyncio.to_thread(gateway.ensure_envoy, default_work_dir())
    envoy = await asyncio.to_thread(gateway.start_envoy, exe, gateway.envoy_config(picker, token), work / "gateway")
    cluster.gateway = envoy
    print(f"kvloop up: gateway (Envoy {gateway.VERSION}) {envoy.extra['url']}, asking the router's endpoint picker "
          f"{picker} (docs/gateway.md)", flush=True)
    return envoy


def up_main(args: argparse.Namespace) -> int:
    from kvloop.shared.telemetry import configure_logging, configure_tracing

    configure_logging("console" if sys.stderr.isatty() else "json", "warning")
    # The router and the broker run in this process: one tracer provider (service "kvloop-up"; the spans'
    # instrumentation scopes, kvloop.router and kvloop.broker, tell them apart) exports every turn's tree to
    # OTEL_EXPORTER_OTLP_ENDPOINT when it is set. Engines and sidecars are processes of their own and export
    # theirs (the launcher passes the endpoint to vLLM).
    provider = configure_tracing("kvloop-up")
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_up(args))
    finally:
        if provider is not None:
            provider.shutdown()  # flush the last turns' spans
    return 0
