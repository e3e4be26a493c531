"""The router's side of the broker: the engine list (``Inspect``), a turn's placement (``PlaceStream``, with the
wait for a due publication), the pin of a TRANSFER's source lease and its ``CompleteTransfer``.

Fail-over between broker replicas acts on status codes only: a placement the replica refuses with UNAVAILABLE
(not the leader, or stopping) goes to the next replica; so does one whose stream broke. Without a plan the turn
falls back to recompute, with the cause (:class:`~kvloop.shared.vocabulary.Fallback`) as its reason.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

import grpc
import structlog
from opentelemetry import propagate, trace

from kvloop.router.books import TurnBooks
from kvloop.router.config import RouterConfig
from kvloop.router.directory import Directory
from kvloop.router.metrics import RouterMetrics
from kvloop.router.plan import Placement, plan_reason, plan_veto
from kvloop.shared.auth import token_of
from kvloop.shared.client import BrokerClient, PlacementStream, complete_request
from kvloop.shared.config import process_name
from kvloop.shared.hashing import ExtraKeys, block_keys
from kvloop.shared.protocol import PrefillReport
from kvloop.shared.tls import TlsFiles
from kvloop.shared.vocabulary import Fallback, Reason, Veto
from kvloop.v1 import broker_pb2 as pb

COMPLETE_RETRY_S: tuple[float | None, ...] = (0.5, 1.0, 2.0, 4.0, None)
"""Waits between ``CompleteTransfer`` tries while the brokers answer UNAVAILABLE (about 7.5 s in all)."""

log = structlog.get_logger("kvloop.router")

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
"""A PlaceStream refusal's code when the replica is not the leader (or is stopping): place on another."""

PUBLICATION_POLL_S = 0.01
"""Re-place period while a lease is due (a PlaceStream call costs the broker ~0.1 ms)."""


