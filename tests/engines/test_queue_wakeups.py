"""No engine kvloop starts stalls on a lost queue wake-up.

vLLM's EngineCore and worker wake each other over shared-memory queues with a notification that can be lost;
an idle reader then re-read the shared-memory flag only every 5 s. kvloop's queue-spin cap makes readers go idle
between steps, so lost notifications stalled requests and streams for ~5 s. On an engine bound to one core, as
kvloop binds its decode engine, this load had 41 and 25 of 60 requests over 1 s in two runs before the fix, 0
and 0 after (slowest time to first token 0.65-0.74 s); the test runs half that load (30 requests), where those
rates would stall 12-20. ``engines.connector.patches.cap_ipc_spin`` bounds the park.

It drives the shared decode engine (kvloop's connector, bound to the decode core, the launcher's default cap)
directly, not through the router: a decode engine also serves plain requests (the DECODE_LOCAL path), and the
probe needs no engine of its own.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from kvloop.app.benchmarks.stall_probe import ProbeShape, probe, summary
from kvloop.engines.config import role_cores

if TYPE_CHECKING:
    from tests.engines.conftest import PDEngines

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BOUND_S = 1.5
"""A gap between two streamed tokens: far under the 5 s of a lost wake-up (a decode step here is 10-60 ms)."""
TTFT_BOUND_S = 3.0
"""A first token: still 2 s under a lost wake-up's 5 s, with room over the compute of the first turns (three
1,536-token prompts at once on one core: 0.65-0.74 s alone here, 1.86 s once on a CI machine with the chaos run
beside it)."""
SHAPE = ProbeShape(sessions=3, turns=10, max_prompt_tokens=3840)
"""Prompts of 1.5k-3.8k tokens and answers of at most 256 within the shared engines' 4096-token context."""


def test_concurrent_streams_never_wait_on_a_lost_wake_up(pd_engines: PDEngines) -> None:
    """Three concurrent streamed sessions of growing prompts (32-256 tokens each answer, 0.2-1.5 s between turns)
    against the decode engine: no time to first token over TTFT_BOUND_S, no gap between two streamed tokens over
    BOUND_S."""
    decode = pd_engines.decode
    config = decode.plan.config
    assert config.ipc_spin_s < 1  # the cap under test is on (vLLM's own spin is 1 s)
    assert config.resolved_omp_threads_bind() == role_cores("decode")
    assert SHAPE.max_prompt_tokens + SHAPE.answer_tokens[1] <= config.max_model_len
    requests = asyncio.run(probe(decode.url, pd_engines.model_name, SHAPE))
    figures = summary(requests, BOUND_S)
    print(f"\nqueue wake-ups: {figures}")
    stalled = [r for r in requests if r.ttft_s > TTFT_BOUND_S or r.max_gap_s > BOUND_S]
    assert len(requests) == 30 and all(r.tokens > 0 for r in requests)
    assert not stalled, stalled
