"""The router's one retry loop over engines (router/engine_calls.py), as the JSON calls and the streamed decode use
it: a failed engine is replaced by the next, a 4xx ends the turn with the engine's own error, a stream broken
mid-way resumes on another engine (or, with n > 1, ends with 502), and no engine left is a 503. Driven on a fake
HTTP session: no engine, no network."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from opentelemetry import trace

from kvloop.router.books import TurnBooks
from kvloop.router.config import RouterConfig
from kvloop.router.directory import EngineInfo
from kvloop.router.engine_calls import STREAM_RETRYABLE, Attempts, EngineCalls, EngineFrozen
from kvloop.router.errors import EngineReplyError, TurnError
from kvloop.router.metrics import RouterMetrics
from kvloop.router.outcome import Turn
from kvloop.router.plan import TurnPlan, candidates
from kvloop.router.turn import TurnRunner
from kvloop.shared.protocol import DECODE_LOCAL_KEY
from kvloop.shared.vocabulary import Fallback, Path, Role
from kvloop.v1 import broker_pb2 as pb

DECODES = tuple(EngineInfo(f"d{i}", Role.DECODE, f"http://d{i}") for i in range(3))
PREFILL = EngineInfo("p0", Role.PREFILL, "http://p0")


def chunk(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode() + b"\n"


class FakeReply:
    """A fake of an aiohttp reply: a status, a JSON body, and streamed lines that may end with a failure."""

    def __init__(self, status: int = 200, lines: tuple[bytes, ...] = (), body: Any = None,
                 breaks: BaseException | None = None) -> None:
        self.status, self.lines, self.body, self.breaks = status, lines, body, breaks

    async def json(self, content_type: str | None = None) -> Any:
        return self.body

    async def text(self) -> str:
        return ""

    @property
    def content(self) -> AsyncIterator[bytes]:
        async def lines() -> AsyncIterator[bytes]:
            for line in self.lines:
                yield line
            if self.breaks is not None:
                raise self.breaks
        return lines()


class FakeCall:
    def __init__(self, answer: FakeReply | BaseException) -> None:
        self.answer = answer

    async def __aenter__(self) -> FakeReply:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    async def __aexit__(self, *exc: object) -> None:
        return None


class FakeHttpSession:
    """A fake of ``aiohttp.ClientSession``: each engine URL answers its scripted replies (or raises its scripted
    failures) in order; ``/metrics`` answers empty. Records each request's URL and body, and what ``watch`` (when
    set) returns as each request goes out."""

    def __init__(self, script: dict[str, list[FakeReply | BaseException]]) -> None:
        self.script = script
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.watch: Callable[[], Any] | None = None
        self.watched: list[Any] = []

    def post(self, url: str, data: bytes, **_: Any) -> FakeCall:
        self.sent.append((url, json.loads(data)))  # the router sends its bodies as JSON bytes
        if self.watch is not None:
            self.watched.append(self.watch())
        return FakeCall(self.script[url.split("/v1/")[0]].pop(0))

    def get(self, url: str, **_: Any) -> FakeCall:
        return FakeCall(FakeReply())


def runner(script: dict[str, list[FakeReply | BaseException]]) -> tuple[TurnRunner, FakeHttpSession]:
    http = FakeHttpSession(script)
    return TurnRunner(RouterConfig(), http, RouterMetrics()), http  # type: ignore[arg-type]


def a_turn(body: dict[str, Any] | None = None, path: Path = Path.RECOMPUTE) -> Turn:
    plan = TurnPlan(kind="chat", session="s", model="m", path=path, reason=Fallback.NO_BROKER, prompt_tokens=40,
                    block_size=16, prefill=DECODES[0] if path == Path.DECODE_LOCAL else PREFILL, decodes=DECODES)
    body = body or {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    turn = Turn(body=body, plan=plan, span=trace.INVALID_SPAN, started=0.0)
    turn.outcome.decode_params = {"from": "prefill"}
    return turn


def fallbacks(r: TurnRunner, kind: Fallback) -> float:
    return r.metrics.registry.get_sample_value("kvloop_router_fallbacks_total", {"kind": kind}) or 0.0


def text_of(lines: list[bytes]) -> str:
    return "".join(json.loads(line[6:])["choices"][0]["delta"]["content"] for line in lines
                   if line.startswith(b"data: {"))


async def streamed(r: TurnRunner, turn: Turn) -> list[bytes]:
    return [line async for line in r.decode_stream(turn)]


async def test_a_stream_broken_mid_way_resumes_on_the_next_engine_and_the_client_gets_each_token_once() -> None:
    broken = FakeReply(lines=(chunk("Hel"), chunk("lo")), breaks=aiohttp.ClientPayloadError("cut"))
    whole = FakeReply(lines=(chunk("Hel"), chunk("lo"), chunk(" world"), b"data: [DONE]\n"))
    r, http = runner({"http://d0": [broken], "http://d1": [whole]})
    turn = a_turn()
    got = await streamed(r, turn)
    assert text_of(got) == "Hello world" and got[-1] == b"data: [DONE]\n"
    assert turn.outcome.decode == DECODES[1] and fallbacks(r, Fallback.DECODE_RESUME) == 1
    assert fallbacks(r, Fallback.DECODE_RETRY) == 0
    first, second = (body["kv_transfer_params"] for _, body in http.sent)
    assert first == {"from": "prefill"} and second[DECODE_LOCAL_KEY] is True  # the retry recomputes there


async def test_a_5xx_or_an_unreachable_engine_before_any_byte_is_retried_on_the_next() -> None:
    r, http = runner({"http://d0": [FakeReply(503, body={"error": {"message": "overloaded"}})],
                      "http://d1": [aiohttp.ClientConnectionError("refused")],
                      "http://d2": [FakeReply(lines=(chunk("ok"),))]})
    turn = a_turn()
    assert text_of(await streamed(r, turn)) == "ok"
    assert [url for url, _ in http.sent] == [f"http://d{i}/v1/chat/completions" for i in range(3)]
    assert turn.outcome.decode == DECODES[2] and fallbacks(r, Fallback.DECODE_RETRY) == 2


async def test_a_4xx_ends_the_stream_with_the_engines_own_error_and_no_other_engine_is_asked() -> None:
    refusal = {"error": {"message": "prompt too long", "type": "invalid_request_error", "param": "messages"}}
    r, http = runner({"http://d0": [FakeReply(400, body=refusal)]})
    with pytest.raises(TurnError) as info:
        await streamed(r, a_turn())
    assert (info.value.status, info.value.message, info.value.param) == (400, "prompt too long", "messages")
    assert len(http.sent) == 1


async def test_a_stream_of_several_choices_broken_mid_way_is_a_502() -> None:
    r, http = runner({"http://d0": [FakeReply(lines=(chunk("a"),), breaks=aiohttp.ClientPayloadError("cut"))]})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2}
    got: list[bytes] = []
    with pytest.raises(TurnError) as info:
        async for line in r.decode_stream(a_turn(body)):
            got.append(line)
    assert info.value.status == 502 and info.value.message.startswith("the decode engine failed mid-stream (d0: ")
    assert got == [chunk("a")] and len(http.sent) == 1


async def test_no_decode_engine_left_is_a_503_naming_the_last_failure() -> None:
    r, _ = runner({"http://d0": [FakeReply(500, body={})], "http://d1": [TimeoutError()],
                   "http://d2": [FakeReply(lines=(chunk("x"),), breaks=aiohttp.ClientPayloadError("cut short"))]})
    with pytest.raises(TurnError) as info:
        await streamed(r, a_turn())
    assert info.value.status == 503
    assert info.value.message == "no decode engine could serve the request (d2: cut short)"
    assert fallbacks(r, Fallback.DECODE_RETRY) == 2 and fallbacks(r, Fallback.DECODE_RESUME) == 1


async def test_a_json_decode_moves_on_after_a_5xx_and_reports_the_engine_that_answered() -> None:
    answer = {"choices": [{"message": {"content": "ok"}}], "kv_transfer_params": {"x": 1}, "usage": {}}
    r, _ = runner({"http://d0": [FakeReply(502, body={})], "http://d1": [FakeReply(body=answer)]})
    turn = a_turn({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    reply = await r.decode_json(turn)
    assert "kv_transfer_params" not in reply and turn.outcome.decode == DECODES[1]
    assert fallbacks(r, Fallback.DECODE_RETRY) == 1


# The loop itself.

class FakePicker:
    """A fake of the directory's pick for :func:`candidates`: hands out the engines in order, counting its picks."""

    def __init__(self, engines: tuple[EngineInfo, ...]) -> None:
        self.engines, self.picks = engines, 0

    def __call__(self, tried: set[str]) -> EngineInfo | None:
        self.picks += 1
        return next((e for e in self.engines if e.engine_id not in tried), None)


