"""The connector's scheduler side (EngineCore process, busy-loop thread): keeps books only, never blocks.

- **Decode retains and publishes.** A request that came from a prefill engine, or was served here whole
  (DECODE_LOCAL), and finished normally (stop or length) keeps its full blocks allocated; the link
  (:mod:`.link`) reports them to the engine's sidecar, which publishes them to the broker as a lease. They are
  freed when the sidecar relays the broker's eviction or expiry, or when the link's safety hold
  (``kvloop_hold_s``, renewed by the sidecar while the lease lives) runs out.
- **Prefill reports its pull.** The params a prefill returns carry a :class:`~kvloop.shared.protocol.PrefillReport`;
  the sidecar gets the same figures for the broker's cost model. Which blocks to pull is upstream's logic:
  only what the local prefix cache lacks, nothing under ``kv_recompute_threshold``.
- **One pull, then recompute.** With ``kv_load_failure_policy=recompute``, vLLM 0.32 resets a request after a
  failed, declined or timed-out pull and asks again; upstream then reports the remote tokens again but skips
  the receive, and the request waits forever. A request whose remote blocks were processed gets ``(0, False)``.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.logger import init_logger
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.request import RequestStatus

from kvloop.engines.connector.books import (
    PrefillBooks,
    RetainedRequest,
    bytes_per_block,
    demotion_copies,
    promotion_copies,
    promotion_load,
    retain,
    split_tier,
)
from kvloop.engines.connector.patches import install_idle_fix, install_tail_free
from kvloop.shared.protocol import (
    DECODE_LOCAL_KEY,
    DROPPED_KEY,
    KEEP_GENERATED_KEY,
    PROMOTE_DEADLINE_KEY,
    PROMOTE_KEY,
    REPORT_KEY,
    RETAINED_KEY,
    SESSION_KEY,
    ConnectorSettings,
    PrefillReport,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvloop.engines.connector.link import EngineLinkClient

WORKER_DEADLINE_S = 86400.0
"""The deadline retained blocks get on the workers. The safety hold is kept by the link thread, which releases
through the scheduler when it lapses; renewing it on the workers would take an engine step per renewal. A day
bounds a leak if that thread died."""

logger = init_logger("kvloop.connector")


def find_engine_input_queue() -> Any:
    """The EngineCoreProc's input queue, found from the constructor frames that are building us.

    EngineCoreProc creates ``input_queue`` before it builds the scheduler (and so this connector), so one of the
    frames above has ``self`` with it. None when not under an EngineCoreProc (an in-process LLM), where the busy
    loop never blocks on it anyway."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        input_queue = getattr(candidate, "input_queue", None)
        if input_queue is not None and hasattr(input_queue, "put_nowait"):
            return input_queue
        frame = frame.f_back  # type: ignore[assignment]
    return None


