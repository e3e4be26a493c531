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

PROGRESS_METRICS = ("vllm:iteration_tokens_total_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
"""vLLM 0.32's counters that move with every engine step (steps, prompt tokens computed, tokens generated)."""


def progress_count(metrics_text: str) -> float | None:
    """The sum of :data:`PROGRESS_METRICS` over every label set in a Prometheus text exposition; None when the
    exposition holds none of them (not a vLLM engine, or a vLLM that renamed them)."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        name = line.split(" ", 1)[0].split("{", 1)[0]
        if name not in PROGRESS_METRICS:
            continue
        try:
            total += float(line.rsplit(" ", 1)[1])
            seen = True
        except (IndexError, ValueError):
            continue
    return total if seen else None


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
