"""JSON encoding of the core's records for the etcd store (keys and bytes as hex)."""

from __future__ import annotations

import json
from typing import Any

from kvloop.broker.core import Addresses, EngineInfo, EngineLoad, EngineRecord, EvictionReason, Lease, Pin, Role, Tier


def encode_engine(rec: EngineRecord) -> bytes:
    info = rec.info
    return json.dumps({
        "engine_id": info.engine_id, "role": info.role.value, "block_size": info.block_size,
        "layout_fingerprint": info.layout_fingerprint, "retention_budget_blocks": info.retention_budget_blocks,
        "addresses": [info.addresses.grpc, info.addresses.http, info.addresses.nixl],
        "incarnation": info.incarnation, "model": info.model, "host_tier_blocks": info.host_tier_blocks,
        "host_tier_first_id": info.host_tier_first_id, "step_tokens": info.step_tokens,
        "registered_at": rec.registered_at,
        "last_seen": rec.last_seen,
        "eviction_seq": rec.eviction_seq, "learned_bandwidth": rec.learned_bandwidth,
        "load": {k: getattr(rec.load, k) for k in EngineLoad.__dataclass_fields__},
    }).encode()


def decode_engine(raw: bytes) -> EngineRecord:
    d: dict[str, Any] = json.loads(raw)
    info = EngineInfo(
        engine_id=d["engine_id"], role=Role(d["role"]), block_size=d["block_size"],
        layout_fingerprint=d["layout_fingerprint"], retention_budget_blocks=d["retention_budget_blocks"],
        addresses=Addresses(*d["addresses"]), incarnation=d["incarnation"], model=d.get("model", ""),
        host_tier_blocks=d.get("host_tier_blocks", 0), host_tier_first_id=d.get("host_tier_first_id", 0),
        step_tokens=d.get("step_tokens", 0),
    )
    return EngineRecord(info=info, registered_at=d["registered_at"], last_seen=d["last_seen"],
                        load=EngineLoad(**d["load"]), eviction_seq=d["eviction_seq"],
                        learned_bandwidth=d["learned_bandwidth"])


def encode_lease(lease: Lease) -> bytes:
    return json.dumps({
        "lease_id": lease.lease_id, "engine_id": lease.engine_id, "session_id": lease.session_id,
        "keys": [k.hex() for k in lease.keys], "block_ids": list(lease.block_ids),
        "num_tokens": lease.num_tokens, "ttl_s": lease.ttl_s, "expires_at": lease.expires_at,
        "last_used": lease.last_used, "created_at": lease.created_at,
        "pending": lease.pending.value if lease.pending else None,
        "tier": lease.tier.value, "demoting_until": lease.demoting_until,
    }).encode()


def decode_lease(raw: bytes) -> Lease:
    d: dict[str, Any] = json.loads(raw)
    return Lease(
        lease_id=d["lease_id"], engine_id=d["engine_id"], session_id=d["session_id"],
        keys=tuple(bytes.fromhex(k) for k in d["keys"]), block_ids=tuple(d["block_ids"]),
        num_tokens=d["num_tokens"], ttl_s=d["ttl_s"], expires_at=d["expires_at"], last_used=d["last_used"],
        created_at=d["created_at"], pending=EvictionReason(d["pending"]) if d["pending"] else None,
        tier=Tier(d.get("tier", Tier.POOL.value)), demoting_until=d.get("demoting_until", 0.0),
    )


def encode_pin(pin: Pin) -> bytes:
    return json.dumps({"pin_id": pin.pin_id, "lease_id": pin.lease_id, "reader_engine_id": pin.reader_engine_id,
                       "num_blocks": pin.num_blocks, "expires_at": pin.expires_at}).encode()


def decode_pin(raw: bytes) -> Pin:
    return Pin(**json.loads(raw))
