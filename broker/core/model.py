"""The broker's value types. Pure data: no I/O, no gRPC, no generated code."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from kvloop.shared.vocabulary import Path, Reason, Role, Veto

Decision = Path
"""The plan's path: the shared vocabulary's (:class:`kvloop.shared.vocabulary.Path`); engines' roles too (``Role``)."""


class EvictionReason(enum.Enum):
    BUDGET = "budget"
    MEMORY_PRESSURE = "memory_pressure"
    TTL_EXPIRED = "ttl_expired"
    SUPERSEDED = "superseded"
    RESYNC = "resync"
    RELEASED = "released"
    ENGINE_GONE = "engine_gone"
    DEMOTION_FAILED = "demotion_failed"
    PREFETCH = "prefetch"
    """Not an eviction: a command to promote a host-tier lease back into the pool (``EvictionCommand.promote_pin``)."""


class Tier(enum.Enum):
    """Where a lease's blocks live on its engine, in demotion order: the engine's own KV pool, then its host tier
    (``EngineInfo.host_tier_blocks`` slots of host memory registered with NIXL like the pool). A lease's
    ``block_ids`` are the ids NIXL reads them by: pool block ids, or host slot ids, which run from
    ``EngineInfo.host_tier_first_id`` (one id space per engine, so a reader builds descriptors for either tier the
    same way)."""

    POOL = "pool"
    HOST = "host"


DEMOTING_REASONS = frozenset({EvictionReason.BUDGET, EvictionReason.MEMORY_PRESSURE})
"""Evictions that make room: on an engine with a host tier they demote the lease instead of dropping it. The
others (TTL, release, supersession, resync, the engine gone) end the lease wherever it is."""


@dataclass(frozen=True, slots=True)
class Addresses:
    grpc: str = ""
    http: str = ""
    nixl: str = ""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    engine_id: str
    role: Role
    block_size: int
    layout_fingerprint: str
    retention_budget_blocks: int
    addresses: Addresses = Addresses()
    incarnation: str = ""
    model: str = ""
    """The name the engine serves in the OpenAI API; "" for an engine that did not say (it serves any model)."""
    host_tier_blocks: int = 0
    """Slots of the engine's host tier (0: none; its evictions drop)."""
    host_tier_first_id: int = 0
    """The id of the tier's first slot; its slots are ``host_tier_first_id .. + host_tier_blocks - 1``. kvloop's
    connector lays the tier after the pool in the same NIXL registration, so this is the pool's block count."""
    step_tokens: int = 0
    """The most tokens one engine step computes, its streams' decode tokens and prompt chunks together (vLLM's
    ``max_num_batched_tokens``, chunked prefill): a DECODE_LOCAL tail runs in chunks of what its streams leave of
    it. 0: not reported (the tail then runs in one step)."""

    def same_layout(self, other: EngineInfo) -> bool:
        return (self.block_size, self.layout_fingerprint) == (other.block_size, other.layout_fingerprint)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running_requests: int = 0
    waiting_requests: int = 0
    kv_usage: float = 0.0
    memory_pressure: bool = False
    pressure_free_blocks: int = 0
    prefill_tokens_per_s: float = 0.0
    transfer_bytes_per_s: float = 0.0
    bytes_per_block: int = 0
    queued_prefill_tokens: int | None = None
    """Prompt tokens the routers have sent this engine and it has not computed yet (prefills not answered,
    DECODE_LOCAL tails before their first token); None where no router counts them (placement then prices a
    flat penalty per request). Never reported by the engine: set from the routers' counts at placement."""

    @property
    def score(self) -> float:
        """Lower is less loaded: queued work first, KV usage as a tie-breaker."""
        return self.running_requests + self.waiting_requests + self.kv_usage


@dataclass(slots=True)
class EngineRecord:
    info: EngineInfo
    registered_at: float
    last_seen: float
    load: EngineLoad = EngineLoad()
    eviction_seq: int = 0
    """Sequence number of the last eviction command issued to this engine."""
    learned_bandwidth: float = 0.0
    """Bytes/s learned from completed pulls out of this engine (EWMA); 0 = none yet."""


