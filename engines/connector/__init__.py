"""kvloop's vLLM KV connector: the one package of kvloop that touches vLLM internals; pinned to vLLM 0.32.

vLLM loads it through ``kv_connector_module_path="kvloop.engines.connector"`` with ``kv_connector="NixlConnector"``
(the class keeps upstream's name: vLLM applies NIXL-specific config checks by that name, and the module path
takes priority over the in-tree class in the connector factory). It is vLLM's NixlConnector in its
decode-to-prefill (``bidirectional_kv_xfer``) mode with kvloop's halves. Reading path:

- this facade: which half runs in which process;
- :mod:`.scheduler`: retain and publish (decode), report the pull (prefill), one pull then recompute;
- :mod:`.worker`: reads of retained blocks never free them; NIXL's progress thread sleeps;
- :mod:`.books`: the arithmetic of both, pure and unit-tested on fakes;
- :mod:`.link`: the thread towards the engine's sidecar (no vLLM);
- :mod:`.patches`: process-wide patches of vLLM 0.32 (queue spin, idle stepping, freeing an answer that will not be
  repeated, NIXL progress delay).

The wire keys kvloop adds to ``kv_transfer_params`` and reads from the extra config are in
:mod:`kvloop.shared.protocol`. Importing this package starts nothing: the API server imports it for metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPullConnector

from kvloop.engines.connector.patches import cap_ipc_spin
from kvloop.engines.connector.scheduler import KvloopConnectorScheduler
from kvloop.engines.connector.worker import KvloopConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig

VLLM_VERSION = "0.32"
"""The vLLM minor version these hooks were read from."""

__all__ = ["VLLM_VERSION", "KvloopConnectorScheduler", "KvloopConnectorWorker", "NixlConnector", "cap_ipc_spin"]


class NixlConnector(NixlPullConnector):
    """vLLM's pull NixlConnector with kvloop's scheduler and worker sides."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any) -> None:
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

    def kvloop_kept_blocks(self, request_id: str) -> int | None:
        return self.connector_scheduler.kvloop_kept_blocks(request_id) if self.connector_scheduler is not None else None
