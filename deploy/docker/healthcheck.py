"""Container health check for kvloop images: ``python healthcheck.py [TARGET]``; exit 0 when healthy.

TARGET (else ``$HEALTHCHECK_TARGET``) is one of:

- ``grpc://HOST:PORT[/SERVICE]``: ``grpc.health.v1`` Check of SERVICE ('' = the process is up); the broker's
  ``kvloop.v1.KVBroker`` is SERVING on the leader only, the sidecar's ``kvloop.v1.EngineLink`` once registered;
- ``http://HOST:PORT/PATH``: a 2xx answer (the router's and vLLM's ``/health``).

Standard library and the image's own grpcio only: no probe binary to fetch.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 3.0


def check_grpc(target: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address, _, service = target.partition("/")
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            print(f"unhealthy: {target}: {exc}", file=sys.stderr)
            return False
    ok = bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    if not ok:
        print(f"unhealthy: {target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
              file=sys.stderr)
    return ok


def check_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as reply:
            return 200 <= int(reply.status) < 300
    except (OSError, urllib.error.URLError) as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return False


def main(argv: list[str]) -> int:
    target = argv[1] if len(argv) > 1 else os.environ.get("HEALTHCHECK_TARGET", "")
    if target.startswith("grpc://"):
        return 0 if check_grpc(target.removeprefix("grpc://")) else 1
    if target.startswith(("http://", "https://")):
        return 0 if check_http(target) else 1
    print(f"healthcheck: target must be grpc://HOST:PORT[/SERVICE] or an http(s) URL (got {target!r})",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
