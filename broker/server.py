"""Start and stop a broker replica: gRPC server with health and reflection, metrics endpoint, the
runtime (election, expiry ticks) and graceful shutdown on SIGTERM/SIGINT.

TLS: with ``tls_cert`` and ``tls_key`` the gRPC port speaks TLS; with ``tls_ca`` too, clients must present
a certificate signed by it and are authorized by its names (:mod:`broker.access`). Health and reflection
share the port, so a probe then needs a client certificate as well.

Health: the overall service ``""`` is SERVING while the process is up (liveness); ``kvloop.v1.KVBroker``
is SERVING only while this replica is the leader (readiness: route traffic here).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

import grpc
import structlog
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from broker.access import Access
from broker.config import BrokerConfig
from broker.metrics import BrokerMetrics
from broker.runtime import BrokerRuntime
from broker.service import BrokerService
from broker.store import Election, MemoryStore, SoloElection, Store
from kvloop.config import parse_host_port
from kvloop.serving import wait_for_stop, write_port_file
from kvloop.tls import TlsFiles
from kvloop.v1 import broker_pb2, broker_pb2_grpc

log = structlog.get_logger("kvloop.broker")
SERVICE_NAME = broker_pb2.DESCRIPTOR.services_by_name["KVBroker"].full_name


def make_store(config: BrokerConfig) -> tuple[Store, Election]:
    if config.store == "memory":
        return MemoryStore(), SoloElection(config.advertised)
    from broker.store.etcd import EtcdElection, EtcdStore, connect

    client = connect(config.etcd_endpoint)
    store = EtcdStore(client, config.etcd_prefix, config.replica, engine_ttl_s=config.engine_ttl_s)
    election = EtcdElection(client, store, config.etcd_prefix, config.replica, config.advertised,
                            ttl_s=config.leader_ttl_s)
    return store, election


@dataclass
class RunningBroker:
    config: BrokerConfig
    server: grpc.aio.Server
    runtime: BrokerRuntime
    health: health_aio.HealthServicer
    port: int
    metrics_port: int
    _metrics_server: Any
    _watcher: asyncio.Task[None]

    async def stop(self) -> None:
        """Drain: report NOT_SERVING, let in-flight RPCs finish, resign leadership, close the store."""
        log.info("broker.stopping", grace_s=self.config.shutdown_grace_s)
        await self.health.enter_graceful_shutdown()
        self._watcher.cancel()
        self.runtime.drain()
        await self.server.stop(self.config.shutdown_grace_s)
        await self.runtime.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        log.info("broker.stopped")


async def start_broker(config: BrokerConfig, metrics: BrokerMetrics | None = None) -> RunningBroker:
    metrics = metrics or BrokerMetrics()
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    host, port = parse_host_port(config.listen, "listen")
    target = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    tls = TlsFiles.of(config, "tls_")
    bound = server.add_secure_port(target, tls.server_credentials()) if tls.enabled else \
        server.add_insecure_port(target)
    if bound == 0:
        raise OSError(f"listen: cannot bind {config.listen}")
    if not config.advertise and port == 0:
        # Port 0 picks a free port: advertise the port bound (followers name it to clients), not ":0".
        config = replace(config, advertise=f"{config.listen.rpartition(':')[0]}:{bound}")
    store, election = make_store(config)
    runtime = BrokerRuntime(config, store, election, metrics)
    broker_pb2_grpc.add_KVBrokerServicer_to_server(BrokerService(runtime, Access(config)), server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    metrics_server, metrics_port = None, 0
    if config.metrics_listen:
        mhost, mport = parse_host_port(config.metrics_listen, "metrics_listen")
        metrics_server, _thread = start_http_server(mport, addr=mhost, registry=metrics.registry)
        metrics_port = metrics_server.server_port
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def follow_leadership() -> None:
        while True:
            await runtime.leader_changed.wait()
            runtime.leader_changed.clear()
            status = health_pb2.HealthCheckResponse.SERVING if runtime.is_leader else \
                health_pb2.HealthCheckResponse.NOT_SERVING
            await health_servicer.set(SERVICE_NAME, status)

    watcher = asyncio.create_task(follow_leadership())
    await runtime.start()
    log.info("broker.listening", address=f"{host}:{bound}", metrics_port=metrics_port, store=store.kind,
             replica=config.replica, policy=config.eviction_policy,
             tls="mutual" if config.mutual_tls else "server" if tls.enabled else "off")
    if config.port_file is not None:
        write_port_file(config.port_file, bound)
    return RunningBroker(config, server, runtime, health_servicer, bound, metrics_port, metrics_server, watcher)


async def serve(config: BrokerConfig) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    running = await start_broker(config)
    try:
        await wait_for_stop()
    finally:
        await running.stop()
