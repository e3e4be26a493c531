"""One turn through the cluster: tokenize, place, pin, prefill (with the pull), decode.

The steps are :mod:`kvloop.benchmarks.pd_driver`'s, asynchronous and with the fallbacks a front door needs:

- **Tokenize** in the router with the served model's tokenizer when configured (:mod:`.tokenizer`), else, and
  for what it does not render, on an engine's ``/tokenize`` with the request's own chat-template arguments, so
  the token ids (and so the block keys) are exactly the ones the engines will compute. Matching is by content; a
  session id (``x-session-id`` header, or ``user``/``session_id`` field) is only a hint to the broker.
- **Place** over the broker's ``PlaceStream``. Broker unreachable or slow (``broker_timeout_s``): the turn
  recomputes on engines picked round-robin from the last known list (logged, counted).
- **Pin** the source lease on ``TRANSFER`` in the same broker call (``PlaceRequest.pin``; refused: recompute),
  and name the source in the prefill's ``kv_transfer_params``, cut to the matched, block-aligned prefix.
- **DECODE_LOCAL**: no prefill at all; the decode engine that holds the prefix gets the whole request and
  computes the short tail from its own cache (``decode_local_params``), and reports what it found there in its
  usage (``cached_tokens``; the router asks for usage and drops it again when the client did not).
- **Prefill** with ``max_tokens=1``; a failed engine is retried on another prefill engine without the
  pull. ``CompleteTransfer`` goes to the broker in the background, off the critical path.
- **Decode** with the prefill's params, streamed to the client when asked; a decode engine that fails
  before answering is retried on another. The decode engine's sidecar publishes what it retains, so
  nothing of the decode's reply needs to reach the broker through the router (one path, documented).
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import structlog
from opentelemetry import propagate, trace

from kvloop.router.config import RouterConfig
from kvloop.router.directory import Directory, EngineInfo
from kvloop.router.in_flight import InFlightCounts
from kvloop.router.metrics import RouterMetrics
from kvloop.router.recent import RecentTurns
from kvloop.router.records import RecordWriter, turn_record
from kvloop.router.resume import StreamLedger
from kvloop.router.tokenizer import RouterTokenizer
from kvloop.router.truth import actual_path, plan_outcome, report_from_usage
from kvloop.shared.auth import token_of
from kvloop.shared.client import BrokerClient, PlacementStream, complete_request, transfer_params
from kvloop.shared.config import process_name
from kvloop.shared.hashing import ExtraKeys, block_keys
from kvloop.shared.protocol import SESSION_KEY, PrefillReport, decode_local_params, prefill_only_params
from kvloop.shared.tls import TlsFiles
from kvloop.shared.vocabulary import Fallback, Path, Reason
from kvloop.v1 import broker_pb2 as pb

log = structlog.get_logger("kvloop.router")
tracer = trace.get_tracer("kvloop.router")

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
"""A PlaceStream refusal's code when the replica is not the leader (or is stopping): place on another."""

PUBLICATION_POLL_S = 0.01
"""Re-place period while a lease is due (a PlaceStream call costs the broker ~0.1 ms)."""

# Request fields that change how a chat is rendered into tokens: passed to /tokenize as given.
CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
                        "add_special_tokens", "tools", "documents")


