"""A fake engine profile for the fleet model's tests (unit tests of the replay, the trace replay and
``kvloop analyze --profile``): figures chosen for the tests, from no machine."""

from __future__ import annotations

from kvloop.shared.engine_model import FIGURE_GROUPS, EngineProfile

FAKE_PROFILE = EngineProfile(
    name="fake-fleet", step_base_s=0.005, prefill_token_s=1e-4, attention_token_s=1e-5, decode_stream_s=5e-4,
    decode_context_s=1e-7, max_num_batched_tokens=2048, max_num_seqs=32, block_size=16, kv_pool_blocks=6000,
    bytes_per_block=65536, pull_latency_s=0.004, pull_bytes_per_s=2e9, router_turn_s=0.003, api_request_s=0.002,
    source={g: "fake: the fleet tests' figures" for g in FIGURE_GROUPS})
"""A fake engine for the fleet tests, from no machine."""
