"""kvloop's vLLM KV connector. The one module of kvloop that touches vLLM internals; pinned to vLLM 0.32.

Loaded by vLLM through ``kv_connector_module_path="engines.connector"`` with ``kv_connector="NixlConnector"``
(the class keeps upstream's name: vLLM applies NIXL-specific config checks by that name, and the module
path takes priority over the in-tree class in the connector factory). It is vLLM's NixlConnector in its
decode-to-prefill (``bidirectional_kv_xfer``) mode, with these changes:

- **No hang after a failed pull.** Upstream 0.32 with ``kv_load_failure_policy=recompute``: after a
  failed, declined or timed-out pull the scheduler resets the request and asks the connector again;
  ``get_num_new_matched_tokens`` reports the remote tokens again, while ``update_state_after_alloc``
  skips the receive because ``_remote_blocks_processed`` is set, so the request waits in
  WAITING_FOR_REMOTE_KVS forever with its blocks held. Here a request whose remote blocks were already
  processed gets ``(0, False)``: one pull attempt, then local recompute.

Still to come (see the engines issue): publishing a finished decode request's blocks to the broker as a
lease through the engine's sidecar, releasing or renewing them on the broker's eviction commands, and
reads that do not consume the decode's blocks.

Importing this module starts nothing: the API server imports it for metrics.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

VLLM_VERSION = "0.32"
"""The vLLM minor version these hooks were read from; engines/launcher refuses another."""


class KvloopConnectorScheduler(NixlPullConnectorScheduler):
    """Scheduler side (EngineCore process, busy-loop thread): keeps books only, never blocks."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and params.get("_remote_blocks_processed"):
            # The one pull this request was allowed has happened (or failed): recompute locally.
            return 0, False
        result: tuple[int, bool] = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return result


class NixlConnector(NixlPullConnector):
    """vLLM's pull NixlConnector with kvloop's scheduler side."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        # NixlPullConnector.__init__ hard-codes its scheduler class: build the base, then our halves.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self.connector_scheduler: KvloopConnectorScheduler | None
        self.connector_worker: NixlPullConnectorWorker | None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvloopConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = NixlPullConnectorWorker(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"unsupported KV connector role: {role}")
