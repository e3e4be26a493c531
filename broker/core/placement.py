"""Placement: for a new prompt, which engines run it and whether prefill pulls the prefix or recomputes.

Pure function of the request, the index's matches and the engines' reported figures.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvloop.broker.core.index import Match
from kvloop.broker.core.model import CostEstimate, Decision, EngineRecord, Plan
from kvloop.shared.errors import FailedPrecondition


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    threshold_tokens: int = 64
    """Below this many matched tokens, recompute (upstream's kv_recompute_threshold)."""
    default_bandwidth_bytes_per_s: float = 1e9
    """Stands in for a NIXL bandwidth no engine has reported yet."""
    default_prefill_tokens_per_s: float = 5000.0
    """Stands in for a prefill throughput no engine has reported yet."""
    default_bytes_per_block: int = 262144
    """Stands in for KV bytes per block when the source has not reported it."""
    transfer_overhead_s: float = 0.005
    """Fixed cost of a pull: handshake, notifications, the extra engine step."""
    sticky_load_gap: float = 4.0
    """Keep a session on the decode engine holding its prefix unless it is this much busier."""


@dataclass(frozen=True, slots=True)
class PlaceInput:
    keys: Sequence[bytes]
    num_tokens: int
    layout_fingerprint: str
    block_size: int
    session_id: str = ""


def _least_loaded(engines: Iterable[EngineRecord]) -> EngineRecord | None:
    return min(engines, key=lambda e: (e.load.score, e.info.engine_id), default=None)


def best_match(matches: Iterable[Match], session_id: str) -> Match | None:
    """Longest match; ties go to the same session, then the most recently used lease."""
    return max(
        matches,
        key=lambda m: (m.blocks, bool(session_id) and m.lease.session_id == session_id, m.lease.last_used,
                       m.lease.lease_id),
        default=None,
    )


def estimate_cost(
    matched_blocks: int, block_size: int, source: EngineRecord, prefill: EngineRecord, policy: PlacementPolicy
) -> CostEstimate:
    measured = True
    bytes_per_block = source.load.bytes_per_block or prefill.load.bytes_per_block
    if not bytes_per_block:
        bytes_per_block, measured = policy.default_bytes_per_block, False
    reported = [b for b in (source.learned_bandwidth, source.load.transfer_bytes_per_s,
                            prefill.load.transfer_bytes_per_s) if b > 0]
    bandwidth = reported[0] if reported else policy.default_bandwidth_bytes_per_s
    measured = measured and bool(reported)
    tps = prefill.load.prefill_tokens_per_s
    if tps <= 0:
        tps, measured = policy.default_prefill_tokens_per_s, False
    transfer_s = policy.transfer_overhead_s + matched_blocks * bytes_per_block / bandwidth
    recompute_s = matched_blocks * block_size / tps
    return CostEstimate(transfer_s, recompute_s, bandwidth, tps, bytes_per_block, measured)


def place(
    request: PlaceInput,
    engines: Sequence[EngineRecord],
    matches: Sequence[Match],
    policy: PlacementPolicy,
    session_engine_id: str = "",
    cached: Mapping[str, int] | None = None,
) -> Plan:
    """``engines`` are the live engines; ``matches`` come from the lease index (any engine); ``cached`` is, per
    engine id, how many leading blocks of ``request.keys`` the engine's own prefix cache holds (the soft index)."""
    fit = [
        e for e in engines
        if e.info.layout_fingerprint == request.layout_fingerprint and e.info.block_size == request.block_size
    ]
    by_id = {e.info.engine_id: e for e in fit}
    prefill = _least_loaded(e for e in fit if e.info.role.can_prefill)
    decode = _least_loaded(e for e in fit if e.info.role.can_decode)
    if prefill is None or decode is None:
        missing = "prefill" if prefill is None else "decode"
        raise FailedPrecondition(
            f"layout_fingerprint: no live {missing} engine with fingerprint {request.layout_fingerprint!r} "
            f"and block size {request.block_size}",
            field="layout_fingerprint",
        )
    usable = [m for m in matches if m.lease.engine_id in by_id and m.lease.pending is None]
    match = best_match(usable, request.session_id)
    # The last prompt token must be computed to produce logits: never reuse the block holding it.
    max_blocks = max(0, (request.num_tokens - 1) // request.block_size)
    matched = min(match.blocks, max_blocks) if match else 0
    source = by_id[match.lease.engine_id] if match else None

    if (source is not None and source.info.role.can_prefill and matched
            and source.load.score - prefill.load.score <= policy.sticky_load_gap):
        prefill = source  # it holds the prefix itself: prefill there, no transfer

    sticky = False
    sticky_candidate = source if source is not None and source.info.role.can_decode else None
    if sticky_candidate is None and session_engine_id in by_id and by_id[session_engine_id].info.role.can_decode:
        sticky_candidate = by_id[session_engine_id]
    if sticky_candidate is not None and sticky_candidate.load.score - decode.load.score <= policy.sticky_load_gap:
        decode, sticky = sticky_candidate, True

    cost = CostEstimate()
    matched_tokens = matched * request.block_size
    if source is None or matched == 0:
        decision, reason = Decision.RECOMPUTE, "no_match"
    elif matched_tokens < policy.threshold_tokens:
        decision, reason = Decision.RECOMPUTE, "below_threshold"
    elif source.info.engine_id == prefill.info.engine_id:
        decision, reason = Decision.PREFILL_LOCAL, "local_prefix"
    else:
        cost = estimate_cost(matched, request.block_size, source, prefill, policy)
        if cost.transfer_s < cost.recompute_s:
            decision, reason = Decision.TRANSFER, "transfer_cheaper"
        else:
            decision, reason = Decision.RECOMPUTE, "recompute_cheaper"

    reused = decision is not Decision.RECOMPUTE
    return Plan(
        decision=decision,
        reason=reason,
        prompt_blocks=len(request.keys),
        threshold_tokens=policy.threshold_tokens,
        prefill=prefill.info,
        decode=decode.info,
        decode_sticky=sticky,
        session_id=request.session_id,
        source=source.info if source else None,
        source_lease_id=match.lease.lease_id if match else "",
        source_block_ids=tuple(match.lease.block_ids[:matched]) if match else (),
        matched_blocks=matched,
        matched_tokens=matched_tokens,
        recompute_tokens=request.num_tokens - (matched_tokens if reused else 0),
        candidates=len(usable),
        cost=cost,
    )
