"""Between ``kvloop.v1`` messages and the core's types. The only broker module besides the service
that imports generated code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvloop.broker.core import (
    Addresses,
    CostEstimate,
    Decision,
    EngineInfo,
    EngineLoad,
    EngineRecord,
    EvictionCommand,
    EvictionReason,
    Lease,
    Pin,
    Plan,
    Role,
    SoftAck,
    Tier,
)
from kvloop.broker.core.sessions import Priority, Session, SessionHint
from kvloop.shared.errors import InvalidArgument
from kvloop.v1 import broker_pb2 as pb

_ROLE_FROM_PB: dict[int, Role] = {pb.ENGINE_ROLE_PREFILL: Role.PREFILL, pb.ENGINE_ROLE_DECODE: Role.DECODE,
                 pb.ENGINE_ROLE_BOTH: Role.BOTH}
_ROLE_TO_PB: dict[Role, Any] = {v: k for k, v in _ROLE_FROM_PB.items()}
_DECISION_TO_PB = {Decision.RECOMPUTE: pb.DECISION_RECOMPUTE, Decision.TRANSFER: pb.DECISION_TRANSFER,
                   Decision.PREFILL_LOCAL: pb.DECISION_PREFILL_LOCAL,
                   Decision.DECODE_LOCAL: pb.DECISION_DECODE_LOCAL}
_REASON_TO_PB = {
    EvictionReason.BUDGET: pb.EVICTION_REASON_BUDGET,
    EvictionReason.MEMORY_PRESSURE: pb.EVICTION_REASON_MEMORY_PRESSURE,
    EvictionReason.TTL_EXPIRED: pb.EVICTION_REASON_TTL_EXPIRED,
    EvictionReason.SUPERSEDED: pb.EVICTION_REASON_SUPERSEDED,
    EvictionReason.RESYNC: pb.EVICTION_REASON_RESYNC,
    EvictionReason.RELEASED: pb.EVICTION_REASON_RELEASED,
    EvictionReason.ENGINE_GONE: pb.EVICTION_REASON_ENGINE_GONE,
    EvictionReason.DEMOTION_FAILED: pb.EVICTION_REASON_DEMOTION_FAILED,
    EvictionReason.PREFETCH: pb.EVICTION_REASON_PREFETCH,
}
TIER_TO_PB: dict[Tier, Any] = {Tier.POOL: pb.TIER_POOL, Tier.HOST: pb.TIER_HOST}


def role_from_pb(value: int) -> Role:
    role = _ROLE_FROM_PB.get(value)
    if role is None:
        raise InvalidArgument("engine.role: must be PREFILL, DECODE or BOTH", field="engine.role")
    return role


def engine_from_pb(msg: pb.Engine) -> EngineInfo:
    return EngineInfo(
        engine_id=msg.engine_id, role=role_from_pb(msg.role), block_size=msg.block_size,
        layout_fingerprint=msg.layout_fingerprint, retention_budget_blocks=msg.retention_budget_blocks,
        addresses=addresses_from_pb(msg.addresses), incarnation=msg.incarnation, model=msg.model,
        host_tier_blocks=msg.host_tier_blocks, host_tier_first_id=msg.host_tier_first_id,
        step_tokens=msg.step_tokens,
    )


def engine_to_pb(info: EngineInfo) -> pb.Engine:
    return pb.Engine(
        engine_id=info.engine_id, role=_ROLE_TO_PB[info.role], addresses=addresses_to_pb(info.addresses),
        block_size=info.block_size, layout_fingerprint=info.layout_fingerprint,
        retention_budget_blocks=info.retention_budget_blocks, incarnation=info.incarnation, model=info.model,
        host_tier_blocks=info.host_tier_blocks, host_tier_first_id=info.host_tier_first_id,
        step_tokens=info.step_tokens,
    )


def addresses_from_pb(msg: pb.EngineAddresses) -> Addresses:
    return Addresses(grpc=msg.grpc, http=msg.http, nixl=msg.nixl)


def addresses_to_pb(a: Addresses) -> pb.EngineAddresses:
    return pb.EngineAddresses(grpc=a.grpc, http=a.http, nixl=a.nixl)


def load_from_pb(msg: pb.EngineLoad) -> EngineLoad:
    return EngineLoad(
        running_requests=msg.running_requests, waiting_requests=msg.waiting_requests, kv_usage=msg.kv_usage,
        memory_pressure=msg.memory_pressure, pressure_free_blocks=msg.pressure_free_blocks,
        prefill_tokens_per_s=msg.prefill_tokens_per_s, transfer_bytes_per_s=msg.transfer_bytes_per_s,
        bytes_per_block=msg.bytes_per_block,
    )


def load_to_pb(load: EngineLoad) -> pb.EngineLoad:
    return pb.EngineLoad(
        running_requests=load.running_requests, waiting_requests=load.waiting_requests, kv_usage=load.kv_usage,
        memory_pressure=load.memory_pressure, pressure_free_blocks=load.pressure_free_blocks,
        prefill_tokens_per_s=load.prefill_tokens_per_s, transfer_bytes_per_s=load.transfer_bytes_per_s,
        bytes_per_block=load.bytes_per_block,
    )


def lease_to_pb(lease: Lease) -> pb.Lease:
    return pb.Lease(
        lease_id=lease.lease_id, engine_id=lease.engine_id, session_id=lease.session_id,
        block_keys=list(lease.keys), block_ids=list(lease.block_ids), num_tokens=lease.num_tokens,
        ttl_s=lease.ttl_s, expires_at_unix=lease.expires_at, last_used_unix=lease.last_used,
        pins=len(lease.pin_ids),
        pending_eviction=_REASON_TO_PB[lease.pending] if lease.pending else pb.EVICTION_REASON_UNSPECIFIED,
        tier=TIER_TO_PB[lease.tier], demoting=bool(lease.demoting_until),
    )


def pin_to_pb(pin: Pin) -> pb.Pin:
    return pb.Pin(pin_id=pin.pin_id, lease_id=pin.lease_id, reader_engine_id=pin.reader_engine_id,
                  num_blocks=pin.num_blocks, expires_at_unix=pin.expires_at)


def command_to_pb(cmd: EvictionCommand) -> pb.EvictionCommand:
    return pb.EvictionCommand(
        seq=cmd.seq, engine_id=cmd.engine_id, lease_id=cmd.lease_id, block_ids=list(cmd.block_ids),
        reason=_REASON_TO_PB[cmd.reason], live_lease_ids=list(cmd.live_lease_ids), tier=TIER_TO_PB[cmd.tier],
        demote_to_block_ids=list(cmd.demote_to), promote_pin_id=cmd.promote_pin,
        promote_within_s=cmd.promote_within_s,
    )


def cost_to_pb(cost: CostEstimate) -> pb.CostEstimate:
    return pb.CostEstimate(
        transfer_s=cost.transfer_s, recompute_s=cost.recompute_s, bandwidth_bytes_per_s=cost.bandwidth_bytes_per_s,
        prefill_tokens_per_s=cost.prefill_tokens_per_s, bytes_per_block=cost.bytes_per_block,
        measured=cost.measured, decode_local_s=cost.decode_local_s, prefill_local_s=cost.prefill_local_s,
        transfer_path_s=cost.transfer_path_s, recompute_path_s=cost.recompute_path_s,
        prefill_queue_s=cost.prefill_queue_s, decode_stall_s=cost.decode_stall_s,
        pd_residual_s=cost.pd_residual_s, decode_local_residual_s=cost.decode_local_residual_s,
    )


def plan_to_pb(plan: Plan) -> pb.Plan:
    return pb.Plan(
        decision=_DECISION_TO_PB[plan.decision], reason=plan.reason,
        source_engine_id=plan.source.engine_id if plan.source else "",
        source_addresses=addresses_to_pb(plan.source.addresses) if plan.source else None,
        source_lease_id=plan.source_lease_id, source_block_ids=list(plan.source_block_ids),
        matched_blocks=plan.matched_blocks, matched_tokens=plan.matched_tokens,
        recompute_tokens=plan.recompute_tokens, prompt_blocks=plan.prompt_blocks,
        threshold_tokens=plan.threshold_tokens, cost=cost_to_pb(plan.cost),
        prefill_engine_id=plan.prefill.engine_id, prefill_addresses=addresses_to_pb(plan.prefill.addresses),
        decode_engine_id=plan.decode.engine_id, decode_addresses=addresses_to_pb(plan.decode.addresses),
        decode_sticky=plan.decode_sticky, session_id=plan.session_id, candidates=plan.candidates,
        local_tokens=plan.local_tokens, pull_tokens=plan.pull_tokens, decode_local_veto=plan.decode_local_veto,
        cached_tokens_seen=plan.cached_tokens_seen, source_tier=TIER_TO_PB[plan.source_tier],
        session_drops_generated=plan.session_drops_generated,
    )


def engine_status_to_pb(rec: EngineRecord, retained: int, leases: int, cached_blocks: int = 0,
                        cache_resets: int = 0) -> pb.EngineStatus:
    return pb.EngineStatus(
        engine=engine_to_pb(rec.info), load=load_to_pb(rec.load), retained_blocks=retained, leases=leases,
        last_seen_unix=rec.last_seen, last_eviction_seq=rec.eviction_seq, cached_blocks=cached_blocks,
        cache_resets=cache_resets,
    )


def cache_ack_to_pb(ack: SoftAck) -> pb.CacheEventAck:
    return pb.CacheEventAck(reset=ack.reset, cached_blocks=ack.cached_blocks, expected_seq=ack.expected_seq)


PRIORITY_FROM_PB: dict[int, Priority | None] = {
    pb.SESSION_PRIORITY_UNSPECIFIED: None, pb.SESSION_PRIORITY_LOW: Priority.LOW,
    pb.SESSION_PRIORITY_NORMAL: Priority.NORMAL, pb.SESSION_PRIORITY_HIGH: Priority.HIGH}
PRIORITY_TO_PB: dict[Priority, Any] = {v: k for k, v in PRIORITY_FROM_PB.items() if v is not None}


def hint_from_pb(msg: pb.HintSessionRequest) -> SessionHint:
    if msg.priority not in PRIORITY_FROM_PB:
        raise InvalidArgument(f"priority: unknown value {msg.priority}", field="priority")
    return SessionHint(pause_s=msg.pause_s if msg.HasField("pause_s") else None, end=msg.end,
                       priority=PRIORITY_FROM_PB[msg.priority],
                       keep_generated=msg.keep_generated if msg.HasField("keep_generated") else None)


def session_to_pb(session_id: str, session: Session | None, leases: Sequence[Lease]) -> pb.SessionState:
    """A session as it stands: its hints (none when ``session`` is None) and what its leases hold."""
    state = pb.SessionState(session_id=session_id, leases=len(leases),
                            blocks=sum(len(x.block_ids) for x in leases),
                            host_blocks=sum(len(x.block_ids) for x in leases if x.tier is Tier.HOST),
                            known=session is not None or bool(leases),
                            priority=PRIORITY_TO_PB[session.priority if session else Priority.NORMAL])
    if session is not None:
        state.resume_at_unix, state.hold_until_unix = session.resume_at, session.hold_until
        state.ended_at_unix = session.ended_at
        state.drops_generated = session.drops_generated
    return state
