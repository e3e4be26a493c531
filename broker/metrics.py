"""Prometheus metrics for the broker. Gauges are read from the state at scrape time by a collector,
so the core keeps no metric code; counters and histograms are recorded by the shell."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvloop.broker.core import BrokerState

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _StateCollector(Collector):
    def __init__(self) -> None:
        self.state: BrokerState | None = None
        self.leader = False

    def collect(self) -> Iterator[GaugeMetricFamily]:
        leader = GaugeMetricFamily("kvloop_broker_leader", "1 while this replica is the leader")
        leader.add_metric([], 1.0 if self.leader else 0.0)
        yield leader
        state = self.state
        retained = GaugeMetricFamily("kvloop_broker_retained_blocks", "KV blocks retained per engine",
                                     labels=["engine"])
        budget = GaugeMetricFamily("kvloop_broker_retention_budget_blocks", "retention budget per engine",
                                   labels=["engine"])
        leases = GaugeMetricFamily("kvloop_broker_leases", "leases held per engine", labels=["engine"])
        pins = GaugeMetricFamily("kvloop_broker_pins", "pins in flight")
        engines = GaugeMetricFamily("kvloop_broker_engines", "live engines by role", labels=["role"])
        host = GaugeMetricFamily("kvloop_broker_host_tier_blocks", "host-tier slots in use per engine (demoted "
                                 "leases)", labels=["engine"])
        sessions = GaugeMetricFamily("kvloop_broker_sessions", "sessions callers hinted, by state (active, paused, "
                                     "ended)", labels=["state"])
        cached = GaugeMetricFamily("kvloop_broker_cached_blocks", "blocks in each engine's soft index (its prefix "
                                   "cache, as its KV events tell it)", labels=["engine"])
        if state is not None:
            by_role: dict[str, int] = {}
            for engine_id, rec in list(state.engines.items()):
                retained.add_metric([engine_id], state.retained_blocks(engine_id))
                host.add_metric([engine_id], state.host_blocks(engine_id))
                budget.add_metric([engine_id], rec.info.retention_budget_blocks)
                leases.add_metric([engine_id], len(state.engine_lease_ids(engine_id)))
                cached.add_metric([engine_id], state.soft.cached_blocks(engine_id))
                by_role[rec.info.role.value] = by_role.get(rec.info.role.value, 0) + 1
            for role, n in by_role.items():
                engines.add_metric([role], n)
            pins.add_metric([], len(state.pins))
            for name, n in state.sessions.counts(time.time()).items():
                sessions.add_metric([name], n)
        yield from (retained, budget, leases, pins, engines, cached, host, sessions)


class BrokerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._collector = _StateCollector()
        self.registry.register(self._collector)
        self.evictions = Counter("kvloop_broker_evictions", "eviction commands issued, by reason", ["reason"],
                                 registry=self.registry)
        self.demotions = Counter("kvloop_broker_demotions", "demotions to a host tier, by outcome: commanded (an "
                                 "eviction command with demote_to), copied or failed (the engine's report)",
                                 ["outcome"], registry=self.registry)
        self.prefetches = Counter("kvloop_broker_prefetches", "promotions of a paused session's host-tier lease back "
                                  "into the pool before its resume, by outcome: commanded, loaded or failed (the "
                                  "engine's report), used or unused (the session's next placement: DECODE_LOCAL on "
                                  "the engine holding it, or not)", ["outcome"], registry=self.registry)
        self.placements = Counter("kvloop_broker_placements", "placements, by decision and reason",
                                  ["decision", "reason"], registry=self.registry)
        self.source_tiers = Counter("kvloop_broker_placement_source_tier", "placements that reuse a lease, by the "
                                    "tier the lease is on (pool, host: a tier hit)", ["tier"], registry=self.registry)
        self.placement_latency = Histogram("kvloop_broker_placement_seconds", "placement latency inside the broker",
                                           buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.rpc_latency = Histogram("kvloop_broker_rpc_seconds", "RPC handling latency", ["method"],
                                     buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.cache_events = Counter("kvloop_broker_cache_events", "engines' prefix-cache events applied to the soft "
                                    "index, by kind (stored, removed, cleared)", ["kind"], registry=self.registry)
        self.cache_resets = Counter("kvloop_broker_cache_resets", "soft index resets, by reason (requested, gap, "
                                    "incarnation)", ["reason"], registry=self.registry)
        self.rpc_errors = Counter("kvloop_broker_rpc_errors", "RPCs refused, by method and status code",
                                  ["method", "code"], registry=self.registry)
        self.session_hints = Counter("kvloop_broker_session_hints", "session hints, by hint (pause, end, priority, "
                                     "keep_generated) and outcome: granted, capped (granted less than asked) or "
                                     "refused (the hint or the whole call)", ["hint", "outcome"],
                                     registry=self.registry)
        self.residuals_clipped = Counter("kvloop_broker_residuals_clipped", "placements whose router's measured "
                                         "residual exceeded residual_bound_s and was applied only to the bound, by "
                                         "kind (pd, decode_local): the cost model is off by more than it may correct",
                                         ["kind"], registry=self.registry)
        self.auth_refusals = Counter("kvloop_broker_auth_refusals", "calls refused by authentication or "
                                     "authorization (broker.access), by method and status code", ["method", "code"],
                                     registry=self.registry)

    def set_state(self, state: BrokerState | None, *, leader: bool) -> None:
        self._collector.state = state
        self._collector.leader = leader
