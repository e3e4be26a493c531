"""The engine protocol: what kvloop adds to vLLM's ``kv_transfer_params`` and connector config. Stdlib only.

vLLM's NIXL connector carries its own keys (``do_remote_decode``, ``remote_block_ids``, ...). kvloop adds:

- on a prefill request that pulls: upstream's pull keys built by :func:`pull_params`, with a
  ``remote_request_id`` of :data:`LEASE_READ_PREFIX` + lease id, so the decode engine counts the read and
  does not free its retained blocks;
- on the prefill's reply: :data:`REPORT_KEY`, the :class:`PrefillReport` (tokens found local, pulled, computed);
- on the decode request: :data:`SESSION_KEY`, the session hint its retained lease is published under, and
  :data:`KEEP_GENERATED_KEY` (false) when the client said the next turn will not repeat this answer: the decode
  engine then retains the prompt's blocks only and frees the answer's at once;
- on a DECODE_LOCAL request (:func:`decode_local_params`): :data:`DECODE_LOCAL_KEY`, so the decode engine,
  which computes the prompt's tail from its own prefix cache, retains and publishes the turn like any other;
- on the decode's reply: :data:`RETAINED_KEY`, the full blocks it retained, and :data:`DROPPED_KEY`, the blocks
  it freed at once because the client said they would not be reused.

The connector reads its settings from ``kv_connector_extra_config`` as a :class:`ConnectorSettings`. The
router, the connector, the launcher, the sidecar and the benchmarks' P/D driver all use this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

REPORT_KEY = "kvloop"
SESSION_KEY = "kvloop_session_id"
RETAINED_KEY = "kvloop_retained_blocks"
DECODE_LOCAL_KEY = "kvloop_decode_local"
KEEP_GENERATED_KEY = "kvloop_keep_generated"
DROPPED_KEY = "kvloop_dropped_blocks"
PROMOTE_KEY = "kvloop_promote_slots"
"""A decode engine's own request that loads a host-tier lease back into its pool (a prefetch): the host slots that
hold the prompt's first blocks, in order (``engines/connector/scheduler.py``)."""
PROMOTE_DEADLINE_KEY = "kvloop_promote_deadline"
"""Wall-clock time (``time.time()``, the engine's host) after which the connector must not read those slots: the
broker's pin on them may have ended and the slots hold another lease's blocks. Past it the prompt is computed."""
LEASE_READ_PREFIX = "kvloop-lease-"
"""``remote_request_id`` of a read of retained blocks: this prefix and the broker's lease id."""

DEFAULT_HOLD_S = 120.0
"""Engine-side safety hold of retained blocks without news from the sidecar; the sidecar renews it while the
broker's lease lives, so it only bounds how long blocks outlive a dead sidecar. Must exceed the broker's engine
TTL (the sidecar warns otherwise)."""

MAX_RESIDUAL_S = 60.0
"""The largest measured residual (``PlaceRequest.pd_residual_s``, ``decode_local_residual_s``) a router sends and a
broker accepts, either sign: the router clamps to it, so turns that stalled longer never get its placements refused."""

KV_EVENTS_TOPIC = "kvloop"
"""The ZMQ topic of the KV cache events an engine publishes for its sidecar (``--kv-events-config``)."""

BANDWIDTH_SAMPLE_MIN_BYTES = 8 << 20
"""Pulls smaller than this teach no bandwidth: their time is the fixed per-pull cost (an engine step, the
notification, the first handshake), which the broker's cost model counts as ``transfer_overhead_s``."""


