"""The engine sidecar: one per engine, a separate process beside ``vllm serve``.

It is the engine's only voice towards the broker (``kvloop.v1.KVBroker`` stubs):

- **Registration**: when the connector attaches (``kvloop.v1.EngineLink`` on a Unix socket private to the
  engine) its hello gives the block size, the number of KV blocks and the bytes per block; the sidecar
  registers the engine (role, addresses, layout fingerprint, retention budget = ``retention_fraction`` of
  the KV blocks, a new incarnation per connector start) and keeps it alive every ``keepalive_interval_s``
  the broker asks for, re-registering when the broker forgot it (a restarted broker).
- **Leases**: each ``Retained`` event becomes a ``PublishLease`` (block keys computed here with the
  shared :mod:`kvloop.hashing`, so the EngineCore never hashes); a refused or failed publication releases
  the blocks at once, since nobody could find them.
- **Evictions**: the ``WatchEvictions`` stream (resumed from the last applied sequence number; a RESYNC
  releases whatever the broker no longer lists) becomes release commands to the connector. With every
  keep-alive the sidecar also renews the connector's safety hold of the leases still live, so a renewed
  lease stays held on the engine, and a dead sidecar lets the engine free them after one hold.
- **Load**: running and waiting requests and KV usage scraped from vLLM's ``/metrics``; memory pressure
  when KV usage passes ``pressure_kv_usage`` with requests waiting; prefill tokens/s and NIXL bytes/s as
  moving averages of what the connector measured.
- **Service**: gRPC health (``""`` live; ``kvloop.v1.EngineLink`` SERVING once registered with a broker)
  and reflection on ``listen``, Prometheus metrics on ``metrics_listen``, SIGTERM: deregister, stop.
- **Security** (optional): ``tls_*`` put TLS (with ``tls_ca``, mutual TLS) on the ``listen`` port;
  ``broker_tls_*`` make the broker link TLS, presenting a certificate that names the engine (a broker with
  mutual TLS lets a caller act only for the engine its certificate names). The connector's Unix socket is
  private to the engine's pod and stays plaintext.

Why a separate process rather than a thread in vLLM: the connector runs on the EngineCore's busy-loop
thread, where any wait stalls every request; broker fail-over, retries and stream resumption belong
elsewhere, the sidecar can restart without the engine (the connector reconnects and replays what it
holds), and on Kubernetes it is the second container of the engine's pod.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from kvloop.client import BrokerClient
from kvloop.config import ServiceConfig, parse_host_port, setting
from kvloop.errors import ConfigError
from kvloop.hashing import ExtraKeys, block_keys
from kvloop.pd import BANDWIDTH_SAMPLE_MIN_BYTES
from kvloop.serving import run_service, wait_for_stop, write_port_file
from kvloop.telemetry import LOG_FORMATS, LOG_LEVELS
from kvloop.tls import TlsFiles, check_files
from kvloop.v1 import broker_pb2 as pb
from kvloop.v1 import engine_link_pb2 as lpb
from kvloop.v1 import engine_link_pb2_grpc

log = structlog.get_logger("kvloop.sidecar")
tracer = trace.get_tracer("kvloop.sidecar")
LINK_SERVICE = lpb.DESCRIPTOR.services_by_name["EngineLink"].full_name
ROLES = {"prefill": pb.ENGINE_ROLE_PREFILL, "decode": pb.ENGINE_ROLE_DECODE, "both": pb.ENGINE_ROLE_BOTH}


@dataclass(frozen=True)
class SidecarConfig(ServiceConfig):
    ENV_PREFIX = "KVLOOP_SIDECAR_"

    engine_id: str = setting("", "the engine's NIXL engine id (required)")
    role: str = setting("both", "the engine's P/D role", choices=tuple(ROLES))
    broker: str = setting("", "broker address(es) host:port, comma-separated (required)")
    socket: Path | None = setting(None, "Unix socket the connector attaches to (required)")
    listen: str = setting("127.0.0.1:0", "gRPC health and reflection address, host:port (0 = a free port)")
    advertise: str = setting("", "gRPC address other services reach this sidecar at (default: listen)")
    metrics_listen: str = setting("127.0.0.1:0", "Prometheus metrics address host:port; empty = off")
    engine_url: str = setting("", "the engine's OpenAI server base URL, e.g. http://127.0.0.1:8000 (required)")
    nixl_address: str = setting("", "the engine's NIXL side channel host:port, advertised to readers")
    layout_fingerprint: str = setting("", "layout fingerprint (engines.layout.engine_fingerprint; required)")
    retention_fraction: float = setting(0.5, "share of the engine's KV blocks the broker may keep retained")
    lease_ttl_s: float = setting(0.0, "TTL asked for each published lease; 0 = the broker's default")
    hold_s: float = setting(120.0, "safety hold renewed on the engine for live leases; must exceed the "
                                   "broker's engine TTL so the broker drops a silent engine's leases first")
    pressure_kv_usage: float = setting(0.9, "KV usage (0..1) at which, with requests waiting, the sidecar "
                                            "reports memory pressure")
    port_file: Path | None = setting(None, "write the bound gRPC port here once serving (for launchers)")
    log_format: str = setting("auto", "log format: json, console, or auto", choices=LOG_FORMATS)
    log_level: str = setting("info", "log level", choices=LOG_LEVELS)
    tls_cert: Path | None = setting(None, "PEM certificate (chain) of the gRPC port (listen); with tls_key: TLS on "
                                          "(the connector's Unix socket stays plaintext, private to the pod)")
    tls_key: Path | None = setting(None, "PEM private key of tls_cert (unencrypted)")
    tls_ca: Path | None = setting(None, "PEM CA bundle: gRPC clients of listen must present a certificate it signed")
    broker_tls_ca: Path | None = setting(None, "PEM CA that signed the broker's certificate: TLS to the broker")
    broker_tls_cert: Path | None = setting(None, "PEM certificate presented to the broker; with its mTLS, its CN or "
                                                 "a SAN must name engine_id (the broker's engine_identity)")
    broker_tls_key: Path | None = setting(None, "PEM private key of broker_tls_cert")
    broker_tls_server_name: str = setting("", "name the broker's certificate must carry, when not the dialled host")

    def validate(self) -> None:
        for name in ("engine_id", "broker", "engine_url", "layout_fingerprint"):
            self._require(bool(getattr(self, name)), name, "is required")
        self._require(self.socket is not None and len(str(self.socket)) < 100, "socket",
                      "is required and must be shorter than 100 characters (Unix socket path limit)")
        for address in self.broker.split(","):
            if address.strip():
                parse_host_port(address.strip(), "broker")
        parse_host_port(self.listen, "listen")
        if self.metrics_listen:
            parse_host_port(self.metrics_listen, "metrics_listen")
        if self.nixl_address:
            parse_host_port(self.nixl_address, "nixl_address")
        self._require(self.engine_url.startswith(("http://", "https://")), "engine_url", "must be an http(s) URL")
        self._require(0 < self.retention_fraction <= 1, "retention_fraction", "must be in (0, 1]")
        self._require(self.lease_ttl_s >= 0, "lease_ttl_s", "must be >= 0")
        self._require(self.hold_s > 0, "hold_s", "must be positive")
        self._require(0 < self.pressure_kv_usage <= 1, "pressure_kv_usage", "must be in (0, 1]")
        check_files(self, "tls_", server=True)
        check_files(self, "broker_tls_", server=False)


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.leases = Gauge("kvloop_sidecar_leases", "Leases this engine holds at the broker", registry=r)
        self.published = Counter("kvloop_sidecar_published_total", "Leases published", registry=r)
        self.released = Counter("kvloop_sidecar_released_total", "Retained requests released, by reason",
                                ["reason"], registry=r)
        self.broker_errors = Counter("kvloop_sidecar_broker_errors_total", "Failed broker calls, by method",
                                     ["method"], registry=r)
        self.connected = Gauge("kvloop_sidecar_connector_attached", "1 while the connector is attached", registry=r)
        self.registered = Gauge("kvloop_sidecar_registered", "1 while registered with a broker", registry=r)
        self.prefill_tps = Gauge("kvloop_sidecar_prefill_tokens_per_second", "Measured prefill throughput",
                                 registry=r)
        self.transfer_bps = Gauge("kvloop_sidecar_transfer_bytes_per_second", "Measured NIXL pull bandwidth",
                                  registry=r)


def scrape_engine_load(engine_url: str, timeout_s: float = 2.0) -> dict[str, float]:
    """Running and waiting requests and KV usage from vLLM's Prometheus text (blocking: run in a thread)."""
    wanted = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
              "vllm:kv_cache_usage_perc": "kv_usage"}
    out: dict[str, float] = {}
    with urllib.request.urlopen(f"{engine_url}/metrics", timeout=timeout_s) as reply:
        for raw in reply.read().decode().splitlines():
            if raw.startswith("#"):
                continue
            name = raw.split("{", 1)[0].split(" ", 1)[0]
            if name in wanted:
                out[wanted[name]] = out.get(wanted[name], 0.0) + float(raw.rpartition(" ")[2])
    return out


