"""One turn through the cluster: tokenize, place, pin, prefill (with the pull), decode. The shell around the pure
plan (:mod:`.plan`): it makes the calls the plan names, in order, and records what the engines report
(:mod:`.outcome`, written only by the turn: :class:`Turn`'s methods and this runner's). It keeps this router's
books of its turns (:mod:`.books`: in flight, recent answers, residuals), which the placer reads into each
placement. Reading path: :mod:`.plan`, :mod:`.placement` (the broker), :mod:`.engine_calls` (the engines and the one
retry loop over them), then this.

- **Tokenize** in the router with the served model's tokenizer when configured (:mod:`.tokenizer`), else, and
  for what it does not render, on an engine's ``/tokenize`` with the request's own chat-template arguments, so
  the token ids (and so the block keys) are exactly the ones the engines will compute. Matching is by content; a
  session id (``x-session-id`` header, or ``user``/``session_id`` field) is only a hint to the broker.
- **Place** over the broker's ``PlaceStream``; without a plan the turn recomputes on engines picked round-robin.
- **Pin** the source lease on ``TRANSFER`` in the same broker call (``PlaceRequest.pin``; refused: recompute),
  and name the source in the prefill's ``kv_transfer_params``, cut to the matched, block-aligned prefix.
- **DECODE_LOCAL**: no prefill at all; the decode engine that holds the prefix gets the whole request and
  computes the short tail from its own cache, and reports what it found there in its usage.
- **Prefill** with ``max_tokens=1``; a failed engine is retried on another prefill engine without the pull.
  ``CompleteTransfer`` goes to the broker in the background, off the critical path.
- **Decode** with the prefill's params, streamed to the client when asked; a decode engine that fails before
  answering is retried on another, one that fails mid-stream is resumed on another (:mod:`.resume`). The decode
  engine's sidecar publishes what it retains: nothing of the reply reaches the broker through the router.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import structlog
from opentelemetry import trace

from kvloop.router.books import TurnBooks
from kvloop.router.chat_tokens import ChatStream, chat_reply, token_request
from kvloop.router.config import RouterConfig
from kvloop.router.directory import Directory, EngineInfo
from kvloop.router.engine_calls import CHAT_TEMPLATE_FIELDS, STREAM_RETRYABLE, Attempt, Attempts, EngineCalls
from kvloop.router.errors import EngineReplyError, TurnError
from kvloop.router.metrics import RouterMetrics
from kvloop.router.outcome import Turn
from kvloop.router.placement import Placer
from kvloop.router.plan import (
    candidates,
    decode_request,
    downgraded,
    plan_path,
    plan_reason,
    plan_turn,
    prefill_request,
)
from kvloop.router.records import RecordWriter, turn_record
from kvloop.router.resume import StreamLedger, relayed_data
from kvloop.router.session_calls import SessionDesk
from kvloop.router.tokenizer import RouterTokenizer
from kvloop.shared.client import plan_attributes, transfer_params
from kvloop.shared.cpu_wait import ThreadLaps
from kvloop.shared.protocol import SESSION_KEY, PrefillReport, decode_local_params, prefill_only_params
from kvloop.shared.vocabulary import Fallback, Path, Reason, Role
from kvloop.v1 import broker_pb2 as pb

__all__ = ["CHAT_TEMPLATE_FIELDS", "Turn", "TurnError", "TurnRunner"]

INLINE_TOKENIZE_CHARS = 65536
"""Prompts up to this many characters are tokenized in the event loop: a few ms of CPU (a 13.8k-token prompt took
8.8 ms here, a 3.2k one 2.3 ms). Handed to a thread, a tokenization waits for the GIL behind the loop's own work,
and its result for the loop: at 16 sessions of the agent workload the router's tokenize step took 124 ms on average
with the thread and 16.5 ms inline (``kvloop bench load``, router records; two runs, the first with idle engines of
a stopped run still up, so not a clean comparison). Longer prompts still go to a thread, so that one cannot stall
the streams the loop relays for long."""

log = structlog.get_logger("kvloop.router")
tracer = trace.get_tracer("kvloop.router")


def prompt_chars(body: dict[str, Any]) -> int:
    """The characters of a request's prompt or messages' string contents."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    return sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))


