"""The fleet replay (kvloop.app.fleet): turns placed by the broker's real core run the path it chose, one-way P/D
never reuses a decode engine's KV, every turn finishes with its tokens, light load meets the closed form, more
sessions queue, and a point has the load bench's shape."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvloop.app.benchmarks.aiperf import Slo
from kvloop.app.benchmarks.workload import AgentSpec, Conversation, agent
from kvloop.app.fleet.broker import BrokerSettings
from kvloop.app.fleet.figures import TurnResult
from kvloop.app.fleet.sim import Config, FleetSpec, Replay, build_fleet, simulate, simulate_points
from kvloop.shared.engine_model import EngineProfile, HostSpec
from kvloop.shared.errors import ConfigError
from kvloop.shared.vocabulary import Path
from tests.support.fleet import FAKE_PROFILE

PROPS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SLO = Slo(ttft_ms=1000.0, itl_ms=50.0)


def session(name: str, new: list[int], answers: list[int], prefix: int = 300, seed: int = 0) -> Conversation:
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(300, 4000) for _ in range(n)]

    return Conversation(name, draw(prefix), [draw(n) for n in new], answers, [0.2] * len(new))


def small_agent(sessions: int = 6, seed: int = 3) -> list[Conversation]:
    return agent(AgentSpec(sessions=sessions, turns_min=3, turns_max=5, system_tokens=400, tool_max=800,
                           answer_max=64, seed=seed))


def replay(config: Config, conversations: list[Conversation], fleet: FleetSpec, profile: EngineProfile,
           concurrency: int) -> list[TurnResult]:
    """One point on a fresh fleet, turn by turn."""
    return Replay(config, conversations, build_fleet(config, fleet, profile), fleet, profile, concurrency).run()


def test_turns_after_the_first_reuse_what_the_decode_engine_retained() -> None:
    """Short tails: the broker keeps the session on its decode engine (DECODE_LOCAL); a long tail goes to a prefill
    engine, which pulls the history from the decode engine's lease (TRANSFER). Each turn runs the path the core
    planned, by the engines' own accounts."""
    conv = session("s", [50, 40, 30, 1500, 30], [20, 20, 20, 20, 20])
    turns = replay(Config.KVLOOP, [conv], FleetSpec(), FAKE_PROFILE, 1)
    assert [t.index for t in turns] == [0, 1, 2, 3, 4]
    assert [t.planned for t in turns] == [Path.RECOMPUTE, Path.DECODE_LOCAL, Path.DECODE_LOCAL, Path.TRANSFER,
                                          Path.DECODE_LOCAL]
    assert [t.actual for t in turns] == [t.planned for t in turns]
    transfer = turns[3]
    assert transfer.pulled_tokens > 0 and transfer.transfer_bytes > 0
    # It computes the new tool output and what the lease could not hold (the last sampled token's block).
    assert transfer.computed_tokens == transfer.prompt_tokens - 16 * ((460 + 20 - 1) // 16)
    # The decode engine holds turn 1's prompt and answer but its last sampled token: turn 2 computes the rest.
    assert turns[1].computed_tokens == turns[1].prompt_tokens - 16 * ((300 + 50 + 20 - 1) // 16)


def test_retained_leases_give_way_when_the_decode_pool_runs_short() -> None:
    """A retention budget as large as the pool: the decode engine reports memory pressure and the broker evicts
    leases, so no turn waits for ever behind retained blocks."""
    small = dataclasses.replace(FAKE_PROFILE, kv_pool_blocks=100)
    conversations = [session(f"s{i}", [60] * 4, [20] * 4, seed=i) for i in range(3)]
    fleet = FleetSpec(broker=BrokerSettings(retention_blocks=100))
    result = simulate("kvloop", conversations, fleet, small, 3, SLO)
    assert result["requests"] == 12 and result["errors"] == 0
    assert result["evictions"].get("memory_pressure", 0) + result["evictions"].get("budget", 0) > 0
    assert result["blocks_retained"]["peak"] <= 100


def test_one_way_never_reuses_a_decode_engines_kv() -> None:
    result = simulate("one_way", small_agent(), FleetSpec(), FAKE_PROFILE, 3, SLO)
    assert set(result["paths"]) <= {Path.RECOMPUTE.value, Path.PREFILL_LOCAL.value}
    assert set(result["planned_paths"]) <= {Path.RECOMPUTE.value, Path.PREFILL_LOCAL.value}
    assert result["blocks_retained"]["peak"] == 0 and result["bytes_moved"]["transfer"] == 0
    assert result["bytes_moved"]["hop"] > 0


@PROPS
@given(st.sampled_from(list(Config)), st.integers(1, 6), st.integers(0, 50))
def test_every_turn_finishes_once_with_its_answer(config: Config, concurrency: int, seed: int) -> None:
    conversations = small_agent(sessions=5, seed=seed)
    fleet = FleetSpec(aggregated_engines=2 if seed % 2 else 1, prefill_engines=1 + seed % 2)
    turns = replay(config, conversations, fleet, FAKE_PROFILE, concurrency)
    expected = {(c.conversation_id, i): c.answer_tokens[i] for c in conversations for i in range(c.turns)}
    assert {(t.session, t.index): t.generated for t in turns} == expected
    for t in turns:
        assert t.local_tokens + t.pulled_tokens + t.computed_tokens == t.prompt_tokens
        assert t.arrived < t.first_token <= t.finished
        if t.actual is Path.DECODE_LOCAL:
            assert t.hop_bytes == 0 and t.prefill_engine == ""
        if config is Config.ONE_WAY:
            assert t.actual in (Path.RECOMPUTE, Path.PREFILL_LOCAL)
    by_session: dict[str, list[float]] = {}
    for t in sorted(turns, key=lambda t: (t.session, t.index)):
        by_session.setdefault(t.session, []).append(t.arrived)
    assert all(a == sorted(a) for a in by_session.values())  # a session's turns one after another


def test_a_lone_turn_at_light_load_takes_the_closed_form_time() -> None:
    p = FAKE_PROFILE
    conv = session("s", [100], [10], prefix=300)
    point = simulate("aggregated", [conv], FleetSpec(), p, 1, SLO)
    prompt = 400
    prefill = p.step_seconds(prompt, prompt * prompt / 2, 0, 0)
    assert point["ttft_ms"]["n"] == 1
    (turn,) = replay(Config.AGGREGATED, [conv], FleetSpec(), p, 1)
    assert turn.ttft_s == pytest.approx(p.api_request_s + prefill)
    decode = sum(p.step_seconds(0, 0, 1, prompt + g) for g in range(1, 10))
    assert turn.itl_s == pytest.approx(decode / 9)


def test_more_sessions_at_once_queue_longer() -> None:
    slow = dataclasses.replace(FAKE_PROFILE, prefill_token_s=1e-3)
    conversations = small_agent(sessions=8, seed=5)
    alone = simulate("aggregated", conversations, FleetSpec(), slow, 1, SLO)
    crowded = simulate("aggregated", conversations, FleetSpec(), slow, 8, SLO)
    assert crowded["ttft_ms"]["p50"] > alone["ttft_ms"]["p50"]
    assert crowded["wall_s"] < alone["wall_s"]


def test_a_point_has_the_load_benchs_shape_and_says_it_is_predicted() -> None:
    result = simulate("kvloop", small_agent(), FleetSpec(), FAKE_PROFILE, 3, SLO)
    for key in ("requests", "errors", "wall_s", "goodput_rps", "throughput_rps", "slo_attainment", "ttft_ms",
                "itl_ms", "e2e_ms", "paths", "load", "concurrency"):
        assert key in result, key
    assert set(result["ttft_ms"]) == {"n", "p50", "p90", "p95", "p99"}
    assert result["ttft_ms"]["p99"] is None  # fewer than 100 turns: no p99, as in the load bench
    assert result["predicted"] is True
    assert result["profile"]["source"] == dict(FAKE_PROFILE.source)
    assert 0 <= result["goodput_rps"] <= result["throughput_rps"]
    assert result == simulate("kvloop", small_agent(), FleetSpec(), FAKE_PROFILE, 3, SLO)  # deterministic


def test_an_unknown_configuration_is_refused() -> None:
    with pytest.raises(ConfigError, match="kvloop_dp"):
        simulate("kvloop_dp", small_agent(), FleetSpec(), FAKE_PROFILE, 1, SLO)


@pytest.mark.parametrize("config", ["kvloop", "one_way", "aggregated"])
def test_a_sweeps_next_point_finds_what_the_last_one_left(config: str) -> None:
    """The second point runs on the engines the first left (their caches, the broker's leases), as the load bench's
    points do: its shared system prompt is cached, where a fresh fleet computes it again."""
    conversations = small_agent(sessions=4, seed=9)
    first, second = simulate_points(config, [(conversations, 2), (conversations, 2)], FleetSpec(), FAKE_PROFILE,
                                    SLO)
    fresh = simulate(config, conversations, FleetSpec(), FAKE_PROFILE, 2, SLO)
    assert first == fresh
    assert second["tokens"]["computed"] < fresh["tokens"]["computed"]
    assert second["requests"] == fresh["requests"]


def test_a_shared_host_slows_every_step() -> None:
    """Busy engines sharing their two cores with a client that takes most of one: the same replay decodes slower
    (background work the engines' idle time cannot hold takes a share of their steps)."""
    slow = dataclasses.replace(FAKE_PROFILE, prefill_token_s=1e-3, decode_stream_s=5e-3)
    conversations = small_agent(sessions=4, seed=9)
    own = simulate("kvloop", conversations, FleetSpec(prefill_engines=1), slow, 4, SLO)
    shared = FleetSpec(prefill_engines=1, host=HostSpec(cores=2, client_cores=1.5, engine_process_cores=0.05,
                                                        turn_cpu_s=0.05, source="fake: the fleet tests' host"))
    slowed = simulate("kvloop", conversations, shared, slow, 4, SLO)
    assert slowed["itl_ms"]["p50"] > own["itl_ms"]["p50"] * 1.05
    assert slowed["host"]["source"] == "fake: the fleet tests' host" and "host" not in own
