"""The roofline profile (kvloop.shared.engine_model.roofline): a model's parameters and KV bytes from its shape, the
profile's figures scaling as the roofline says (more accelerators or a better efficiency: faster), a compute
efficiency fitted from a TTFT reproduces it, every figure group says it was derived, and a model that does not fit
its accelerators' memory is refused."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.shared.engine_model.roofline import (
    Accelerator,
    Deployment,
    ModelShape,
    efficiency_for_ttft,
    fit_prefill,
    lone_prefill_s,
    memory_efficiency_for_step,
    roofline_profile,
)
from kvloop.shared.errors import ConfigError

FAKE_GPU = Accelerator("fake-gpu", dense_flops=1e15, memory_bytes_per_s=3e12, memory_bytes=80e9,
                       source="fake: the roofline tests' accelerator")
FAKE_MODEL = ModelShape("fake-8b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                        vocab=128256, source="fake: a Llama-3.1-8B-like shape")
FAKE_DEPLOYMENT = Deployment(tensor_parallel=1, compute_efficiency=0.5, memory_efficiency=0.8,
                             efficiency_source="fake: chosen for the tests", network_bytes_per_s=25e9,
                             network_latency_s=0.01, network_source="fake: the tests' network")


def test_a_models_parameters_and_kv_bytes_come_from_its_shape() -> None:
    # Attention: q and o 4096 x 4096 each, k and v 4096 x 1024 each; MLP 3 x 4096 x 14336; embeddings and head.
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert FAKE_MODEL.parameters == 32 * per_layer + 2 * 128256 * 4096  # ~8.0e9
    assert FAKE_MODEL.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB a token in BF16


def test_more_accelerators_or_a_better_efficiency_make_every_step_faster() -> None:
    base = roofline_profile(FAKE_GPU, FAKE_MODEL, FAKE_DEPLOYMENT)
    wide = roofline_profile(FAKE_GPU, FAKE_MODEL, dataclasses.replace(FAKE_DEPLOYMENT, tensor_parallel=2))
    keen = roofline_profile(FAKE_GPU, FAKE_MODEL, dataclasses.replace(FAKE_DEPLOYMENT, compute_efficiency=1.0))
    assert wide.prefill_token_s == pytest.approx(base.prefill_token_s / 2)
    assert wide.step_base_s == pytest.approx(base.step_base_s / 2)
    assert wide.kv_pool_blocks > 2 * base.kv_pool_blocks  # the weights take a smaller share of twice the memory
    assert keen.prefill_token_s == pytest.approx(base.prefill_token_s / 2)
    assert keen.step_base_s == base.step_base_s  # decode is the memory's, not the compute's
    # 2 x 8e9 FLOPs a token at half of 1e15 FLOP/s: ~32 us; the weights (16 GB) at 2.4 TB/s: ~6.7 ms a step.
    assert base.prefill_token_s == pytest.approx(2 * FAKE_MODEL.parameters / 0.5e15)
    assert base.step_base_s == pytest.approx(FAKE_MODEL.parameters * 2 / 2.4e12)


@settings(max_examples=40, deadline=None)
@given(efficiency=st.floats(0.05, 1.0), prompt=st.integers(256, 60000))
def test_an_efficiency_fitted_from_a_ttft_reproduces_it(efficiency: float, prompt: int) -> None:
    deployment = dataclasses.replace(FAKE_DEPLOYMENT, compute_efficiency=efficiency)
    ttft = lone_prefill_s(roofline_profile(FAKE_GPU, FAKE_MODEL, deployment), prompt)
    assert efficiency_for_ttft(FAKE_GPU, FAKE_MODEL, FAKE_DEPLOYMENT, prompt, ttft) == pytest.approx(efficiency)


def test_every_group_says_it_was_derived_or_where_it_came_from() -> None:
    profile = roofline_profile(FAKE_GPU, FAKE_MODEL, FAKE_DEPLOYMENT)
    assert profile.source["prefill"].startswith("derived: roofline of fake-8b")
    assert "compute efficiency 0.5 (fake: chosen for the tests)" in profile.source["prefill"]
    assert profile.source["pull"] == "fake: the tests' network"


def test_a_model_that_leaves_no_room_for_kv_is_refused() -> None:
    small = dataclasses.replace(FAKE_GPU, memory_bytes=16e9)
    with pytest.raises(ConfigError) as err:
        roofline_profile(small, FAKE_MODEL, FAKE_DEPLOYMENT)
    assert err.value.field == "tensor_parallel"


def test_a_ttft_faster_than_the_datasheet_allows_is_refused() -> None:
    with pytest.raises(ConfigError, match="datasheet"):
        efficiency_for_ttft(FAKE_GPU, FAKE_MODEL, FAKE_DEPLOYMENT, 32000, 0.05)


@settings(max_examples=40, deadline=None)
@given(efficiency=st.floats(0.05, 1.0), streams=st.integers(1, 64), context=st.integers(1, 30000))
def test_a_memory_efficiency_fitted_from_a_decode_step_reproduces_it(efficiency: float, streams: int,
                                                                     context: int) -> None:
    deployment = dataclasses.replace(FAKE_DEPLOYMENT, memory_efficiency=efficiency)
    step = roofline_profile(FAKE_GPU, FAKE_MODEL, deployment).step_seconds(0, 0, streams, streams * context)
    fitted = memory_efficiency_for_step(FAKE_GPU, FAKE_MODEL, FAKE_DEPLOYMENT, streams, context, step)
    assert fitted == pytest.approx(efficiency)


@settings(max_examples=40, deadline=None)
@given(efficiency=st.floats(0.05, 1.0), fixed=st.floats(0.0, 0.3), short=st.integers(256, 4000),
       long=st.integers(8000, 60000))
def test_two_published_prefills_give_back_the_efficiency_and_the_fixed_cost(efficiency: float, fixed: float,
                                                                           short: int, long: int) -> None:
    truth = roofline_profile(FAKE_GPU, FAKE_MODEL, dataclasses.replace(
        FAKE_DEPLOYMENT, compute_efficiency=efficiency, api_request_s=fixed))
    points = [(short, lone_prefill_s(truth, short)), (long, lone_prefill_s(truth, long))]
    fitted_efficiency, fitted_fixed = fit_prefill(FAKE_GPU, FAKE_MODEL, FAKE_DEPLOYMENT, points)
    assert fitted_efficiency == pytest.approx(efficiency) and fitted_fixed == pytest.approx(fixed, abs=1e-9)
