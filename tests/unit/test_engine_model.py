"""The modelled engine (kvloop.shared.engine_model): its profile's checks and file, and the engine step by step
against closed forms and properties: the step budget, the pool's bounds, tokens conserved, TTFT against compute,
cached tokens against TTFT, and queueing under a burst."""

from __future__ import annotations

import dataclasses
import json
import math
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvloop.shared.engine_model import (
    FIGURE_GROUPS,
    Account,
    EngineProfile,
    EngineSim,
    EventKind,
    SimRequest,
    dump_profile,
    load_profile,
)
from kvloop.shared.errors import ConfigError, ResourceExhausted

PROPS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

FAKE_PROFILE = EngineProfile(
    name="fake", step_base_s=0.01, prefill_token_s=1e-4, attention_token_s=2e-5, decode_stream_s=1e-3,
    decode_context_s=1e-6, max_num_batched_tokens=256, max_num_seqs=8, block_size=16, kv_pool_blocks=400,
    bytes_per_block=65536, pull_latency_s=0.005, pull_bytes_per_s=1e9, router_turn_s=0.002, api_request_s=0.001,
    source={g: "fake: the unit tests' figures" for g in FIGURE_GROUPS})
"""A fake engine: figures chosen for the tests, from no machine."""


def fake(**changes: object) -> EngineProfile:
    return dataclasses.replace(FAKE_PROFILE, **changes)  # type: ignore[arg-type]


def keys(session: int, blocks: int) -> tuple[bytes, ...]:
    """Distinct keys per session and block (the engine only compares them)."""
    return tuple(f"s{session}b{i}".encode().ljust(32, b".") for i in range(blocks))


def run(engine: EngineSim, arrivals: list[tuple[float, SimRequest]]) -> dict[str, Account]:
    """Submit each request at its time and run to the end; checks the pool's bounds after every advance."""
    accounts: dict[str, Account] = {}
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or not math.isinf(engine.next_event_time()):
        t_next = engine.next_event_time()
        if pending and pending[0][0] <= t_next:
            t, request = pending.pop(0)
            events = engine.advance(t)
            engine.submit(request, t)
        else:
            events = engine.advance(t_next)
        for event in events:
            if event.kind is EventKind.FINISHED:
                assert event.account is not None
                accounts[event.request_id] = event.account
        assert 0 <= engine.pool.used <= engine.pool.capacity
        assert engine.pool.private >= 0
    return accounts


def lone_prefill_s(p: EngineProfile, prompt: int, done: int = 0) -> float:
    """Closed form: the steps that compute ``prompt`` from ``done`` alone, in chunks of the step budget."""
    total = 0.0
    while done < prompt:
        n = min(p.max_num_batched_tokens, prompt - done)
        total += p.step_seconds(n, n * (done + n / 2), 0, 0)
        done += n
    return total


# --------------------------------------------------------------------------------------------- the profile

@pytest.mark.parametrize(("field", "value"), [("prefill_token_s", 0.0), ("step_base_s", -0.1),
                                              ("kv_pool_blocks", 0), ("pull_bytes_per_s", -1.0),
                                              ("block_size", 0), ("router_turn_s", -0.001)])
def test_an_impossible_figure_is_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ConfigError) as err:
        fake(**{field: value})
    assert err.value.field == field


def test_every_figure_group_needs_a_source() -> None:
    source = {g: "fake: tests" for g in FIGURE_GROUPS if g != "pull"}
    with pytest.raises(ConfigError, match="'pull'"):
        fake(source=source)
    with pytest.raises(ConfigError, match="beginning with"):
        fake(source={**FAKE_PROFILE.source, "pull": "about 1 GB/s"})


def test_a_profile_file_round_trips_with_its_version(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    dump_profile(FAKE_PROFILE, path)
    assert json.loads(path.read_text())["version"] == 1
    assert load_profile(path) == FAKE_PROFILE
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "version": 99}))
    with pytest.raises(ConfigError, match="version"):
        load_profile(path)
    path.write_text(json.dumps({**raw, "figures": {**raw["figures"], "gpu_tflops": 1.0}}))
    with pytest.raises(ConfigError, match="gpu_tflops"):
        load_profile(path)


