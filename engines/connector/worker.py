"""The connector's worker side (each vLLM worker process): upstream's pull worker, with reads of retained
blocks never freeing them and a NIXL progress thread that sleeps between polls."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

from kvloop.engines.connector.books import split_lease_reads
from kvloop.engines.connector.patches import nixl_progress_delay
from kvloop.shared.protocol import LEASE_READ_PREFIX, ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
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


class KvloopConnectorWorker(NixlPullConnectorWorker):
    """Upstream's worker, its NIXL agent created with ``kvloop_nixl_progress_delay_us`` and its notifications
    filtered by :class:`CountingNotifs`."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig) -> None:
        settings = ConnectorSettings.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        with nixl_progress_delay(settings.kvloop_nixl_progress_delay_us):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        wrapper: Any = getattr(self, "nixl_wrapper", None)
        if wrapper is not None:
            self.nixl_wrapper = CountingNotifs(wrapper)
