"""The profiling bench's fit (kvloop.app.benchmarks.profile_fit): its design rows agree with the modelled engine,
it recovers a known fake profile from noisy synthetic samples, and it refuses sample sets that cannot determine
one."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from kvloop.app.benchmarks.profile_fit import (
    COLUMNS,
    DecodeSample,
    EngineFacts,
    FitError,
    GivenFigures,
    PrefillSample,
    PullSample,
    decode_row,
    decode_sample,
    fit_profile,
    fit_pull,
    prefill_row,
)
from kvloop.shared.engine_model import FIGURE_GROUPS, EngineProfile, EngineSim, EventKind, SimRequest, load_profile
from kvloop.shared.engine_model.profile import dump_profile

FAKE_STEP_TOKENS = 512
FAKE_PROFILE = EngineProfile(
    name="fake", step_base_s=0.004, prefill_token_s=4e-5, attention_token_s=2e-5, decode_stream_s=5e-4,
    decode_context_s=2e-7, max_num_batched_tokens=FAKE_STEP_TOKENS, max_num_seqs=16, block_size=128,
    kv_pool_blocks=2000, bytes_per_block=262144, pull_latency_s=0.003, pull_bytes_per_s=5e8, router_turn_s=0.0,
    api_request_s=0.002, source={g: "fake: the unit tests' figures" for g in FIGURE_GROUPS})
"""A fake engine whose figures the fit must find again: of the order of the tiny model on one core here."""

FACTS = EngineFacts(max_num_batched_tokens=FAKE_STEP_TOKENS, max_num_seqs=16, block_size=128, kv_pool_blocks=2000,
                    bytes_per_block=262144, scheduler_source="fake: settings", pool_source="fake: pool")
GIVEN = GivenFigures(pull_latency_s=0.003, pull_bytes_per_s=5e8, pull_source="fake: pull", router_turn_s=0.0,
                     router_source="fake: router")
LENGTHS = (64, 128, 256, 512, 1024, 2048, 3000)
STREAMS = (1, 2, 4, 8)
CONTEXTS = (128, 2048)
DECODE_TOKENS = 48
TOLERANCE = 0.10
"""Each fitted figure within 10% of the fake's, with 2% noise on every sample (seeded: the check is exact)."""
NOISE = 0.02


def coefficients(profile: EngineProfile) -> list[float]:
    return [getattr(profile, name) for name in COLUMNS]


def predict(row: tuple[float, ...], profile: EngineProfile = FAKE_PROFILE) -> float:
    return sum(a * b for a, b in zip(row, coefficients(profile), strict=True))


def synthetic(noise: float, seed: int = 0, lengths: tuple[int, ...] = LENGTHS, repeats: int = 3
              ) -> tuple[list[PrefillSample], list[DecodeSample]]:
    """Samples as the fake engine would give them, each time scaled by a random factor within ``noise``."""
    rng = random.Random(seed)

    def jitter(t: float) -> float:
        return t * (1 + rng.uniform(-noise, noise))

    prefill = [PrefillSample(n, jitter(predict(prefill_row(n, FAKE_STEP_TOKENS))))
               for _ in range(repeats) for n in lengths]
    decode = []
    for s in STREAMS:
        for c in CONTEXTS:
            context = s * (c + (DECODE_TOKENS - 1) / 2)
            decode.append(DecodeSample(s, c, context, jitter(predict(decode_row(s, context))), DECODE_TOKENS))
    return prefill, decode


def fitted(prefill: list[PrefillSample], decode: list[DecodeSample]) -> EngineProfile:
    return fit_profile(prefill, decode, FACTS, GIVEN, name="fitted", measured="measured here: the tests").profile


def test_prefill_rows_agree_with_the_modelled_engine() -> None:
    """A lone request's first token in EngineSim (submitted at 0) is its row's steps; the row adds the API's cost."""
    for tokens in (1, 100, 512, 513, 1500, 3000):
        engine = EngineSim("e", FAKE_PROFILE)
        engine.submit(SimRequest("r", tokens, 1), 0.0)
        first = next(e.t for e in engine.advance(1e9) if e.kind == EventKind.FIRST_TOKEN)
        assert predict(prefill_row(tokens, FAKE_STEP_TOKENS)) == pytest.approx(first + FAKE_PROFILE.api_request_s)


