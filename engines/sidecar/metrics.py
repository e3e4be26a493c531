"""The sidecar's Prometheus metrics (its own registry), and what it reads of the engine's."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvloop.shared.http import metric_total, read_metrics

ENGINE_FIGURES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
                  "vllm:kv_cache_usage_perc": "kv_usage"}


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
        self.cache_events = Counter("kvloop_sidecar_cache_events_total", "vLLM KV cache events received, by type",
                                    ["type"], registry=r)
        self.cache_resets = Counter("kvloop_sidecar_cache_resets_total", "times the prefix-cache mirror or the "
                                    "broker's index of it started over, by reason", ["reason"], registry=r)
        self.cache_replays = Counter("kvloop_sidecar_cache_replays_total", "gaps in the engine's KV events asked of "
                                     "its replay endpoint, by outcome (covered, missed)", ["outcome"], registry=r)
        self.cached_blocks = Gauge("kvloop_sidecar_cached_blocks", "blocks of the engine's prefix cache the mirror "
                                   "names", registry=r)
        self.resyncs = Counter("kvloop_sidecar_resyncs_total", "re-registrations because the broker listed another "
                               "number of leases for the engine than the sidecar held", registry=r)
        self.freed_while_pinned = Counter("kvloop_sidecar_freed_while_pinned_total", "leases whose blocks the engine "
                                          "freed on its own while the broker had them pinned (must stay 0)",
                                          registry=r)
        self.unknown_released_pinned = Counter(
            "kvloop_sidecar_unknown_released_while_pinned_total", "leases the broker offered that this sidecar did "
            "not know (a restart, a lost reply), released while a reader had them pinned: the engine still holds "
            "their blocks, released at the broker when the pin ends", registry=r)
        self.engine_responsive = Gauge("kvloop_sidecar_engine_responsive", "1 while the engine answers its /health "
                                       "(0: keep-alives withheld, see engine_unresponsive_s)", registry=r)
        self.engine_responsive.set(1)
        self.demotions = Counter("kvloop_sidecar_demotions_total", "leases the broker demoted to the host tier, by "
                                 "outcome (copied, failed)", ["outcome"], registry=r)
        self.promotions = Counter("kvloop_sidecar_promotions_total", "host-tier leases the broker asked to load "
                                  "back into the pool before their session resumes, by outcome (loaded, failed)",
                                  ["outcome"], registry=r)
        self.host_tier_leases = Gauge("kvloop_sidecar_host_tier_leases", "leases on the engine's host tier",
                                      registry=r)
        self.transfer_bps = Gauge("kvloop_sidecar_transfer_bytes_per_second", "Measured NIXL pull bandwidth",
                                  registry=r)


def scrape_engine_load(engine_url: str, timeout_s: float = 2.0) -> dict[str, float]:
    """Running and waiting requests and KV usage from vLLM's ``/metrics`` (blocking: run in a thread)."""
    samples = read_metrics(engine_url, timeout_s=timeout_s)
    return {short: metric_total(samples, name) for name, short in ENGINE_FIGURES.items()
            if any(k == name or k.startswith(name + "{") for k in samples)}


def post_json(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST ``body`` as JSON and return the JSON reply (blocking: run in a thread); raises OSError on a status
    other than 200 or no answer, ValueError on a reply that is not JSON."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        if reply.status != 200:
            raise OSError(f"{url} answered {reply.status}")
        out: dict[str, Any] = json.loads(reply.read())
        return out


def probe_health(engine_url: str, timeout_s: float) -> None:
    """GET the engine's ``/health`` (blocking: run in a thread); raises OSError when it does not answer 200."""
    with urllib.request.urlopen(f"{engine_url.rstrip('/')}/health", timeout=timeout_s) as reply:
        if reply.status != 200:
            raise OSError(f"/health answered {reply.status}")