class TurnRunner:
    def __init__(self, config: RouterConfig, http: aiohttp.ClientSession, metrics: RouterMetrics) -> None:
        self.config, self.http, self.metrics = config, http, metrics
        self.directory = Directory(config)
        self.books = TurnBooks(config)
        """What the turns tell the placements (in flight, recent answers, residuals): written here, read by the
        placer."""
        self.placer = Placer(config, metrics, self.directory, self.books)
        self.engines = EngineCalls(config, http)
        self.tokenizer = RouterTokenizer(config.tokenizer, config.tokenizer_sessions) if config.tokenizer else None
        self.before_transfer: Callable[[pb.Plan, EngineInfo], None] | None = None
        """Called as a TRANSFER's prefill request (the one that pulls) is about to go out: ``kvloop bench chaos``
        kills the puller or the source there, to fail a pull in flight. None in service."""
        self.records = RecordWriter(config.records_path) if config.records_path else None
        self.sessions = SessionDesk(self.placer.broker, metrics)

    async def refresh(self) -> None:
        await self.placer.refresh()

    async def refresh_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.config.refresh_s)

    async def close(self) -> None:
        await self.sessions.close()
        if self.records is not None:
            self.records.close()
        await self.placer.close()

    async def tokenize(self, kind: str, body: dict[str, Any], session: str = "") -> tuple[list[int], bool]:
        """The prompt's token ids, and whether the router rendered them itself (else: the client's ids, or an
        engine's ``/tokenize``)."""
        if kind == "completion" and isinstance(body.get("prompt"), list) and all(
                isinstance(t, int) for t in body["prompt"]):
            return list(body["prompt"]), False
        model = str(body.get("model", ""))
        if self.tokenizer is not None and self.tokenizer_serves(model):
            if prompt_chars(body) <= INLINE_TOKENIZE_CHARS:
                local = self.tokenizer.tokens(kind, body, CHAT_TEMPLATE_FIELDS, session)
            else:
                local = await asyncio.to_thread(self.tokenizer.tokens, kind, body, CHAT_TEMPLATE_FIELDS, session)
            if local is not None:
                return local, True
        d = self.directory
        return await self.engines.tokenize(kind, body, candidates(
            [], lambda tried: d.pick(Role.PREFILL, model, tried) or d.pick(Role.DECODE, model, tried))), False

    def tokenizer_serves(self, model: str) -> bool:
        """The configured tokenizer is the served model's: the one model a router with ``model`` set accepts, else
        the one model its engines name (with several, each request's engine tokenizes)."""
        return bool(self.config.model) or len(self.directory.models() - {model}) == 0

    async def prepare(self, kind: str, body: dict[str, Any], session: str) -> Turn:
        """The turn up to its first decode request: planned, placed, pinned and prefilled. Opens the turn's span
        (ended by :meth:`finish`, or here when the turn fails before it is prepared)."""
        started = time.perf_counter()
        span = tracer.start_span("kvloop.turn", attributes={
            "kvloop.session": session, "gen_ai.request.model": str(body.get("model", "")), "gen_ai.system": "vllm",
            "gen_ai.operation.name": "chat" if kind == "chat" else "text_completion"})
        try:
            with trace.use_span(span, end_on_exit=False):
                return await self._prepare(kind, body, session, span, started)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
            span.end()
            raise

    async def _prepare(self, kind: str, body: dict[str, Any], session: str, span: Any, started: float) -> Turn:
        model = str(body.get("model", ""))
        if not self.directory.knows(model):
            served = ", ".join(sorted(self.directory.models()))
            raise TurnError(404, f"model: the model '{model}' does not exist (the engines serve {served})",
                            "invalid_request_error", "model")
        timings: dict[str, float] = {}
        mark = time.perf_counter()

        def lap(step: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            timings[step] = round((now - mark) * 1e3, 3)
            mark = now

        own = ThreadLaps()  # the loop thread's CPU and wait for a core in each step
        with tracer.start_as_current_span("kvloop.tokenize"):
            tokens, rendered_here = await self.tokenize(kind, body, session)
        lap("tokenize")
        own.lap(timings, "tokenize")
        if len(tokens) > self.config.max_prompt_tokens:
            raise TurnError(400, f"prompt has {len(tokens)} tokens, more than this router accepts "
                                 f"({self.config.max_prompt_tokens})", "invalid_request_error", "messages")
        span.set_attribute("gen_ai.usage.input_tokens", len(tokens))
        with tracer.start_as_current_span("kvloop.place") as place_span:
            placement = await self.placer.place(tokens, session, model)
            plan = plan_turn(self.directory, kind, session, model, len(tokens), placement)
            place_span.set_attribute("kvloop.decision", plan.path)
        lap("place")
        own.lap(timings, "place")
        if placement.wait_ms:
            timings["publication_wait"] = placement.wait_ms
        if placement.plan is not None:
            span.set_attributes(plan_attributes(placement.plan))
        turn = Turn(body=body, plan=plan, span=span, started=started)
        if kind == "chat" and rendered_here and self.config.chat_as_tokens:
            turn.as_tokens = token_request(body, tokens)
        turn.outcome.timings_ms = timings
        if plan.decode_local:  # the decode engine serves the whole request from its own cache: no prefill, no pull
            turn.outcome.prefill_engine = plan.decode.engine_id
            turn.outcome.decode_params = decode_local_params(session)
            return turn
        params, pin = prefill_only_params(), placement.pin
        if plan.path == Path.TRANSFER and plan.broker_plan is not None:
            pin = pin or await self.placer.pin(plan.broker_plan, plan.prefill.engine_id)
            if pin is None:
                turn.plan = downgraded(plan, Reason.PIN_REFUSED)
            else:
                params = transfer_params(plan.broker_plan, pin)
                if self.before_transfer is not None:
                    self.before_transfer(plan.broker_plan, plan.prefill)
            lap("pin")
        await self._prefill(turn, params, pin)
        lap("prefill")
        return turn

    async def _prefill(self, turn: Turn, params: dict[str, Any], pin: pb.PinBlocksResponse | None) -> None:
        """The prefill, on the planned engine, then (without the pull) on any other prefill engine."""
        plan = turn.plan
        request = prefill_request(turn.engine_body, params)

        async def call(engine: EngineInfo, attempt: int) -> dict[str, Any]:
            if attempt:
                request["kv_transfer_params"] = prefill_only_params()  # no pull on a retry
            tokens = plan.prompt_tokens if attempt else plan.compute_tokens
            with self.books.track(engine.engine_id, tokens):
                return await self.engines.post(engine, turn.endpoint, request)

        def failed(engine: EngineInfo, error: str) -> None:
            log.warning("router.prefill_failed", engine=engine.engine_id, error=error)
            self.metrics.fallbacks.labels(Fallback.PREFILL_RETRY).inc()

        with tracer.start_as_current_span("kvloop.prefill") as prefill_span:
            more = candidates([plan.prefill], lambda tried: self.directory.pick(Role.PREFILL, plan.model, tried))
            reply, used = await self.engines.first_answer(more, call, failed, "no prefill engine could serve the "
                                                                                "request")
            p_params = dict(reply.get("kv_transfer_params") or {})
            report = PrefillReport.pop_from(p_params)
            prefill_span.set_attribute("kvloop.engine", used.engine_id)
            for key, value in (report.to_params() if report else {}).items():
                if key != "pull_failed":
                    prefill_span.set_attribute(f"kvloop.{key}", value)
        turn.outcome.prefill_engine = used.engine_id
        if pin is not None:
            failed_over = used.engine_id != plan.prefill.engine_id
            self.placer.complete(pin, PrefillReport(pull_failed=True) if failed_over else report)
            if failed_over or report is None or report.pull_failed:
                turn.plan = downgraded(plan, Reason.PULL_FAILED_RECOMPUTED)
        p_params[SESSION_KEY] = turn.plan.session
        turn.outcome.decode_params, turn.outcome.report = p_params, report

    async def decode_stream(self, turn: Turn) -> AsyncIterator[bytes]:
        """The decode's SSE bytes, relayed as they come. An engine that fails, or sends nothing for
        ``engine_stall_s``, is replaced by another decode engine (:class:`.engine_calls.Attempts`): before any byte
        by a retry, after some by a resume that relays only what the client has not had (:mod:`.resume`)."""
        turn.outcome.decode_started_ns = time.time_ns()
        ledger = StreamLedger()
        resumable = int(turn.body.get("n") or 1) == 1
        as_chat = ChatStream().line if turn.as_tokens else (lambda line, data: line)
        attempts = Attempts(candidates(turn.plan.decodes), "no decode engine could serve the request",
                            STREAM_RETRYABLE)
        for attempt in attempts:
            engine = attempt.engine
            request, turn.outcome.client_usage = decode_request(turn.plan, turn.engine_body, turn.outcome.decode_params,
                                                                retry=attempt.number > 0,
                                                                keep_generated=turn.keeps_generated)
            if attempt.number and ledger.started:
                ledger.resume()
            # A DECODE_LOCAL tail is the decode engine's to compute until its first bytes arrive.
            tail = turn.plan.compute_tokens if turn.plan.decode_local and not attempt.number else 0
            with attempt, self.books.track(engine.engine_id, tail) as computed:
                async with self.engines.stream(engine, turn.endpoint, request, turn.span) as reply:
                    turn.outcome.decode = engine
                    async for line in reply.content:
                        computed()
                        data = relayed_data(line) if resumable or turn.as_tokens else None
                        if not resumable:
                            ledger.chunks += 1  # only that the client has had something
                            yield as_chat(line, data)
                        elif (relayed := ledger.relay(line, data)) is not None:
                            yield as_chat(relayed, data)
                if ledger.diverged:
                    self.metrics.fallbacks.labels(Fallback.DECODE_RESUME_DIVERGED).inc()
                return
            self.decode_failed(turn, attempt, ledger.started, resumable)
        raise attempts.exhausted()

    def decode_failed(self, turn: Turn, attempt: Attempt, started: bool, resumable: bool) -> None:
        """A decode engine failed the stream (``started``: after the client had some of it): counted, and the next
        engine retries or resumes it; a stream that cannot be resumed (n > 1) ends the turn with 502."""
        if isinstance(attempt.cause, EngineReplyError):  # a 5xx answer, before any byte of its own
            self.metrics.fallbacks.labels(Fallback.DECODE_RETRY).inc()
            log.warning("router.decode_failed", engine=attempt.engine.engine_id, error=attempt.error, resume=False)
            return
        if started and not resumable:
            raise TurnError(502, f"the decode engine failed mid-stream ({attempt.error})")
        kind = Fallback.DECODE_RESUME if started else Fallback.DECODE_RETRY
        self.metrics.fallbacks.labels(kind).inc()
        turn.span.add_event(f"kvloop.{kind}", {"kvloop.engine": attempt.engine.engine_id, "error": attempt.error})
        log.warning("router.decode_failed", engine=attempt.engine.engine_id, error=attempt.error, resume=started)

    def first_line(self, turn: Turn) -> None:
        """The decode's first streamed line has come: time it, and measure the broker's estimate on it when the
        turn ran as the broker planned (no downgrade, the planned engines answered; :mod:`.residuals`)."""
        now = time.monotonic()
        turn.outcome.timings_ms["decode_first"] = round((time.time_ns() - turn.outcome.decode_started_ns) / 1e6, 3)
        plan, broker = turn.plan, turn.plan.broker_plan
        if broker is None or plan.reason != plan_reason(broker) or plan.path != plan_path(broker):
            return
        if turn.outcome.prefill_engine != plan.prefill.engine_id or turn.decode.engine_id != plan.decode.engine_id:
            return  # a fail-over: not what the planned engines cost
        by = turn.decode.engine_id if plan.path == Path.DECODE_LOCAL else turn.outcome.prefill_engine
        measured = self.books.observe_residual(plan.path, broker.cost, turn.outcome.timings_ms, now, by)
        if measured is not None:
            kind, residual_s, estimate_s = measured
            turn.span.set_attribute("kvloop.residual_s", round(residual_s, 6))
            self.metrics.residuals.labels(kind).set(estimate_s)
            crossed = self.books.drift.crossing(kind, estimate_s)
            if crossed is not None:
                (log.warning if crossed else log.info)(
                    "router.model_drift" if crossed else "router.model_drift_back", kind=kind,
                    drift_s=round(estimate_s, 3), bound_s=self.books.drift.bound_s, engine=turn.decode.engine_id)

    async def decode_json(self, turn: Turn) -> dict[str, Any]:
        turn.outcome.decode_started_ns = time.time_ns()

        async def call(engine: EngineInfo, attempt: int) -> dict[str, Any]:
            request, _ = decode_request(turn.plan, turn.engine_body, turn.outcome.decode_params, retry=attempt > 0,
                                        keep_generated=turn.keeps_generated)
            with self.books.track(engine.engine_id):
                return await self.engines.post(engine, turn.endpoint, request, turn.span)

        def failed(engine: EngineInfo, error: str) -> None:
            self.metrics.fallbacks.labels(Fallback.DECODE_RETRY).inc()
            log.warning("router.decode_failed", engine=engine.engine_id, error=error)

        reply, turn.outcome.decode = await self.engines.first_answer(
            candidates(turn.plan.decodes), call, failed, "no decode engine could serve the request")
        reply.pop("kv_transfer_params", None)  # internal to the cluster
        turn.observe_reply(reply)
        return chat_reply(reply) if turn.as_tokens else reply

    def finish(self, turn: Turn, *, output_tokens: int, ttft_s: float, error: str = "") -> None:
        """The turn's span, record, metrics and log line, from its plan and what the engines reported."""
        plan, report, path, outcome = turn.plan, turn.done, turn.path, turn.plan_vs_actual
        if turn.outcome.decode_started_ns:
            decode_span = tracer.start_span("kvloop.decode", context=trace.set_span_in_context(turn.span),
                                            start_time=turn.outcome.decode_started_ns)
            decode_span.set_attribute("kvloop.engine", turn.decode.engine_id)
            decode_span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
            decode_span.end()
        turn.span.set_attributes({
            "kvloop.decision": path, "kvloop.path": path, "kvloop.reason": plan.reason,
            "kvloop.plan_vs_actual": outcome, "kvloop.measured": turn.measured,
            "kvloop.matched_tokens": plan.matched_tokens, "kvloop.pulled_blocks": report.pulled_blocks,
            "kvloop.pulled_tokens": report.pulled_tokens, "kvloop.local_tokens": report.local_tokens,
            "kvloop.pulled_bytes": report.pulled_bytes, "kvloop.pull_ms": report.pull_ms,
            "kvloop.recomputed_tokens": report.computed_tokens, "kvloop.ttft_ms": round(ttft_s * 1e3, 3),
            "kvloop.prefill_engine": turn.outcome.prefill_engine, "kvloop.decode_engine": turn.decode.engine_id,
            "gen_ai.usage.output_tokens": output_tokens})
        hints = turn.session.hints.said if turn.session is not None and turn.session.hints is not None else {}
        if hints:
            turn.span.set_attribute("kvloop.session_hints", [f"{k}={v}" for k, v in sorted(hints.items())])
        if error:
            turn.span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        else:
            self.books.answered(list(plan.keys), time.monotonic())
        turn.span.end()
        if self.records is not None:
            self.records.write(turn_record(turn, now=time.time(), elapsed_s=time.perf_counter() - turn.started,
                                           output_tokens=output_tokens, ttft_s=ttft_s, error=error, hints=hints))
        self.metrics.turn_finished(path, plan.path, plan.reason, outcome, report, ttft_s)
        log.info("router.turn", session=plan.session or None, path=path, planned=plan.path, reason=plan.reason,
                 outcome=outcome, prompt_tokens=plan.prompt_tokens, local_tokens=report.local_tokens,
                 pulled_tokens=report.pulled_tokens, computed_tokens=report.computed_tokens,
                 prefill_engine=turn.outcome.prefill_engine or None, decode_engine=turn.decode.engine_id,
                 ttft_ms=round(ttft_s * 1e3, 1), error=error or None, hints=hints or None)
        self.sessions.after_turn(turn.session)