def test_attempts_draw_each_engine_only_when_the_one_before_failed() -> None:
    picker = FakePicker(DECODES)
    attempts = Attempts(candidates([], picker), "none left")
    seen = []
    for attempt in attempts:
        seen.append((attempt.engine.engine_id, attempt.number))
        with attempt:
            if attempt.number == 0:
                raise EngineReplyError(503, {})
            break
    assert seen == [("d0", 0), ("d1", 1)] and picker.picks == 2  # d2 never picked


def test_attempts_describe_each_retryable_failure_and_end_with_a_503_naming_the_last() -> None:
    attempts = Attempts(DECODES, "no decode engine could serve the request")
    failures = (EngineReplyError(500, {}), EngineFrozen("no progress"), aiohttp.ClientConnectionError())
    errors = []
    for attempt, failure in zip(attempts, failures, strict=False):
        with attempt:
            raise failure
        assert attempt.cause is failure
        errors.append(attempt.error)
    assert errors == ["d0 answered 500", "d1: no progress", "d2: ClientConnectionError"]
    error = attempts.exhausted()
    assert (error.status, error.message) == (503, "no decode engine could serve the request (d2: "
                                                  "ClientConnectionError)")
    assert Attempts([], "nobody").exhausted().message == "nobody (no engine)"


