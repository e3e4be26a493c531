"""The ``kvloop.v1.KVBroker`` gRPC service: validate, call the runtime, map errors to status codes.

Every RPC gets one OpenTelemetry span (parented by an incoming ``traceparent``), a latency sample and,
when refused, an error count by status code. Placement spans carry the whole decision. Every call is first
authenticated and authorized by the caller's token or certificate (:mod:`kvloop.broker.access`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

import grpc
import structlog
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvloop.broker import convert
from kvloop.broker.access import CALLER, Access
from kvloop.broker.core import BrokerState, Decision, EvictionCommand, PlaceInput
from kvloop.broker.runtime import BrokerRuntime
from kvloop.shared.auth import Unauthenticated
from kvloop.shared.client import plan_attributes
from kvloop.shared.errors import KvloopError, PermissionDenied
from kvloop.shared.vocabulary import Reason
from kvloop.v1 import broker_pb2 as pb
from kvloop.v1 import broker_pb2_grpc

log = structlog.get_logger("kvloop.broker.rpc")
tracer = trace.get_tracer("kvloop.broker")

Req = TypeVar("Req")
Resp = TypeVar("Resp")
AuthRefusal = (Unauthenticated, PermissionDenied)
Handler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]

_CODES = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
}


def _remote_context(context: grpc.aio.ServicerContext) -> Any:
    carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def rpc(method: str) -> Callable[[Handler[Req, Resp]], Handler[Req, Resp]]:
    def wrap(fn: Handler[Req, Resp]) -> Handler[Req, Resp]:
        @functools.wraps(fn)
        async def handler(self: BrokerService, request: Req, context: grpc.aio.ServicerContext) -> Resp:
            start = time.perf_counter()
            with tracer.start_as_current_span(f"kvloop.v1.KVBroker/{method}", kind=SpanKind.SERVER,
                                              context=_remote_context(context)) as span:
                try:
                    self.authorize(method, request, context)
                    return await fn(self, request, context)
                except KvloopError as exc:
                    code = _CODES[exc.status.value]
                    self.runtime.metrics.rpc_errors.labels(method=method, code=code.name).inc()
                    if isinstance(exc, AuthRefusal):
                        self.runtime.metrics.auth_refusals.labels(method=method, code=code.name).inc()
                    span.set_status(Status(StatusCode.ERROR, exc.message))
                    span.set_attribute("rpc.grpc.status_code", code.value[0])
                    log.info("rpc.refused", method=method, code=code.name, error=exc.message)
                    await context.abort(code, exc.message)
                    raise  # unreachable: abort raises
                finally:
                    self.runtime.metrics.rpc_latency.labels(method=method).observe(time.perf_counter() - start)

        return handler

    return wrap


class BrokerService(broker_pb2_grpc.KVBrokerServicer):
    def __init__(self, runtime: BrokerRuntime, access: Access | None = None) -> None:
        self.runtime = runtime
        self.access = access

    def _lease_owner(self, lease_id: str) -> str | None:
        lease = self.runtime.read(lambda s, now: s.leases.get(lease_id))
        return lease.engine_id if lease is not None else None

    def authorize(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Raise ``Unauthenticated`` or ``PermissionDenied`` when the caller may not make this call
        (:mod:`kvloop.broker.access`); the caller is then :data:`CALLER` for the handler."""
        if self.access is not None:
            CALLER.set(self.access.check(method, request, context, self._lease_owner))

    async def _authorize_stream(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        try:
            self.authorize(method, request, context)
        except KvloopError as exc:
            code = _CODES[exc.status.value]
            self.runtime.metrics.rpc_errors.labels(method=method, code=code.name).inc()
            self.runtime.metrics.auth_refusals.labels(method=method, code=code.name).inc()
            log.info("rpc.refused", method=method, code=code.name, error=exc.message)
            await context.abort(code, exc.message)

    @rpc("RegisterEngine")
    async def RegisterEngine(self, request: pb.RegisterEngineRequest, context: Any) -> pb.RegisterEngineResponse:
        info = convert.engine_from_pb(request.engine)
        rec, live = await self.runtime.mutate(lambda s, now: s.register(info, now))
        log.info("engine.registered", engine=info.engine_id, role=info.role.value, live_leases=len(live))
        cfg = self.runtime.config
        return pb.RegisterEngineResponse(keepalive_interval_s=cfg.keepalive_interval_s, engine_ttl_s=cfg.engine_ttl_s,
                                         last_eviction_seq=rec.eviction_seq, live_lease_ids=live)

    @rpc("KeepAlive")
    async def KeepAlive(self, request: pb.KeepAliveRequest, context: Any) -> pb.KeepAliveResponse:
        load = convert.load_from_pb(request.load)

        def keepalive(s: BrokerState, now: float) -> int:
            s.keepalive(request.engine_id, load, now)
            return len(s.engine_lease_ids(request.engine_id))

        live = await self.runtime.mutate(keepalive)
        return pb.KeepAliveResponse(engine_ttl_s=self.runtime.config.engine_ttl_s, live_leases=live)

    @rpc("DeregisterEngine")
    async def DeregisterEngine(self, request: pb.DeregisterEngineRequest, context: Any
                               ) -> pb.DeregisterEngineResponse:
        dropped = await self.runtime.mutate(lambda s, now: s.deregister(request.engine_id, now))
        log.info("engine.deregistered", engine=request.engine_id, dropped_leases=dropped)
        return pb.DeregisterEngineResponse(dropped_leases=dropped)

    @rpc("PublishLease")
    async def PublishLease(self, request: pb.PublishLeaseRequest, context: Any) -> pb.PublishLeaseResponse:
        keys, block_ids = list(request.block_keys), list(request.block_ids)
        lease, commands = await self.runtime.mutate(
            lambda s, now: s.publish(request.engine_id, request.session_id, keys, block_ids,
                                     request.num_tokens, request.ttl_s, now))
        trace.get_current_span().set_attributes({"kvloop.lease_id": lease.lease_id, "kvloop.blocks": len(keys),
                                                 "kvloop.evictions": len(commands)})
        return pb.PublishLeaseResponse(lease=convert.lease_to_pb(lease),
                                       evictions=[convert.command_to_pb(c) for c in commands])

    @rpc("RenewLease")
    async def RenewLease(self, request: pb.RenewLeaseRequest, context: Any) -> pb.RenewLeaseResponse:
        lease = await self.runtime.mutate(lambda s, now: s.renew(request.lease_id, request.ttl_s, now))
        return pb.RenewLeaseResponse(lease=convert.lease_to_pb(lease))

    @rpc("ReleaseLease")
    async def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: Any) -> pb.ReleaseLeaseResponse:
        deferred = await self.runtime.mutate(lambda s, now: s.release(request.lease_id, now))
        return pb.ReleaseLeaseResponse(deferred=deferred)

    @rpc("PinBlocks")
    async def PinBlocks(self, request: pb.PinBlocksRequest, context: Any) -> pb.PinBlocksResponse:
        return await self._pin(request.reader_engine_id, request.lease_id, request.num_blocks, request.timeout_s)

    async def _pin(self, reader: str, lease_id: str, num_blocks: int, timeout_s: float) -> pb.PinBlocksResponse:
        def pin(s: BrokerState, now: float) -> pb.PinBlocksResponse:
            p = s.pin(reader, lease_id, num_blocks, timeout_s, now)
            lease = s.leases[p.lease_id]
            return pb.PinBlocksResponse(pin_id=p.pin_id, block_ids=list(lease.block_ids[: p.num_blocks]),
                                        expires_at_unix=p.expires_at, lease_expires_at_unix=lease.expires_at,
                                        tier=convert.TIER_TO_PB[lease.tier])

        return await self.runtime.mutate(pin)

    @rpc("CompleteTransfer")
    async def CompleteTransfer(self, request: pb.CompleteTransferRequest, context: Any
                               ) -> pb.CompleteTransferResponse:
        lease = await self.runtime.mutate(
            lambda s, now: s.complete(request.pin_id, request.success, request.bytes, request.duration_s, now))
        return pb.CompleteTransferResponse(lease_expires_at_unix=lease.expires_at if lease else 0.0)

    @rpc("CompleteDemotion")
    async def CompleteDemotion(self, request: pb.CompleteDemotionRequest, context: Any
                               ) -> pb.CompleteDemotionResponse:
        lease = await self.runtime.mutate(
            lambda s, now: s.complete_demotion(request.engine_id, request.lease_id, request.success, now))
        self.runtime.metrics.demotions.labels(outcome="copied" if lease else "failed").inc()
        return pb.CompleteDemotionResponse(retained=lease is not None)

    @rpc("CompletePromotion")
    async def CompletePromotion(self, request: pb.CompletePromotionRequest, context: Any
                                ) -> pb.CompletePromotionResponse:
        await self.runtime.mutate(lambda s, now: s.complete_promotion(request.engine_id, request.lease_id,
                                                                      request.pin_id, request.success, now))
        self.runtime.metrics.prefetches.labels(outcome="loaded" if request.success else "failed").inc()
        return pb.CompletePromotionResponse()

    def _count_clipped(self, request: pb.PlaceRequest) -> None:
        cfg = self.runtime.config
        if not cfg.measured_residuals:
            return
        for kind, residual, by_engine in (("pd", request.pd_residual_s, request.pd_residual_by_engine),
                                          ("decode_local", request.decode_local_residual_s,
                                           request.decode_local_residual_by_engine)):
            if any(abs(r) > cfg.residual_bound_s for r in (*by_engine.values(), residual)):
                self.runtime.metrics.residuals_clipped.labels(kind=kind).inc()

    async def _place(self, request: pb.PlaceRequest) -> pb.Plan:
        start = time.perf_counter()
        place_input = PlaceInput(keys=list(request.block_keys), num_tokens=request.num_tokens,
                                 layout_fingerprint=request.layout_fingerprint, block_size=request.block_size,
                                 session_id=request.session_id, decode_local=not request.no_decode_local,
                                 pd_residual_s=request.pd_residual_s,
                                 decode_local_residual_s=request.decode_local_residual_s,
                                 pd_residual_by_engine=dict(request.pd_residual_by_engine),
                                 decode_local_residual_by_engine=dict(request.decode_local_residual_by_engine))
        self._count_clipped(request)
        if request.counts_in_flight:
            router, counts, tokens = _router_name(request), dict(request.in_flight), dict(request.in_flight_tokens)
            self.runtime.volatile(lambda s, now: s.report_in_flight(router, counts, now, tokens))
        plan = self.runtime.read(lambda s, now: s.place(place_input, now))
        pin = None
        if request.pin and plan.decision is Decision.TRANSFER:
            # Place and pin in one call: the router's critical path saves a round trip. The lease may have gone
            # between the two (an eviction): then the turn recomputes, as a refused PinBlocks would make it.
            try:
                pin = await self._pin(plan.prefill.engine_id, plan.source_lease_id, plan.matched_blocks, 0.0)
            except KvloopError as exc:
                log.info("broker.place_pin_refused", lease=plan.source_lease_id, error=exc.message)
                plan = replace(plan, decision=Decision.RECOMPUTE, reason=Reason.PIN_REFUSED, pull_tokens=0,
                               recompute_tokens=request.num_tokens - plan.local_tokens)
        if request.counts_in_flight:
            self.runtime.volatile(lambda s, now: s.count_placement(plan, now))
        use = self.runtime.volatile(lambda s, now: s.prefetch_use(plan)) if plan.session_id else None
        if use:
            self.runtime.metrics.prefetches.labels(outcome=use).inc()
        metrics = self.runtime.metrics
        metrics.placement_latency.observe(time.perf_counter() - start)
        metrics.placements.labels(decision=plan.decision.value, reason=plan.reason).inc()
        if plan.source_lease_id:
            metrics.source_tiers.labels(tier=plan.source_tier.value).inc()
        reply = convert.plan_to_pb(plan)
        reply.prefetch = use or ""
        # The router's turn span carries the same attributes (one builder); kvloop.decision names the plan here.
        trace.get_current_span().set_attributes({**plan_attributes(reply), "kvloop.decision": plan.decision.value})
        if pin is not None:
            reply.pin.CopyFrom(pin)
        return reply

    @rpc("Place")
    async def Place(self, request: pb.PlaceRequest, context: Any) -> pb.Plan:
        return await self._place(request)

    async def PlaceStream(self, batches: AsyncIterator[pb.PlaceBatch], context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[pb.PlanBatch]:
        """One PlanBatch per PlaceBatch, plans in request order; a refused request's plan carries ``error``."""
        await self._authorize_stream("PlaceStream", None, context)
        async for batch in batches:
            reply = pb.PlanBatch()
            for request in batch.requests:
                parent = propagate.extract({"traceparent": request.traceparent}) if request.traceparent else None
                with tracer.start_as_current_span("kvloop.v1.KVBroker/PlaceStream", context=parent,
                                                  kind=SpanKind.SERVER) as span:
                    try:
                        reply.plans.append(await self._place(request))
                    except KvloopError as exc:
                        self.runtime.metrics.rpc_errors.labels(method="PlaceStream", code=exc.status.value).inc()
                        span.set_status(Status(StatusCode.ERROR, exc.message))
                        reply.plans.append(pb.Plan(error=f"{exc.status.value}: {exc.message}",
                                                   error_code=_CODES[exc.status.value].value[0]))
            yield reply

    @rpc("ReportCacheEvents")
    async def ReportCacheEvents(self, request: pb.CacheEventBatch, context: Any) -> pb.CacheEventAck:
        """Into the soft index, in memory only (``volatile``): a hint for placement, never worth an etcd write."""
        stored, removed = list(request.stored_keys), list(request.removed_keys)
        ack = self.runtime.volatile(
            lambda s, now: s.report_cache_events(request.engine_id, request.incarnation, request.seq,
                                                 reset=request.reset, cleared=request.cleared, stored=stored,
                                                 removed=removed))
        metrics = self.runtime.metrics
        if ack.counted and ack.reason is not None:
            metrics.cache_resets.labels(reason=ack.reason.value).inc()
        for kind, n in (("stored", ack.stored), ("removed", ack.removed), ("cleared", int(request.cleared))):
            if n:
                metrics.cache_events.labels(kind=kind).inc(n)
        if ack.counted:
            log.info("cache_index.reset", engine=request.engine_id, reason=ack.reason.value if ack.reason else "",
                     seq=request.seq)
        trace.get_current_span().set_attributes({"kvloop.engine_id": request.engine_id, "kvloop.seq": request.seq,
                                                 "kvloop.cached_blocks": ack.cached_blocks,
                                                 "kvloop.reset": ack.reset})
        return convert.cache_ack_to_pb(ack)

    @rpc("Inspect")
    async def Inspect(self, request: pb.InspectRequest, context: Any) -> pb.InspectResponse:
        runtime = self.runtime
        base = pb.InspectResponse(store=runtime.store.kind, replica_id=runtime.config.replica,
                                  leader=runtime.is_leader, now_unix=runtime.clock())
        if runtime.state is None:
            return base

        def inspect(s: BrokerState, now: float) -> pb.InspectResponse:
            base.engines.extend(
                convert.engine_status_to_pb(rec, s.retained_blocks(eid), len(s.engine_lease_ids(eid)),
                                            s.soft.cached_blocks(eid), s.soft.resets(eid))
                for eid, rec in sorted(s.engines.items()))
            if not CALLER.get().full_view:
                return base  # a router: the engines it may route to, never what they hold (broker.access)
            base.leases.extend(convert.lease_to_pb(x) for x in sorted(s.leases.values(), key=lambda x: x.created_at))
            base.pins.extend(convert.pin_to_pb(p) for p in s.pins.values())
            return base

        return runtime.read(inspect)

    @rpc("HintSession")
    async def HintSession(self, request: pb.HintSessionRequest, context: Any) -> pb.SessionState:
        """A caller's hint on its session (``broker.core.sessions``); the reply says what was granted."""
        metrics = self.runtime.metrics
        asked = {name: field for name, field, said in (
            ("pause", "pause_s", request.HasField("pause_s")), ("end", "end", request.end),
            ("priority", "priority", bool(request.priority)),
            ("keep_generated", "keep_generated", request.HasField("keep_generated"))) if said}
        try:
            hint = convert.hint_from_pb(request)
            grant, commands = await self.runtime.mutate(
                lambda s, now: s.hint_session(request.owner, request.session_id, hint, now))
        except KvloopError:
            for name in asked:
                metrics.session_hints.labels(hint=name, outcome="refused").inc()
            raise
        for name, field in asked.items():
            # Only a pause or a priority is ever granted less than asked.
            outcome = "granted" if field not in grant.not_granted else "capped"
            metrics.session_hints.labels(hint=name, outcome=outcome).inc()
        leases = self.runtime.read(lambda s, now: s.session_leases(request.session_id))
        reply = convert.session_to_pb(request.session_id, grant.session, leases)
        reply.pause_granted_s = grant.pause_granted_s
        reply.refused.extend(grant.refused)
        reply.released_leases = sum(1 for c in commands if c.lease_id)
        trace.get_current_span().set_attributes({"kvloop.session_id": request.session_id, "kvloop.hints": list(asked),
                                                 "kvloop.refused": list(grant.refused),
                                                 "kvloop.pause_granted_s": grant.pause_granted_s})
        log.info("session.hinted", session=request.session_id, hints=list(asked), pause_granted_s=grant.pause_granted_s,
                 refused=list(grant.refused), released_leases=reply.released_leases)
        return reply

    @rpc("GetSession")
    async def GetSession(self, request: pb.GetSessionRequest, context: Any) -> pb.SessionState:
        def get(s: BrokerState, now: float) -> pb.SessionState:
            session = s.sessions.get(request.owner, request.session_id)
            return convert.session_to_pb(request.session_id, session, s.session_leases(request.session_id))

        return self.runtime.read(get)

    async def WatchEvictions(self, request: pb.WatchEvictionsRequest, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.EvictionCommand]:
        """Replay commands after ``after_seq`` (or a RESYNC), then stream new ones as they are issued."""
        await self._authorize_stream("WatchEvictions", request, context)
        engine_id, cursor = request.engine_id, request.after_seq
        event = self.runtime.subscribe(engine_id)
        try:
            while True:
                if self.runtime.draining:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "this broker replica is shutting down")
                event.clear()
                try:
                    after, durable = cursor, self.runtime.durable_seq(engine_id)
                    commands: list[EvictionCommand] = self.runtime.read(
                        lambda s, now: s.commands_after(engine_id, after, durable))  # noqa: B023 (called at once)
                except KvloopError as exc:
                    code = _CODES[exc.status.value]
                    self.runtime.metrics.rpc_errors.labels(method="WatchEvictions", code=code.name).inc()
                    await context.abort(code, exc.message)
                for cmd in commands:
                    yield convert.command_to_pb(cmd)
                    cursor = cmd.seq
                # Re-check now and then even without a wake-up: an engine dropped by expiry ends its stream.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout=5.0)
        finally:
            self.runtime.unsubscribe(engine_id, event)


def _router_name(request: pb.PlaceRequest) -> str:
    """Whose in-flight counts these are: the authenticated caller's name, so no router can overwrite another's;
    the request's ``router_id`` only where nobody is authenticated (development)."""
    caller = CALLER.get()
    if caller.how != "open":
        return caller.subject or min(caller.names, default="router")
    return request.router_id or "router"
