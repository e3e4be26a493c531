"""kvloop's vLLM KV connector. The one module of kvloop that touches vLLM internals; pinned to vLLM 0.32.

Loaded by vLLM through ``kv_connector_module_path="engines.connector"`` with ``kv_connector="NixlConnector"``
(the class keeps upstream's name: vLLM applies NIXL-specific config checks by that name, and the module
path takes priority over the in-tree class in the connector factory). It is vLLM's NixlConnector in its
decode-to-prefill (``bidirectional_kv_xfer``) mode, with these changes:

- **Decode retains and publishes.** When a request that came from a prefill engine finishes normally
  (stop or length), its full blocks (prompt and generated tokens; the last sampled token has no KV) stay
  allocated and are reported to the engine's sidecar (:mod:`engines.link`), which publishes them to the
  broker as a lease. They are freed when the sidecar relays the broker's eviction or expiry, or when the
  engine-side safety hold (``kvloop_hold_s``, above the broker's TTL, extended by the sidecar while the
  lease lives) runs out. A read never frees them: reads of retained blocks are named
  ``kvloop-lease-<lease id>`` and the decode worker counts their notifications instead of freeing
  (upstream frees a request's blocks on its first read).
- **Prefill reports its pull.** The params a prefill returns carry ``kvloop``: tokens found in the local
  prefix cache, pulled (blocks, tokens, milliseconds, failed or not) and computed; the sidecar gets the
  same figures for the broker's cost model. Which blocks to pull is upstream's logic: only what the local
  prefix cache lacks, and nothing under ``kv_recompute_threshold``.
- **No hang after a failed pull.** Upstream 0.32 with ``kv_load_failure_policy=recompute``: after a
  failed, declined or timed-out pull the scheduler resets the request and asks the connector again;
  ``get_num_new_matched_tokens`` reports the remote tokens again, while ``update_state_after_alloc``
  skips the receive because ``_remote_blocks_processed`` is set, so the request waits in
  WAITING_FOR_REMOTE_KVS forever with its blocks held. Here a request whose remote blocks were already
  processed gets ``(0, False)``: one pull attempt, then local recompute.
- **Idle engines sleep.** NIXL's progress thread gets a poll delay (see :func:`_nixl_progress_delay`), and
  vLLM's EngineCore steps without pause while any finished request still holds blocks
  (``Scheduler.has_finished_requests``), so a decode engine holding retained KV burned a core doing
  nothing (and vLLM's CPU worker spins for a second after every step, a second core). Retained requests
  with nothing to apply no longer count as work; when a release arrives the link thread wakes the busy
  loop with a no-op on its input queue (an ``ABORT`` of no request), and the step that follows applies
  it. Hold renewals stay on the link thread and take no step.

Importing this module starts nothing: the API server imports it for metrics.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.request import RequestStatus

VLLM_VERSION = "0.32"
"""The vLLM minor version these hooks were read from; engines/launcher refuses another."""

LEASE_READ_PREFIX = "kvloop-lease-"
"""``remote_request_id`` of a read of retained blocks: this prefix and the broker's lease id."""

DEFAULT_HOLD_S = 900.0
"""Engine-side safety hold of retained blocks without news from the sidecar (above the broker's TTLs)."""

WORKER_DEADLINE_S = 86400.0
"""The deadline retained blocks get on the workers. The safety hold is kept by the link thread, which
releases through the scheduler when it lapses; renewing it on the workers would take an engine step per
renewal (see :meth:`engines.link.EngineLinkClient._deliver`). A day bounds a leak if that thread died."""

logger = init_logger("kvloop.connector")


def cap_ipc_spin(seconds: float) -> None:
    """Cap how long vLLM's shared-memory message queues busy-wait after a message (vLLM: 1 s).

    vLLM's EngineCore and its worker talk over ``shm_broadcast.MessageQueue``; after each message the reader
    spins with ``sched_yield`` for ``busy_loop_s`` (1 s) before sleeping on its ZMQ socket. Two spinning
    processes per engine after every step, on a machine whose cores the engines share, slow every other
    engine: here, the first prefill request 0.3 s after a decode step took 545-702 ms instead of 22-30 ms,
    and with a 2 ms cap 27-30 ms (kvloop's turn TTFT went from 84-322 ms to 81-107 ms). Past the cap a
    reader wakes on the socket, which costs tens of microseconds. Patched on the class, so queues made
    before the call follow it too; idempotent. Called in every engine process by :mod:`engines.vllm_entry`
    with ``EngineConfig.ipc_spin_s`` (passed as :data:`engines.vllm_entry.IPC_SPIN_ENV`)."""
    from vllm.distributed.device_communicators import shm_broadcast

    spin = shm_broadcast.SpinCondition
    original = getattr(spin.wait, "_kvloop_original", spin.wait)

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if self.busy_loop_s > seconds:
            self.busy_loop_s = seconds
        original(self, timeout_ms)

    wait._kvloop_original = original  # type: ignore[attr-defined]
    spin.wait = wait