@dataclass(slots=True)
class Lease:
    lease_id: str
    engine_id: str
    session_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    num_tokens: int
    ttl_s: float
    expires_at: float
    last_used: float
    created_at: float
    pin_ids: set[str] = field(default_factory=set)
    pending: EvictionReason | None = None
    """An eviction that fell on this lease while pinned; carried out when the last pin ends."""
    tier: Tier = Tier.POOL
    demoting_until: float = 0.0
    """Non-zero while the engine copies the lease into its host tier: not offered, not pinnable, until the engine
    reports the copy (``BrokerState.complete_demotion``) or this time passes (then it is dropped)."""

    @property
    def pinned(self) -> bool:
        return bool(self.pin_ids)


@dataclass(frozen=True, slots=True)
class Pin:
    pin_id: str
    lease_id: str
    reader_engine_id: str
    num_blocks: int
    expires_at: float


@dataclass(frozen=True, slots=True)
class EvictionCommand:
    seq: int
    engine_id: str
    lease_id: str
    block_ids: tuple[int, ...]
    reason: EvictionReason
    live_lease_ids: tuple[str, ...] = ()
    tier: Tier = Tier.POOL
    """The tier ``block_ids`` are in: the engine frees them there."""
    demote_to: tuple[int, ...] = ()
    """Host slots, one per block: copy each block there before freeing it, then report the copy. Empty: drop."""
    promote_pin: str = ""
    """A promotion (reason PREFETCH): load the host slots ``block_ids`` back into the pool as a retained request of
    the lease's session, publish it, and report it; this pin keeps the slots until then. Nothing is freed."""
    promote_within_s: float = 0.0
    """How long the pin holds the slots from now: the engine must not read them after."""


@dataclass(frozen=True, slots=True)
class CostEstimate:
    transfer_s: float = 0.0
    recompute_s: float = 0.0
    bandwidth_bytes_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    bytes_per_block: int = 0
    measured: bool = False
    decode_local_s: float = 0.0
    """Each path's estimated seconds to the first token (0: the path was not possible)."""
    prefill_local_s: float = 0.0
    transfer_path_s: float = 0.0
    recompute_path_s: float = 0.0
    prefill_queue_s: float = 0.0
    """The wait priced for the chosen engine's queue before it starts this prompt."""
    decode_stall_s: float = 0.0
    """DECODE_LOCAL's price for holding up the decode engine's streams (in ``decode_local_s``; 0: none)."""
    pd_residual_s: float = 0.0
    """The caller's measured residuals, included in the path prices above (0: none, or not applied)."""
    decode_local_residual_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Plan:
    """Where a turn runs and why. Carries every field a trace needs to explain the decision."""

    decision: Decision
    reason: Reason
    prompt_blocks: int
    threshold_tokens: int
    prefill: EngineInfo
    decode: EngineInfo
    decode_sticky: bool
    session_id: str = ""
    source: EngineInfo | None = None
    source_lease_id: str = ""
    source_block_ids: tuple[int, ...] = ()
    source_tier: Tier = Tier.POOL
    """The tier ``source_block_ids`` are in on the source engine."""
    matched_blocks: int = 0
    matched_tokens: int = 0
    recompute_tokens: int = 0
    candidates: int = 0
    cost: CostEstimate = CostEstimate()
    local_tokens: int = 0
    """Prompt tokens the serving engine holds itself (lease or prefix cache)."""
    pull_tokens: int = 0
    """TRANSFER: tokens to pull, beyond the prefill engine's own prefix."""
    decode_local_veto: Veto | Literal[""] = ""
    """Why DECODE_LOCAL was not taken though the decode engine held the prefix (a :class:`Veto`: the first rule of
    ``broker.core.vetoes`` that refused it, or ``costlier``); "" when taken or not possible."""
    cached_tokens_seen: int = 0
    """The longest usable prefix any live engine held: the reuse available to this turn."""
    session_drops_generated: bool = False
    """The session said its answers will not be repeated (``keep_generated: false``): retain the prompt only."""
