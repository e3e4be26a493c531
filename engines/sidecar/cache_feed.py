"""The shell around :mod:`.cache_events`: subscribe to the engine's KV cache events over ZMQ, keep the mirror, and
report it to the broker's soft index (``ReportCacheEvents``).

One :class:`CacheFeed` per engine incarnation (the connector's hello starts it, its detach stops it), two tasks on
the sidecar's event loop:

- **subscriber**: a SUB socket on the engine's publisher. A gap in the publisher's sequence is asked of its
  replay endpoint (a DEALER to vLLM's ROUTER: ``[b"", start seq]`` in, ``[b"", topic, seq, payload]`` out until
  the seq ``-1``); when the replay cannot cover it, the mirror loses track and the broker is told to reset.
- **reporter**: while the engine is registered, sends the outbox in batches of at most ``kv_events_batch_keys``,
  gathering ``kv_events_batch_s`` of events first. Every (re-)registration, a failed call, and an ack that shows
  the broker lost the thread (a restarted or new leader, a lost batch) make it send the whole mirror again, with
  ``reset`` on its first batch. The broker keeps the index in memory only, so this is how it is rebuilt.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
import structlog
import zmq
import zmq.asyncio

from kvloop.engines.sidecar.cache_events import CacheMirror, Outbox, SeqTracker, Verdict, decode_batch, needs_resync
from kvloop.engines.sidecar.config import SidecarConfig
from kvloop.engines.sidecar.metrics import SidecarMetrics
from kvloop.shared.client import BrokerClient
from kvloop.shared.protocol import KV_EVENTS_TOPIC
from kvloop.v1 import broker_pb2 as pb

log = structlog.get_logger("kvloop.sidecar.cache")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_S = 2.0
EVENT_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
MAX_REPLAY_BATCHES = 20_000  # vLLM keeps buffer_steps batches (10,000 by default): a bound, not a target


class CacheFeed:
    def __init__(self, config: SidecarConfig, broker: BrokerClient, metrics: SidecarMetrics, incarnation: str,
                 block_size: int) -> None:
        self.config = config
        self.broker = broker
        self.metrics = metrics
        self.incarnation = incarnation
        self.outbox = Outbox()
        self.mirror = CacheMirror(block_size, config.layout_fingerprint, config.kv_events_max_blocks, self.outbox)
        self.tracker = SeqTracker()
        self._ctx = zmq.asyncio.Context()
        self._registered = False
        self._wake = asyncio.Event()
        self._tasks = [asyncio.create_task(self._subscribe(), name="kv-events-subscriber"),
                       asyncio.create_task(self._report(), name="kv-events-reporter")]
        for task in self._tasks:
            task.add_done_callback(self._ended)

    @staticmethod
    def _ended(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("cache_events.task_failed", task=task.get_name(), error=repr(task.exception()))

    # ---------------------------------------------------------------- from the sidecar
    def on_registered(self) -> None:
        """Registered (again): the broker's index of this engine may be gone or stale; send it everything."""
        self._registered = True
        self.outbox.resync(self.mirror.keys())
        self._wake.set()

    def on_unregistered(self) -> None:
        self._registered = False

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._ctx.destroy(linger=0)

    # ---------------------------------------------------------------- subscriber
    async def _subscribe(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, KV_EVENTS_TOPIC.encode())
        sub.connect(self.config.kv_events_endpoint)  # ZMQ connects (and reconnects) in the background
        log.info("cache_events.subscribed", endpoint=self.config.kv_events_endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.metrics.cache_events.labels("malformed").inc()
                    continue  # its seq, if it had one, is missed: the next batch finds the gap
                await self._on_message(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(linger=0)

    async def _on_message(self, seq: int, payload: bytes) -> None:
        verdict = self.tracker.check(seq)
        if verdict is Verdict.DUPLICATE:
            return
        if verdict is Verdict.RESTART:
            self.mirror.restart()
            self.metrics.cache_resets.labels("publisher_restart").inc()
        elif verdict is Verdict.GAP:
            await self._fill_gap(self.tracker.expected, seq)
            if self.tracker.expected > seq:
                return  # the replay brought this batch too
        self._apply(seq, payload)

    async def _fill_gap(self, start: int, seq: int) -> None:
        replayed = await self._replay(start)
        if replayed and replayed[0][0] == start:
            for s, payload in replayed:
                if s == self.tracker.expected:
                    self._apply(s, payload)
        self.metrics.cache_replays.labels("covered" if self.tracker.expected >= seq else "missed").inc()
        if self.tracker.expected < seq:
            log.info("cache_events.gap_not_covered", expected=self.tracker.expected, got=seq)
            self.mirror.lose_track("gap")
            self.metrics.cache_resets.labels("gap").inc()
            self.tracker.expected = seq

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        endpoint = self.config.kv_events_replay_endpoint
        if not endpoint:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPLAY_TIMEOUT_S
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while len(out) < MAX_REPLAY_BATCHES:
                left_ms = int((deadline - loop.time()) * 1000)
                if left_ms <= 0 or not await sock.poll(left_ms):
                    return None
                frames = await sock.recv_multipart()
                if len(frames) != 4:
                    return None
                if frames[2] == END_SEQ:
                    return out
                out.append((int.from_bytes(frames[2], "big"), frames[3]))
            return None
        finally:
            sock.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.tracker.applied(seq)
        try:
            events = decode_batch(payload)
            for event in events:
                kind = event.get("type")
                self.metrics.cache_events.labels(kind if kind in EVENT_TYPES else "other").inc()
            lost = self.mirror.apply(events)
        except (ValueError, TypeError) as exc:  # not vLLM's format (a hash that is a list, a token id out of range)
            log.warning("cache_events.malformed", seq=seq, error=str(exc))
            lost = []
            self.mirror.lose_track("malformed", lost)
        for reason in lost:
            log.info("cache_events.lost_track", reason=reason, seq=seq)
            self.metrics.cache_resets.labels(reason).inc()
        self.metrics.cached_blocks.set(len(self.mirror))
        if self.outbox:
            self._wake.set()

    # ---------------------------------------------------------------- reporter
    async def _report(self) -> None:
        delay = 0.1
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._registered or not self.outbox:
                continue
            if len(self.outbox) < self.config.kv_events_batch_keys:
                await asyncio.sleep(self.config.kv_events_batch_s)  # the batching window: more steps, one call
            if await self._flush():
                delay = 0.1
            else:
                await asyncio.sleep(delay)  # back off, then send everything again
                delay = min(delay * 2, 5.0)
                self._wake.set()

    async def _flush(self) -> bool:
        while self._registered:
            batch = self.outbox.take(self.config.kv_events_batch_keys)
            if batch is None:
                return True
            request = pb.CacheEventBatch(engine_id=self.config.engine_id, incarnation=self.incarnation, seq=batch.seq,
                                         reset=batch.reset, cleared=batch.cleared, stored_keys=batch.stored,
                                         removed_keys=batch.removed)
            try:
                ack: Any = await self.broker.call("ReportCacheEvents", request)
            except grpc.aio.AioRpcError as exc:
                # Applied or not, nobody knows: only a full re-send with reset is sure to be right.
                self.metrics.broker_errors.labels("ReportCacheEvents").inc()
                log.info("cache_events.report_failed", code=exc.code().name, details=exc.details())
                self.outbox.resync(self.mirror.keys())
                return False
            if needs_resync(batch, ack.reset, ack.expected_seq):
                log.info("cache_events.broker_resync", seq=batch.seq, expected_seq=ack.expected_seq)
                self.metrics.cache_resets.labels("broker").inc()
                self.outbox.resync(self.mirror.keys())
        return True