def _extra(vllm_config: Any) -> dict[str, Any]:
    return dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})


@dataclass
class _RetainedRequest:
    token_ids: list[int]
    block_ids: list[int]
    session_id: str


@dataclass
class _PrefillBooks:
    started: float
    local_tokens: int
    external_tokens: int = 0
    pull_started: float = 0.0
    pull_s: float = 0.0
    pull_done: bool = False
    pull_failed: bool = False


def _find_engine_input_queue() -> Any:
    """The EngineCoreProc's input queue, found from the constructor frames that are building us.

    EngineCoreProc creates ``input_queue`` before it builds the scheduler (and the scheduler this
    connector), so one of the frames above has ``self`` with it. None when not under an EngineCoreProc
    (an in-process LLM), where the busy loop never blocks on it anyway."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        input_queue = getattr(candidate, "input_queue", None)
        if input_queue is not None and hasattr(input_queue, "put_nowait"):
            return input_queue
        frame = frame.f_back  # type: ignore[assignment]
    return None


_ORIGINAL_HAS_FINISHED = Scheduler.has_finished_requests


def _has_finished_requests(self: Any) -> bool:
    """``Scheduler.has_finished_requests`` minus the requests kvloop merely holds for a later turn."""
    if self.finished_req_ids:
        return True
    quiet = getattr(self.connector, "kvloop_quiet_requests", None)
    if quiet is None:
        return bool(_ORIGINAL_HAS_FINISHED(self))
    running, waiting = self.get_request_counts()
    return len(self.requests) - quiet() > running + waiting


def _install_idle_fix() -> None:
    if Scheduler.has_finished_requests is not _has_finished_requests:
        Scheduler.has_finished_requests = _has_finished_requests


class KvloopConnectorScheduler(NixlPullConnectorScheduler):
    """Scheduler side (EngineCore process, busy-loop thread): keeps books only, never blocks."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        extra = _extra(vllm_config)
        self.hold_s = float(extra.get("kvloop_hold_s", DEFAULT_HOLD_S))
        self.retain = bool(self.is_bidirectional_kv_xfer_enabled) and bool(extra.get("kvloop_retain", True))
        self._retained: dict[str, _RetainedRequest] = {}
        self._prefills: dict[str, _PrefillBooks] = {}
        self._single_group = len(kv_cache_config.kv_cache_groups) == 1
        tensors = getattr(kv_cache_config, "kv_cache_tensors", None) or []
        self.bytes_per_block = (sum(int(t.size) for t in tensors) // max(1, int(kv_cache_config.num_blocks))
                                if tensors else 0)
        self._link: Any = None
        socket_path = extra.get("kvloop_sidecar_socket") or os.environ.get("KVLOOP_SIDECAR_SOCKET", "")
        if socket_path:
            self._start_link(str(socket_path), kv_cache_config)
        if self.retain:
            _install_idle_fix()

    def _start_link(self, socket_path: str, kv_cache_config: Any) -> None:
        from engines.link import EngineLinkClient
        from kvloop.v1 import engine_link_pb2 as lpb

        input_queue = _find_engine_input_queue()

        def wake() -> None:
            if input_queue is not None:
                input_queue.put_nowait((EngineCoreRequestType.ABORT, []))  # a no-op that ends a blocking wait

        hello = lpb.ConnectorHello(engine_id=self.engine_id, incarnation=uuid.uuid4().hex, block_size=self.block_size,
                                   num_blocks=int(kv_cache_config.num_blocks), bytes_per_block=self.bytes_per_block,
                                   kv_role_decode=self.retain)
        self._link = EngineLinkClient(socket_path, hello, wake)
        self._link.start(resend=self._retained_events)
        logger.info("kvloop connector %s: engine link on %s, retain=%s, hold %.0fs", self.engine_id,
                    socket_path, self.retain, self.hold_s)

    def _retained_events(self) -> list[Any]:
        # Called on the link thread after a reconnect; a snapshot, since the scheduler may change the dict.
        return [self._retained_event(rid, r) for rid, r in list(self._retained.items())]

    def _retained_event(self, request_id: str, r: _RetainedRequest) -> Any:
        from kvloop.v1 import engine_link_pb2 as lpb

        return lpb.ConnectorEvent(retained=lpb.Retained(request_id=request_id, token_ids=r.token_ids,
                                                        block_ids=r.block_ids, session_id=r.session_id,
                                                        hold_s=self.hold_s))

    def kvloop_quiet_requests(self) -> int:
        """Finished requests that hold blocks only for a later turn and need no engine step now."""
        if self._link is not None and self._link.pending():
            return 0
        return len(self._retained)

    # Prefill side.

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and params.get("_remote_blocks_processed"):
            # The one pull this request was allowed has happened (or failed): recompute locally.
            return 0, False
        result: tuple[int, bool] = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if params and params.get("do_remote_decode") and request.request_id not in self._prefills:
            self._prefills[request.request_id] = _PrefillBooks(started=time.perf_counter(),
                                                               local_tokens=num_computed_tokens)
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        books = self._prefills.get(request.request_id)
        params = request.kv_transfer_params or {}
        if books is not None and num_external_tokens > 0 and not params.get("_remote_blocks_processed"):
            books.external_tokens = num_external_tokens
            books.pull_started = time.perf_counter()
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        failed = connector_output.failed_recving or set()
        for rid in connector_output.finished_recving or ():
            books = self._prefills.get(rid)
            if books is not None and books.pull_started and not books.pull_done:
                books.pull_done = True
                books.pull_failed = rid in failed
                books.pull_s = time.perf_counter() - books.pull_started

    def _prefill_report(self, request: Any) -> dict[str, Any] | None:
        books = self._prefills.pop(request.request_id, None)
        if books is None:
            return None
        pulled_tokens = books.external_tokens if books.pull_done and not books.pull_failed else 0
        pulled_blocks = -(-pulled_tokens // self.block_size)
        computed = max(0, int(request.num_prompt_tokens) - books.local_tokens - pulled_tokens)
        report = {"local_tokens": books.local_tokens, "pulled_tokens": pulled_tokens, "pulled_blocks": pulled_blocks,
                  "pulled_bytes": pulled_blocks * self.bytes_per_block, "pull_ms": round(books.pull_s * 1e3, 3),
                  "pull_failed": books.pull_failed or (books.external_tokens > 0 and not books.pull_done),
                  "computed_tokens": computed}
        if self._link is not None:
            from kvloop.v1 import engine_link_pb2 as lpb

            compute_s = max(0.0, time.perf_counter() - books.started - books.pull_s)
            self._link.send(lpb.ConnectorEvent(prefill_done=lpb.PrefillDone(
                request_id=request.request_id, computed_tokens=computed, compute_s=compute_s,
                pulled_blocks=pulled_blocks, pulled_bytes=report["pulled_bytes"], pull_s=books.pull_s,
                pull_failed=report["pull_failed"])))
        return report

    # Decode side.

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        came_from_prefill = bool(params) and not params.get("do_remote_decode") and bool(
            params.get("_remote_blocks_processed"))
        report = self._prefill_report(request) if params and params.get("do_remote_decode") else None
        delay_free, out = super().request_finished(request, block_ids)
        if report is not None and out is not None:
            out["kvloop"] = report
        if not came_from_prefill or not delay_free or not self.retain:
            return delay_free, out
        rid = request.request_id
        retainable = (request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
                      and self._single_group and self._link is not None)
        full_blocks = int(request.num_computed_tokens) // self.block_size
        if not retainable or full_blocks == 0:
            # Nothing kvloop can publish (no sidecar, hybrid layout, or under one block): free at the next step.
            self._reqs_need_send[rid] = time.perf_counter()
            return delay_free, out
        blocks = list(block_ids[0])[:full_blocks]
        token_ids = list(request.all_token_ids[: full_blocks * self.block_size])
        retained = _RetainedRequest(token_ids=token_ids, block_ids=blocks,
                                    session_id=str(params.get("kvloop_session_id") or ""))
        self._retained[rid] = retained
        self._reqs_need_send[rid] = time.perf_counter() + WORKER_DEADLINE_S
        self._link.track(rid, time.monotonic() + self.hold_s)
        if not self._link.send(self._retained_event(rid, retained)):
            logger.warning("kvloop: engine link queue full; %s retained but not published", rid)
        if out is not None:
            out["kvloop_retained_blocks"] = full_blocks
        return delay_free, out

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        if self._link is not None:
            self._apply_commands()
        return super().build_connector_meta(scheduler_output)

    def _apply_commands(self) -> None:
        from kvloop.v1 import engine_link_pb2 as lpb

        now = time.perf_counter()
        for command in self._link.commands():
            for rid in command.release:
                if self._retained.pop(rid, None) is not None:
                    self._reqs_need_send[rid] = now  # the workers free it at this step
                    self._link.send(lpb.ConnectorEvent(freed=lpb.Freed(request_id=rid, why="released")))

    def shutdown(self) -> None:
        if self._link is not None:
            self._link.stop()
        super().shutdown()


class _CountingNotifs:
    """A proxy of the worker's NIXL wrapper that takes out notifications of reads of retained blocks.

    Upstream frees a request's blocks when its reader's notification arrives; kvloop's retained blocks
    are freed only on the broker's word, so these are counted and dropped here."""

    def __init__(self, wrapper: Any) -> None:
        self._wrapper = wrapper
        self.lease_reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapper, name)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        notifs: dict[str, list[bytes]] = self._wrapper.get_new_notifs()
        prefix = LEASE_READ_PREFIX.encode()
        kept: dict[str, list[bytes]] = {}
        for agent, messages in notifs.items():
            rest = [m for m in messages if not m.startswith(prefix)]
            self.lease_reads += len(messages) - len(rest)
            if rest:
                kept[agent] = rest
        return kept


