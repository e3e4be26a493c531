"""Process-wide patches of vLLM 0.32 internals, each idempotent and each for a measured reason.

- :func:`cap_ipc_spin`: vLLM's shared-memory queues busy-wait 1 s after every message, and trust a wake-up
  notification that can be lost for 5 s;
- :func:`install_idle_fix`: an engine that merely holds retained blocks must not step without pause;
- :func:`install_tail_free`: a retained request whose answer the client will not repeat frees the answer's blocks;
- :func:`nixl_progress_delay`: NIXL's progress thread busy-polls unless given a delay.

Why each costs what it costs on a shared machine is in its docstring and in ``docs/architecture.md``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.scheduler import Scheduler

from kvloop.engines.connector.books import tail_to_free

if TYPE_CHECKING:
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition


RECHECK_MIN_MS = 1
RECHECK_MAX_MS = 50
"""Bounds of an idle queue reader's park between re-reads of the shared-memory flag (vLLM: 5000 ms)."""


def recheck_ms(idle_s: float, timeout_ms: int | None) -> int:
    """How long an idle reader parks on its notify socket before re-reading the shared-memory flag.

    ``idle_s`` is how long the reader has been idle (past its spin), ``timeout_ms`` the caller's own bound
    (None: none). The park doubles with the idle time, from RECHECK_MIN_MS to RECHECK_MAX_MS: a wake-up lost
    while the engine is between steps costs at most about as long as the reader had already waited, and one
    lost after a long idle spell at most RECHECK_MAX_MS, while an idle reader wakes at most 1000 /
    RECHECK_MAX_MS times a second. Never longer than ``timeout_ms``."""
    park = min(RECHECK_MAX_MS, max(RECHECK_MIN_MS, int(idle_s * 1000)))
    return park if timeout_ms is None else max(0, min(park, timeout_ms))


def capped_wait(original: Callable[..., None], seconds: float,
                clock: Callable[[], float]) -> Callable[..., None]:
    """``SpinCondition.wait`` with the spin capped at ``seconds`` and every park bounded by :func:`recheck_ms`.

    The bound is passed to vLLM's ``wait`` on every call, the spinning ones included. vLLM's ``wait`` reads the
    clock again to choose between a spin and a park; a reader preempted between the two reads (two cores shared
    by a dozen processes) crossed the end of its spin in between, and vLLM then parked it with the caller's own
    timeout, 5 s, which a lost notification turned into a 5 s stall (issue 49: inter-token gaps of 5,018-5,043
    ms with the cap on). A spinning call ignores the bound, so passing it always costs nothing."""

    def wait(self: SpinCondition, timeout_ms: int | None = None) -> None:
        if self.busy_loop_s > seconds:
            self.busy_loop_s = seconds
        idle_s = clock() - self.last_read - self.busy_loop_s
        original(self, recheck_ms(max(0.0, idle_s), timeout_ms))

    wait._kvloop_original = original  # type: ignore[attr-defined]
    return wait


def cap_ipc_spin(seconds: float) -> None:
    """Cap how long vLLM's shared-memory message queues busy-wait after a message (vLLM: 1 s), and bound how
    long an idle reader trusts its wake-up notification (vLLM: 5 s).

    vLLM's EngineCore and its worker talk over ``shm_broadcast.MessageQueue``; after each message the reader
    spins with ``sched_yield`` for ``busy_loop_s`` before parking on its ZMQ notify socket. Two spinning
    processes per engine after every step slow every other engine that shares the cores (a prefill 0.3 s
    after a decode step took 545-702 ms instead of 22-30 ms on 2 cores), so the spin is capped at ``seconds``.

    The notification is only a hint, and it can be lost (the writer's PUB socket has a send high-water mark of
    1): a parked reader then re-reads the authoritative shared-memory flag only after vLLM's
    ``SHM_READER_RECHECK_INTERVAL_MS`` (5 s). With a short spin a reader parks between every two steps, so the
    park is bounded (:func:`capped_wait`) and a lost wake-up costs at most one park. Patched on the class, so
    queues made before the call follow it too. Called in every engine process by
    :mod:`kvloop.engines.vllm_entry` with ``EngineConfig.ipc_spin_s``; measurements in docs/architecture.md."""
    import time

    from vllm.distributed.device_communicators import shm_broadcast

    spin = shm_broadcast.SpinCondition
    original = getattr(spin.wait, "_kvloop_original", spin.wait)
    spin.wait = capped_wait(original, seconds, time.monotonic)


