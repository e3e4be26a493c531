"""``kvloop bench profile`` against the shared decode engine (no engine of its own): a small measurement, ~20 s,
fits a profile whose figures are positive where they must be, whose prefill fit explains the latencies, and whose
file loads back; and the fleet model, fed that profile, predicts a small burst on the same engine within a stated
factor (the CI-sized check of issue 51).

The decode engine serves plain requests (the DECODE_LOCAL path), so it is measured directly; its settings come from
its launcher config (step budget 512, vLLM's CPU default of 128 seats) and its pool from its own metrics.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest

from kvloop.app.benchmarks.aiperf import Slo
from kvloop.app.benchmarks.profile import ProfilePlan, facts_of, profile_engine, write_run
from kvloop.app.benchmarks.workload import Conversation
from kvloop.app.fleet.sim import FleetSpec, simulate
from kvloop.engines.config import DECODE_STEP_TOKENS
from kvloop.shared.engine_model import load_profile

if TYPE_CHECKING:
    from tests.engines.conftest import PDEngines

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PLAN = ProfilePlan(lengths=(64, 256, 1024, 2048), repeats=2, streams=(1, 2), contexts=(64, 1024), decode_tokens=24,
                   prefix_tokens=512, budget_s=30.0)
"""Four lengths (1024 and 2048 take two and four of the engine's 512-token steps), two stream counts and two
contexts: the fewest shapes the fit takes, within the shared engines' 4096-token context."""
PREFILL_R2_MIN = 0.8
"""Prefill latency spans ~30x from 64 to 2048 tokens on one core, far more than the shared machine's noise; the
decode rows (one or two streams) vary too little against that noise to bound their R² here."""


def test_profile_of_the_decode_engine(pd_engines: PDEngines, tmp_path: Path) -> None:
    engine = pd_engines.decode
    facts = facts_of(engine)
    assert facts.max_num_batched_tokens == DECODE_STEP_TOKENS and facts.block_size == 128
    assert facts.kv_pool_blocks > 0 and facts.bytes_per_block == 2 * 4 * 2 * 64 * 128 * 4  # the tiny model, float32

    profile, run = profile_engine(engine.url, pd_engines.model_name, facts=facts, plan=PLAN, name="decode-test")

    assert profile.prefill_token_s > 0 and profile.step_base_s + profile.decode_stream_s > 0
    assert run.errors["prefill"].r2 is not None and run.errors["prefill"].r2 >= PREFILL_R2_MIN, run.errors
    assert run.errors["prefill"].n >= len(PLAN.lengths) and run.errors["decode"].n == 4, run.samples.skipped
    assert all(s.step_s > 0 and s.tokens >= 2 for s in run.samples.decode)
    assert run.samples.prefix_cache["first_s"] > 0 and run.samples.prefix_cache["second_s"] > 0
    assert run.samples.seconds < 3 * PLAN.budget_s
    assert all(profile.source[g].startswith("measured here:") for g in ("prefill", "decode", "api", "pool"))

    out = tmp_path / "profile.json"
    evidence = write_run(out, profile, run)
    assert load_profile(out) == profile
    assert evidence.is_file() and evidence.name == "profile.samples.json"


MODEL_CHECK_FACTOR = 2.0
"""The CI-sized check of the fleet model (issue 51): its TTFT p50 for a small burst against the profile just measured,
within this factor of the engine's own. Loose on purpose: the shared CI machine runs other processes beside the
engine, which the profile (measured the same minute) only partly sees; the load bench's validation is the tight one
(docs/fleet-model.md)."""


def test_the_fleet_model_predicts_a_small_burst_on_the_profiled_engine(pd_engines: PDEngines) -> None:
    """Eight single-turn prompts of 200-1,600 tokens, two at a time, streamed to the decode engine; the same
    prompts through the model of that engine (its profile measured first): TTFT p50 within the factor."""
    engine = pd_engines.decode
    profile, _ = profile_engine(engine.url, pd_engines.model_name, facts=facts_of(engine), plan=PLAN, name="check")
    rng = random.Random(51)
    convs = [Conversation(f"check-{i}", [rng.randrange(300, 4000) for _ in range(200 * (1 + i % 8))], [[]], [16],
                          [0.0]) for i in range(8)]

    async def measure() -> list[float]:
        ttfts: list[float] = []
        pending = list(convs)
        async with aiohttp.ClientSession() as http:
            async def worker() -> None:
                while pending:
                    conv = pending.pop(0)
                    body = {"model": pd_engines.model_name, "prompt": conv.prefix, "max_tokens": 16,
                            "ignore_eos": True, "stream": True}
                    start = time.monotonic()
                    async with http.post(f"{engine.url}/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        async for _ in resp.content:
                            ttfts.append(time.monotonic() - start)
                            break
                        async for _ in resp.content:
                            pass
            await asyncio.gather(worker(), worker())
        return ttfts

    measured = statistics.median(asyncio.run(measure()))
    predicted = simulate("aggregated", convs, FleetSpec(), profile, 2, Slo())["ttft_ms"]["p50"] / 1e3
    print(f"fleet model check: TTFT p50 predicted {predicted * 1e3:.0f} ms, measured {measured * 1e3:.0f} ms (n = 8)")
    assert 1 / MODEL_CHECK_FACTOR <= predicted / measured <= MODEL_CHECK_FACTOR, (predicted, measured)