def _ewma(old: float, new: float, weight: float = 0.3) -> float:
    return new if old <= 0 else (1 - weight) * old + weight * new


class Sidecar(engine_link_pb2_grpc.EngineLinkServicer):
    def __init__(self, config: SidecarConfig, metrics: SidecarMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or SidecarMetrics()
        self.broker = BrokerClient(config.broker, timeout_s=5.0, tls=TlsFiles.of(config, "broker_tls_"))
        self.extra = ExtraKeys(config.layout_fingerprint)
        self.hello: lpb.ConnectorHello | None = None
        self.registered = asyncio.Event()
        self.registration_changed = asyncio.Event()
        self.keepalive_interval_s = 2.0
        self.last_seq = 0
        self.held: dict[str, str] = {}        # request id -> lease id
        self.by_lease: dict[str, str] = {}    # lease id -> request id
        self.prefill_tokens_per_s = 0.0
        self.transfer_bytes_per_s = 0.0
        self.engine_figures: dict[str, float] = {}
        self._outbox: asyncio.Queue[lpb.ConnectorCommand] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._engine_tasks: list[asyncio.Task[Any]] = []
        self.grpc_address = config.advertise or config.listen

    # The connector's stream.

    async def Attach(self, request_iterator: AsyncIterator[lpb.ConnectorEvent], context: Any
                     ) -> AsyncIterator[lpb.ConnectorCommand]:
        outbox: asyncio.Queue[lpb.ConnectorCommand] = asyncio.Queue()
        self._outbox = outbox
        reader = asyncio.create_task(self._read_events(request_iterator))
        self.metrics.connected.set(1)
        try:
            yield lpb.ConnectorCommand()  # an empty first command: tells the connector it is attached
            while not reader.done() or not outbox.empty():
                get = asyncio.create_task(outbox.get())
                done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    yield get.result()
                else:
                    get.cancel()
        finally:
            reader.cancel()
            self.metrics.connected.set(0)
            if self._outbox is outbox:
                self._outbox = None
                # The EngineCore is gone (or restarting): its blocks went with it. Deregistering drops the
                # engine's leases at once, so no reader is sent to them; the next hello registers anew.
                log.info("connector.detached", engine=self.config.engine_id, dropped_leases=len(self.held))
                self._spawn(self._deregister())

    async def _read_events(self, events: AsyncIterator[lpb.ConnectorEvent]) -> None:
        async for event in events:
            kind = event.WhichOneof("event")
            if kind == "hello":
                await self._on_hello(event.hello)
            elif kind == "retained":
                self._spawn(self._publish(event.retained))
            elif kind == "freed":
                self._on_freed(event.freed)
            elif kind == "prefill_done":
                self._on_prefill_done(event.prefill_done)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    def _command(self, command: lpb.ConnectorCommand) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(command)

    def _release(self, request_ids: list[str], reason: str) -> None:
        for rid in request_ids:
            lease = self.held.pop(rid, None)
            if lease is not None:
                self.by_lease.pop(lease, None)
            self.metrics.released.labels(reason).inc()
        self.metrics.leases.set(len(self.held))
        if request_ids:
            self._command(lpb.ConnectorCommand(release_request_ids=request_ids))

    async def _on_hello(self, hello: lpb.ConnectorHello) -> None:
        restarted = self.hello is not None and self.hello.incarnation != hello.incarnation
        self.hello = hello
        log.info("connector.attached", engine=hello.engine_id, blocks=hello.num_blocks, block_size=hello.block_size,
                 bytes_per_block=hello.bytes_per_block, restarted=restarted)
        if hello.engine_id != self.config.engine_id:
            log.warning("connector.engine_id_mismatch", expected=self.config.engine_id, got=hello.engine_id)
        if restarted or not self.registered.is_set():
            self.held.clear()
            self.by_lease.clear()
            self._set_registered(False)
            for task in self._engine_tasks:
                task.cancel()
            self._engine_tasks = [asyncio.create_task(self._register_forever())]

    def _set_registered(self, registered: bool) -> None:
        if registered:
            self.registered.set()
        else:
            self.registered.clear()
        self.metrics.registered.set(int(registered))
        self.registration_changed.set()

    def engine_pb(self) -> pb.Engine:
        assert self.hello is not None
        budget = int(self.hello.num_blocks * self.config.retention_fraction)
        return pb.Engine(engine_id=self.config.engine_id, role=ROLES[self.config.role],
                         addresses=pb.EngineAddresses(grpc=self.grpc_address, http=self.config.engine_url,
                                                      nixl=self.config.nixl_address),
                         block_size=self.hello.block_size, layout_fingerprint=self.config.layout_fingerprint,
                         retention_budget_blocks=budget if self.hello.kv_role_decode else 0,
                         incarnation=self.hello.incarnation)

    async def _register_forever(self) -> None:
        """Register (retrying with back-off), then keep alive and follow evictions until cancelled."""
        delay = 0.1
        while True:
            try:
                reply = await self.broker.call("RegisterEngine", pb.RegisterEngineRequest(engine=self.engine_pb()))
            except grpc.aio.AioRpcError as exc:
                self.metrics.broker_errors.labels("RegisterEngine").inc()
                log.warning("broker.register_failed", code=exc.code().name, details=exc.details(), retry_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            self.keepalive_interval_s = max(0.2, reply.keepalive_interval_s or 2.0)
            self.last_seq = reply.last_eviction_seq
            live = set(reply.live_lease_ids)
            self._release([rid for rid, lease in self.held.items() if lease not in live], "resync")
            self._set_registered(True)
            log.info("broker.registered", engine=self.config.engine_id, keepalive_s=self.keepalive_interval_s,
                     engine_ttl_s=reply.engine_ttl_s, hold_s=self.config.hold_s)
            if reply.engine_ttl_s and self.config.hold_s <= reply.engine_ttl_s:
                log.warning("sidecar.hold_below_engine_ttl", hold_s=self.config.hold_s, engine_ttl_s=reply.engine_ttl_s)
            watcher = asyncio.create_task(self._watch_evictions())
            try:
                await self._keepalive_loop()
            finally:
                watcher.cancel()
                self._set_registered(False)
            delay = 0.1

    async def _keepalive_loop(self) -> None:
        """Returns when the broker no longer knows the engine (re-register) or stays unreachable too long.

        The engine's figures come from a separate sampler: a slow ``/metrics`` (seen here taking minutes on a
        loaded machine) must never delay a keep-alive, or the broker drops a healthy engine."""
        sampler = asyncio.create_task(self._sample_load_forever())
        try:
            await self._keepalives()
        finally:
            sampler.cancel()

    async def _sample_load_forever(self) -> None:
        while True:
            try:
                self.engine_figures = await asyncio.wait_for(
                    asyncio.to_thread(scrape_engine_load, self.config.engine_url), timeout=5.0)
            except (OSError, ValueError, TimeoutError) as exc:
                log.debug("engine.metrics_unavailable", error=str(exc))
            await asyncio.sleep(self.keepalive_interval_s)

    async def _keepalives(self) -> None:
        failures = 0
        while True:
            load = self._load()
            try:
                await self.broker.call("KeepAlive", pb.KeepAliveRequest(engine_id=self.config.engine_id, load=load))
                failures = 0
            except grpc.aio.AioRpcError as exc:
                self.metrics.broker_errors.labels("KeepAlive").inc()
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning("broker.forgot_engine", engine=self.config.engine_id)
                    return
                failures += 1
                log.warning("broker.keepalive_failed", code=exc.code().name, failures=failures)
                if failures >= 5:
                    return
            if failures == 0 and self.held:
                self._command(lpb.ConnectorCommand(hold_request_ids=list(self.held), hold_s=self.config.hold_s))
            await asyncio.sleep(self.keepalive_interval_s)

    def _load(self) -> pb.EngineLoad:
        load = pb.EngineLoad(prefill_tokens_per_s=self.prefill_tokens_per_s,
                             transfer_bytes_per_s=self.transfer_bytes_per_s,
                             bytes_per_block=self.hello.bytes_per_block if self.hello else 0)
        figures = self.engine_figures
        load.running_requests = int(figures.get("running", 0))
        load.waiting_requests = int(figures.get("waiting", 0))
        load.kv_usage = min(1.0, max(0.0, figures.get("kv_usage", 0.0)))
        if load.kv_usage >= self.config.pressure_kv_usage and load.waiting_requests > 0 and self.hello:
            load.memory_pressure = True
            excess = load.kv_usage - self.config.pressure_kv_usage + 0.05
            load.pressure_free_blocks = max(1, int(self.hello.num_blocks * excess))
        return load

    async def _watch_evictions(self) -> None:
        while True:
            try:
                call = self.broker.stub.WatchEvictions(
                    pb.WatchEvictionsRequest(engine_id=self.config.engine_id, after_seq=self.last_seq))
                async for command in call:
                    self._apply_eviction(command)
            except grpc.aio.AioRpcError as exc:
                self.metrics.broker_errors.labels("WatchEvictions").inc()
                log.info("broker.eviction_stream_broke", code=exc.code().name)
            await asyncio.sleep(0.2)

    def _apply_eviction(self, command: pb.EvictionCommand) -> None:
        if command.seq and command.seq <= self.last_seq:
            return  # already applied (commands are also returned by PublishLease)
        self.last_seq = max(self.last_seq, command.seq)
        reason = pb.EvictionReason.Name(command.reason).removeprefix("EVICTION_REASON_").lower()
        if command.reason == pb.EVICTION_REASON_RESYNC:
            live = set(command.live_lease_ids)
            self._release([rid for rid, lease in self.held.items() if lease not in live], "resync")
            return
        rid = self.by_lease.get(command.lease_id)
        if rid is not None:
            log.info("lease.evicted", lease=command.lease_id, request=rid, reason=reason, blocks=len(command.block_ids))
            self._release([rid], reason)

    async def _publish(self, retained: lpb.Retained) -> None:
        assert self.hello is not None
        try:
            await asyncio.wait_for(self.registered.wait(), timeout=10.0)
        except TimeoutError:
            log.warning("lease.not_published", request=retained.request_id, why="not registered with a broker")
            self._release([retained.request_id], "unpublished")
            return
        keys = block_keys(list(retained.token_ids), self.hello.block_size, self.extra)
        request = pb.PublishLeaseRequest(engine_id=self.config.engine_id, session_id=retained.session_id,
                                         block_keys=keys, block_ids=list(retained.block_ids)[: len(keys)],
                                         num_tokens=len(keys) * self.hello.block_size, ttl_s=self.config.lease_ttl_s)
        with tracer.start_as_current_span("kvloop.sidecar.publish") as span:
            span.set_attribute("kvloop.blocks", len(keys))
            try:
                reply = await self.broker.call("PublishLease", request)
            except grpc.aio.AioRpcError as exc:
                self.metrics.broker_errors.labels("PublishLease").inc()
                log.warning("lease.publish_failed", request=retained.request_id, code=exc.code().name,
                            details=exc.details())
                self._release([retained.request_id], "unpublished")
                return
        self.held[retained.request_id] = reply.lease.lease_id
        self.by_lease[reply.lease.lease_id] = retained.request_id
        self.metrics.published.inc()
        self.metrics.leases.set(len(self.held))
        log.info("lease.published", lease=reply.lease.lease_id, request=retained.request_id, blocks=len(keys),
                 session=retained.session_id or None, ttl_s=round(reply.lease.ttl_s, 1))
        for command in reply.evictions:
            self._apply_eviction(command)

    def _on_freed(self, freed: lpb.Freed) -> None:
        lease = self.held.pop(freed.request_id, None)
        if lease is None:
            return  # we asked for it
        # The engine freed blocks on its own (its safety hold ran out): the broker must stop offering them.
        self.by_lease.pop(lease, None)
        self.metrics.leases.set(len(self.held))
        self.metrics.released.labels("hold_expired").inc()
        self._spawn(self._release_at_broker(lease))

    async def _release_at_broker(self, lease_id: str) -> None:
        try:
            await self.broker.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id))
        except grpc.aio.AioRpcError as exc:
            self.metrics.broker_errors.labels("ReleaseLease").inc()
            log.info("lease.release_failed", lease=lease_id, code=exc.code().name)

    def _on_prefill_done(self, done: lpb.PrefillDone) -> None:
        if done.computed_tokens >= 256 and done.compute_s > 0:
            self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, done.computed_tokens / done.compute_s)
            self.metrics.prefill_tps.set(self.prefill_tokens_per_s)
        if done.pulled_bytes >= BANDWIDTH_SAMPLE_MIN_BYTES and done.pull_s > 0 and not done.pull_failed:
            self.transfer_bytes_per_s = _ewma(self.transfer_bytes_per_s, done.pulled_bytes / done.pull_s)
            self.metrics.transfer_bps.set(self.transfer_bytes_per_s)

    async def _deregister(self) -> None:
        for task in self._engine_tasks:
            task.cancel()
        self._engine_tasks = []
        was_registered = self.registered.is_set()
        self._set_registered(False)
        self.held.clear()
        self.by_lease.clear()
        self.metrics.leases.set(0)
        self.hello = None
        if was_registered:
            try:
                await self.broker.call("DeregisterEngine", pb.DeregisterEngineRequest(engine_id=self.config.engine_id),
                                       timeout_s=2.0)
            except grpc.aio.AioRpcError as exc:
                self.metrics.broker_errors.labels("DeregisterEngine").inc()
                log.info("broker.deregister_failed", code=exc.code().name)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self._deregister()
        await self.broker.close()