class TurnError(Exception):
    """A turn that cannot be served: the HTTP status and an OpenAI-style error."""

    def __init__(self, status: int, message: str, kind: str = "server_error", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass
class Prepared:
    """A turn up to its prefill: what the decode needs, and what the trace and metrics report."""

    kind: str
    session: str
    body: dict[str, Any]
    decode: EngineInfo
    decode_params: dict[str, Any]
    span: Any
    started: float
    decision: str = Path.RECOMPUTE
    """The planned path (what the broker chose, or RECOMPUTE when it could not be asked)."""
    reason: str = ""
    prompt_tokens: int = 0
    matched_tokens: int = 0
    planned_local_tokens: int = 0
    planned_pull_tokens: int = 0
    available_tokens: int = 0
    """The longest prefix any engine held (the broker's lease and soft indexes): the reuse this turn could have."""
    block_size: int = 0
    prefill_engine: str = ""
    report: PrefillReport | None = None
    """The prefill engine's own account (None: no kvloop connector reported, e.g. the prefill failed over); on
    DECODE_LOCAL, the decode engine's, from its usage once the reply is complete."""
    usage: dict[str, Any] | None = None
    client_usage: bool = True
    """False when the router asked the decode engine for usage that the client did not ask for."""
    decode_alternatives: list[EngineInfo] = field(default_factory=list)
    decode_started_ns: int = 0
    prompt_keys: list[bytes] = field(default_factory=list)
    timings_ms: dict[str, float] = field(default_factory=dict)
    """Where the turn's time went before its first token, by step (``x-kvloop-timing``; the benchmark's breakdown):
    tokenize, place (with any publication wait), publication_wait, pin, prefill (the request's round trip),
    decode_first (the decode request to its first streamed line)."""

    @property
    def decode_local(self) -> bool:
        return self.decision == Path.DECODE_LOCAL

    @property
    def measured(self) -> bool:
        """Whether an engine's own account of the prompt is in (a DECODE_LOCAL stream's comes at its end)."""
        return self.report is not None

    @property
    def done(self) -> PrefillReport:
        """The engine's report; until then (or without one) the plan's figures on DECODE_LOCAL, else a full
        recompute."""
        if self.report is not None:
            return self.report
        if self.decode_local:
            return PrefillReport(local_tokens=self.planned_local_tokens,
                                 computed_tokens=self.prompt_tokens - self.planned_local_tokens)
        return PrefillReport(computed_tokens=self.prompt_tokens)

    @property
    def path(self) -> str:
        """The path the turn actually took (:mod:`kvloop.router.truth`)."""
        return actual_path(self.decision, self.done)

    @property
    def outcome(self) -> str:
        return plan_outcome(self.decision, self.path, self.planned_local_tokens + self.planned_pull_tokens,
                            self.done.reused_tokens, self.block_size)


def plan_attributes(plan: pb.Plan) -> dict[str, Any]:
    """The broker's plan on the ``kvloop.turn`` span: the path, why, and each path's estimated cost."""
    cost = plan.cost
    return {"kvloop.planned": pb.Decision.Name(plan.decision).removeprefix("DECISION_"),
            "kvloop.plan.reason": plan.reason, "kvloop.plan.local_tokens": plan.local_tokens,
            "kvloop.plan.pull_tokens": plan.pull_tokens, "kvloop.plan.matched_tokens": plan.matched_tokens,
            "kvloop.plan.cached_tokens_seen": plan.cached_tokens_seen,
            "kvloop.plan.decode_local_veto": plan.decode_local_veto,
            "kvloop.plan.source_engine": plan.source_engine_id, "kvloop.plan.prefill_engine": plan.prefill_engine_id,
            "kvloop.plan.decode_engine": plan.decode_engine_id,
            "kvloop.cost.decode_local_s": cost.decode_local_s, "kvloop.cost.prefill_local_s": cost.prefill_local_s,
            "kvloop.cost.transfer_path_s": cost.transfer_path_s,
            "kvloop.cost.recompute_path_s": cost.recompute_path_s}


class TurnRunner:
    def __init__(self, config: RouterConfig, http: aiohttp.ClientSession, metrics: RouterMetrics) -> None:
        self.config = config
        self.http = http
        self.metrics = metrics
        self.directory = Directory(config)
        self.broker = BrokerClient(config.broker, timeout_s=config.broker_timeout_s,
                                   tls=TlsFiles.of(config, "broker_tls_"), token=token_of(config)) \
            if config.broker else None
        self.placements = PlacementStream(self.broker) if self.broker else None
        self.in_flight = InFlightCounts()
        """Prefill and decode requests this router has sent and not yet seen end, per engine (sent with each
        placement: the broker prices load on them)."""
        self.router_id = process_name()
        """Names this router's in-flight counts where the broker authenticates nobody (development)."""
        self._background: set[asyncio.Task[Any]] = set()
        self.recent = RecentTurns(config.publication_wait_s)
        self.tokenizer = RouterTokenizer(config.tokenizer) if config.tokenizer else None
        self.before_transfer: Callable[[pb.Plan, EngineInfo], None] | None = None
        """Called as a TRANSFER's prefill request (the one that pulls) is about to go out: ``kvloop bench chaos``
        kills the puller or the source there, to fail a pull in flight. None in service."""
        self.records = RecordWriter(config.records_path) if config.records_path else None
        self.broker_answered = False
        """Whether the last ``Inspect`` got an answer: without a layout, the turn's fallback is then ``no_layout``
        (the broker knows no engine of the model), else ``broker_unavailable``."""

    async def refresh(self) -> None:
        if self.broker is None:
            return
        try:
            # A follower answers Inspect with an empty view (engines register with the leader): ask until the
            # leader answers; with none leading, keep the last list, or every turn of a fail-over finds no engine at
            # all (seen in kvloop bench chaos and in the compose cluster).
            reply = await self.broker.call("Inspect", pb.InspectRequest(), from_leader=True)
            if reply.store != "memory" and not reply.leader:
                self.broker_answered = False
                return
            self.directory.update(reply, time.monotonic())
            self.broker_answered = True
        except Exception as exc:  # the broker may be down: keep the last list
            self.broker_answered = False
            log.debug("router.refresh_failed", error=str(exc))

    async def refresh_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.config.refresh_s)

    async def close(self) -> None:
        if self.records is not None:
            self.records.close()
        for task in list(self._background):
            task.cancel()
        if self.placements is not None:
            await self.placements.close()
        if self.broker is not None:
            await self.broker.close()

    # Engine calls.

    def _headers(self, span: Any = None) -> dict[str, str]:
        """traceparent: vLLM's own spans nest under ours (--otlp-traces-endpoint); the decode runs after
        ``prepare`` left the turn's span, so it names the span to nest under."""
        headers = {"content-type": "application/json"}
        propagate.inject(headers, context=trace.set_span_in_context(span) if span is not None else None)
        return headers

    async def _post(self, engine: EngineInfo, path: str, body: dict[str, Any], span: Any = None) -> dict[str, Any]:
        async with self.http.post(f"{engine.http}{path}", json=body, headers=self._headers(span),
                                  timeout=self.engine_timeout()) as r:
            data = await r.json(content_type=None)
            if r.status >= 400:
                raise EngineReplyError(r.status, data)
            result: dict[str, Any] = data
            return result

    async def tokenize(self, kind: str, body: dict[str, Any]) -> list[int]:
        if kind == "completion" and isinstance(body.get("prompt"), list) and all(
                isinstance(t, int) for t in body["prompt"]):
            return list(body["prompt"])
        model = str(body.get("model", ""))
        if self.tokenizer is not None and self.tokenizer_serves(model):
            local = await asyncio.to_thread(self.tokenizer.tokens, kind, body, CHAT_TEMPLATE_FIELDS)
            if local is not None:
                return local
        request: dict[str, Any] = {"model": body.get("model")}
        if kind == "chat":
            request["messages"] = body["messages"]
            request.update({k: body[k] for k in CHAT_TEMPLATE_FIELDS if k in body})
        else:
            request["prompt"] = body["prompt"]
        tried: set[str] = set()
        while (engine := self.directory.pick("prefill", model, tried)
               or self.directory.pick("decode", model, tried)) is not None:
            tried.add(engine.engine_id)
            try:
                reply = await self._post(engine, "/tokenize", request)
                return list(reply["tokens"])
            except EngineReplyError as exc:
                if exc.status < 500:
                    raise exc.turn_error() from None
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("router.tokenize_failed", engine=engine.engine_id, error=str(exc))
        raise TurnError(503, "no engine is available to tokenize the request")

    def tokenizer_serves(self, model: str) -> bool:
        """The configured tokenizer is the served model's: the one model a router with ``model`` set accepts, else
        the one model its engines name (with several, each request's engine tokenizes)."""
        return bool(self.config.model) or len(self.directory.models() - {model}) == 0

    # The turn.

    async def prepare(self, kind: str, body: dict[str, Any], session: str) -> Prepared:
        started = time.perf_counter()
        span = tracer.start_span("kvloop.turn")
        span.set_attribute("kvloop.session", session)
        span.set_attribute("gen_ai.request.model", str(body.get("model", "")))
        span.set_attribute("gen_ai.operation.name", "chat" if kind == "chat" else "text_completion")
        span.set_attribute("gen_ai.system", "vllm")
        try:
            with trace.use_span(span, end_on_exit=False):
                return await self._prepare(kind, body, session, span, started)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
            span.end()
            raise

    async def _prepare(self, kind: str, body: dict[str, Any], session: str, span: Any, started: float) -> Prepared:
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

        with tracer.start_as_current_span("kvloop.tokenize"):
            tokens = await self.tokenize(kind, body)
        lap("tokenize")
        if len(tokens) > self.config.max_prompt_tokens:
            raise TurnError(400, f"prompt has {len(tokens)} tokens, more than this router accepts "
                                 f"({self.config.max_prompt_tokens})", "invalid_request_error", "messages")
        span.set_attribute("gen_ai.usage.input_tokens", len(tokens))
        with tracer.start_as_current_span("kvloop.place") as place_span:
            plan, keys, wait_ms, pin, fallback = await self._place(tokens, session, model)
            decision = pb.Decision.Name(plan.decision).removeprefix("DECISION_") if plan else Path.RECOMPUTE
            reason = plan.reason if plan else fallback
            place_span.set_attribute("kvloop.decision", decision)
        lap("place")
        if wait_ms:
            timings["publication_wait"] = wait_ms
        prefill = self.directory.engines.get(plan.prefill_engine_id) if plan else None
        decode = self.directory.engines.get(plan.decode_engine_id) if plan else None
        if decision == Path.DECODE_LOCAL and decode is None:
            decision, reason = Path.RECOMPUTE, Reason.DECODE_ENGINE_UNKNOWN
        prefill = prefill or self.directory.pick("prefill", model)
        decode = decode or self.directory.pick("decode", model)
        if prefill is None or decode is None:
            raise TurnError(503, f"no prefill and decode engines serving '{model}' are available")
        layout = self.directory.layout(model)
        prepared = Prepared(kind=kind, session=session, body=body, decode=decode, decode_params={}, span=span,
                            started=started, decision=decision, reason=reason, prompt_tokens=len(tokens),
                            matched_tokens=int(plan.matched_tokens) if plan else 0, prompt_keys=keys,
                            timings_ms=timings, block_size=layout[1] if layout else 0,
                            planned_local_tokens=int(plan.local_tokens) if plan else 0,
                            planned_pull_tokens=int(plan.pull_tokens) if plan else 0,
                            available_tokens=int(plan.cached_tokens_seen) if plan else 0)
        prepared.decode_alternatives = [e for e in [*self.directory.of_role("decode", model),
                                                    *self.directory.last_resort("decode", model)]
                                        if e.engine_id != decode.engine_id]
        if plan is not None:
            span.set_attributes(plan_attributes(plan))
        if decision == Path.DECODE_LOCAL:
            # The decode engine serves the whole request from its own prefix cache: no prefill, no pull.
            prepared.prefill_engine = decode.engine_id
            prepared.decode_params = decode_local_params(session)
            return prepared
        params = prefill_only_params()
        if decision == Path.TRANSFER and plan is not None:
            pin = pin or await self._pin(plan, prefill.engine_id)
            if pin is None:
                prepared.decision, prepared.reason = Path.RECOMPUTE, Reason.PIN_REFUSED
                prepared.planned_pull_tokens = 0
            else:
                params = transfer_params(plan, pin)
                if self.before_transfer is not None:
                    self.before_transfer(plan, prefill)
            lap("pin")
        with tracer.start_as_current_span("kvloop.prefill") as prefill_span:
            reply, used = await self._prefill(body, params, prefill, model)
            p_params = dict(reply.get("kv_transfer_params") or {})
            report = PrefillReport.pop_from(p_params)
            prefill_span.set_attribute("kvloop.engine", used.engine_id)
            for key, value in (report.to_params() if report else {}).items():
                if key != "pull_failed":
                    prefill_span.set_attribute(f"kvloop.{key}", value)
        lap("prefill")
        prepared.prefill_engine = used.engine_id
        if pin is not None:
            failed_over = used.engine_id != prefill.engine_id
            self._complete(pin, PrefillReport(pull_failed=True) if failed_over else report)
            if failed_over or report is None or report.pull_failed:
                prepared.reason = Reason.PULL_FAILED_RECOMPUTED
        p_params[SESSION_KEY] = session
        prepared.decode_params, prepared.report = p_params, report
        return prepared

    async def _place(self, tokens: list[int], session: str, model: str
                     ) -> tuple[pb.Plan | None, list[bytes], float, pb.PinBlocksResponse | None, str]:
        """The plan, the prompt's block keys, the milliseconds spent waiting for a publication, the pin the broker
        took with the plan (TRANSFER), and without a plan why not (the turn's reason and the fallback's label):
        ``no_broker`` (none configured), ``no_layout`` (the broker answered, and no engine serving the model has
        registered a layout), ``broker_unavailable`` (unreachable, or past ``broker_timeout_s``), ``place_refused``
        (the broker answered the placement with an error, e.g. no live engine of that layout)."""
        layout = self.directory.layout(model)
        if self.placements is None or layout is None:
            cause: str = (Fallback.NO_BROKER if self.placements is None
                          else Fallback.NO_LAYOUT if self.broker_answered else Fallback.BROKER_UNAVAILABLE)
            self.metrics.fallbacks.labels(cause).inc()
            return None, [], 0.0, None, cause
        fingerprint, block_size = layout
        keys = block_keys(tokens, block_size, ExtraKeys(fingerprint))
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        request = pb.PlaceRequest(session_id=session, block_keys=keys, num_tokens=len(tokens),
                                  layout_fingerprint=fingerprint, block_size=block_size, pin=True,
                                  no_decode_local=not self.config.decode_local,
                                  traceparent=carrier.get("traceparent", ""),
                                  in_flight=self.in_flight.snapshot(), counts_in_flight=True,
                                  router_id=self.router_id)
        plan, cause = await self._place_once(request)
        wait_ms = 0.0
        # The previous answer's lease may be a few ms from published (router/recent.py): place again until the
        # match covers the answered prompt this one extends, or the window since that answer has passed.
        due, deadline = self.recent.expected(keys, time.monotonic())
        due = min(due, max(0, (len(tokens) - 1) // block_size))
        if plan is not None and plan.matched_blocks < due:
            if plan.HasField("pin"):  # not the plan this turn will use: let the pin go at once
                self._complete(plan.pin, PrefillReport(pull_failed=True))
            request.pin = False  # the re-placements only look; the final plan is pinned by the caller
            waited = time.monotonic()
            while plan is not None and plan.matched_blocks < due and time.monotonic() < deadline:
                await asyncio.sleep(PUBLICATION_POLL_S)
                plan, cause = await self._place_once(request)
            outcome = "published" if plan is not None and plan.matched_blocks >= due else "timed_out"
            wait_ms = round((time.monotonic() - waited) * 1e3, 3)
            self.metrics.publication_waits.labels(outcome).inc()
            trace.get_current_span().set_attribute("kvloop.publication_wait_ms", wait_ms)
            log.info("router.publication_wait", outcome=outcome, due_blocks=due,
                     matched_blocks=plan.matched_blocks if plan else None)
        pin = plan.pin if plan is not None and plan.HasField("pin") else None
        return plan, keys, wait_ms, pin, cause

    async def _place_once(self, request: pb.PlaceRequest) -> tuple[pb.Plan | None, str]:
        """The plan, or None and the fallback's cause (see :meth:`_place`). A replica that is not the leader, or a
        stream that broke, sends the placement to the next replica (each tried once)."""
        assert self.placements is not None
        for attempt in range(self.placements.replicas):
            last = attempt == self.placements.replicas - 1
            generation = self.placements.generation
            try:
                plan: pb.Plan = await self.placements.place(request, timeout_s=self.config.broker_timeout_s)
            except Exception as exc:
                self.metrics.broker_errors.labels("Place").inc()
                if not last:
                    self.placements.fail_over(generation)
                    continue
                self.metrics.fallbacks.labels(Fallback.BROKER_UNAVAILABLE).inc()
                log.warning("router.broker_unavailable", error=str(exc) or type(exc).__name__)
                return None, Fallback.BROKER_UNAVAILABLE
            if plan.error_code == UNAVAILABLE and not last:
                self.placements.fail_over(generation)
                continue
            break
        if plan.error:
            self.metrics.broker_errors.labels("Place").inc()
            self.metrics.fallbacks.labels(Fallback.PLACE_REFUSED).inc()
            log.warning("router.place_refused", error=plan.error)
            if plan.error_code == UNAVAILABLE and self.placements is not None:
                # A follower's refusal (a fail-over, or a stream opened before the leader was known): find the
                # leader now and reopen the stream there for the next placement.
                await self.refresh()
                await self.placements.close()
            return None, Fallback.PLACE_REFUSED
        return plan, ""

    async def _pin(self, plan: pb.Plan, reader: str) -> pb.PinBlocksResponse | None:
        assert self.broker is not None
        try:
            pin: pb.PinBlocksResponse = await self.broker.call("PinBlocks", pb.PinBlocksRequest(
                reader_engine_id=reader, lease_id=plan.source_lease_id, num_blocks=plan.matched_blocks))
            return pin
        except Exception as exc:
            self.metrics.broker_errors.labels("PinBlocks").inc()
            log.info("router.pin_refused", lease=plan.source_lease_id, error=str(exc))
            return None

    def _complete(self, pin: pb.PinBlocksResponse, report: PrefillReport | None) -> None:
        assert self.broker is not None
        request = complete_request(pin, report)

        async def send() -> None:
            try:
                await self.broker.call("CompleteTransfer", request)  # type: ignore[union-attr]
            except Exception as exc:
                self.metrics.broker_errors.labels("CompleteTransfer").inc()
                log.info("router.complete_failed", pin=pin.pin_id, error=str(exc))

        task = asyncio.create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _prefill(self, body: dict[str, Any], params: dict[str, Any], first: EngineInfo, model: str
                       ) -> tuple[dict[str, Any], EngineInfo]:
        request = copy.deepcopy(body)
        for key in ("stream", "stream_options", "n", "logprobs", "top_logprobs", "echo"):
            request.pop(key, None)
        request.update(max_tokens=1, stream=False, kv_transfer_params=params)
        if "max_completion_tokens" in request:
            request["max_completion_tokens"] = 1
        engine: EngineInfo | None = first
        tried: set[str] = set()
        while engine is not None:
            tried.add(engine.engine_id)
            try:
                with self.in_flight.track(engine.engine_id):
                    reply = await self._post(engine, "/v1/chat/completions" if "messages" in body
                                             else "/v1/completions", request)
                return reply, engine
            except EngineReplyError as exc:
                if exc.status < 500:
                    raise exc.turn_error() from None
                log.warning("router.prefill_failed", engine=engine.engine_id, status=exc.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("router.prefill_failed", engine=engine.engine_id, error=str(exc) or type(exc).__name__)
            self.metrics.fallbacks.labels(Fallback.PREFILL_RETRY).inc()
            request["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}  # no pull
            engine = self.directory.pick("prefill", model, tried)
        raise TurnError(503, "no prefill engine could serve the request")

    def decode_request(self, prepared: Prepared) -> dict[str, Any]:
        request = copy.deepcopy(prepared.body)
        request["kv_transfer_params"] = prepared.decode_params
        if prepared.decode_local and request.get("stream"):
            # The decode engine's usage says what it found in its cache: ask for it, drop it if the client did not.
            options = dict(request.get("stream_options") or {})
            prepared.client_usage = bool(options.get("include_usage"))
            request["stream_options"] = {**options, "include_usage": True}
        return request

    def observe(self, prepared: Prepared, line: bytes) -> bool:
        """Read the decode's usage chunk off a streamed line; True when the line is for the router only."""
        if not prepared.decode_local or not line.startswith(b"data: {") or b'"usage"' not in line:
            return False
        try:
            data = json.loads(line[6:])
        except ValueError:
            return False
        if not isinstance(data, dict) or not data.get("usage"):
            return False
        prepared.usage = data["usage"]
        prepared.report = report_from_usage(prepared.usage, prepared.prompt_tokens)
        return not prepared.client_usage and not data.get("choices")

    def path(self, prepared: Prepared) -> str:
        return "/v1/chat/completions" if prepared.kind == "chat" else "/v1/completions"

    def finish(self, prepared: Prepared, *, output_tokens: int, ttft_s: float, error: str = "") -> None:
        span, report, path, outcome = prepared.span, prepared.done, prepared.path, prepared.outcome
        if prepared.decode_started_ns:
            decode_span = tracer.start_span("kvloop.decode", context=trace.set_span_in_context(span),
                                            start_time=prepared.decode_started_ns)
            decode_span.set_attribute("kvloop.engine", prepared.decode.engine_id)
            decode_span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
            decode_span.end()
        span.set_attributes({
            "kvloop.decision": path, "kvloop.path": path, "kvloop.reason": prepared.reason,
            "kvloop.plan_vs_actual": outcome, "kvloop.measured": prepared.measured,
            "kvloop.matched_tokens": prepared.matched_tokens, "kvloop.pulled_blocks": report.pulled_blocks,
            "kvloop.pulled_tokens": report.pulled_tokens, "kvloop.local_tokens": report.local_tokens,
            "kvloop.pulled_bytes": report.pulled_bytes, "kvloop.pull_ms": report.pull_ms,
            "kvloop.recomputed_tokens": report.computed_tokens, "kvloop.ttft_ms": round(ttft_s * 1e3, 3),
            "kvloop.prefill_engine": prepared.prefill_engine, "kvloop.decode_engine": prepared.decode.engine_id,
            "gen_ai.usage.output_tokens": output_tokens})
        if error:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        else:
            self.recent.answered(prepared.prompt_keys, time.monotonic())
        span.end()
        if self.records is not None:
            self.records.write(turn_record(prepared, now=time.time(), elapsed_s=time.perf_counter() - prepared.started,
                                           output_tokens=output_tokens, ttft_s=ttft_s, error=error))
        m = self.metrics
        m.ttft.labels(path).observe(ttft_s)
        m.decisions.labels(path, prepared.reason).inc()
        m.plan_outcomes.labels(prepared.decision, path, outcome).inc()
        m.tokens.labels("local").inc(report.local_tokens)
        m.tokens.labels("pulled").inc(report.pulled_tokens)
        m.tokens.labels("computed").inc(report.computed_tokens)
        if report.pulled_bytes:
            m.pull_bytes.inc(report.pulled_bytes)
            m.pull_seconds.observe(report.pull_ms / 1e3)
        log.info("router.turn", session=prepared.session or None, path=path, planned=prepared.decision,
                 reason=prepared.reason, outcome=outcome, prompt_tokens=prepared.prompt_tokens,
                 local_tokens=report.local_tokens, pulled_tokens=report.pulled_tokens,
                 computed_tokens=report.computed_tokens, prefill_engine=prepared.prefill_engine or None,
                 decode_engine=prepared.decode.engine_id, ttft_ms=round(ttft_s * 1e3, 1), error=error or None)

    def retry_request(self, prepared: Prepared) -> dict[str, Any]:
        """The decode request for a second decode engine: the prompt computed there, never the first attempt's
        transfer params (the prefill engine frees the blocks they name once a decode has read them, and may have
        reused them: a second read would return another request's KV without an error)."""
        request = self.decode_request(prepared)
        request["kv_transfer_params"] = decode_local_params(prepared.session)
        return request

    def engine_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.config.request_timeout_s, sock_read=self.config.engine_stall_s)

    async def decode_stream(self, prepared: Prepared) -> AsyncIterator[bytes]:
        """The decode's SSE bytes, relayed as they come. An engine that fails, or sends nothing for
        ``engine_stall_s``, is replaced by another decode engine: before any byte by a retry, after some by a
        resume that relays only what the client has not had (:mod:`.resume`)."""
        request = self.decode_request(prepared)
        prepared.decode_started_ns = time.time_ns()
        engines = [prepared.decode, *prepared.decode_alternatives]
        ledger = StreamLedger()
        resumable = int(prepared.body.get("n") or 1) == 1
        last = "no decode engine"
        for attempt, engine in enumerate(engines):
            if attempt:
                request = self.retry_request(prepared)
                if ledger.started:
                    ledger.resume()
            try:
                with self.in_flight.track(engine.engine_id):
                    async with self.http.post(f"{engine.http}{self.path(prepared)}", json=request,
                                              headers=self._headers(prepared.span),
                                              timeout=self.engine_timeout()) as reply:
                        if reply.status >= 400:
                            data = await reply.json(content_type=None)
                            if reply.status < 500:
                                raise EngineReplyError(reply.status, data).turn_error()
                            last = f"{engine.engine_id} answered {reply.status}"
                            self.metrics.fallbacks.labels(Fallback.DECODE_RETRY).inc()
                            continue
                        prepared.decode = engine
                        async for line in reply.content:
                            if not resumable:
                                ledger.chunks += 1  # only that the client has had something
                                yield line
                            elif (relayed := ledger.relay(line)) is not None:
                                yield relayed
                        if ledger.diverged:
                            self.metrics.fallbacks.labels(Fallback.DECODE_RESUME_DIVERGED).inc()
                        return
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
                last = f"{engine.engine_id}: {exc or type(exc).__name__}"
                if ledger.started and not resumable:
                    raise TurnError(502, f"the decode engine failed mid-stream ({last})") from None
                kind = Fallback.DECODE_RESUME if ledger.started else Fallback.DECODE_RETRY
                self.metrics.fallbacks.labels(kind).inc()
                prepared.span.add_event(f"kvloop.{kind}", {"kvloop.engine": engine.engine_id, "error": last})
                log.warning("router.decode_failed", engine=engine.engine_id, error=last, resume=ledger.started)
        raise TurnError(503, f"no decode engine could serve the request ({last})")

    async def decode_json(self, prepared: Prepared) -> dict[str, Any]:
        request = self.decode_request(prepared)
        prepared.decode_started_ns = time.time_ns()
        last = "no decode engine"
        for attempt, engine in enumerate([prepared.decode, *prepared.decode_alternatives]):
            if attempt:
                request = self.retry_request(prepared)
            try:
                with self.in_flight.track(engine.engine_id):
                    reply = await self._post(engine, self.path(prepared), request, prepared.span)
                prepared.decode = engine
                reply.pop("kv_transfer_params", None)  # internal to the cluster
                return reply
            except EngineReplyError as exc:
                if exc.status < 500:
                    raise exc.turn_error() from None
                last = f"{engine.engine_id} answered {exc.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{engine.engine_id}: {exc or type(exc).__name__}"
            self.metrics.fallbacks.labels(Fallback.DECODE_RETRY).inc()
            log.warning("router.decode_failed", engine=engine.engine_id, error=last)
        raise TurnError(503, f"no decode engine could serve the request ({last})")


class EngineReplyError(Exception):
    def __init__(self, status: int, data: Any) -> None:
        super().__init__(f"engine answered {status}")
        self.status, self.data = status, data

    def turn_error(self) -> TurnError:
        """The engine's own OpenAI error, passed on with its status (a bad request stays a bad request)."""
        error = self.data.get("error") if isinstance(self.data, dict) else None
        if isinstance(error, dict):
            kind = str(error.get("type", "invalid_request_error"))
            return TurnError(self.status, str(error.get("message", "")), kind, error.get("param"))
        message = self.data.get("message", str(self.data)) if isinstance(self.data, dict) else str(self.data)
        return TurnError(self.status, str(message), "invalid_request_error")
