"""Checks the engine tests share: Prometheus samples, polling, and answers equal up to a near-tie."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvloop.shared.http import read_metrics

T = TypeVar("T")

def scrape(url: str, attempts: int = 3, timeout_s: float = 60.0) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value} (samples only); retried on a new connection."""
    return read_metrics(url, timeout_s=timeout_s, attempts=attempts)


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


NEAR_TIE = 0.05  # nats: where greedy paths may legitimately part


def wait_for(fn: Callable[[], T], ok: Callable[[T], bool], *, timeout_s: float, what: str) -> T:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if ok(last):
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last: {last!r}")


def assert_same_tokens(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Chat answers with logprobs: equal token for token, or parting at a near-tie of the reference."""
    a = got["choices"][0]["logprobs"]["content"]
    b = want["choices"][0]["logprobs"]["content"]
    for x, y in zip(a, b, strict=False):
        if x["token"] != y["token"]:
            tops = sorted((t["logprob"] for t in y["top_logprobs"]), reverse=True)
            assert len(tops) >= 2 and tops[0] - tops[1] < NEAR_TIE, (x, y)
            return
    assert len(a) == len(b)