_ORIGINAL_HAS_FINISHED = Scheduler.has_finished_requests


def _has_finished_requests(self: Scheduler) -> bool:
    """``Scheduler.has_finished_requests`` minus the requests kvloop merely holds for a later turn.

    vLLM's EngineCore steps without pause while any finished request still holds blocks, so a decode engine
    holding retained KV burned a core doing nothing. The connector says how many of its requests are quiet
    (retained, nothing to apply); those no longer count as work."""
    if self.finished_req_ids:
        return True
    quiet = getattr(self.connector, "kvloop_quiet_requests", None)
    if quiet is None:
        return bool(_ORIGINAL_HAS_FINISHED(self))
    running, waiting = self.get_request_counts()
    return len(self.requests) - quiet() > running + waiting


def install_idle_fix() -> None:
    if Scheduler.has_finished_requests is not _has_finished_requests:
        Scheduler.has_finished_requests = _has_finished_requests


_ORIGINAL_CONNECTOR_FINISHED = Scheduler._connector_finished


def _connector_finished(self: Scheduler, request: Any) -> tuple[bool, dict[str, Any] | None]:
    """``Scheduler._connector_finished``, then the answer's blocks of a request the connector retains for its
    prompt only are given back to the pool at once.

    vLLM frees a finished request's blocks together, when its connector says so; a decode engine that retains a
    turn whose answer the next turn drops (a reasoning model's stripped thinking, said by the client's
    ``keep_generated: false``) would otherwise hold the answer's blocks as long as the prompt's. The tail is cut
    from the request's block list, so the later free returns only the kept blocks. When an in-flight step may
    still write the request's blocks (async scheduling), the tail waits for that step as vLLM's own frees do
    (``Scheduler.deferred_frees``)."""
    delay_free, params = _ORIGINAL_CONNECTOR_FINISHED(self, request)
    if delay_free:
        free_answer_blocks(self, request)
    return delay_free, params


def free_answer_blocks(scheduler: Any, request: Any) -> int:
    """Give back the blocks past those the connector keeps of a finished, held request; how many were freed."""
    kept_blocks = getattr(scheduler.connector, "kvloop_kept_blocks", None)
    keep = kept_blocks(request.request_id) if kept_blocks is not None else None
    if keep is None:
        return 0
    now = scheduler._request_blocks_can_be_freed(request)
    freed = 0
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        blocks = manager.req_to_blocks.get(request.request_id)
        if not blocks:
            continue
        tail = tail_to_free(blocks, keep)
        cached = manager.num_cached_block.get(request.request_id)
        if cached is not None:
            manager.num_cached_block[request.request_id] = min(cached, keep)
        if now:
            scheduler.kv_cache_manager.block_pool.free_blocks(reversed(tail))
        elif tail:  # a step in flight may still write them (async scheduling): freed when it is done, as vLLM does
            scheduler.deferred_frees.append((scheduler.sched_step_seq, tail))
        freed += len(tail)
    return freed


def install_tail_free() -> None:
    if Scheduler._connector_finished is not _connector_finished:
        Scheduler._connector_finished = _connector_finished


@contextlib.contextmanager
def nixl_progress_delay(delay_us: int) -> Iterator[None]:
    """Create NIXL agents with a progress-thread delay of ``delay_us`` microseconds.

    NIXL's Python agent hard-codes ``pthrDelay = 0``: its progress thread polls without pause, 0.46-0.60
    CPU-seconds per second per idle engine here. With 1000 us an idle agent used 0.004-0.015, and a 16 MiB
    READ over loopback took 4.0 ms instead of 19.5 ms on 2 cores, because the spinning threads no longer
    compete with the transfer. The config object is built inside ``nixl_agent.__init__``, so the delay is set
    on its way into the native constructor."""
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
