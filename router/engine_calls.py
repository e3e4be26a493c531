"""The router's HTTP calls to engines, and the one way a call moves to the next engine.

:meth:`EngineCalls.first_answer` tries :func:`~kvloop.router.plan.candidates` in order. An engine that fails
(unreachable, frozen, or answering 5xx) is logged, counted by the caller's ``on_failure`` and replaced by the
next; one that answers 4xx ends the turn with its own error (another engine would refuse the request too).

A JSON call (:meth:`EngineCalls.post`) is never cut for silence: a non-streamed answer sends nothing until it is
complete. While it waits, the router scrapes the engine's step counters (:mod:`.progress`), and only an engine
that shows no progress for ``engine_stall_s`` is taken as frozen and replaced; a call still running at
``request_timeout_s`` ends the turn with 504, never a retry of work an engine is still doing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import aiohttp
import structlog
from opentelemetry import propagate, trace

from kvloop.router.config import RouterConfig
from kvloop.router.directory import EngineInfo
from kvloop.router.errors import EngineReplyError, TurnError
from kvloop.router.progress import ProgressWatch, progress_count

log = structlog.get_logger("kvloop.router")

T = TypeVar("T")

RETRYABLE = (EngineReplyError, aiohttp.ClientError, TimeoutError)
"""Failures another engine may not have."""

SCRAPES_PER_STALL = 4
"""Progress scrapes of an engine within ``engine_stall_s`` while a JSON call to it waits: a frozen engine is
replaced between ``engine_stall_s`` and 1.25x that after its last progress."""


class EngineFrozen(TimeoutError):
    """An engine showed no progress for ``engine_stall_s`` while a call to it waited: retried elsewhere."""

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
        """A stream's: it sends a byte every token, so silence for ``engine_stall_s`` is a frozen engine."""
        return aiohttp.ClientTimeout(total=None, sock_connect=self.config.engine_stall_s,
                                     sock_read=self.config.engine_stall_s)

    async def post(self, engine: EngineInfo, path: str, body: dict[str, Any], span: Any = None) -> dict[str, Any]:
        """The engine's JSON reply; :class:`EngineReplyError` for a status of 400 or more, :class:`EngineFrozen`
        when the engine stops making progress, :class:`TurnError` 504 past ``request_timeout_s``."""
        call = asyncio.ensure_future(self._post(engine, path, body, span))
        try:
            return await self.watched(engine, call)
        finally:
            call.cancel()

    async def _post(self, engine: EngineInfo, path: str, body: dict[str, Any], span: Any) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.engine_stall_s)
        async with self.http.post(f"{engine.http}{path}", json=body, headers=self.headers(span),
                                  timeout=timeout) as r:
            data = await r.json(content_type=None)
            if r.status >= 400:
                raise EngineReplyError(r.status, data)
            result: dict[str, Any] = data
            return result

    async def watched(self, engine: EngineInfo, call: asyncio.Future[T]) -> T:
        """``call``'s result, scraping ``engine`` for progress while it waits (:mod:`.progress`)."""
        stall_s, deadline_s = self.config.engine_stall_s, self.config.request_timeout_s
        started = time.monotonic()
        watch = ProgressWatch(stall_s, started)
        interval = stall_s / SCRAPES_PER_STALL
        while True:  # the first scrape after one interval: a quick call costs the engine no scrape
            left = started + deadline_s - time.monotonic()
            await asyncio.wait({call}, timeout=min(interval, max(0.0, left)))
            if call.done():
                return call.result()
            if time.monotonic() - started >= deadline_s:
                raise TurnError(504, f"{engine.engine_id} had not answered within the engine call's deadline of "
                                     f"{deadline_s:g} s (request_timeout_s)")
            scrape = asyncio.ensure_future(self.progress(engine, interval))
            either: set[asyncio.Future[Any]] = {call, scrape}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if call.done():
                scrape.cancel()
                return call.result()
            answered, count = scrape.result()
            watch.observe(answered, count, time.monotonic())
            if watch.frozen(time.monotonic()):
                raise EngineFrozen(f"no progress in {stall_s:g} s (engine_stall_s): taken as frozen")

    async def progress(self, engine: EngineInfo, timeout_s: float) -> tuple[bool, float | None]:
        """Whether the engine answered a scrape of its ``/metrics``, and its step counters
        (:func:`.progress.progress_count`)."""
        try:
            async with self.http.get(f"{engine.http}/metrics",
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return (True, progress_count(await r.text())) if r.status == 200 else (False, None)
        except (aiohttp.ClientError, TimeoutError):
            return False, None

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