def test_an_attempt_raises_a_4xx_as_the_engines_own_error_and_lets_other_failures_through() -> None:
    (attempt,) = Attempts(DECODES[:1], "none")
    with pytest.raises(TurnError) as info, attempt:
        raise EngineReplyError(404, {"error": {"message": "no such model", "type": "not_found", "param": "model"}})
    assert (info.value.status, info.value.kind, info.value.param) == (404, "not_found", "model")
    deadline = TurnError(504, "past request_timeout_s")
    for passing in (deadline, ValueError("not JSON")):
        (attempt,) = Attempts(DECODES[:1], "none")
        with pytest.raises(type(passing)) as caught, attempt:
            raise passing
        assert caught.value is passing and attempt.cause is None


def test_a_streams_attempts_retry_only_what_a_stream_can_fail_with() -> None:
    (attempt,) = Attempts(DECODES[:1], "none", STREAM_RETRYABLE)
    with attempt:
        raise aiohttp.ClientPayloadError("cut")
    assert attempt.error == "d0: cut"
    (attempt,) = Attempts(DECODES[:1], "none", STREAM_RETRYABLE)
    with pytest.raises(aiohttp.InvalidURL), attempt:
        raise aiohttp.InvalidURL("http://")  # a ClientError, but no engine's failure


async def test_first_answer_gives_the_call_its_attempt_number() -> None:
    calls = EngineCalls(RouterConfig(), http=None)  # type: ignore[arg-type]
    failed: list[tuple[str, str]] = []

    async def call(engine: EngineInfo, number: int) -> int:
        if number < 2:
            raise TimeoutError()
        return number

    answer, used = await calls.first_answer(DECODES, call, lambda e, why: failed.append((e.engine_id, why)), "no")
    assert (answer, used) == (2, DECODES[2]) and failed == [("d0", "d0: TimeoutError"), ("d1", "d1: TimeoutError")]


# The turn's books and outcome.

async def test_a_stream_counts_in_flight_while_it_runs_and_its_local_tail_until_the_first_bytes() -> None:
    r, http = runner({"http://d0": [FakeReply(lines=(chunk("a"), chunk("b")))]})
    http.watch = lambda: (r.books.in_flight.snapshot(), r.books.in_flight.tokens())
    turn = a_turn(path=Path.DECODE_LOCAL)
    seen = []
    async for _ in r.decode_stream(turn):
        seen.append((r.books.in_flight.snapshot(), r.books.in_flight.tokens()))
    assert http.watched == [({"d0": 1}, {"d0": 40})]  # the DECODE_LOCAL tail, the decode engine's to compute
    assert seen == [({"d0": 1}, {}), ({"d0": 1}, {})]  # computed by the first line
    assert r.books.in_flight.snapshot() == {} and r.placer.books is r.books


async def test_a_stream_given_up_by_its_client_lets_its_in_flight_count_go() -> None:
    r, _ = runner({"http://d0": [FakeReply(lines=(chunk("a"), chunk("b")))]})
    stream = r.decode_stream(a_turn(path=Path.DECODE_LOCAL))
    await anext(stream)
    assert r.books.in_flight.snapshot() == {"d0": 1}
    await stream.aclose()  # type: ignore[attr-defined]
    assert r.books.in_flight.snapshot() == {}


async def test_a_non_streamed_decode_local_reply_measures_the_turn() -> None:
    usage = {"prompt_tokens": 40, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 32}}
    r, _ = runner({"http://d0": [FakeReply(body={"choices": [], "usage": usage})]})
    turn = a_turn({"model": "m", "prompt": "hi"}, path=Path.DECODE_LOCAL)
    assert not turn.measured
    await r.decode_json(turn)
    assert turn.measured and (turn.done.local_tokens, turn.done.computed_tokens) == (32, 8)


def test_the_books_fill_each_placement_and_learn_from_the_turns() -> None:
    books = TurnBooks(RouterConfig(residual_window_s=30.0, publication_wait_s=0.5))
    with books.track("p0", 100):
        request = pb.PlaceRequest()
        books.stamp(request, 0.0)
    assert dict(request.in_flight) == {"p0": 1} and dict(request.in_flight_tokens) == {"p0": 100}
    assert request.counts_in_flight and request.pd_residual_s == 0.0
    cost = pb.CostEstimate(recompute_path_s=0.1)
    for now in (1.0, 2.0, 3.0, 4.0):
        kind, residual_s, estimate_s = books.observe_residual("RECOMPUTE", cost, {"decode_first": 300.0}, now) \
            or ("", 0.0, 0.0)
    assert kind == "pd" and residual_s == pytest.approx(0.2) and estimate_s == pytest.approx(0.2)
    stamped = pb.PlaceRequest()
    books.stamp(stamped, 4.0)
    assert stamped.pd_residual_s == pytest.approx(0.2) and not stamped.in_flight
    books.answered([b"k1", b"k2"], 5.0)
    assert books.expected([b"k1", b"k2", b"k3"], 5.1) == (2, 5.5)
    off = TurnBooks(RouterConfig(residual_window_s=0.0))
    assert off.residuals is None and off.observe_residual("RECOMPUTE", cost, {"decode_first": 1.0}, 0.0) is None
