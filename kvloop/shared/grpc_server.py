"""The gRPC server every kvloop service shell starts the same way: its servicers, gRPC health and reflection,
TLS or mutual TLS from PEM files, an optional Unix socket, and Prometheus metrics on their own HTTP port.

Health: the overall service ``""`` is SERVING from start (liveness); each named service starts NOT_SERVING
and the service flips it (:meth:`GrpcShell.set_serving`) when it is ready for traffic (readiness).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from kvloop.shared.config import parse_host_port
from kvloop.shared.tls import TlsFiles


@dataclass
class GrpcShell:
    server: grpc.aio.Server
    health: health_aio.HealthServicer
    port: int
    """The bound TCP port (the real one when ``listen`` asked for port 0)."""
    metrics_port: int
    unix_socket: Path | None
    _metrics_server: Any

    async def set_serving(self, service: str, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(service, status)

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING everywhere, let in-flight RPCs finish for ``grace_s``, close the metrics port."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        if self.unix_socket is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_socket)


async def start_grpc_server(*, listen: str, services: Sequence[str],
                            add_servicers: Callable[[grpc.aio.Server, int], None], tls: TlsFiles | None = None,
                            registry: CollectorRegistry | None = None, metrics_listen: str = "",
                            unix_socket: Path | None = None, options: Sequence[tuple[str, Any]] = ()) -> GrpcShell:
    """Bind ``listen`` (field ``listen``; TLS when ``tls`` is enabled) and ``unix_socket`` (plaintext), call
    ``add_servicers(server, bound_port)``, add health and reflection for ``services``, start metrics on
    ``metrics_listen`` (empty: none), start serving."""
    server = grpc.aio.server(options=list(options))
    if unix_socket is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(unix_socket)
        unix_socket.parent.mkdir(parents=True, exist_ok=True)
        if server.add_insecure_port(f"unix://{unix_socket}") == 0:
            raise OSError(f"socket: cannot bind {unix_socket}")
    host, port = parse_host_port(listen, "listen")
    target = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    bound = server.add_secure_port(target, tls.server_credentials()) if tls is not None and tls.enabled else \
        server.add_insecure_port(target)
    if bound == 0:
        raise OSError(f"listen: cannot bind {listen}")
    add_servicers(server, bound)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*services, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    metrics_server, metrics_port = None, 0
    if metrics_listen:
        mhost, mport = parse_host_port(metrics_listen, "metrics_listen")
        metrics_server, _thread = start_http_server(mport, addr=mhost, registry=registry or CollectorRegistry())
        metrics_port = int(metrics_server.server_port)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    for service in services:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    return GrpcShell(server, health_servicer, bound, metrics_port, unix_socket, metrics_server)
