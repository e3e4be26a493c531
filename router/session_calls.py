"""The router's side of session hints: sends what a client said (:mod:`.sessions`) to the broker, after a turn or on
``/v1/sessions/{id}``, and counts, logs and traces what the broker granted. A turn's hints never fail the turn: the
answer has been sent when they go out, so a refused or lost hint is a log line and a metric."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import structlog
from opentelemetry import trace

from kvloop.router.errors import TurnError
from kvloop.router.metrics import RouterMetrics
from kvloop.router.sessions import SessionCall, SessionHints
from kvloop.shared.client import BrokerClient
from kvloop.v1 import broker_pb2 as pb

log = structlog.get_logger("kvloop.router.sessions")
tracer = trace.get_tracer("kvloop.router")

PRIORITY_TO_PB = {"low": pb.SESSION_PRIORITY_LOW, "normal": pb.SESSION_PRIORITY_NORMAL,
                  "high": pb.SESSION_PRIORITY_HIGH}
PRIORITY_NAMES = {v: k for k, v in PRIORITY_TO_PB.items()}
HTTP_OF = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.PERMISSION_DENIED: 404,
           grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429}
"""A broker refusal as the client sees it. Another tenant's session is a 404, as one that does not exist: the
router scopes ids by tenant, so only a router's own fault reaches the broker's owner check."""


def refusal(exc: grpc.aio.AioRpcError, what: str = "") -> TurnError:
    """A failed broker call as the client's error: the request's fault by :data:`HTTP_OF`, else a 503."""
    code = exc.code()
    return TurnError(HTTP_OF.get(code, 503), f"session: {what}{exc.details()}",
                     "invalid_request_error" if code in HTTP_OF else "server_error")


def hint_request(call: SessionCall, hints: SessionHints) -> pb.HintSessionRequest:
    request = pb.HintSessionRequest(session_id=call.scoped_id, owner=call.owner, end=hints.end,
                                    priority=PRIORITY_TO_PB.get(hints.priority or "", pb.SESSION_PRIORITY_UNSPECIFIED))
    if hints.pause_s is not None:
        request.pause_s = hints.pause_s
    if hints.keep_generated is not None:
        request.keep_generated = hints.keep_generated
    return request


def session_json(call: SessionCall, state: pb.SessionState) -> dict[str, Any]:
    """A session as ``/v1/sessions/{id}`` shows it (times are Unix seconds; null: not set)."""
    return {"id": call.session_id, "object": "session", "priority": PRIORITY_NAMES.get(state.priority, "normal"),
            "resume_at": state.resume_at_unix or None, "held_until": state.hold_until_unix or None,
            "ended_at": state.ended_at_unix or None, "leases": state.leases, "blocks": state.blocks,
            "host_blocks": state.host_blocks, "keep_generated": not state.drops_generated}


class SessionDesk:
    def __init__(self, broker: BrokerClient | None, metrics: RouterMetrics) -> None:
        self.broker, self.metrics = broker, metrics
        self._background: set[asyncio.Task[Any]] = set()

    def _require_broker(self) -> BrokerClient:
        if self.broker is None:
            raise TurnError(404, "sessions: this router has no broker (static engine lists keep no sessions)",
                            "invalid_request_error")
        return self.broker

    async def hint(self, call: SessionCall, hints: SessionHints, source: str) -> pb.SessionState:
        """Send ``hints`` for the caller's session; a broker refusal as a :class:`TurnError` of its HTTP status."""
        broker = self._require_broker()
        with tracer.start_as_current_span("kvloop.session_hint", attributes={
                "kvloop.session": call.scoped_id, "kvloop.hints": sorted(hints.said)}) as span:
            try:
                state: pb.SessionState = await broker.call("HintSession", hint_request(call, hints))
            except grpc.aio.AioRpcError as exc:
                self.metrics.session_hints.labels(source, "failed").inc()
                span.set_status(trace.Status(trace.StatusCode.ERROR, exc.details() or ""))
                raise refusal(exc, "the broker refused the hint: ") from None
            span.set_attributes({"kvloop.pause_granted_s": state.pause_granted_s,
                                 "kvloop.refused": list(state.refused), "kvloop.released_leases":
                                     state.released_leases})
        self.metrics.session_hints.labels(source, "partly" if state.refused else "granted").inc()
        log.info("router.session_hint", session=call.scoped_id, source=source, hints=hints.said,
                 pause_granted_s=state.pause_granted_s, refused=list(state.refused) or None,
                 released_leases=state.released_leases or None)
        return state

    async def get(self, call: SessionCall) -> pb.SessionState:
        broker = self._require_broker()
        try:
            return await broker.call("GetSession", pb.GetSessionRequest(session_id=call.scoped_id, owner=call.owner))
        except grpc.aio.AioRpcError as exc:
            raise refusal(exc) from None

    def after_turn(self, call: SessionCall | None) -> None:
        """Send a finished turn's hints in the background (the client has its answer)."""
        hints = call.hints if call is not None else None
        if call is None or hints is None or self.broker is None:
            return

        async def send() -> None:
            try:
                await self.hint(call, hints, "turn")
            except TurnError as exc:
                log.warning("router.session_hint_failed", session=call.scoped_id, error=exc.message)

        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Let the hints in flight finish (a graceful stop loses none)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=5.0)