@contextlib.contextmanager
def _nixl_progress_delay(delay_us: int) -> Iterator[None]:
    """Create NIXL agents with a progress-thread delay of ``delay_us`` microseconds.

    NIXL's Python agent hard-codes ``pthrDelay = 0``: its progress thread polls without pause, 0.46-0.60
    CPU-seconds per second per idle engine here. With 1000 us an idle agent used 0.004-0.015, and a 16 MiB
    READ over loopback took 4.0 ms instead of 19.5 ms on this 2-core machine (512 KiB: 0.20 vs 0.07 ms),
    because the spinning threads no longer compete with the transfer. The config object is built inside
    ``nixl_agent.__init__``, so the delay is set on its way into the native constructor."""
    from vllm.distributed import nixl_utils

    wrapper_cls = getattr(nixl_utils, "NixlWrapper", None)
    bindings: Any = getattr(sys.modules.get(getattr(wrapper_cls, "__module__", ""), None), "nixlBind", None)
    native = getattr(bindings, "nixlAgent", None)
    if native is None or delay_us <= 0:
        yield
        return

    def with_delay(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return native(name, config)

    bindings.nixlAgent = with_delay
    try:
        yield
    finally:
        bindings.nixlAgent = native


class KvloopConnectorWorker(NixlPullConnectorWorker):
    """Worker side: upstream's, with reads of retained blocks never freeing them and a NIXL progress
    thread that sleeps between polls (``kvloop_nixl_progress_delay_us``, default 1000; 0 = upstream's)."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        delay_us = int(_extra(vllm_config).get("kvloop_nixl_progress_delay_us", 1000))
        with _nixl_progress_delay(delay_us):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        wrapper: Any = getattr(self, "nixl_wrapper", None)
        if wrapper is not None:
            self.nixl_wrapper = _CountingNotifs(wrapper)


class NixlConnector(NixlPullConnector):
    """vLLM's pull NixlConnector with kvloop's scheduler and worker sides."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        # NixlPullConnector.__init__ hard-codes its classes: build the base, then our halves.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self.connector_scheduler: KvloopConnectorScheduler | None
        self.connector_worker: KvloopConnectorWorker | None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvloopConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = KvloopConnectorWorker(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"unsupported KV connector role: {role}")

    def kvloop_quiet_requests(self) -> int:
        return self.connector_scheduler.kvloop_quiet_requests() if self.connector_scheduler is not None else 0
