"""A prediction (``kvloop plan simulate``'s JSON) beside a measurement (``kvloop bench load``'s): per configuration
and load point present in both, each figure predicted and measured, its relative error and the n of each side. Pure.

A point the measurement marks unhealthy is listed, flagged: its figures hold a stall or errors the model does not
predict, so its error says nothing about the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvloop.app.benchmarks.stats import markdown_table

METRICS: dict[str, tuple[str, str | None]] = {
    "goodput_rps": ("goodput_rps", None),
    "throughput_rps": ("throughput_rps", None),
    "ttft_p50_ms": ("ttft_ms", "p50"),
    "ttft_p99_ms": ("ttft_ms", "p99"),
    "itl_p50_ms": ("itl_ms", "p50"),
}
"""Each compared figure: its field in a load point, and the percentile within it (None: a rate over the point)."""

SAME_RUN_KEYS = ("workload", "slo")
"""Top-level objects whose shared keys must agree for the two runs to be the same workload."""


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured; None where either is missing or the measurement is 0."""
    if predicted is None or measured is None or measured == 0:
        return None
    return round((predicted - measured) / measured, 3)


def figure(point: Mapping[str, Any], metric: str) -> tuple[float | None, int]:
    """One figure of a load point and its n: the requests for a rate, the percentile's sample for a percentile."""
    name, quantile = METRICS[metric]
    if quantile is None:
        return point.get(name), int(point.get("requests", 0))
    stats = point.get(name) or {}
    return stats.get(quantile), int(stats.get("n", 0))


def compare_point(config: str, predicted: Mapping[str, Any], measured: Mapping[str, Any]) -> dict[str, Any]:
    health = measured.get("health") or {}
    healthy = bool(health.get("healthy", True))
    row: dict[str, Any] = {"config": config, "load": measured["load"], "measured_healthy": healthy,
                           "flag": "" if healthy else f"measured unhealthy: {health.get('reason', '')}",
                           "figures": {}}
    for metric in METRICS:
        (p, n_p), (m, n_m) = figure(predicted, metric), figure(measured, metric)
        row["figures"][metric] = {"predicted": p, "measured": m, "error": relative_error(p, m),
                                  "n_predicted": n_p, "n_measured": n_m}
    return row


def mismatches(predicted: Mapping[str, Any], measured: Mapping[str, Any]) -> list[str]:
    """The workload and SLO settings both runs state and state differently: where they differ, so do the runs."""
    out = []
    for section in SAME_RUN_KEYS:
        p, m = predicted.get(section) or {}, measured.get(section) or {}
        out += [f"{section}.{k}: predicted {p[k]!r}, measured {m[k]!r}" for k in sorted(set(p) & set(m))
                if p[k] != m[k]]
    return out


def compare_runs(predicted: Mapping[str, Any], measured: Mapping[str, Any]) -> dict[str, Any]:
    """Every configuration and load point in both runs, compared, in the predicted run's order."""
    rows = []
    for config, entry in predicted.get("configs", {}).items():
        measured_points = {float(p["load"]): p for p in measured.get("configs", {}).get(config, {}).get("points", [])}
        for point in entry.get("points", []):
            if (m := measured_points.get(float(point["load"]))) is not None:
                rows.append(compare_point(config, point, m))
    return {"rows": rows, "mismatches": mismatches(predicted, measured),
            "profile": predicted.get("profile", {}), "metrics": list(METRICS)}


def _cell(entry: Mapping[str, Any]) -> str:
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:g}"

    error = entry["error"]
    return f"{num(entry['predicted'])} / {num(entry['measured'])} ({'-' if error is None else f'{error:+.0%}'})"


def compare_table(result: Mapping[str, Any]) -> str:
    """One row per point: each figure as ``predicted / measured (error)``, then the n of each side."""
    rows = []
    for row in result["rows"]:
        figures = row["figures"]
        rate, ttft = figures["goodput_rps"], figures["ttft_p50_ms"]
        rows.append([row["config"], f"{row['load']:g}", "yes" if row["measured_healthy"] else "NO (flagged)",
                     *(_cell(figures[m]) for m in METRICS),
                     f"{rate['n_predicted']} / {rate['n_measured']}", f"{ttft['n_predicted']} / {ttft['n_measured']}"])
    return markdown_table(["config", "load", "measured healthy", "goodput/s P / M (err)", "req/s P / M (err)",
                           "TTFT p50 ms P / M (err)", "TTFT p99 ms P / M (err)", "ITL p50 ms P / M (err)",
                           "n requests P / M", "n TTFT P / M"], rows)
