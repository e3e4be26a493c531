"""The router's HTTP calls to engines, and the one way a call moves to the next engine.

:meth:`EngineCalls.first_answer` tries :func:`~kvloop.router.plan.candidates` in order. An engine that fails
(unreachable, timed out, or answering 5xx) is logged, counted by the caller's ``on_failure`` and replaced by the
next; one that answers 4xx ends the turn with its own error (another engine would refuse the request too).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import aiohttp
import structlog
from opentelemetry import propagate, trace

from kvloop.router.config import RouterConfig
from kvloop.router.directory import EngineInfo
from kvloop.router.errors import EngineReplyError, TurnError

log = structlog.get_logger("kvloop.router")

T = TypeVar("T")

RETRYABLE = (EngineReplyError, aiohttp.ClientError, TimeoutError)
"""Failures another engine may not have."""

CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
                        "add_special_tokens", "tools", "documents")
"""Request fields that change how a chat is rendered into tokens: passed to ``/tokenize`` as given."""


def failure_text(engine: EngineInfo, exc: BaseException) -> str:
    """A retryable failure, described; a 4xx reply raises the engine's own error as a :class:`TurnError`."""
    if isinstance(exc, EngineReplyError):
        if exc.status < 500:
            raise exc.turn_error() from None
        return f"{engine.engine_id} answered {exc.status}"
    return f"{engine.engine_id}: {str(exc) or type(exc).__name__}"


class EngineCalls:
    def __init__(self, config: RouterConfig, http: aiohttp.ClientSession) -> None:
        self.config, self.http = config, http

    def headers(self, span: Any = None) -> dict[str, str]:
        """traceparent: vLLM's own spans nest under ours (--otlp-traces-endpoint); the decode runs after
        ``prepare`` left the turn's span, so it names the span to nest under."""
        headers = {"content-type": "application/json"}
        propagate.inject(headers, context=trace.set_span_in_context(span) if span is not None else None)
        return headers

    def timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.config.request_timeout_s, sock_read=self.config.engine_stall_s)

    async def post(self, engine: EngineInfo, path: str, body: dict[str, Any], span: Any = None) -> dict[str, Any]:
        """The engine's JSON reply; :class:`EngineReplyError` for a status of 400 or more."""
        async with self.http.post(f"{engine.http}{path}", json=body, headers=self.headers(span),
                                  timeout=self.timeout()) as r:
            data = await r.json(content_type=None)
            if r.status >= 400:
                raise EngineReplyError(r.status, data)
            result: dict[str, Any] = data
            return result

    async def first_answer(self, engines: Iterable[EngineInfo], call: Callable[[EngineInfo, int], Awaitable[T]],
                           on_failure: Callable[[EngineInfo, str], None], none_left: str) -> tuple[T, EngineInfo]:
        """``call(engine, attempt)`` on each engine in turn until one answers: its answer and the engine.
        Raises :class:`TurnError` 503 (``none_left`` and the last failure) when none does."""
        last = "no engine"
        for attempt, engine in enumerate(engines):
            try:
                return await call(engine, attempt), engine
            except RETRYABLE as exc:
                last = failure_text(engine, exc)
                on_failure(engine, last)
        raise TurnError(503, f"{none_left} ({last})")

    async def tokenize(self, kind: str, body: dict[str, Any], engines: Iterable[EngineInfo]) -> list[int]:
        """The prompt's token ids from an engine's ``/tokenize``, with the request's own chat-template fields."""
        request: dict[str, Any] = {"model": body.get("model")}
        if kind == "chat":
            request["messages"] = body["messages"]
            request.update({k: body[k] for k in CHAT_TEMPLATE_FIELDS if k in body})
        else:
            request["prompt"] = body["prompt"]

        async def call(engine: EngineInfo, attempt: int) -> list[int]:
            return list((await self.post(engine, "/tokenize", request))["tokens"])

        def failed(engine: EngineInfo, error: str) -> None:
            log.warning("router.tokenize_failed", engine=engine.engine_id, error=error)

        tokens, _ = await self.first_answer(engines, call, failed, "no engine is available to tokenize the request")
        return tokens
