"""The broker's functional core: index, leases, pins, eviction, placement and cost model.

Pure code: it imports no gRPC, etcd or generated stubs, and takes the time as an argument.
"""

from kvloop.broker.core.eviction import (
    POLICIES,
    CostAwarePolicy,
    EvictionPolicy,
    LruPolicy,
    choose_victims,
    make_policy,
)
from kvloop.broker.core.index import BlockIndex, Match
from kvloop.broker.core.model import (
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
    Tier,
)
from kvloop.broker.core.placement import PlaceInput, PlacementPolicy, place
from kvloop.broker.core.soft_index import ResetReason, SoftAck, SoftIndex
from kvloop.broker.core.state import BrokerState, Changes, Limits

__all__ = [
    "POLICIES",
    "Addresses",
    "BlockIndex",
    "BrokerState",
    "Changes",
    "CostAwarePolicy",
    "CostEstimate",
    "Decision",
    "EngineInfo",
    "EngineLoad",
    "EngineRecord",
    "EvictionCommand",
    "EvictionPolicy",
    "EvictionReason",
    "Lease",
    "Limits",
    "LruPolicy",
    "Match",
    "Pin",
    "PlaceInput",
    "PlacementPolicy",
    "Plan",
    "ResetReason",
    "Role",
    "SoftAck",
    "SoftIndex",
    "Tier",
    "choose_victims",
    "make_policy",
    "place",
]