class KvloopConnectorScheduler(NixlPullConnectorScheduler):
    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        settings = ConnectorSettings.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.hold_s = settings.kvloop_hold_s
        self.retain = bool(self.is_bidirectional_kv_xfer_enabled) and settings.kvloop_retain
        self._retained: dict[str, RetainedRequest] = {}
        self._keep_only: dict[str, int] = {}
        """Retained requests that keep only their prompt's blocks: how many, until the scheduler frees the rest."""
        self._prefills: dict[str, PrefillBooks] = {}
        self._single_group = len(kv_cache_config.kv_cache_groups) == 1
        tensors = getattr(kv_cache_config, "kv_cache_tensors", None) or []
        self.bytes_per_block = bytes_per_block([t.size for t in tensors], kv_cache_config.num_blocks)
        # The host tier: the top of the KV allocation, kept from vLLM's pool. vLLM's Scheduler builds its block
        # pool from this same config right after its connector, so the scheduler never hands out the tier's ids;
        # the workers (configured before) still address, and NIXL still registers, the whole allocation.
        self.host_tier_blocks = settings.kvloop_host_tier_blocks if self.retain else 0
        self.pool_blocks, self.host_tier_first_id = split_tier(int(kv_cache_config.num_blocks), self.host_tier_blocks)
        kv_cache_config.num_blocks = self.pool_blocks
        # The engine's step size as vLLM resolved it (its default, or the launcher's --max-num-batched-tokens): what
        # placement needs to tell how a short tail on this engine is chunked among its streams' decodes.
        self.step_tokens = int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 0)
        self._copies: list[tuple[int, int]] = []
        """Demotion and promotion copies for the next step's connector metadata."""
        self._promoting: dict[str, int] = {}
        """Promotions (a prefetch: the sidecar's request with ``PROMOTE_KEY``) that load from the host tier: the
        tokens vLLM's prefix cache had, until the scheduler allocates their blocks."""
        self._demoting: set[str] = set()
        """Retained requests whose copy is in a step that has not reported them freed yet."""
        self._link: EngineLinkClient | None = None
        socket_path = settings.kvloop_sidecar_socket or os.environ.get("KVLOOP_SIDECAR_SOCKET", "")
        if socket_path:
            self._start_link(socket_path, kv_cache_config)
        if self.retain:
            install_idle_fix()
            install_tail_free()

    def _start_link(self, socket_path: str, kv_cache_config: KVCacheConfig) -> None:
        from kvloop.engines.connector.link import EngineLinkClient
        from kvloop.v1 import engine_link_pb2 as lpb

        input_queue = find_engine_input_queue()

        def wake() -> None:
            if input_queue is not None:
                input_queue.put_nowait((EngineCoreRequestType.ABORT, []))  # a no-op that ends a blocking wait

        hello = lpb.ConnectorHello(engine_id=self.engine_id, incarnation=uuid.uuid4().hex, block_size=self.block_size,
                                   num_blocks=self.pool_blocks, bytes_per_block=self.bytes_per_block,
                                   kv_role_decode=self.retain, host_tier_blocks=self.host_tier_blocks,
                                   host_tier_first_id=self.host_tier_first_id if self.host_tier_blocks else 0,
                                   step_tokens=self.step_tokens)
        self._link = EngineLinkClient(socket_path, hello, wake)
        self._link.start(resend=self._retained_events)
        logger.info("kvloop connector %s: engine link on %s, retain=%s, hold %.0fs, host tier %d blocks from id %d",
                    self.engine_id, socket_path, self.retain, self.hold_s, self.host_tier_blocks,
                    self.host_tier_first_id)

    def _retained_events(self) -> list[Any]:
        # Called on the link thread after a reconnect; a snapshot, since the scheduler may change the dict.
        return [self._retained_event(rid, r) for rid, r in list(self._retained.items())]

    def _retained_event(self, request_id: str, r: RetainedRequest) -> Any:
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

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get(PROMOTE_KEY) is not None:
            return self._promotion_tokens(request, num_computed_tokens), False
        if params and params.get("do_remote_decode") and params.get("_remote_blocks_processed"):
            # The one pull this request was allowed has happened (or failed): recompute locally.
            return 0, False
        result: tuple[int, bool] = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if params and params.get("do_remote_decode") and request.request_id not in self._prefills:
            # arrival_time is wall-clock (time.time()); the books keep perf_counter for durations.
            self._prefills[request.request_id] = PrefillBooks(
                started=time.perf_counter(), local_tokens=num_computed_tokens,
                queued_s=max(0.0, time.time() - float(getattr(request, "arrival_time", time.time()))))
        return result

    def _promotion_tokens(self, request: Request, local_tokens: int) -> int:
        """A promotion's tokens to load from the host tier, copied at the start of the step that computes the rest
        (a synchronous load); 0 past its deadline, when the broker's pin on the slots may have ended."""
        params = request.kv_transfer_params or {}
        if time.time() > float(params.get(PROMOTE_DEADLINE_KEY) or 0.0):
            logger.warning("kvloop: promotion %s past its deadline; its prompt is computed", request.request_id)
            return 0
        load = promotion_load(list(params[PROMOTE_KEY]), int(request.num_tokens), local_tokens, self.block_size,
                              self.host_tier_first_id, self.host_tier_blocks)
        if load:
            self._promoting[request.request_id] = local_tokens
        return load

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        books = self._prefills.get(request.request_id)
        params = request.kv_transfer_params or {}
        local_tokens = self._promoting.pop(request.request_id, None)
        if local_tokens is not None and num_external_tokens > 0:
            self._copies.extend(promotion_copies(list(params[PROMOTE_KEY]), list(blocks.get_block_ids()[0]),
                                                 local_tokens, num_external_tokens, self.block_size))
        if books is not None and num_external_tokens > 0 and not params.get("_remote_blocks_processed"):
            books.pull_began(num_external_tokens, time.perf_counter())
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        failed = connector_output.failed_recving or set()
        now = time.perf_counter()
        for rid in connector_output.finished_recving or ():
            books = self._prefills.get(rid)
            if books is not None:
                books.pull_finished(rid in failed, now)
        if self._demoting and self._link is not None:
            from kvloop.v1 import engine_link_pb2 as lpb

            # Freed at the end of the step whose start copied them: the tier now holds the blocks.
            for rid in self._demoting.intersection(connector_output.finished_sending or ()):
                self._demoting.discard(rid)
                self._link.send(lpb.ConnectorEvent(demoted=lpb.Demoted(request_id=rid, ok=True)))
                self._link.send(lpb.ConnectorEvent(freed=lpb.Freed(request_id=rid, why="demoted")))

    def _prefill_report(self, request: Request) -> PrefillReport | None:
        books = self._prefills.pop(request.request_id, None)
        if books is None:
            return None
        report = books.report(int(request.num_prompt_tokens), self.block_size, self.bytes_per_block,
                              time.perf_counter())
        if self._link is not None:
            from kvloop.v1 import engine_link_pb2 as lpb

            self._link.send(lpb.ConnectorEvent(prefill_done=lpb.PrefillDone(
                request_id=request.request_id, computed_tokens=report.computed_tokens,
                compute_s=report.compute_ms / 1e3, pulled_blocks=report.pulled_blocks,
                pulled_bytes=report.pulled_bytes, pull_s=books.pull_s, pull_failed=report.pull_failed)))
        return report

    # Decode side.

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        # A decode request whose prompt came from a prefill engine, or one the router sent here whole
        # (DECODE_LOCAL: the tail computed from this engine's own prefix cache): either is retained.
        came_from_prefill = bool(params) and not params.get("do_remote_decode") and bool(
            params.get("_remote_blocks_processed") or params.get(DECODE_LOCAL_KEY))
        report = self._prefill_report(request) if params and params.get("do_remote_decode") else None
        delay_free, out = super().request_finished(request, block_ids)
        if report is not None and out is not None:
            out[REPORT_KEY] = report.to_params()
        if not came_from_prefill or not delay_free or not self.retain:
            return delay_free, out
        rid = request.request_id
        # The workers act on a request's deadline in ``reqs_to_send`` only if it was ever in a batch they were told
        # of. A request from a prefill engine was (upstream adds it when it allocates for the pull); a DECODE_LOCAL
        # one never was, and without this its blocks were never freed: neither on release nor when the safety hold
        # ran out (kvloop bench chaos found a decode engine holding 1,156 blocks with no lease and no request).
        self._reqs_in_batch.add(rid)
        # (A block id in the host tier's range would mean vLLM's pool was not built from the carved config.)
        retainable = (request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
                      and self._single_group and self._link is not None
                      and max(block_ids[0], default=0) < self.pool_blocks)
        # The client said the next turn will not repeat this answer (a reasoning model's stripped thinking): keep
        # the prompt's blocks only, and have the scheduler free the answer's now (patches.install_tail_free).
        prompt_only = int(request.num_prompt_tokens) if params.get(KEEP_GENERATED_KEY) is False else None
        retained = retain(request.all_token_ids, list(block_ids[0]), request.num_computed_tokens, self.block_size,
                          str(params.get(SESSION_KEY) or ""), prompt_only) if retainable else None
        if retained is None or self._link is None:
            # Nothing kvloop can publish (no sidecar, hybrid layout, or under one block): free at the next step.
            self._reqs_need_send[rid] = time.perf_counter()
            return delay_free, out
        self._retained[rid] = retained
        self._reqs_need_send[rid] = time.perf_counter() + WORKER_DEADLINE_S
        self._link.track(rid, time.monotonic() + self.hold_s)
        if not self._link.send(self._retained_event(rid, retained)):
            logger.warning("kvloop: engine link queue full; %s retained but not published", rid)
        if prompt_only is not None:
            self._keep_only[rid] = len(retained.block_ids)
        if out is not None:
            out[RETAINED_KEY] = len(retained.block_ids)
            if prompt_only is not None:
                out[DROPPED_KEY] = len(block_ids[0]) - len(retained.block_ids)
        return delay_free, out

    def kvloop_kept_blocks(self, request_id: str) -> int | None:
        """How many of a just-finished request's blocks to keep, the rest to be freed now; None: keep them all.
        Asked once, by the scheduler right after ``request_finished`` (patches.install_tail_free)."""
        return self._keep_only.pop(request_id, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        if self._link is not None:
            self._apply_commands(self._link)
        meta = super().build_connector_meta(scheduler_output)
        if self._copies:
            # The workers copy at the start of this step (KvloopConnectorWorker.start_load_kv); the same step's
            # metadata frees the blocks (reqs_to_send, due now), which the workers report only at its end.
            meta.kvloop_copies, self._copies = self._copies, []
        return meta

    def _apply_commands(self, link: EngineLinkClient) -> None:
        from kvloop.v1 import engine_link_pb2 as lpb

        now = time.perf_counter()
        for command in link.commands():
            for rid in command.release:
                if self._retained.pop(rid, None) is not None:
                    self._reqs_need_send[rid] = now  # the workers free it at this step
                    link.send(lpb.ConnectorEvent(freed=lpb.Freed(request_id=rid, why="released")))
            for rid, to_ids in command.demote.items():
                retained = self._retained.pop(rid, None)
                copies = (demotion_copies(retained.block_ids, to_ids, self.host_tier_first_id, self.host_tier_blocks)
                          if retained is not None else None)
                if retained is not None:
                    self._reqs_need_send[rid] = now  # freed at this step, after its copy (if any) at its start
                if copies is None:
                    if retained is not None:
                        logger.warning("kvloop: demotion of %s to %s does not fit the host tier; released", rid,
                                       to_ids)
                        link.send(lpb.ConnectorEvent(freed=lpb.Freed(request_id=rid, why="released")))
                    link.send(lpb.ConnectorEvent(demoted=lpb.Demoted(request_id=rid, ok=False)))
                    continue
                self._copies.extend(copies)
                self._demoting.add(rid)

    def shutdown(self) -> None:
        if self._link is not None:
            self._link.stop()
        super().shutdown()
