"""Prometheus metrics of the router, recorded by the shell (router/turn.py, router/placement.py, router/server.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvloop.shared.protocol import PrefillReport
from kvloop.shared.vocabulary import Path, PlanOutcome, TurnReason

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kvloop_router_ttft_seconds", "Time to first token as the client sees it, by decision",
                              ["decision"], buckets=_TTFT_BUCKETS, registry=r)
        self.decisions = Counter("kvloop_router_decisions_total", "Turns by the path they actually took (measured) "
                                 "and the plan's reason", ["decision", "reason"], registry=r)
        self.plan_outcomes = Counter("kvloop_router_plan_outcomes_total", "Turns by planned path, actual path and "
                                     "outcome (as_planned, other_path, less_reused)", ["planned", "actual", "outcome"],
                                     registry=r)
        self.tokens = Counter("kvloop_router_prompt_tokens_total", "Prompt tokens by what the engines measured: "
                              "found in the serving engine's own cache (local), pulled, or computed", ["kind"],
                              registry=r)
        self.pull_bytes = Counter("kvloop_router_pull_bytes_total", "KV bytes pulled by prefill engines", registry=r)
        self.pull_seconds = Histogram("kvloop_router_pull_seconds", "Pull time reported by prefill engines",
                                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0), registry=r)
        self.broker_errors = Counter("kvloop_router_broker_errors_total", "Failed broker calls, by method",
                                     ["method"], registry=r)
        self.fallbacks = Counter("kvloop_router_fallbacks_total", "Fallbacks taken, by kind", ["kind"], registry=r)
        self.publication_waits = Counter("kvloop_router_publication_waits_total", "Turns that re-placed while the "
                                         "previous answer's lease was being published, by outcome", ["outcome"],
                                         registry=r)
        self.residuals = Gauge("kvloop_router_path_residual_seconds", "This router's measured residual of the "
                               "broker's estimates (seconds to first token beyond the plan's), by kind of path (pd, "
                               "decode_local), as of its last turn of that kind", ["kind"], registry=r)
        self.session_hints = Counter("kvloop_router_session_hints_total", "Session hints sent to the broker, by "
                                     "source (turn: on a chat or completions request; rest: /v1/sessions) and "
                                     "outcome (granted, partly: some part refused or capped, failed)",
                                     ["source", "outcome"], registry=r)
        self.requests = Counter("kvloop_router_requests_total", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)

    def turn_finished(self, path: Path, planned: Path, reason: TurnReason, outcome: PlanOutcome,
                      report: PrefillReport, ttft_s: float) -> None:
        """A finished turn's figures: its actual ``path``, the ``planned`` one, the plan's ``reason``, the
        plan-against-actual ``outcome`` and the engines' ``report``."""
        self.ttft.labels(path).observe(ttft_s)
        self.decisions.labels(path, reason).inc()
        self.plan_outcomes.labels(planned, path, outcome).inc()
        self.tokens.labels("local").inc(report.local_tokens)
        self.tokens.labels("pulled").inc(report.pulled_tokens)
        self.tokens.labels("computed").inc(report.computed_tokens)
        if report.pulled_bytes:
            self.pull_bytes.inc(report.pulled_bytes)
            self.pull_seconds.observe(report.pull_ms / 1e3)
