"""The connector's worker side (each vLLM worker process): upstream's pull worker, with reads of retained
blocks never freeing them, a NIXL progress thread that sleeps between polls, and the worker's CPU binding kept."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

from kvloop.engines.connector.books import peers_to_rehandshake, split_lease_reads
from kvloop.engines.connector.patches import nixl_progress_delay
from kvloop.shared.protocol import LEASE_READ_PREFIX, ConnectorSettings

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig


class CountingNotifs:
    """A proxy of the worker's NIXL wrapper that takes out notifications of reads of retained blocks
    (:func:`~kvloop.engines.connector.books.split_lease_reads`)."""

    def __init__(self, wrapper: Any) -> None:
        self._wrapper = wrapper
        self.lease_reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapper, name)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        kept, reads = split_lease_reads(self._wrapper.get_new_notifs(), LEASE_READ_PREFIX.encode())
        self.lease_reads += reads
        return kept


@contextlib.contextmanager
def keep_cpu_binding() -> Iterator[None]:
    """Undo any change of this thread's CPU affinity made inside the block.

    vLLM 0.32's NIXL worker on the CPU pins the thread that builds it (the worker's main thread) to the last core
    of each NUMA node, "reserved for start_load_kv". With one OpenMP thread per engine that main thread is the one
    that runs the model, so every engine's forward pass moved to the machine's last core: in the benchmark the two
    prefill engines (bound to core 0 by ``omp_threads_bind``) computed on core 1 beside the decode engine, and a
    prefill engine's worker ran 0.46 s of 10 s while core 0 sat a third idle (``/proc/PID/schedstat``). The
    binding that vLLM's CPU worker gave the thread from ``VLLM_CPU_OMP_THREADS_BIND`` is the one to keep."""
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        yield
    finally:
        if before is not None and os.sched_getaffinity(0) != before:
            os.sched_setaffinity(0, before)


class KvloopConnectorWorker(NixlPullConnectorWorker):
    """Upstream's worker, its NIXL agent created with ``kvloop_nixl_progress_delay_us``, its notifications
    filtered by :class:`CountingNotifs`, the engine's CPU binding kept (:func:`keep_cpu_binding`), and the host
    tier's demotion copies made at the start of the step that frees their blocks.

    The tier is the top ``kvloop_host_tier_blocks`` blocks of the KV allocation: the workers' config (sent before
    the scheduler carves it, see ``KvloopConnectorScheduler``) still counts them, so the cache tensors, NIXL's
    registration and every peer's descriptors cover them, and a pull reads a slot like any block."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig) -> None:
        settings = ConnectorSettings.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self._total_blocks = int(kv_cache_config.num_blocks)
        self._host_tier_blocks = settings.kvloop_host_tier_blocks
        self._caches: list[torch.Tensor] = []
        with nixl_progress_delay(settings.kvloop_nixl_progress_delay_us), keep_cpu_binding():
            super().__init__(vllm_config, engine_id, kv_cache_config)
        wrapper: Any = getattr(self, "nixl_wrapper", None)
        if wrapper is not None:
            self.nixl_wrapper = CountingNotifs(wrapper)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._caches = list(kv_caches.values())
        if self._host_tier_blocks:
            # A copy of block 0 onto itself: a layout the per-block copy cannot address fails here, at start,
            # not at the first demotion.
            copy_kv_cache_blocks_inplace(self._caches, self._total_blocks, [(0, 0)])

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        copies = getattr(metadata, "kvloop_copies", None)
        if copies:
            copy_kv_cache_blocks_inplace(self._caches, self._total_blocks, copies)
        super().start_load_kv(metadata)

    def _cleanup_remote_engines(self) -> None:
        """Upstream's cleanup, after a peer that failed a read is marked for a fresh handshake.

        Upstream re-handshakes a peer only when the peer's NIXL metadata is gone from this agent. A peer that froze
        (SIGSTOP past UCX's keep-alive) or restarted under the same engine id leaves that metadata in place and its
        endpoint disconnected, and every later read from it failed with ``NIXL_ERR_REMOTE_DISCONNECT``: in kvloop
        bench chaos a prefill engine recomputed every turn it should have pulled from a decode engine for the rest
        of the run after that engine's 10 s freeze. Marked invalid, the peer is released once its reads drain and
        the next read handshakes again; upstream's backoff (1 s doubling to 60 s) bounds how often."""
        now = time.perf_counter()
        for engine_id in peers_to_rehandshake(self._failed_remote_engines, self._invalid_remote_engines,
                                              self._remote_agents):
            self._mark_remote_engine_invalid(engine_id, now)
        super()._cleanup_remote_engines()
