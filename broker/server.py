"""Start and stop a broker replica: gRPC server with health and reflection, metrics endpoint, the
runtime (election, expiry ticks) and graceful shutdown on SIGTERM/SIGINT.

TLS: with ``tls_cert`` and ``tls_key`` the gRPC port speaks TLS; with ``tls_ca`` too, clients must present
a certificate signed by it. Every call is authenticated (a token signed with ``auth_secret_file``, or the client
certificate) and authorized by role (:mod:`kvloop.broker.access`); ``dev_no_auth`` turns that off, loudly. Health
and reflection share the port and need no token (they carry no user data), but a client certificate under mTLS.

Health: the overall service ``""`` is SERVING while the process is up (liveness); ``kvloop.v1.KVBroker``
is SERVING only while this replica is the leader (readiness: route traffic here).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

import grpc
import structlog

from kvloop.broker.access import Access
from kvloop.broker.config import BrokerConfig
from kvloop.broker.metrics import BrokerMetrics
from kvloop.broker.runtime import BrokerRuntime
from kvloop.broker.service import BrokerService
from kvloop.broker.store import Election, MemoryStore, SoloElection, Store
from kvloop.shared.config import parse_host_port
from kvloop.shared.grpc_server import GrpcShell, start_grpc_server
from kvloop.shared.serving import freeze_started_heap, wait_for_stop, write_port_file
from kvloop.shared.tls import TlsFiles
from kvloop.v1 import broker_pb2, broker_pb2_grpc

log = structlog.get_logger("kvloop.broker")
SERVICE_NAME = broker_pb2.DESCRIPTOR.services_by_name["KVBroker"].full_name


def make_store(config: BrokerConfig) -> tuple[Store, Election]:
    if config.store == "memory":
        return MemoryStore(), SoloElection(config.advertised)
    from kvloop.broker.store.etcd import EtcdElection, EtcdStore, connect

    client = connect(config.etcd_endpoint)
    store = EtcdStore(client, config.etcd_prefix, config.replica, engine_ttl_s=config.engine_ttl_s)
    election = EtcdElection(client, store, config.etcd_prefix, config.replica, config.advertised,
                            ttl_s=config.leader_ttl_s)
    return store, election


@dataclass
class RunningBroker:
    config: BrokerConfig
    shell: GrpcShell
    runtime: BrokerRuntime
    _watcher: asyncio.Task[None]

    @property
    def port(self) -> int:
        return self.shell.port

    @property
    def metrics_port(self) -> int:
        return self.shell.metrics_port

    @property
    def server(self) -> grpc.aio.Server:
        return self.shell.server

    async def stop(self) -> None:
        """Drain: report NOT_SERVING, let in-flight RPCs finish, resign leadership, close the store."""
        log.info("broker.stopping", grace_s=self.config.shutdown_grace_s)
        self._watcher.cancel()
        self.runtime.drain()
        await self.shell.stop(self.config.shutdown_grace_s)
        await self.runtime.stop()
        log.info("broker.stopped")


async def start_broker(config: BrokerConfig, metrics: BrokerMetrics | None = None) -> RunningBroker:
    config.require_auth()
    metrics = metrics or BrokerMetrics()
    built: dict[str, Any] = {}

    def add_servicers(server: grpc.aio.Server, bound: int) -> None:
        nonlocal config
        if not config.advertise and parse_host_port(config.listen, "listen")[1] == 0:
            # Port 0 picks a free port: advertise the port bound (followers name it to clients), not ":0".
            config = replace(config, advertise=f"{config.listen.rpartition(':')[0]}:{bound}")
        store, election = make_store(config)
        built["store"] = store
        built["runtime"] = runtime = BrokerRuntime(config, store, election, metrics)
        broker_pb2_grpc.add_KVBrokerServicer_to_server(BrokerService(runtime, Access(config)), server)

    tls = TlsFiles.of(config, "tls_")
    shell = await start_grpc_server(
        listen=config.listen, services=[SERVICE_NAME], add_servicers=add_servicers, tls=tls,
        registry=metrics.registry, metrics_listen=config.metrics_listen,
        options=[("grpc.max_receive_message_length", config.max_message_bytes),
                 ("grpc.max_send_message_length", config.max_message_bytes), ("grpc.so_reuseport", 0)])
    runtime: BrokerRuntime = built["runtime"]

    async def follow_leadership() -> None:
        while True:
            await runtime.leader_changed.wait()
            runtime.leader_changed.clear()
            await shell.set_serving(SERVICE_NAME, runtime.is_leader)

    watcher = asyncio.create_task(follow_leadership())
    await runtime.start()
    log.info("broker.listening", address=f"{config.listen.rpartition(':')[0]}:{shell.port}",
             metrics_port=shell.metrics_port, store=built["store"].kind, replica=config.replica,
             policy=config.eviction_policy, tls="mutual" if config.mutual_tls else "server" if tls.enabled else "off",
             auth=",".join(a for a, on in (("token", config.auth_secret_file is not None),
                                           ("certificate", config.mutual_tls)) if on) or "OFF (dev_no_auth)")
    if not (config.auth_secret_file or config.mutual_tls):
        log.warning("broker.auth_off_for_development", dev_no_auth=True,
                    detail="every caller is accepted unchecked: any process that reaches this port may register "
                           "as an engine and receive users' prompts; never run a shared cluster like this")
    freeze_started_heap()
    if config.port_file is not None:
        write_port_file(config.port_file, shell.port)
    return RunningBroker(config, shell, runtime, watcher)


async def serve(config: BrokerConfig) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    running = await start_broker(config)
    try:
        await wait_for_stop()
    finally:
        await running.stop()