# --------------------------------------------------------------------------------------------- closed forms

def test_a_lone_request_takes_the_closed_form_time() -> None:
    p = FAKE_PROFILE
    prompt, answer = 600, 5  # three chunks: 256, 256, 88
    engine = EngineSim("e", p)
    account = run(engine, [(1.0, SimRequest("r", prompt, answer, keys(0, prompt // 16)))])["r"]
    ttft = lone_prefill_s(p, prompt)
    assert account.first_token_t - 1.0 == pytest.approx(ttft)
    decode = sum(p.step_seconds(0, 0, 1, prompt + g) for g in range(1, answer))
    assert account.finished_t - 1.0 == pytest.approx(ttft + decode)
    assert (account.computed_tokens, account.local_tokens, account.generated) == (prompt, 0, answer)
    assert engine.max_step_tokens == p.max_num_batched_tokens


def test_known_tokens_are_pulled_before_the_prefill_and_not_computed() -> None:
    p = FAKE_PROFILE
    engine = EngineSim("e", p)
    account = run(engine, [(0.0, SimRequest("r", 320, 1, keys(0, 20), known_tokens=319))])["r"]
    assert (account.pulled_tokens, account.pulled_blocks, account.computed_tokens) == (319, 20, 1)
    assert account.first_token_t == pytest.approx(p.pull_seconds(20) + p.step_seconds(1, 319.5, 0, 0))


def test_a_cached_prefix_is_not_computed_again_and_the_last_token_always_is() -> None:
    engine = EngineSim("e", FAKE_PROFILE)
    first = run(engine, [(0.0, SimRequest("a", 160, 1, keys(0, 10)))])["a"]
    again = run(engine, [(5.0, SimRequest("b", 160, 1, keys(0, 10)))])["b"]
    longer = run(engine, [(9.0, SimRequest("c", 200, 1, keys(0, 12)))])["c"]
    assert first.local_tokens == 0
    assert (again.local_tokens, again.computed_tokens) == (144, 16)  # the last block holds the last token
    assert (longer.local_tokens, longer.computed_tokens) == (160, 40)
    assert engine.cached_prefix_tokens(keys(0, 12)) == 192


def test_a_burst_queues_each_request_behind_the_ones_before_it() -> None:
    """Identical requests at one instant: each waits for the chunks of those ahead, so TTFT grows with the
    position in the queue (the queueing the no-queue model lacked)."""
    p = FAKE_PROFILE
    engine = EngineSim("e", p)
    burst = [(0.0, SimRequest(f"r{i}", 256, 4, keys(i, 16))) for i in range(6)]
    accounts = run(engine, burst)
    ttfts = [accounts[f"r{i}"].first_token_t for i in range(6)]
    assert all(b > a for a, b in pairwise(ttfts))
    assert ttfts[-1] >= 6 * p.prefill_token_s * 256
    assert ttfts[0] == pytest.approx(lone_prefill_s(p, 256))


def test_a_burst_sharing_a_prefix_computes_it_once_the_first_step_has_cached_it() -> None:
    """Four requests with one 240-token prefix at one instant, a 256-token step: vLLM admits waiting requests
    while the step's budget lasts, each looking up the prefix cache then, so the later ones find the first one's
    blocks cached instead of computing them again."""
    engine = EngineSim("e", FAKE_PROFILE)
    shared = keys(0, 15)
    burst = [(0.0, SimRequest(f"r{i}", 256, 2, (*shared, *keys(100 + i, 1)))) for i in range(4)]
    accounts = run(engine, burst)
    assert accounts["r0"].computed_tokens == 256
    assert sum(a.computed_tokens for a in accounts.values()) < 2 * 256
    assert all(accounts[f"r{i}"].local_tokens == 240 for i in (2, 3))


def test_a_request_waits_for_room_in_the_pool() -> None:
    p = fake(kv_pool_blocks=30)
    engine = EngineSim("e", p)
    accounts = run(engine, [(0.0, SimRequest("a", 300, 20, keys(0, 18))), (0.0, SimRequest("b", 300, 20, keys(1, 18)))])
    assert accounts["b"].admitted_t == accounts["a"].finished_t
    with pytest.raises(ResourceExhausted):
        engine.submit(SimRequest("huge", 30 * 16, 1), 10.0)


def test_a_retained_lease_pins_its_blocks_until_released() -> None:
    p = fake(kv_pool_blocks=40)
    engine = EngineSim("e", p)
    run(engine, [(0.0, SimRequest("a", 320, 1, keys(0, 20)))])
    assert engine.retain("lease", keys(0, 20)) == 20
    assert engine.retained_blocks == 20 and engine.pool.evictable == 0
    # 21 blocks more do not fit beside 20 pinned: the request waits until the lease ends.
    engine.submit(SimRequest("b", 320, 16, keys(1, 21)), 1.0)
    assert engine.advance(1.0) == [] and math.isinf(engine.next_event_time())
    assert engine.blocks_short() == 1
    engine.release("lease")
    accounts = run(engine, [])
    assert accounts["b"].admitted_t == 1.0
    assert engine.cached_prefix_tokens(keys(0, 20)) < 320  # evicted to make room


# --------------------------------------------------------------------------------------------- properties

request_st = st.tuples(
    st.floats(0, 2, allow_nan=False),  # arrival
    st.integers(0, 4),  # session: requests of one session share a prefix
    st.integers(1, 700),  # prompt tokens
    st.integers(1, 40),  # max tokens
    st.integers(0, 700),  # known tokens
)


def requests_of(raw: list[tuple[float, int, int, int, int]]) -> list[tuple[float, SimRequest]]:
    return [(t, SimRequest(f"r{i}", prompt, answer, keys(s, (prompt + answer) // 16), min(known, prompt)))
            for i, (t, s, prompt, answer, known) in enumerate(raw)]


@PROPS
@given(st.lists(request_st, min_size=1, max_size=12), st.sampled_from([64, 256, 1024]), st.integers(2, 8),
       st.sampled_from([60, 150, 800]))
def test_every_request_finishes_with_its_tokens_within_budget_and_pool(
        raw: list[tuple[float, int, int, int, int]], budget: int, seqs: int, pool: int) -> None:
    p = fake(max_num_batched_tokens=budget, max_num_seqs=seqs, kv_pool_blocks=pool)
    arrivals = [(t, r) for t, r in requests_of(raw) if p.blocks_for(r.prompt_tokens + r.max_tokens) <= pool]
    engine = EngineSim("e", p)
    accounts = run(engine, arrivals)
    assert set(accounts) == {r.request_id for _, r in arrivals}
    assert engine.max_step_tokens <= budget
    for t, r in arrivals:
        a = accounts[r.request_id]
        assert a.generated == r.max_tokens
        assert a.local_tokens + a.pulled_tokens + a.computed_tokens == r.prompt_tokens
        assert a.computed_tokens >= 1
        # Never faster than computing its own tokens alone, after its pull.
        floor = p.pull_seconds(a.pulled_blocks) + p.prefill_token_s * a.computed_tokens + p.step_base_s
        assert a.first_token_t - t >= floor - 1e-9
        assert t <= a.admitted_t <= a.first_token_t <= a.finished_t
    assert engine.pool.private == 0 and engine.pool.evictable == engine.pool.cached  # nothing left pinned
    assert engine.requests == 0


@PROPS
@given(st.integers(17, 1500), st.integers(0, 90), st.integers(0, 90), st.integers(1, 8))
def test_more_cached_tokens_never_make_a_lone_request_slower(prompt: int, a: int, b: int, answer: int) -> None:
    usable = (prompt - 1) // 16
    fewer, more = sorted((min(a, usable), min(b, usable)))
    ttfts = []
    for cached in (fewer, more):
        engine = EngineSim("e", fake(kv_pool_blocks=1000))
        if cached:
            run(engine, [(0.0, SimRequest("warm", cached * 16, 1, keys(0, cached)))])
        accounts = run(engine, [(100.0, SimRequest("r", prompt, answer, keys(0, (prompt + answer) // 16)))])
        assert accounts["r"].local_tokens == cached * 16
        ttfts.append(accounts["r"].first_token_t - 100.0)
    assert ttfts[1] <= ttfts[0] + 1e-12
    assert ttfts[1] == pytest.approx(lone_prefill_s(FAKE_PROFILE, prompt, more * 16))