def test_decode_rows_agree_with_the_modelled_engine() -> None:
    """S streams prefilled in one step, then decoding in lockstep: the time from their first token to their last is
    the decode rows' steps at the contexts decode_sample assigns them."""
    streams, prompt, tokens = 3, 100, 20
    engine = EngineSim("e", FAKE_PROFILE)
    for i in range(streams):
        engine.submit(SimRequest(f"r{i}", prompt, tokens), 0.0)
    events = engine.advance(1e9)
    first = max(e.t for e in events if e.kind == EventKind.FIRST_TOKEN)
    last = max(e.t for e in events if e.kind == EventKind.FINISHED)
    # Tokens 2..tokens each take one step; after k tokens a stream's context is prompt + k.
    steps = sum(predict(decode_row(streams, streams * (prompt + k))) for k in range(1, tokens))
    assert last - first == pytest.approx(steps)
    arrivals = [[(first + sum(predict(decode_row(streams, streams * (prompt + j))) for j in range(1, k)), k)
                 for k in range(1, tokens + 1)] for _ in range(streams)]
    sample = decode_sample(prompt, arrivals, skip_chunks=0)
    assert sample is not None
    assert sample.step_s * (tokens - 1) == pytest.approx(last - first)
    assert predict(decode_row(streams, sample.context_tokens)) == pytest.approx(sample.step_s)


def test_exact_samples_give_the_exact_profile() -> None:
    profile = fitted(*synthetic(0.0))
    for name in COLUMNS:
        assert getattr(profile, name) == pytest.approx(getattr(FAKE_PROFILE, name), rel=1e-6), name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_samples_recover_the_fake_profile(seed: int) -> None:
    result = fit_profile(*synthetic(NOISE, seed), FACTS, GIVEN, name="fitted", measured="measured here: the tests")
    for name in COLUMNS:
        assert getattr(result.profile, name) == pytest.approx(getattr(FAKE_PROFILE, name), rel=TOLERANCE), name
    for group in ("prefill", "decode"):
        err = result.errors[group]
        assert err.r2 is not None and err.r2 > 0.98, group
        assert err.max_rel_error < 2 * NOISE, group
    assert result.errors["prefill"].n == 3 * len(LENGTHS) and result.errors["decode"].n == len(STREAMS) * len(CONTEXTS)


def test_the_profile_names_its_sources_and_loads_back(tmp_path: Path) -> None:
    result = fit_profile(*synthetic(NOISE), FACTS, GIVEN, name="fitted", measured="measured here: the tests")
    source = result.profile.source
    assert all(source[g].startswith("measured here: the tests") for g in ("prefill", "decode", "api"))
    assert (source["scheduler"], source["pool"], source["pull"]) == ("fake: settings", "fake: pool", "fake: pull")
    assert result.profile.max_num_batched_tokens == FAKE_STEP_TOKENS
    path = tmp_path / "profile.json"
    dump_profile(result.profile, path)
    assert load_profile(path) == result.profile


def test_one_length_only_is_refused() -> None:
    prefill, decode = synthetic(NOISE, lengths=(512,))
    with pytest.raises(FitError, match="at least 3 different lengths"):
        fitted(prefill, decode)


def test_one_stream_count_is_refused() -> None:
    prefill, decode = synthetic(NOISE)
    with pytest.raises(FitError, match="2 or more stream counts"):
        fitted(prefill, [d for d in decode if d.streams == 1])


def test_flat_prefill_is_refused() -> None:
    """Latencies that do not grow with the prompt leave no per-token cost to fit: refused, not a zero figure."""
    prefill, decode = synthetic(0.0)
    flat = [dataclasses.replace(s, latency_s=0.05) for s in prefill]
    with pytest.raises(FitError, match="prefill_token_s"):
        fitted(flat, decode)


def test_decode_sample_needs_a_steady_window() -> None:
    assert decode_sample(100, [[(0.0, 1), (0.1, 2)], [(0.0, 1), (0.1, 2)]]) is None
    # Two streams, the second starting 5 steps late: only the steps where both decode count.
    a = [(0.01 * k, k) for k in range(1, 31)]
    b = [(0.01 * k, k - 5) for k in range(6, 31)]
    sample = decode_sample(100, [a, b], skip_chunks=0)
    assert sample is not None and sample.step_s == pytest.approx(0.01) and sample.tokens == 24
    # A chunk that carries two tokens (the API server fell behind) still counts as two steps.
    merged = [p for p in a if p[1] != 10]
    sample = decode_sample(100, [merged, merged], skip_chunks=0)
    assert sample is not None and sample.step_s == pytest.approx(0.01)


def test_pull_fit_recovers_latency_and_bandwidth() -> None:
    rng = random.Random(3)
    samples = [PullSample(n, (0.003 + n / 5e8) * (1 + rng.uniform(-NOISE, NOISE)))
               for n in (262144 * b for b in (1, 2, 4, 8, 16, 32, 64)) for _ in range(3)]
    latency, rate, err = fit_pull(samples)
    assert latency == pytest.approx(0.003, rel=TOLERANCE) and rate == pytest.approx(5e8, rel=TOLERANCE)
    assert err.n == 21 and err.max_rel_error < 2 * NOISE
    with pytest.raises(FitError, match="at least 2 sizes"):
        fit_pull([PullSample(262144, 0.004)] * 3)
