"""The engine sidecar: one per engine, a separate process beside ``vllm serve`` (``kvloop sidecar``,
``python -m kvloop.engines.sidecar``). Reading path: :mod:`.config`, :mod:`.books` (pure), :mod:`.service`,
:mod:`.metrics`; for the prefix cache :mod:`.cache_events` (pure), then :mod:`.cache_feed`.

It is the engine's only voice towards the broker (``kvloop.v1.KVBroker`` stubs):

- **Registration**: when the connector attaches (``kvloop.v1.EngineLink`` on a Unix socket private to the
  engine) its hello gives the block size, the number of KV blocks and the bytes per block; the sidecar
  registers the engine (role, addresses, layout fingerprint, retention budget = ``retention_fraction`` of
  the KV blocks, a new incarnation per connector start) and keeps it alive every ``keepalive_interval_s``
  the broker asks for, re-registering when the broker forgot it (a restarted broker).
- **Leases**: each ``Retained`` event becomes a ``PublishLease`` (block keys computed here with the
  shared :mod:`kvloop.shared.hashing`, so the EngineCore never hashes); a refused or failed publication releases
  the blocks at once, since nobody could find them.
- **Evictions**: the ``WatchEvictions`` stream (resumed from the last applied sequence number; a RESYNC
  releases whatever the broker no longer lists) becomes release commands to the connector. With every
  keep-alive the sidecar also renews the connector's safety hold of the leases still live, so a renewed
  lease stays held on the engine, and a dead sidecar lets the engine free them after one hold.
- **Prefix cache** (with ``kv_events_endpoint``): the engine's vLLM KV cache events (ZMQ), mirrored as kvloop
  block keys and reported to the broker's soft index (``ReportCacheEvents``) in numbered batches; a gap is
  asked of the publisher's replay endpoint, and the whole mirror is sent again whenever the broker may have lost
  it (a re-registration, a failed call, an ack that shows a reset).
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
import sys

from kvloop.engines.sidecar.config import SidecarConfig
from kvloop.engines.sidecar.metrics import SidecarMetrics
from kvloop.engines.sidecar.service import Sidecar, serve
from kvloop.shared.errors import ConfigError
from kvloop.shared.serving import run_service

__all__ = ["Sidecar", "SidecarConfig", "SidecarMetrics", "main", "serve"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvloop sidecar", description="kvloop's engine sidecar")
    SidecarConfig.add_arguments(parser)
    try:
        config = SidecarConfig.load(parser.parse_args(argv))
    except ConfigError as exc:
        print(f"kvloop sidecar: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return run_service("kvloop-sidecar", config, serve)
