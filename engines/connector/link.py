"""The connector's end of the engine link: a daemon thread that streams connector events to the sidecar
and hands the sidecar's commands back, without ever blocking the caller.

It runs inside vLLM's EngineCore process, next to the scheduler's busy loop, so the rules are those of
a scheduler hook: :meth:`EngineLinkClient.send` is ``put_nowait`` on a bounded queue (an event that
does not fit is dropped and counted, never waited for), :meth:`EngineLinkClient.commands` is a
non-blocking drain, and everything that waits (connecting, reconnecting with backoff, reading the
stream, checking safety-hold deadlines) happens on the thread. After each command batch and each
expired hold it calls ``wake()``, which the connector points at the EngineCore's input queue so an
idle engine steps once to apply it.

Imports no vLLM: the protocol is ``kvloop.v1.EngineLink`` (``protos/kvloop/v1/engine_link.proto``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from kvloop.v1 import engine_link_pb2 as lpb
from kvloop.v1 import engine_link_pb2_grpc

log = logging.getLogger("kvloop.engine_link")

_STOP = object()


@dataclass
class Command:
    """A command from the sidecar: free these requests, or copy these into their host-tier slots then free them
    (both applied by the connector at its next step), or hold these ``hold_s`` longer (applied here, to the
    safety-hold deadlines)."""

    release: list[str] = field(default_factory=list)
    hold: list[str] = field(default_factory=list)
    hold_s: float = 0.0
    demote: dict[str, list[int]] = field(default_factory=dict)


class EngineLinkClient:
    """Connects to ``unix://socket_path``, sends ``hello`` first on every (re)connect, then the queued
    events; delivers commands through :meth:`commands`.

    Safety holds: :meth:`track` registers a retained request with a deadline (monotonic seconds);
    a hold command pushes it later. When a deadline passes (the sidecar went silent: it died, or lost
    its broker for longer than the hold), the thread issues a release itself, so blocks never outlive
    their coordination by more than one hold. This thread is the safety net; the workers' own deadline
    for retained blocks is far beyond it (:data:`kvloop.engines.connector.scheduler.WORKER_DEADLINE_S`)."""

    MAX_QUEUED = 4096
    BACKOFF_S = (0.05, 0.2, 0.5, 1.0, 2.0)
    FREEZE_S = 1.0
    """A tick this much later than due means this process did not run (SIGSTOP, a paused VM, a starved core)."""

    def __init__(self, socket_path: str, hello: lpb.ConnectorHello, wake: Callable[[], None],
                 *, tick_s: float = 0.5) -> None:
        self.socket_path = socket_path
        self.hello = hello
        self.wake = wake
        self.tick_s = tick_s
        self.dropped_events = 0
        self.connected = threading.Event()
        self._events: queue.Queue[object] = queue.Queue(self.MAX_QUEUED)
        self._commands: collections.deque[Command] = collections.deque()
        self._holds: dict[str, float] = {}
        self._holds_lock = threading.Lock()
        self._stop = threading.Event()
        self._call: grpc.RpcContext | None = None
        self._resend: Callable[[], list[lpb.ConnectorEvent]] = list
        self._thread = threading.Thread(target=self._run, name="kvloop-engine-link", daemon=True)
        self._ticker = threading.Thread(target=self._tick, name="kvloop-hold-ticker", daemon=True)

    def start(self, resend: Callable[[], list[lpb.ConnectorEvent]] = list) -> None:
        """``resend()`` gives the events to replay after a reconnect (what is still retained)."""
        self._resend = resend
        self._thread.start()
        self._ticker.start()

    # Caller side (the scheduler's thread): never blocks.

    def send(self, event: lpb.ConnectorEvent) -> bool:
        try:
            self._events.put_nowait(event)
            return True
        except queue.Full:
            self.dropped_events += 1
            return False

    def commands(self) -> list[Command]:
        out = []
        while self._commands:
            out.append(self._commands.popleft())
        return out

    def pending(self) -> bool:
        return bool(self._commands)

    def track(self, request_id: str, deadline: float) -> None:
        with self._holds_lock:
            self._holds[request_id] = deadline

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._events.put_nowait(_STOP)
        if self._call is not None:
            self._call.cancel()
        for thread in (self._thread, self._ticker):
            if thread.is_alive():
                thread.join(timeout_s)

    # The thread.

    def _deliver(self, command: Command) -> None:
        # Holds only move this thread's deadlines: they need no engine step. (Waking the engine for them
        # made an idle decode engine step every keep-alive, and vLLM's CPU worker spins for a second after
        # every step: a whole core, measured.) Only releases reach the scheduler.
        if command.hold:
            now = time.monotonic()
            with self._holds_lock:
                for rid in command.hold:
                    if rid in self._holds:
                        self._holds[rid] = max(self._holds[rid], now + command.hold_s)
        if command.release or command.demote:
            # A demoted request's blocks are freed once copied: its safety hold ends here, as a release's does.
            self.untrack_many([*command.release, *command.demote])
            self._commands.append(Command(release=command.release, demote=command.demote))
            self.wake()

    def untrack_many(self, request_ids: list[str]) -> None:
        with self._holds_lock:
            for rid in request_ids:
                self._holds.pop(rid, None)

    def _tick(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            frozen, last = now - last - self.tick_s, now
            if frozen > self.FREEZE_S:
                # The sidecar's renewals sent meanwhile wait unread on the socket: a deadline that passed while
                # this process was not running says nothing about the sidecar. Every hold moves on by the freeze
                # (holding longer is always safe; freeing a block the broker may have pinned is not).
                with self._holds_lock:
                    for rid in self._holds:
                        self._holds[rid] += frozen
                log.warning("kvloop: engine link did not run for %.1fs; safety holds extended by as much", frozen)
                continue
            with self._holds_lock:
                expired = [rid for rid, deadline in self._holds.items() if deadline <= now]
                for rid in expired:
                    del self._holds[rid]
            if expired:
                log.warning("kvloop: safety hold ran out for %d retained request(s); releasing", len(expired))
                self._commands.append(Command(release=expired))
                self.wake()

    def _outgoing(self) -> Iterator[lpb.ConnectorEvent]:
        yield lpb.ConnectorEvent(hello=self.hello)
        yield from self._resend()
        while not self._stop.is_set():
            try:
                item = self._events.get(timeout=self.tick_s)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            assert isinstance(item, lpb.ConnectorEvent)
            yield item

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            channel = grpc.insecure_channel(f"unix://{self.socket_path}")
            try:
                stub = engine_link_pb2_grpc.EngineLinkStub(channel)
                call = stub.Attach(self._outgoing(), wait_for_ready=True)
                self._call = call
                for reply in call:
                    if not self.connected.is_set():
                        self.connected.set()
                        attempt = 0
                    self._deliver(Command(release=list(reply.release_request_ids),
                                          hold=list(reply.hold_request_ids), hold_s=reply.hold_s,
                                          demote={d.request_id: list(d.to_block_ids) for d in reply.demote}))
            except grpc.RpcError as exc:
                if not self._stop.is_set():
                    log.info("kvloop: engine link to %s broke (%s); reconnecting", self.socket_path,
                             getattr(exc, "code", lambda: "?")())
            finally:
                self.connected.clear()
                self._call = None
                channel.close()
            delay = self.BACKOFF_S[min(attempt, len(self.BACKOFF_S) - 1)]
            attempt += 1
            self._stop.wait(delay)
