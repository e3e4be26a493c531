"""The router's turn as a plan, driven on fakes: the plan from the broker's (or none), its downgrades, the order a
fail-over tries engines in, the requests it sends, what a turn reports, and broker fail-over on status codes."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from kvloop.router.config import RouterConfig
from kvloop.router.directory import Directory, EngineInfo
from kvloop.router.engine_calls import EngineCalls
from kvloop.router.errors import EngineReplyError, TurnError
from kvloop.router.metrics import RouterMetrics
from kvloop.router.outcome import Turn
from kvloop.router.placement import Placer
from kvloop.router.plan import (
    Placement,
    candidates,
    decode_request,
    downgraded,
    plan_turn,
    prefill_request,
)
from kvloop.shared.protocol import DECODE_LOCAL_KEY, KEEP_GENERATED_KEY, PrefillReport
from kvloop.shared.vocabulary import Fallback, Path, Reason, Role, Veto
from kvloop.v1 import broker_pb2 as pb

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 1, "logprobs": True,
        "max_completion_tokens": 50}


def directory(*engines: tuple[str, int]) -> Directory:
    d = Directory(RouterConfig(broker="127.0.0.1:1"))
    d.update(pb.InspectResponse(engines=[pb.EngineStatus(engine=pb.Engine(
        engine_id=eid, role=role, block_size=4, layout_fingerprint="fp", model="m",
        addresses=pb.EngineAddresses(http=f"http://{eid}", nixl="127.0.0.1:1"))) for eid, role in engines]), now=0.0)
    return d


FLEET = (("p0", pb.ENGINE_ROLE_PREFILL), ("p1", pb.ENGINE_ROLE_PREFILL), ("d0", pb.ENGINE_ROLE_DECODE),
         ("d1", pb.ENGINE_ROLE_DECODE))


def broker_plan(decision: int, prefill: str = "p1", decode: str = "d1", **more: Any) -> pb.Plan:
    more.setdefault("reason", Reason.TRANSFER_CHEAPER)
    return pb.Plan(decision=decision, prefill_engine_id=prefill, decode_engine_id=decode,
                   matched_tokens=8, local_tokens=4, pull_tokens=4, cached_tokens_seen=12, **more)


def test_without_a_plan_the_turn_recomputes_on_round_robin_engines_with_the_fallback_as_its_reason() -> None:
    d = directory(*FLEET)
    first = plan_turn(d, "chat", "s", "m", 10, Placement(None, fallback=Fallback.BROKER_UNAVAILABLE))
    second = plan_turn(d, "chat", "s", "m", 10, Placement(None, fallback=Fallback.BROKER_UNAVAILABLE))
    assert (first.path, first.reason, first.matched_tokens, first.block_size) == (Path.RECOMPUTE,
                                                                                  "broker_unavailable", 0, 4)
    assert {first.prefill.engine_id, second.prefill.engine_id} == {"p0", "p1"}
    assert {e.engine_id for e in first.decodes} == {"d0", "d1"} and len(first.decodes) == 2


def test_the_brokers_plan_is_followed_with_its_engines_first() -> None:
    plan = plan_turn(directory(*FLEET), "chat", "s", "m", 16, Placement(broker_plan(pb.DECISION_TRANSFER),
                                                                         keys=(b"k",)))
    assert (plan.path, plan.prefill.engine_id, plan.decode.engine_id) == (Path.TRANSFER, "p1", "d1")
    assert [e.engine_id for e in plan.decodes] == ["d1", "d0"]
    assert (plan.matched_tokens, plan.local_tokens, plan.pull_tokens, plan.available_tokens) == (8, 4, 4, 12)
    down = downgraded(plan, Reason.PIN_REFUSED)
    assert (down.path, down.reason, down.pull_tokens, down.prefill) == (Path.RECOMPUTE, "pin_refused", 0,
                                                                         plan.prefill)


def test_decode_local_runs_on_the_decode_engine_or_recomputes_when_the_router_does_not_know_it() -> None:
    d = directory(*FLEET)
    local = plan_turn(d, "chat", "s", "m", 16, Placement(broker_plan(pb.DECISION_DECODE_LOCAL, decode="d0")))
    assert local.decode_local and local.prefill.engine_id == local.decode.engine_id == "d0"
    unknown = plan_turn(d, "chat", "s", "m", 16, Placement(broker_plan(pb.DECISION_DECODE_LOCAL, decode="gone")))
    assert (unknown.path, unknown.reason) == (Path.RECOMPUTE, Reason.DECODE_ENGINE_UNKNOWN)
    assert unknown.decode.engine_id in {"d0", "d1"}


def test_the_brokers_words_arrive_typed() -> None:
    plan = plan_turn(directory(*FLEET), "chat", "s", "m", 16, Placement(broker_plan(
        pb.DECISION_TRANSFER, reason="recompute_cheaper", decode_local_veto="decode_busy")))
    assert plan.reason is Reason.RECOMPUTE_CHEAPER and plan.veto is Veto.DECODE_BUSY
    taken = plan_turn(directory(*FLEET), "chat", "s", "m", 16, Placement(broker_plan(pb.DECISION_DECODE_LOCAL)))
    assert taken.veto == ""


def test_a_word_this_router_does_not_know_is_unknown_and_logged_once() -> None:
    """A newer broker's reason or veto (strings on the wire, for mixed versions): the plan is served as given, and
    reported as ``unknown``; each word is logged once, not on every turn."""
    newer = broker_plan(pb.DECISION_TRANSFER, reason="cheaper_on_tuesdays", decode_local_veto="moon_phase")
    placer = Placer(RouterConfig(), RouterMetrics(), directory(*FLEET))
    placer.placements = FakePlacementStream([newer])  # type: ignore[assignment]
    with capture_logs() as logs:
        for _ in range(3):
            plan, cause = asyncio.run(placer.place_once(pb.PlaceRequest()))
    assert plan is newer and cause == ""
    warned = [(e["field"], e["word"]) for e in logs if e["event"] == "router.unknown_plan_word"]
    assert warned == [("reason", "cheaper_on_tuesdays"), ("decode_local_veto", "moon_phase")]
    turn = plan_turn(directory(*FLEET), "chat", "s", "m", 16, Placement(newer))
    assert (turn.path, turn.reason, turn.veto) == (Path.TRANSFER, Reason.UNKNOWN, Veto.UNKNOWN)
    assert turn.reason == "unknown"  # the header's and the metric label's text


def test_no_engine_of_a_role_is_a_503() -> None:
    with pytest.raises(TurnError) as info:
        plan_turn(directory(("p0", pb.ENGINE_ROLE_PREFILL)), "chat", "s", "m", 1, Placement(None))
    assert info.value.status == 503


def test_candidates_are_the_first_ones_then_fresh_picks_each_once() -> None:
    a, b, c = (EngineInfo(x, Role.DECODE, f"http://{x}") for x in "abc")
    pool = [a, b, c]
    picked = list(candidates([b, b], lambda tried: next((e for e in pool if e.engine_id not in tried), None)))
    assert [e.engine_id for e in picked] == ["b", "a", "c"]
    assert list(candidates([a])) == [a]


def test_the_prefill_is_one_unstreamed_token_and_a_retried_decode_never_reuses_transfer_params() -> None:
    request = prefill_request(CHAT, {"pull": 1})
    assert request["max_tokens"] == request["max_completion_tokens"] == 1 and request["stream"] is False
    assert "logprobs" not in request and "n" not in request and request["kv_transfer_params"] == {"pull": 1}
    assert CHAT["max_completion_tokens"] == 50  # the client's request is left as it was
    plan = plan_turn(directory(*FLEET), "chat", "s", "m", 16, Placement(broker_plan(pb.DECISION_DECODE_LOCAL)))
    first, client_usage = decode_request(plan, CHAT, {"from": "prefill"})
    assert first["kv_transfer_params"] == {"from": "prefill"} and first["stream_options"] == {"include_usage": True}
    assert client_usage is False  # asked for the router's sake: the usage chunk is dropped again
    retry, _ = decode_request(plan, CHAT, {"from": "prefill"}, retry=True)
    assert retry["kv_transfer_params"][DECODE_LOCAL_KEY] is True and "from" not in retry["kv_transfer_params"]
    # The requests are shallow copies: what they change of the client's request is replaced, never changed in place.
    asked = {**CHAT, "stream_options": {"include_usage": False}, "kv_transfer_params": {"client": 1}}
    request, _ = decode_request(plan, asked, {"from": "prefill"})
    assert request["stream_options"] == {"include_usage": True} and request["messages"] is asked["messages"]
    assert asked["stream_options"] == {"include_usage": False} and asked["kv_transfer_params"] == {"client": 1}


def test_an_answer_the_client_will_not_repeat_is_named_to_the_decode_engine_by_the_turn_or_its_session() -> None:
    from types import SimpleNamespace

    from kvloop.router.sessions import SessionHints

    placed = broker_plan(pb.DECISION_DECODE_LOCAL)
    plan = plan_turn(directory(*FLEET), "chat", "s", "m", 16, Placement(placed))
    turn = Turn(body=CHAT, plan=plan, span=None, started=0.0)
    assert turn.keeps_generated  # nothing said
    placed.session_drops_generated = True  # said earlier in the session: the broker's plan remembers it
    assert not turn.keeps_generated
    turn.session = SimpleNamespace(hints=SessionHints(keep_generated=True))  # the turn's own hint wins
    assert turn.keeps_generated
    request, _ = decode_request(plan, CHAT, {"from": "prefill"}, keep_generated=False)
    assert request["kv_transfer_params"] == {"from": "prefill", KEEP_GENERATED_KEY: False}
    retry, _ = decode_request(plan, CHAT, {"from": "prefill"}, retry=True, keep_generated=False)
    assert retry["kv_transfer_params"][KEEP_GENERATED_KEY] is False and retry["kv_transfer_params"][DECODE_LOCAL_KEY]
    kept, _ = decode_request(plan, CHAT, {"from": "prefill"})
    assert KEEP_GENERATED_KEY not in kept["kv_transfer_params"]


def test_a_turn_reports_the_plan_until_the_engine_measures_then_the_measurement() -> None:
    plan = plan_turn(directory(*FLEET), "chat", "s", "m", 16, Placement(broker_plan(pb.DECISION_DECODE_LOCAL)))
    turn = Turn(body=CHAT, plan=plan, span=None, started=0.0)
    _, turn.outcome.client_usage = decode_request(plan, CHAT, {})
    assert not turn.measured and turn.done == PrefillReport(local_tokens=4, computed_tokens=12)
    line = b'data: {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 8}}}'
    assert turn.observe(line) is True  # the client did not ask for usage: not relayed
    assert turn.measured and turn.done.local_tokens == 8 and turn.path == Path.DECODE_LOCAL
    assert turn.observe(b'data: {"choices": [{"text": "x"}]}') is False


def test_first_answer_moves_on_after_5xx_and_errors_and_stops_at_a_4xx() -> None:
    calls = EngineCalls(RouterConfig(), http=None)  # type: ignore[arg-type]
    engines = [EngineInfo(x, Role.PREFILL, f"http://{x}") for x in ("a", "b", "c")]
    failures: list[str] = []

    async def flaky(engine: EngineInfo, attempt: int) -> str:
        if engine.engine_id == "a":
            raise EngineReplyError(503, {})
        if engine.engine_id == "b":
            raise TimeoutError()
        return f"{engine.engine_id}@{attempt}"

    answer, used = asyncio.run(calls.first_answer(engines, flaky, lambda e, why: failures.append(why), "none"))
    assert (answer, used.engine_id, failures) == ("c@2", "c", ["a answered 503", "b: TimeoutError"])

    async def refusing(engine: EngineInfo, attempt: int) -> str:
        raise EngineReplyError(400, {"error": {"message": "bad", "type": "invalid_request_error", "param": "x"}})

    with pytest.raises(TurnError) as info:
        asyncio.run(calls.first_answer(engines, refusing, lambda e, why: None, "none"))
    assert (info.value.status, info.value.param) == (400, "x")

    async def down(engine: EngineInfo, attempt: int) -> str:
        raise EngineReplyError(500, {})

    with pytest.raises(TurnError) as info:
        asyncio.run(calls.first_answer(engines, down, lambda e, why: None, "no prefill engine"))
    assert info.value.status == 503 and "c answered 500" in info.value.message


class FakePlacementStream:
    """A fake of :class:`kvloop.shared.client.PlacementStream`: each replica answers with its canned plan."""

    def __init__(self, answers: list[pb.Plan]) -> None:
        self.answers, self.replicas, self.generation, self.asked, self.closed = answers, len(answers), 0, 0, 0

    async def place(self, request: pb.PlaceRequest, timeout_s: float) -> pb.Plan:
        self.asked += 1
        return self.answers[self.generation % self.replicas]

    def fail_over(self, generation: int) -> None:
        self.generation += 1

    async def close(self) -> None:
        self.closed += 1


@pytest.mark.parametrize(("code", "fails_over"), [(grpc.StatusCode.UNAVAILABLE, True),
                                                  (grpc.StatusCode.FAILED_PRECONDITION, False)])
def test_placement_fails_over_on_the_refusals_status_code_not_its_text(code: grpc.StatusCode,
                                                                       fails_over: bool) -> None:
    placer = Placer(RouterConfig(), RouterMetrics(), directory(*FLEET))
    refusal = pb.Plan(error="FAILED_PRECONDITION: not the leader", error_code=code.value[0])
    stream = FakePlacementStream([refusal, broker_plan(pb.DECISION_RECOMPUTE)])
    placer.placements = stream  # type: ignore[assignment]
    plan, cause = asyncio.run(placer.place_once(pb.PlaceRequest()))
    assert stream.asked == (2 if fails_over else 1)
    assert (plan is not None, cause) == ((True, "") if fails_over else (False, Fallback.PLACE_REFUSED))
