"""The fleet replay of a Mooncake-format trace (kvloop.app.fleet.trace_load and the replay's schedule): requests that
share hash ids share the engine's block keys whatever the two block sizes, a conversation's requests are one
session, each request is sent at its time whatever came back, at most ``concurrency`` in flight, and kvloop reuses
what an earlier request of the same conversation left."""

from __future__ import annotations

from kvloop.app.benchmarks.aiperf import Slo
from kvloop.app.fleet.sim import Config, FleetSpec, Replay, build_fleet, simulate_schedules
from kvloop.app.fleet.trace_load import trace_schedule
from kvloop.shared.mooncake import TraceRow
from tests.support.fleet import FAKE_PROFILE

SLO = Slo(ttft_ms=1000.0, itl_ms=50.0)


def test_shared_hash_ids_give_shared_keys_and_a_conversation_is_one_session() -> None:
    rows = [TraceRow(0, 100, 10, (1, 2, 3, 4)), TraceRow(500, 150, 10, (1, 2, 3, 4, 5, 6)),
            TraceRow(700, 100, 10, (1, 9, 10, 11))]
    (t0, a), (t1, b), (t2, c) = trace_schedule(rows, trace_block=32, block_size=16)
    assert (t0, t1, t2) == (0.0, 0.5, 0.7)
    assert a.prompt_tokens == 100 and len(a.prompt_keys) == 100 // 16
    assert b.prompt_keys[: len(a.prompt_keys)] == a.prompt_keys  # the second continues the first
    assert (a.session, a.index, b.session, b.index) == ("conv-0", 0, "conv-0", 1)
    assert c.session != a.session and c.prompt_keys[:2] == a.prompt_keys[:2]  # one 32-token block in common
    assert c.prompt_keys[2] != a.prompt_keys[2]
    assert b.keys[len(b.prompt_keys):] != a.keys[len(a.prompt_keys):]  # answers are never shared


def test_a_salt_draws_new_text_for_the_same_ids_as_each_aiperf_run_does() -> None:
    rows = [TraceRow(0, 100, 10, (1, 2, 3, 4)), TraceRow(500, 150, 10, (1, 2, 3, 4, 5, 6))]
    (_, a), (_, b) = trace_schedule(rows, trace_block=32, block_size=16, salt="point-1/")
    (_, a0), _ = trace_schedule(rows, trace_block=32, block_size=16)
    assert b.prompt_keys[: len(a.prompt_keys)] == a.prompt_keys  # within a point the ids still share their blocks
    assert not set(a.keys) & set(a0.keys)  # across points nothing is shared


def test_requests_go_at_their_times_and_at_most_concurrency_at_once() -> None:
    rows = [TraceRow(0, 400, 20, (i,)) for i in range(6)] + [TraceRow(10_000, 400, 20, (99,))]
    schedule = trace_schedule(rows, trace_block=512, block_size=16)
    fleet = FleetSpec(prefill_engines=1)
    turns = Replay(Config.KVLOOP, (), build_fleet(Config.KVLOOP, fleet, FAKE_PROFILE), fleet, FAKE_PROFILE, 2,
                   schedule=schedule).run()
    assert len(turns) == 7
    starts = sorted(t.arrived for t in turns)
    assert starts[:2] == [0.0, 0.0] and all(s > 0.0 for s in starts[2:6])  # four held back until two finished
    assert starts[6] == 10.0  # the late one goes at its time: the others are long done


def test_kvloop_reuses_what_a_conversations_earlier_request_left() -> None:
    rows = [TraceRow(1000.0 * i, 300 + 150 * i, 40, tuple(range(1 + i))) for i in range(6)]
    schedule = trace_schedule(rows, trace_block=150, block_size=16)
    kvloop, one_way = (simulate_schedules(c, [schedule], 4, FleetSpec(), FAKE_PROFILE, SLO)[0]
                       for c in ("kvloop", "one_way"))
    assert kvloop["requests"] == one_way["requests"] == 6
    assert kvloop["tokens"]["computed"] < sum(r.input_length for r in rows) / 2
    assert kvloop["paths"].get("DECODE_LOCAL", 0) + kvloop["paths"].get("TRANSFER", 0) >= 3