async def serve(config: SidecarConfig, stop: asyncio.Event | None = None) -> None:
    sidecar = Sidecar(config)
    server = grpc.aio.server()
    engine_link_pb2_grpc.add_EngineLinkServicer_to_server(sidecar, server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([LINK_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    assert config.socket is not None
    with contextlib.suppress(FileNotFoundError):
        os.unlink(config.socket)
    config.socket.parent.mkdir(parents=True, exist_ok=True)
    if server.add_insecure_port(f"unix://{config.socket}") == 0:
        raise OSError(f"socket: cannot bind {config.socket}")
    host, port = parse_host_port(config.listen, "listen")
    target = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    tls = TlsFiles.of(config, "tls_")
    bound = server.add_secure_port(target, tls.server_credentials()) if tls.enabled else \
        server.add_insecure_port(target)
    if bound == 0:
        raise OSError(f"listen: cannot bind {config.listen}")
    if not config.advertise:
        sidecar.grpc_address = f"{host}:{bound}"
    metrics_server = None
    if config.metrics_listen:
        mhost, mport = parse_host_port(config.metrics_listen, "metrics_listen")
        metrics_server, _ = start_http_server(mport, addr=mhost, registry=sidecar.metrics.registry)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(LINK_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def follow_registration() -> None:
        while True:
            await sidecar.registration_changed.wait()
            sidecar.registration_changed.clear()
            status = health_pb2.HealthCheckResponse.SERVING if sidecar.registered.is_set() else \
                health_pb2.HealthCheckResponse.NOT_SERVING
            await health_servicer.set(LINK_SERVICE, status)

    follower = asyncio.create_task(follow_registration())
    log.info("sidecar.listening", engine=config.engine_id, grpc=sidecar.grpc_address, socket=str(config.socket),
             metrics_port=metrics_server.server_port if metrics_server else None,
             tls="mutual" if tls.mutual else "server" if tls.enabled else "off",
             broker_tls=TlsFiles.of(config, "broker_tls_").enabled)
    if config.port_file is not None:
        write_port_file(config.port_file, bound)
    try:
        await wait_for_stop(stop)
    finally:
        log.info("sidecar.stopping", engine=config.engine_id)
        follower.cancel()
        await health_servicer.enter_graceful_shutdown()
        await sidecar.close()
        await server.stop(1.0)
        if metrics_server is not None:
            metrics_server.shutdown()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.socket)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvloop sidecar", description=__doc__.split("\n", 1)[0] if __doc__ else "")
    SidecarConfig.add_arguments(parser)
    try:
        config = SidecarConfig.load(parser.parse_args(argv))
    except ConfigError as exc:
        print(f"kvloop sidecar: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return run_service("kvloop-sidecar", config, serve)


if __name__ == "__main__":
    sys.exit(main())