@dataclass(frozen=True)
class ConnectorSettings:
    """kvloop's keys in ``kv_connector_extra_config``, with their one set of defaults."""

    kvloop_hold_s: float = DEFAULT_HOLD_S
    kvloop_retain: bool = True
    """Decode: retain finished requests' KV (needs upstream's ``bidirectional_kv_xfer``)."""
    kvloop_sidecar_socket: str = ""
    """The sidecar's Unix socket (empty: ``KVLOOP_SIDECAR_SOCKET``, else no link: nothing published)."""
    kvloop_nixl_progress_delay_us: int = 20_000
    """NIXL progress-thread poll delay; 0 = upstream's busy poll. Each poll wakes a thread in the engine's worker
    process and preempts one of its compute threads on saturated cores: at 1,000 us (~900 wakes/s) an engine with
    the connector carried ~0.87x the bare engine's chat turns, at 20,000 us ~0.99x, and a pull's bytes move in
    ``transfer`` itself on this transport (docs/engine-patches.md)."""
    kvloop_host_tier_blocks: int = 0
    """Decode: blocks of the KV cache allocation kept back from vLLM's pool as the host tier (0 = none): the
    scheduler gets ``num_blocks - kvloop_host_tier_blocks`` blocks, the tier the ids above them."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = extra or {}
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in extra and extra[f.name] is not None:
                default = getattr(cls, f.name)
                values[f.name] = type(default)(extra[f.name])
        return cls(**values)

    def to_extra(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v != getattr(ConnectorSettings, k)}


@dataclass(frozen=True)
class PrefillReport:
    """What a prefill engine did with a request's prompt, from its own books (``REPORT_KEY`` in its reply)."""

    local_tokens: int = 0
    pulled_tokens: int = 0
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    pull_ms: float = 0.0
    pull_failed: bool = False
    computed_tokens: int = 0
    queue_ms: float = 0.0
    """From the request's arrival at the engine to the scheduler's first look at it."""
    compute_ms: float = 0.0
    """From the scheduler's first look to the prefill's end, less the pull: the tail's compute and engine steps."""

    @classmethod
    def pop_from(cls, params: dict[str, Any]) -> PrefillReport | None:
        """Take the report out of a prefill's returned params (None: no kvloop connector reported)."""
        raw = params.pop(REPORT_KEY, None)
        if not raw:
            return None
        return cls(**{f.name: type(getattr(cls, f.name))(raw[f.name]) for f in fields(cls) if f.name in raw})

    def to_params(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def reused_tokens(self) -> int:
        return self.local_tokens + self.pulled_tokens

    def bandwidth_sample(self) -> tuple[int, float]:
        """(bytes, seconds) for the broker's bandwidth estimate; seconds is 0 for pulls too small to learn from."""
        seconds = self.pull_ms / 1e3 if self.pulled_bytes >= BANDWIDTH_SAMPLE_MIN_BYTES else 0.0
        return self.pulled_bytes, seconds


def prefill_report(*, prompt_tokens: int, local_tokens: int, external_tokens: int, pull_done: bool,
                   pull_failed: bool, pull_s: float, block_size: int, bytes_per_block: int, queue_s: float = 0.0,
                   compute_s: float = 0.0) -> PrefillReport:
    """The connector's arithmetic: a pull counts only when it finished without failing; a pull that never
    finished counts as failed; computed = prompt - local - pulled."""
    pulled_tokens = external_tokens if pull_done and not pull_failed else 0
    pulled_blocks = -(-pulled_tokens // block_size)
    return PrefillReport(local_tokens=local_tokens, pulled_tokens=pulled_tokens, pulled_blocks=pulled_blocks,
                         pulled_bytes=pulled_blocks * bytes_per_block, pull_ms=round(pull_s * 1e3, 3),
                         pull_failed=pull_failed or (external_tokens > 0 and not pull_done),
                         computed_tokens=max(0, prompt_tokens - local_tokens - pulled_tokens),
                         queue_ms=round(queue_s * 1e3, 3), compute_ms=round(compute_s * 1e3, 3))


def prefill_only_params() -> dict[str, Any]:
    """A prefill request that pulls nothing and hands its KV to a decode engine."""
    return {"do_remote_decode": True, "do_remote_prefill": False}


def decode_local_params(session_id: str) -> dict[str, Any]:
    """A request the decode engine serves whole: no prefill engine, no pull (its prefix is in the engine's own
    cache); retained and published when it finishes."""
    return {"do_remote_decode": False, "do_remote_prefill": False, DECODE_LOCAL_KEY: True, SESSION_KEY: session_id}


def pull_params(*, source_engine_id: str, lease_id: str, nixl_address: str, block_ids: list[int],
                matched_blocks: int, matched_tokens: int) -> dict[str, Any]:
    """A prefill request's params to pull the first ``matched_blocks`` pinned blocks of a lease, then hand on."""
    host, _, port = nixl_address.rpartition(":")
    return {**prefill_only_params(), "remote_engine_id": source_engine_id,
            "remote_request_id": LEASE_READ_PREFIX + lease_id, "remote_block_ids": [list(block_ids)[:matched_blocks]],
            "remote_host": host, "remote_port": int(port), "remote_num_tokens": int(matched_tokens), "tp_size": 1}


def retainable_blocks(num_computed_tokens: int, block_size: int) -> int:
    """Full blocks a finished decode request can retain: those whose every token has KV (the last sampled token
    has none)."""
    return max(0, int(num_computed_tokens)) // block_size
