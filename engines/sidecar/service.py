"""The sidecar's service: the connector's stream in, broker calls out. A thin shell around :mod:`.books`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog
from opentelemetry import trace

from kvloop.engines.sidecar.books import LeaseBooks, Throughput, engine_load
from kvloop.engines.sidecar.cache_feed import CacheFeed
from kvloop.engines.sidecar.config import SidecarConfig
from kvloop.engines.sidecar.metrics import SidecarMetrics, post_json, probe_health, scrape_engine_load
from kvloop.shared.auth import token_of
from kvloop.shared.client import BrokerClient
from kvloop.shared.grpc_server import start_grpc_server
from kvloop.shared.hashing import ExtraKeys, block_keys
from kvloop.shared.protocol import PROMOTE_DEADLINE_KEY, PROMOTE_KEY, decode_local_params
from kvloop.shared.serving import freeze_started_heap, wait_for_stop, write_port_file
from kvloop.shared.tls import TlsFiles
from kvloop.shared.vocabulary import Role
from kvloop.v1 import broker_pb2 as pb
from kvloop.v1 import engine_link_pb2 as lpb
from kvloop.v1 import engine_link_pb2_grpc

log = structlog.get_logger("kvloop.sidecar")
tracer = trace.get_tracer("kvloop.sidecar")
LINK_SERVICE = lpb.DESCRIPTOR.services_by_name["EngineLink"].full_name
ROLES = {Role.PREFILL: pb.ENGINE_ROLE_PREFILL, Role.DECODE: pb.ENGINE_ROLE_DECODE, Role.BOTH: pb.ENGINE_ROLE_BOTH}


class Sidecar(engine_link_pb2_grpc.EngineLinkServicer):
    def __init__(self, config: SidecarConfig, metrics: SidecarMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or SidecarMetrics()
        self.broker = BrokerClient(config.broker, timeout_s=5.0, tls=TlsFiles.of(config, "broker_tls_"),
                                   token=token_of(config))
        self.extra = ExtraKeys(config.layout_fingerprint)
        self.hello: lpb.ConnectorHello | None = None
        self.registered = asyncio.Event()
        self.registration_changed = asyncio.Event()
        self.keepalive_interval_s = 2.0
        self.books = LeaseBooks()
        self.throughput = Throughput()
        self.engine_figures: dict[str, float] = {}
        self.engine_answered: float | None = None
        """When the engine last answered its /health (see ``engine_unresponsive_s``); None: not yet, and until it
        has answered once it counts as responsive (it is starting)."""
        self._responsive = True
        self.cache_feed: CacheFeed | None = None
        self._outbox: asyncio.Queue[lpb.ConnectorCommand] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._engine_tasks: list[asyncio.Task[Any]] = []
        self.grpc_address = config.advertise or config.listen

    # The connector's stream.

    async def Attach(self, request_iterator: AsyncIterator[lpb.ConnectorEvent], context: Any
                     ) -> AsyncIterator[lpb.ConnectorCommand]:
        outbox: asyncio.Queue[lpb.ConnectorCommand] = asyncio.Queue()
        self._outbox = outbox
        reader = asyncio.create_task(self._read_events(request_iterator))
        self.metrics.connected.set(1)
        try:
            yield lpb.ConnectorCommand()  # an empty first command: tells the connector it is attached
            while not reader.done() or not outbox.empty():
                get = asyncio.create_task(outbox.get())
                done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    yield get.result()
                else:
                    get.cancel()
        finally:
            reader.cancel()
            self.metrics.connected.set(0)
            if self._outbox is outbox:
                self._outbox = None
                # The EngineCore is gone (or restarting): its blocks went with it. Deregistering drops the
                # engine's leases at once, so no reader is sent to them; the next hello registers anew.
                log.info("connector.detached", engine=self.config.engine_id, dropped_leases=len(self.books.held))
                self._spawn(self._deregister())

    async def _read_events(self, events: AsyncIterator[lpb.ConnectorEvent]) -> None:
        async for event in events:
            kind = event.WhichOneof("event")
            if kind == "hello":
                await self._on_hello(event.hello)
            elif kind == "retained":
                if self.books.claim(event.retained.request_id):
                    self._spawn(self._publish(event.retained))
                else:
                    log.info("lease.duplicate_retained", request=event.retained.request_id)
            elif kind == "freed":
                self._on_freed(event.freed)
            elif kind == "prefill_done":
                self._on_prefill_done(event.prefill_done)
            elif kind == "demoted":
                self._on_demoted(event.demoted)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    def _command(self, command: lpb.ConnectorCommand) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(command)

    def _release(self, request_ids: list[str], reason: str) -> None:
        self.books.forget(request_ids)
        for _ in request_ids:
            self.metrics.released.labels(reason).inc()
        self.metrics.leases.set(len(self.books.held))
        self.metrics.host_tier_leases.set(len(self.books.hosted))
        if request_ids:
            self._command(lpb.ConnectorCommand(release_request_ids=request_ids))

    async def _on_hello(self, hello: lpb.ConnectorHello) -> None:
        restarted = self.hello is not None and self.hello.incarnation != hello.incarnation
        self.hello = hello
        log.info("connector.attached", engine=hello.engine_id, blocks=hello.num_blocks, block_size=hello.block_size,
                 bytes_per_block=hello.bytes_per_block, restarted=restarted)
        if hello.engine_id != self.config.engine_id:
            log.warning("connector.engine_id_mismatch", expected=self.config.engine_id, got=hello.engine_id)
        self._follow_cache_events(hello)
        if restarted or not self.registered.is_set():
            self.books.clear()
            self.metrics.host_tier_leases.set(0)
            self._set_registered(False)
            for task in self._engine_tasks:
                task.cancel()
            self._engine_tasks = [asyncio.create_task(self._register_forever())]

    def _follow_cache_events(self, hello: lpb.ConnectorHello) -> None:
        """One feed of the engine's KV cache events per engine incarnation (a new one's cache starts empty)."""
        if not self.config.kv_events_endpoint:
            return
        old = self.cache_feed
        if old is not None and old.incarnation == hello.incarnation:
            return
        if old is not None:
            self._spawn(old.close())
        # It reports once the engine is (re-)registered under this incarnation: _set_registered tells it.
        self.cache_feed = CacheFeed(self.config, self.broker, self.metrics, hello.incarnation, hello.block_size)

    def _set_registered(self, registered: bool) -> None:
        if self.cache_feed is not None:
            if registered:
                self.cache_feed.on_registered()
            else:
                self.cache_feed.on_unregistered()
        if registered:
            self.registered.set()
        else:
            self.registered.clear()
        self.metrics.registered.set(int(registered))
        self.registration_changed.set()

    def engine_pb(self) -> pb.Engine:
        assert self.hello is not None
        budget = int(self.hello.num_blocks * self.config.retention_fraction)
        return pb.Engine(engine_id=self.config.engine_id, role=ROLES[self.config.role],
                         addresses=pb.EngineAddresses(grpc=self.grpc_address, http=self.config.engine_url,
                                                      nixl=self.config.nixl_address),
                         block_size=self.hello.block_size, layout_fingerprint=self.config.layout_fingerprint,
                         retention_budget_blocks=budget if self.hello.kv_role_decode else 0,
                         incarnation=self.hello.incarnation, model=self.config.served_model,
                         host_tier_blocks=self.hello.host_tier_blocks if self.hello.kv_role_decode else 0,
                         host_tier_first_id=self.hello.host_tier_first_id, step_tokens=self.hello.step_tokens)

    async def _register_forever(self) -> None:
        """Register (retrying with back-off), then keep alive and follow evictions until cancelled."""
        delay = 0.1
        while True:
            try:
                reply = await self.broker.call("RegisterEngine", pb.RegisterEngineRequest(engine=self.engine_pb()))
            except grpc.aio.AioRpcError as exc:
                self.metrics.broker_errors.labels("RegisterEngine").inc()
                log.warning("broker.register_failed", code=exc.code().name, details=exc.details(), retry_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            self.keepalive_interval_s = max(0.2, reply.keepalive_interval_s or 2.0)
            self.books.last_seq = reply.last_eviction_seq
            self._release(self.books.not_live(reply.live_lease_ids), "resync")
            for lease_id in set(reply.live_lease_ids) - self.books.known():
                # The broker offers a lease this engine does not hold (its publication's reply, or the command
                # that freed it, was lost in a fail-over): it must stop offering those blocks.
                log.warning("lease.unknown_to_engine", lease=lease_id)
                self._spawn(self._release_at_broker(lease_id, known=False))
            self._set_registered(True)
            if self.books.held:
                # The broker offers these again from now (a new leader waits for this): hold them from now too.
                self._command(lpb.ConnectorCommand(hold_request_ids=list(self.books.held), hold_s=self.config.hold_s))
            log.info("broker.registered", engine=self.config.engine_id, keepalive_s=self.keepalive_interval_s,
                     engine_ttl_s=reply.engine_ttl_s, hold_s=self.config.hold_s)
            if reply.engine_ttl_s and self.config.hold_s <= reply.engine_ttl_s:
                log.warning("sidecar.hold_below_engine_ttl", hold_s=self.config.hold_s, engine_ttl_s=reply.engine_ttl_s)
            watcher = asyncio.create_task(self._watch_evictions())
            try:
                await self._keepalive_loop()
            finally:
                watcher.cancel()
                self._set_registered(False)
            delay = 0.1

    async def _keepalive_loop(self) -> None:
        """Returns when the broker no longer knows the engine (re-register) or stays unreachable too long.

        The engine's figures come from a separate sampler: a slow ``/metrics`` (seen here taking minutes on a
        loaded machine) must never delay a keep-alive, or the broker drops a healthy engine."""
        sampler = asyncio.create_task(self._sample_load_forever())
        prober = asyncio.create_task(self._probe_engine_forever())
        try:
            await self._keepalives()
        finally:
            sampler.cancel()
            prober.cancel()

    async def _probe_engine_forever(self) -> None:
        """Whether the engine answers at all: a frozen process keeps its connections open and never replies, and
        a broker that keeps placing turns on it makes every one of them wait for a timeout."""
        timeout = min(5.0, self.config.engine_unresponsive_s)
        while True:
            try:
                await asyncio.wait_for(asyncio.to_thread(probe_health, self.config.engine_url, timeout), timeout + 1)
                self.engine_answered = time.monotonic()
            except (OSError, TimeoutError) as exc:
                log.debug("engine.health_unanswered", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(self.keepalive_interval_s)

    def engine_responsive(self) -> bool:
        silent = 0.0 if self.engine_answered is None else time.monotonic() - self.engine_answered
        responsive = silent < self.config.engine_unresponsive_s
        if responsive != self._responsive:
            self._responsive = responsive
            self.metrics.engine_responsive.set(int(responsive))
            log.warning("engine.responsive" if responsive else "engine.unresponsive", engine=self.config.engine_id,
                        silent_s=round(silent, 1))
        return responsive

    async def _sample_load_forever(self) -> None:
        while True:
            try:
                self.engine_figures = await asyncio.wait_for(
                    asyncio.to_thread(scrape_engine_load, self.config.engine_url), timeout=5.0)
            except (OSError, ValueError, TimeoutError) as exc:
                log.debug("engine.metrics_unavailable", error=str(exc))
            await asyncio.sleep(self.keepalive_interval_s)

    async def _keepalives(self) -> None:
        failures = 0
        differ = 0
        while True:
            if not self.engine_responsive():
                # No keep-alive: the broker lets the engine expire (its leases go, nothing is placed on it). When
                # it answers again, the next keep-alive finds it forgotten and the sidecar registers it anew.
                await asyncio.sleep(self.keepalive_interval_s)
                continue
            load = self._load()
            try:
                reply = await self.broker.call("KeepAlive", pb.KeepAliveRequest(engine_id=self.config.engine_id,
                                                                                 load=load))
                failures = 0
                # Books that differ twice in a row (once may be a publication or an eviction in flight) are
                # resynced by registering again: the reply lists the broker's leases (see _register_forever).
                differ = differ + 1 if reply.live_leases != len(self.books.held) else 0
                if differ >= 2:
                    log.warning("lease.books_differ", broker=reply.live_leases, sidecar=len(self.books.held))
                    self.metrics.resyncs.inc()
                    return
            except grpc.aio.AioRpcError as exc:
                self.metrics.broker_errors.labels("KeepAlive").inc()
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning("broker.forgot_engine", engine=self.config.engine_id)
                    return
                failures += 1
                log.warning("broker.keepalive_failed", code=exc.code().name, failures=failures)
                if failures >= 5:
                    return
            if failures == 0 and self.books.held:
                self._command(lpb.ConnectorCommand(hold_request_ids=list(self.books.held), hold_s=self.config.hold_s))
            await asyncio.sleep(self.keepalive_interval_s)

    def _load(self) -> pb.EngineLoad:
        load = engine_load(self.engine_figures, self.hello.num_blocks if self.hello else 0,
                           self.config.pressure_kv_usage)
        return pb.EngineLoad(prefill_tokens_per_s=self.throughput.prefill_tokens_per_s,
                             transfer_bytes_per_s=self.throughput.transfer_bytes_per_s,
                             bytes_per_block=self.hello.bytes_per_block if self.hello else 0,
                             running_requests=load.running_requests, waiting_requests=load.waiting_requests,
                             kv_usage=load.kv_usage, memory_pressure=load.memory_pressure,
                             pressure_free_blocks=load.pressure_free_blocks)

    async def _watch_evictions(self) -> None:
        while True:
            try:
                call = self.broker.stub.WatchEvictions(
                    pb.WatchEvictionsRequest(engine_id=self.config.engine_id, after_seq=self.books.last_seq))
                async for command in call:
                    self._apply_eviction(command)
            except grpc.aio.AioRpcError as exc:
                self.metrics.broker_errors.labels("WatchEvictions").inc()
                log.info("broker.eviction_stream_broke", code=exc.code().name)
            await asyncio.sleep(0.2)

    def _apply_eviction(self, command: pb.EvictionCommand) -> None:
        if not self.books.is_new(command.seq):
            return  # already applied (commands are also returned by PublishLease)
        reason = pb.EvictionReason.Name(command.reason).removeprefix("EVICTION_REASON_").lower()
        if command.reason == pb.EVICTION_REASON_RESYNC:
            self._release(self.books.not_live(command.live_lease_ids), "resync")
            return
        if command.demote_to_block_ids:
            self._demote(command, reason)
            return
        if command.promote_pin_id:
            self._promote(command)
            return
        if command.tier == pb.TIER_HOST:
            # The tier's slots hold nothing the engine frees: the broker reuses them for a later demotion.
            if self.books.drop_hosted(command.lease_id):
                self.metrics.released.labels(reason).inc()
                self.metrics.host_tier_leases.set(len(self.books.hosted))
                log.info("lease.dropped_from_host_tier", lease=command.lease_id, reason=reason,
                         slots=len(command.block_ids))
            return
        rid = self.books.holder_of(command.lease_id)
        if rid is not None:
            log.info("lease.evicted", lease=command.lease_id, request=rid, reason=reason, blocks=len(command.block_ids))
            self._release([rid], reason)

    def _demote(self, command: pb.EvictionCommand, reason: str) -> None:
        """Ask the connector to copy the lease's blocks into the slots the broker chose, then free them; a lease
        this engine does not hold (or an engine without a tier) fails at once, so the broker drops it."""
        rid = self.books.demoting(command.lease_id)
        if rid is None or not (self.hello and self.hello.host_tier_blocks):
            if rid is not None:
                self._release([rid], reason)
                self.books.copying.pop(rid, None)
            log.warning("lease.demotion_refused", lease=command.lease_id, request=rid,
                        why="no host tier" if rid is not None else "not held here")
            self._spawn(self._complete_demotion(command.lease_id, False))
            return
        log.info("lease.demoting", lease=command.lease_id, request=rid, reason=reason,
                 slots=list(command.demote_to_block_ids)[:4])
        self.metrics.leases.set(len(self.books.held))
        self._command(lpb.ConnectorCommand(demote=[lpb.Demotion(request_id=rid,
                                                                to_block_ids=list(command.demote_to_block_ids))]))

    def _on_demoted(self, demoted: lpb.Demoted) -> None:
        lease = self.books.demoted(demoted.request_id, demoted.ok)
        self.metrics.host_tier_leases.set(len(self.books.hosted))
        if lease is not None:
            self._spawn(self._complete_demotion(lease, demoted.ok))

    async def _complete_demotion(self, lease_id: str, success: bool) -> None:
        self.metrics.demotions.labels("copied" if success else "failed").inc()
        try:
            await self.broker.call("CompleteDemotion", pb.CompleteDemotionRequest(
                engine_id=self.config.engine_id, lease_id=lease_id, success=success))
        except grpc.aio.AioRpcError as exc:
            # The broker's demotion timeout drops the lease (its command frees the slots here): nothing is lost
            # but the lease.
            self.metrics.broker_errors.labels("CompleteDemotion").inc()
            self.books.drop_hosted(lease_id)
            self.metrics.host_tier_leases.set(len(self.books.hosted))
            log.info("lease.demotion_report_failed", lease=lease_id, code=exc.code().name, details=exc.details())

    def _promote(self, command: pb.EvictionCommand) -> None:
        """Load a host-tier lease back into the pool before its session resumes (the broker's prefetch): the engine
        runs the lease's own tokens, plus one to compute, as a one-token request whose connector copies the prompt's
        KV from the host slots; it retains and this sidecar publishes the result, which supersedes the host lease."""
        found = self.books.promotion(command.lease_id)
        block_size = self.hello.block_size if self.hello else 0
        if found is None or len(found[1]) != len(command.block_ids) * block_size:
            log.warning("lease.promotion_refused", lease=command.lease_id,
                        why="not on this engine's host tier" if found is None else "slots and tokens differ")
            self._spawn(self._complete_promotion(command, False))
            return
        session_id, tokens = found
        log.info("lease.promoting", lease=command.lease_id, session=session_id or None, blocks=len(command.block_ids))
        self._spawn(self._run_promotion(command, session_id, tokens))

    async def _run_promotion(self, command: pb.EvictionCommand, session_id: str, tokens: list[int]) -> None:
        started = time.perf_counter()
        # Half the pin's time from now: the pin began when the broker issued the command, before it got here.
        within_s = command.promote_within_s / 2
        body = {"prompt": tokens + tokens[-1:], "max_tokens": 1, "temperature": 0.0,
                **({"model": self.config.served_model} if self.config.served_model else {}),
                "kv_transfer_params": {**decode_local_params(session_id), PROMOTE_KEY: list(command.block_ids),
                                       PROMOTE_DEADLINE_KEY: time.time() + within_s}}
        ok = True
        try:
            await asyncio.to_thread(post_json, f"{self.config.engine_url.rstrip('/')}/v1/completions", body,
                                    max(1.0, within_s))
        except (OSError, ValueError) as exc:
            ok = False
            log.warning("lease.promotion_failed", lease=command.lease_id, error=str(exc)[:200])
        log.info("lease.promoted", lease=command.lease_id, ok=ok, ms=round((time.perf_counter() - started) * 1e3, 1))
        await self._complete_promotion(command, ok)

    async def _complete_promotion(self, command: pb.EvictionCommand, success: bool) -> None:
        self.metrics.promotions.labels("loaded" if success else "failed").inc()
        try:
            await self.broker.call("CompletePromotion", pb.CompletePromotionRequest(
                engine_id=self.config.engine_id, lease_id=command.lease_id, pin_id=command.promote_pin_id,
                success=success))
        except grpc.aio.AioRpcError as exc:
            # The pin's timeout ends it at the broker all the same.
            self.metrics.broker_errors.labels("CompletePromotion").inc()
            log.info("lease.promotion_report_failed", lease=command.lease_id, code=exc.code().name)

    async def _publish(self, retained: lpb.Retained) -> None:
        assert self.hello is not None
        try:
            await asyncio.wait_for(self.registered.wait(), timeout=10.0)
        except TimeoutError:
            log.warning("lease.not_published", request=retained.request_id, why="not registered with a broker")
            self._release([retained.request_id], "unpublished")
            return
        keys = block_keys(list(retained.token_ids), self.hello.block_size, self.extra)
        request = pb.PublishLeaseRequest(engine_id=self.config.engine_id, session_id=retained.session_id,
                                         block_keys=keys, block_ids=list(retained.block_ids)[: len(keys)],
                                         num_tokens=len(keys) * self.hello.block_size, ttl_s=self.config.lease_ttl_s)
        with tracer.start_as_current_span("kvloop.sidecar.publish") as span:
            span.set_attribute("kvloop.blocks", len(keys))
            try:
                reply = await self.broker.call("PublishLease", request)
            except grpc.aio.AioRpcError as exc:
                self.metrics.broker_errors.labels("PublishLease").inc()
                log.warning("lease.publish_failed", request=retained.request_id, code=exc.code().name,
                            details=exc.details())
                self._release([retained.request_id], "unpublished")
                return
        self.books.published(retained.request_id, reply.lease.lease_id, retained.session_id,
                             list(retained.token_ids))
        self.metrics.published.inc()
        self.metrics.leases.set(len(self.books.held))
        log.info("lease.published", lease=reply.lease.lease_id, request=retained.request_id, blocks=len(keys),
                 session=retained.session_id or None, ttl_s=round(reply.lease.ttl_s, 1))
        for command in reply.evictions:
            self._apply_eviction(command)

    def _on_freed(self, freed: lpb.Freed) -> None:
        lease = self.books.freed_by_engine(freed.request_id)
        if lease is None:
            return  # we asked for it
        # The engine freed blocks on its own (its safety hold ran out): the broker must stop offering them.
        self.metrics.leases.set(len(self.books.held))
        self.metrics.released.labels("hold_expired").inc()
        self._spawn(self._release_at_broker(lease))

    async def _release_at_broker(self, lease_id: str, *, known: bool = True) -> None:
        try:
            reply = await self.broker.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id))
            if reply.deferred and not known:
                # A lease this sidecar never held (it restarted, or a publication's reply was lost) that a reader
                # pinned meanwhile. Its blocks were not freed: the engine frees a lease's blocks only when a sidecar
                # that knows the lease says so, or when its own hold runs out, and the hold outlasts the broker's
                # engine TTL, after which the broker offers none of the engine's leases. The pin ends the lease.
                self.metrics.unknown_released_pinned.inc()
                log.warning("lease.unknown_released_while_pinned", lease=lease_id, engine=self.config.engine_id)
            elif reply.deferred:
                # The engine has already freed these blocks (its hold ran out) while a reader held a pin on them:
                # the reader may get another request's KV. Must never happen (kvloop bench chaos counts these).
                self.metrics.freed_while_pinned.inc()
                log.error("lease.freed_while_pinned", lease=lease_id, engine=self.config.engine_id)
        except grpc.aio.AioRpcError as exc:
            self.metrics.broker_errors.labels("ReleaseLease").inc()
            log.info("lease.release_failed", lease=lease_id, code=exc.code().name)

    def _on_prefill_done(self, done: lpb.PrefillDone) -> None:
        self.throughput.prefill_done(done.computed_tokens, done.compute_s, done.pulled_bytes, done.pull_s,
                                     done.pull_failed)
        self.metrics.prefill_tps.set(self.throughput.prefill_tokens_per_s)
        self.metrics.transfer_bps.set(self.throughput.transfer_bytes_per_s)

    async def _deregister(self) -> None:
        for task in self._engine_tasks:
            task.cancel()
        self._engine_tasks = []
        was_registered = self.registered.is_set()
        self._set_registered(False)
        self.books.clear()
        self.metrics.leases.set(0)
        self.hello = None
        feed, self.cache_feed = self.cache_feed, None
        if feed is not None:
            await feed.close()
        if was_registered:
            try:
                await self.broker.call("DeregisterEngine", pb.DeregisterEngineRequest(engine_id=self.config.engine_id),
                                       timeout_s=2.0)
            except grpc.aio.AioRpcError as exc:
                self.metrics.broker_errors.labels("DeregisterEngine").inc()
                log.info("broker.deregister_failed", code=exc.code().name)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self._deregister()
        await self.broker.close()



async def serve(config: SidecarConfig, stop: asyncio.Event | None = None) -> None:
    sidecar = Sidecar(config)
    assert config.socket is not None
    tls = TlsFiles.of(config, "tls_")

    def add_servicers(server: grpc.aio.Server, bound: int) -> None:
        engine_link_pb2_grpc.add_EngineLinkServicer_to_server(sidecar, server)
        if not config.advertise:
            sidecar.grpc_address = f"{config.listen.rpartition(':')[0]}:{bound}"

    shell = await start_grpc_server(listen=config.listen, services=[LINK_SERVICE], add_servicers=add_servicers,
                                    tls=tls, registry=sidecar.metrics.registry, metrics_listen=config.metrics_listen,
                                    unix_socket=config.socket)

    async def follow_registration() -> None:
        while True:
            await sidecar.registration_changed.wait()
            sidecar.registration_changed.clear()
            await shell.set_serving(LINK_SERVICE, sidecar.registered.is_set())

    follower = asyncio.create_task(follow_registration())
    log.info("sidecar.listening", engine=config.engine_id, grpc=sidecar.grpc_address, socket=str(config.socket),
             metrics_port=shell.metrics_port or None,
             tls="mutual" if tls.mutual else "server" if tls.enabled else "off",
             broker_tls=TlsFiles.of(config, "broker_tls_").enabled)
    freeze_started_heap()
    if config.port_file is not None:
        write_port_file(config.port_file, shell.port)
    try:
        await wait_for_stop(stop)
    finally:
        log.info("sidecar.stopping", engine=config.engine_id)
        follower.cancel()
        await shell.health.enter_graceful_shutdown()
        await sidecar.close()
        await shell.stop(1.0)
