"""The router's HTTP calls to engines, and the one way a call moves to the next engine.

:class:`Attempts` walks :func:`~kvloop.router.plan.candidates` in order, one :class:`Attempt` per engine, and every
call that may move to another engine runs in it: the JSON calls (:meth:`EngineCalls.first_answer`: tokenize,
prefill, a non-streamed decode) and the streamed decode (``TurnRunner.decode_stream``, which resumes a broken
stream on the next engine: :mod:`.resume`). An engine that fails (unreachable, frozen, or answering 5xx) is
replaced by the next, the caller counting and logging the failure; one that answers 4xx ends the turn with its own
error (another engine would refuse the request too); with no engine left, the turn ends with 503 naming the last
failure.

A JSON call (:meth:`EngineCalls.post`) is never cut for silence: a non-streamed answer sends nothing until it is
complete. While it waits, the router scrapes the engine's step counters (:mod:`.progress`), and only an engine
that shows no progress for ``engine_stall_s`` is taken as frozen and replaced; a call still running at
``request_timeout_s`` ends the turn with 504, never a retry of work an engine is still doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar

import aiohttp
import structlog
from opentelemetry import propagate, trace

from kvloop.router.chat_tokens import encode_json
from kvloop.router.config import RouterConfig
from kvloop.router.directory import EngineInfo
from kvloop.router.errors import EngineReplyError, TurnError
from kvloop.router.progress import ProgressWatch, progress_count

log = structlog.get_logger("kvloop.router")

T = TypeVar("T")

RETRYABLE: tuple[type[BaseException], ...] = (EngineReplyError, aiohttp.ClientError, TimeoutError)
"""Failures another engine may not have."""

STREAM_RETRYABLE: tuple[type[BaseException], ...] = (
    EngineReplyError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)
"""A stream's failures another engine may not have: its status, a lost connection, a broken or silent stream."""

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


class Attempt:
    """One engine's try in :class:`Attempts`, used as ``with attempt:`` around the call to ``engine``. On leaving
    the block, a retryable failure is described in ``error`` (its exception in ``cause``) and suppressed, so the
    caller's loop goes on to the next engine; a 4xx reply raises the engine's own error as a :class:`TurnError`
    (:func:`failure_text`); any other exception (a :class:`TurnError` 504, a cancellation) passes through."""

    def __init__(self, engine: EngineInfo, number: int, retryable: tuple[type[BaseException], ...]) -> None:
        self.engine, self.number, self.retryable = engine, number, retryable
        """``number``: 0 for the first engine tried, 1 for the next, ..."""
        self.error = ""
        self.cause: BaseException | None = None

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if exc is None or not isinstance(exc, self.retryable):
            return False
        self.error, self.cause = failure_text(self.engine, exc), exc
        return True


class Attempts:
    """The one retry loop over engines: an :class:`Attempt` per engine of ``engines``, in order, drawn one at a
    time (so :func:`~kvloop.router.plan.candidates` picks the next only when it is needed)::

        attempts = Attempts(engines, "no decode engine could serve the request")
        for attempt in attempts:
            with attempt:
                return await call(attempt.engine)  # an answer leaves the loop
            count_and_log(attempt)  # a retryable failure: attempt.error says what it was
        raise attempts.exhausted()
    """

    def __init__(self, engines: Iterable[EngineInfo], none_left: str,
                 retryable: tuple[type[BaseException], ...] = RETRYABLE) -> None:
        self.engines, self.none_left, self.retryable = engines, none_left, retryable
        self.last = "no engine"
        """The last failure, described (:func:`failure_text`)."""

    def __iter__(self) -> Iterator[Attempt]:
        for number, engine in enumerate(self.engines):
            attempt = Attempt(engine, number, self.retryable)
            yield attempt
            self.last = attempt.error or self.last

    def exhausted(self) -> TurnError:
        """The turn's error once every engine has failed: 503, ``none_left`` and the last failure."""
        return TurnError(503, f"{self.none_left} ({self.last})")


class EngineCalls:
    def __init__(self, config: RouterConfig, http: aiohttp.ClientSession) -> None:
        self.config, self.http = config, http

    def headers(self, span: Any = None) -> dict[str, str]:
        """traceparent: vLLM's own spans nest under ours (--otlp-traces-endpoint); the decode runs after
        ``prepare`` left the turn's span, so it names the span to nest under."""
        headers = {"content-type": "application/json"}  # the bodies go as msgspec's bytes: 0.02 ms, json's 0.3
        propagate.inject(headers, context=trace.set_span_in_context(span) if span is not None else None)
        return headers

    def timeout(self) -> aiohttp.ClientTimeout:
        """A stream's: it sends a byte every token, so silence for ``engine_stall_s`` is a frozen engine."""
        return aiohttp.ClientTimeout(total=None, sock_connect=self.config.engine_stall_s,
                                     sock_read=self.config.engine_stall_s)

    @contextlib.asynccontextmanager
    async def stream(self, engine: EngineInfo, path: str, body: dict[str, Any], span: Any = None
                     ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A streamed call's reply, its lines to read within the block (cut after ``engine_stall_s`` of silence:
        :meth:`timeout`); :class:`EngineReplyError` for a status of 400 or more."""
        async with self.http.post(f"{engine.http}{path}", data=encode_json(body), headers=self.headers(span),
                                  timeout=self.timeout()) as reply:
            if reply.status >= 400:
                raise EngineReplyError(reply.status, await reply.json(content_type=None))
            yield reply

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
        async with self.http.post(f"{engine.http}{path}", data=encode_json(body), headers=self.headers(span),
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
        """``call(engine, attempt)`` on each engine in turn until one answers (:class:`Attempts`): its answer and
        the engine; ``on_failure(engine, error)`` after each retryable failure. Raises :class:`TurnError` 503
        (``none_left`` and the last failure) when none answers."""
        attempts = Attempts(engines, none_left)
        for attempt in attempts:
            with attempt:
                return await call(attempt.engine, attempt.number), attempt.engine
            on_failure(attempt.engine, attempt.error)
        raise attempts.exhausted()

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
