"""Busy or frozen: an engine's progress while a non-streamed answer is outstanding. Pure: time is an argument.

A non-streamed answer sends no byte until it is complete, so silence on its socket says nothing: a few thousand
tokens on a GPU take minutes. What tells a busy engine from a frozen one is the engine's own step counters
(vLLM's ``/metrics``): a busy engine's move every step, whatever request the step served; a frozen engine (a
SIGSTOPped process, a hung EngineCore) answers no scrape or shows the same counts. The router scrapes the engine
while it waits (:meth:`kvloop.router.engine_calls.EngineCalls.post`) and takes it as frozen once
``engine_stall_s`` has passed without a scrape that showed progress.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvloop.shared.http import metric_total, parse_metrics

PROGRESS_METRICS = ("vllm:iteration_tokens_total_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
"""vLLM 0.32's counters that move with every engine step (steps, prompt tokens computed, tokens generated)."""


def progress_count(metrics_text: str) -> float | None:
    """The sum of :data:`PROGRESS_METRICS` over every label set in a Prometheus text exposition; None when the
    exposition holds none of them (not a vLLM engine, or a vLLM that renamed them) or does not parse."""
    try:
        samples = parse_metrics(metrics_text)
    except ValueError:
        return None
    if not any(key.split("{", 1)[0] in PROGRESS_METRICS for key in samples):
        return None
    return sum(metric_total(samples, name) for name in PROGRESS_METRICS)


@dataclass
class ProgressWatch:
    """Whether an engine has shown progress within ``stall_s``. Progress is the start of the watch (the engine
    has had no time to show any), an answered scrape whose count differs from the last, or an answered scrape with
    no counters at all (an engine that is not vLLM: it answers, and no more can be told)."""

    stall_s: float
    last_progress: float
    count: float | None = None

    def observe(self, answered: bool, count: float | None, now: float) -> None:
        """A scrape: whether the engine answered it, and the count it showed (None: no counters)."""
        if answered and (count is None or count != self.count):
            self.count, self.last_progress = count, now

    def frozen(self, now: float) -> bool:
        return now - self.last_progress >= self.stall_s