class Placer:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics, directory: Directory,
                 books: TurnBooks | None = None) -> None:
        self.config, self.metrics, self.directory = config, metrics, directory
        self.broker = BrokerClient(config.broker, timeout_s=config.broker_timeout_s,
                                   tls=TlsFiles.of(config, "broker_tls_"), token=token_of(config)) \
            if config.broker else None
        self.placements = PlacementStream(self.broker) if self.broker else None
        self.books = books if books is not None else TurnBooks(config)
        """The turns' books (the turn runner's), read into each placement: in flight, recent answers, residuals."""
        self.router_id = process_name()
        """Names this router's in-flight counts where the broker authenticates nobody (development)."""
        self.broker_answered = False
        """Whether the last ``Inspect`` got an answer: without a layout, the turn's fallback is then ``no_layout``
        (the broker knows no engine of the model), else ``broker_unavailable``."""
        self.unknown_words: set[tuple[str, str]] = set()
        """(field, word) of the plans' words this router did not know, each logged once."""
        self._background: set[asyncio.Task[Any]] = set()

    async def refresh(self) -> None:
        """The engine list from the leader. A follower answers with an empty view (engines register with the
        leader): with none leading, the last list stays, so the turns of a fail-over still find engines."""
        if self.broker is None:
            return
        try:
            reply = await self.broker.call("Inspect", pb.InspectRequest(), from_leader=True)
            if reply.store != "memory" and not reply.leader:
                self.broker_answered = False
                return
            self.directory.update(reply, time.monotonic())
            self.broker_answered = True
        except Exception as exc:  # the broker may be down: keep the last list
            self.broker_answered = False
            log.debug("router.refresh_failed", error=str(exc))

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self.placements is not None:
            await self.placements.close()
        if self.broker is not None:
            await self.broker.close()

    async def place(self, tokens: list[int], session: str, model: str) -> Placement:
        """The turn's placement; without a plan, ``fallback`` says why: ``no_broker`` (none configured),
        ``no_layout`` (the broker answered, and no engine serving the model has registered a layout),
        ``broker_unavailable`` (unreachable, or past ``broker_timeout_s``), ``place_refused`` (the broker refused
        the placement, e.g. no live engine of that layout)."""
        layout = self.directory.layout(model)
        if self.placements is None or layout is None:
            fallback = (Fallback.NO_BROKER if self.placements is None
                        else Fallback.NO_LAYOUT if self.broker_answered else Fallback.BROKER_UNAVAILABLE)
            self.metrics.fallbacks.labels(fallback).inc()
            return Placement(None, fallback=fallback)
        fingerprint, block_size = layout
        keys = block_keys(tokens, block_size, ExtraKeys(fingerprint))
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        request = pb.PlaceRequest(session_id=session, block_keys=keys, num_tokens=len(tokens),
                                  layout_fingerprint=fingerprint, block_size=block_size, pin=True,
                                  no_decode_local=not self.config.decode_local,
                                  traceparent=carrier.get("traceparent", ""), router_id=self.router_id)
        self.books.stamp(request, time.monotonic())
        plan, cause = await self.place_once(request)
        wait_ms = 0.0
        # The previous answer's lease may be a few ms from published (router/recent.py): place again until the
        # match covers the answered prompt this one extends, or the window since that answer has passed.
        due, deadline = self.books.expected(keys, time.monotonic())
        due = min(due, max(0, (len(tokens) - 1) // block_size))
        if plan is not None and plan.matched_blocks < due:
            if plan.HasField("pin"):  # not the plan this turn will use: let the pin go at once
                self.complete(plan.pin, PrefillReport(pull_failed=True))
            request.pin = False  # the re-placements only look; the final plan is pinned by the caller
            waited = time.monotonic()
            while plan is not None and plan.matched_blocks < due and time.monotonic() < deadline:
                await asyncio.sleep(PUBLICATION_POLL_S)
                plan, cause = await self.place_once(request)
            outcome = "published" if plan is not None and plan.matched_blocks >= due else "timed_out"
            wait_ms = round((time.monotonic() - waited) * 1e3, 3)
            self.metrics.publication_waits.labels(outcome).inc()
            trace.get_current_span().set_attribute("kvloop.publication_wait_ms", wait_ms)
            log.info("router.publication_wait", outcome=outcome, due_blocks=due,
                     matched_blocks=plan.matched_blocks if plan else None)
        pin = plan.pin if plan is not None and plan.HasField("pin") else None
        return Placement(plan, tuple(keys), wait_ms, pin, cause)

    async def place_once(self, request: pb.PlaceRequest) -> tuple[pb.Plan | None, Fallback | Literal[""]]:
        """The plan, or None and the fallback's cause (see :meth:`place`); each replica tried once."""
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
            if plan.error_code == UNAVAILABLE:
                # A follower's refusal (a fail-over, or a stream opened before the leader was known): find the
                # leader now and reopen the stream there for the next placement.
                await self.refresh()
                await self.placements.close()
            return None, Fallback.PLACE_REFUSED
        self.note_unknown_words(plan)
        return plan, ""

    def note_unknown_words(self, plan: pb.Plan) -> None:
        """Log, once per word, a reason or veto this router does not know (a newer broker's, in a rolling upgrade):
        the turn goes on as planned and reports it as ``unknown`` (:func:`~kvloop.router.plan.plan_reason`)."""
        for field, word, typed in (("reason", plan.reason, plan_reason(plan)),
                                   ("decode_local_veto", plan.decode_local_veto, plan_veto(plan))):
            if typed in (Reason.UNKNOWN, Veto.UNKNOWN) and word != typed and (field, word) not in self.unknown_words:
                self.unknown_words.add((field, word))
                log.warning("router.unknown_plan_word", field=field, word=word, reported_as=str(typed))

    async def pin(self, plan: pb.Plan, reader: str) -> pb.PinBlocksResponse | None:
        assert self.broker is not None
        try:
            pin: pb.PinBlocksResponse = await self.broker.call("PinBlocks", pb.PinBlocksRequest(
                reader_engine_id=reader, lease_id=plan.source_lease_id, num_blocks=plan.matched_blocks))
            return pin
        except Exception as exc:
            self.metrics.broker_errors.labels("PinBlocks").inc()
            log.info("router.pin_refused", lease=plan.source_lease_id, error=str(exc))
            return None

    def complete(self, pin: pb.PinBlocksResponse, report: PrefillReport | None) -> None:
        """``CompleteTransfer`` in the background, off the turn's critical path."""
        assert self.broker is not None
        broker, request = self.broker, complete_request(pin, report)

        async def send() -> None:
            # Retried while no replica leads (a fail-over takes a leader TTL or two): a pin left behind holds its
            # lease's blocks until the pin's timeout, after its source may have let them go.
            for delay in COMPLETE_RETRY_S:
                try:
                    await broker.call("CompleteTransfer", request)
                    return
                except Exception as exc:
                    unavailable = isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE
                    if not unavailable or delay is None:
                        self.metrics.broker_errors.labels("CompleteTransfer").inc()
                        log.info("router.complete_failed", pin=pin.pin_id, error=str(exc))
                        return
                await asyncio.sleep(delay)

        task = asyncio.create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
