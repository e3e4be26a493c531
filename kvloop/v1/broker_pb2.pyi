from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_ROLE_UNSPECIFIED: _ClassVar[EngineRole]
    ENGINE_ROLE_PREFILL: _ClassVar[EngineRole]
    ENGINE_ROLE_DECODE: _ClassVar[EngineRole]
    ENGINE_ROLE_BOTH: _ClassVar[EngineRole]

class Decision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECISION_UNSPECIFIED: _ClassVar[Decision]
    DECISION_RECOMPUTE: _ClassVar[Decision]
    DECISION_TRANSFER: _ClassVar[Decision]
    DECISION_PREFILL_LOCAL: _ClassVar[Decision]
    DECISION_DECODE_LOCAL: _ClassVar[Decision]

class EvictionReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVICTION_REASON_UNSPECIFIED: _ClassVar[EvictionReason]
    EVICTION_REASON_BUDGET: _ClassVar[EvictionReason]
    EVICTION_REASON_MEMORY_PRESSURE: _ClassVar[EvictionReason]
    EVICTION_REASON_TTL_EXPIRED: _ClassVar[EvictionReason]
    EVICTION_REASON_SUPERSEDED: _ClassVar[EvictionReason]
    EVICTION_REASON_RESYNC: _ClassVar[EvictionReason]
    EVICTION_REASON_RELEASED: _ClassVar[EvictionReason]
    EVICTION_REASON_ENGINE_GONE: _ClassVar[EvictionReason]
    EVICTION_REASON_DEMOTION_FAILED: _ClassVar[EvictionReason]
    EVICTION_REASON_PREFETCH: _ClassVar[EvictionReason]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_POOL: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]

class SessionPriority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_PRIORITY_UNSPECIFIED: _ClassVar[SessionPriority]
    SESSION_PRIORITY_LOW: _ClassVar[SessionPriority]
    SESSION_PRIORITY_NORMAL: _ClassVar[SessionPriority]
    SESSION_PRIORITY_HIGH: _ClassVar[SessionPriority]
ENGINE_ROLE_UNSPECIFIED: EngineRole
ENGINE_ROLE_PREFILL: EngineRole
ENGINE_ROLE_DECODE: EngineRole
ENGINE_ROLE_BOTH: EngineRole
DECISION_UNSPECIFIED: Decision
DECISION_RECOMPUTE: Decision
DECISION_TRANSFER: Decision
DECISION_PREFILL_LOCAL: Decision
DECISION_DECODE_LOCAL: Decision
EVICTION_REASON_UNSPECIFIED: EvictionReason
EVICTION_REASON_BUDGET: EvictionReason
EVICTION_REASON_MEMORY_PRESSURE: EvictionReason
EVICTION_REASON_TTL_EXPIRED: EvictionReason
EVICTION_REASON_SUPERSEDED: EvictionReason
EVICTION_REASON_RESYNC: EvictionReason
EVICTION_REASON_RELEASED: EvictionReason
EVICTION_REASON_ENGINE_GONE: EvictionReason
EVICTION_REASON_DEMOTION_FAILED: EvictionReason
EVICTION_REASON_PREFETCH: EvictionReason
TIER_POOL: Tier
TIER_HOST: Tier
SESSION_PRIORITY_UNSPECIFIED: SessionPriority
SESSION_PRIORITY_LOW: SessionPriority
SESSION_PRIORITY_NORMAL: SessionPriority
SESSION_PRIORITY_HIGH: SessionPriority

class EngineAddresses(_message.Message):
    __slots__ = ("grpc", "http", "nixl")
    GRPC_FIELD_NUMBER: _ClassVar[int]
    HTTP_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    grpc: str
    http: str
    nixl: str
    def __init__(self, grpc: _Optional[str] = ..., http: _Optional[str] = ..., nixl: _Optional[str] = ...) -> None: ...

class Engine(_message.Message):
    __slots__ = ("engine_id", "role", "addresses", "block_size", "layout_fingerprint", "retention_budget_blocks", "incarnation", "model", "host_tier_blocks", "host_tier_first_id", "step_tokens")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RETENTION_BUDGET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_FIRST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: EngineRole
    addresses: EngineAddresses
    block_size: int
    layout_fingerprint: str
    retention_budget_blocks: int
    incarnation: str
    model: str
    host_tier_blocks: int
    host_tier_first_id: int
    step_tokens: int
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[_Union[EngineRole, str]] = ..., addresses: _Optional[_Union[EngineAddresses, _Mapping]] = ..., block_size: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., retention_budget_blocks: _Optional[int] = ..., incarnation: _Optional[str] = ..., model: _Optional[str] = ..., host_tier_blocks: _Optional[int] = ..., host_tier_first_id: _Optional[int] = ..., step_tokens: _Optional[int] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "kv_usage", "memory_pressure", "pressure_free_blocks", "prefill_tokens_per_s", "transfer_bytes_per_s", "bytes_per_block")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    kv_usage: float
    memory_pressure: bool
    pressure_free_blocks: int
    prefill_tokens_per_s: float
    transfer_bytes_per_s: float
    bytes_per_block: int
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_usage: _Optional[float] = ..., memory_pressure: _Optional[bool] = ..., pressure_free_blocks: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., transfer_bytes_per_s: _Optional[float] = ..., bytes_per_block: _Optional[int] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("engine",)
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    engine: Engine
    def __init__(self, engine: _Optional[_Union[Engine, _Mapping]] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("keepalive_interval_s", "engine_ttl_s", "last_eviction_seq", "live_lease_ids")
    KEEPALIVE_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    LAST_EVICTION_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    keepalive_interval_s: float
    engine_ttl_s: float
    last_eviction_seq: int
    live_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keepalive_interval_s: _Optional[float] = ..., engine_ttl_s: _Optional[float] = ..., last_eviction_seq: _Optional[int] = ..., live_lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("engine_id", "load")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    load: EngineLoad
    def __init__(self, engine_id: _Optional[str] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("engine_ttl_s", "live_leases")
    ENGINE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    engine_ttl_s: float
    live_leases: int
    def __init__(self, engine_ttl_s: _Optional[float] = ..., live_leases: _Optional[int] = ...) -> None: ...

class DeregisterEngineRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class DeregisterEngineResponse(_message.Message):
    __slots__ = ("dropped_leases",)
    DROPPED_LEASES_FIELD_NUMBER: _ClassVar[int]
    dropped_leases: int
    def __init__(self, dropped_leases: _Optional[int] = ...) -> None: ...

class EvictionCommand(_message.Message):
    __slots__ = ("seq", "engine_id", "lease_id", "block_ids", "reason", "live_lease_ids", "tier", "demote_to_block_ids", "promote_pin_id", "promote_within_s")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DEMOTE_TO_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_PIN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_WITHIN_S_FIELD_NUMBER: _ClassVar[int]
    seq: int
    engine_id: str
    lease_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    reason: EvictionReason
    live_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    tier: Tier
    demote_to_block_ids: _containers.RepeatedScalarFieldContainer[int]
    promote_pin_id: str
    promote_within_s: float
    def __init__(self, seq: _Optional[int] = ..., engine_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., reason: _Optional[_Union[EvictionReason, str]] = ..., live_lease_ids: _Optional[_Iterable[str]] = ..., tier: _Optional[_Union[Tier, str]] = ..., demote_to_block_ids: _Optional[_Iterable[int]] = ..., promote_pin_id: _Optional[str] = ..., promote_within_s: _Optional[float] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "engine_id", "session_id", "block_keys", "block_ids", "num_tokens", "ttl_s", "expires_at_unix", "last_used_unix", "pins", "pending_eviction", "tier", "demoting")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    PENDING_EVICTION_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DEMOTING_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    engine_id: str
    session_id: str
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    ttl_s: float
    expires_at_unix: float
    last_used_unix: float
    pins: int
    pending_eviction: EvictionReason
    tier: Tier
    demoting: bool
    def __init__(self, lease_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., session_id: _Optional[str] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., ttl_s: _Optional[float] = ..., expires_at_unix: _Optional[float] = ..., last_used_unix: _Optional[float] = ..., pins: _Optional[int] = ..., pending_eviction: _Optional[_Union[EvictionReason, str]] = ..., tier: _Optional[_Union[Tier, str]] = ..., demoting: _Optional[bool] = ...) -> None: ...

class PublishLeaseRequest(_message.Message):
    __slots__ = ("engine_id", "session_id", "block_keys", "block_ids", "num_tokens", "ttl_s")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    session_id: str
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    ttl_s: float
    def __init__(self, engine_id: _Optional[str] = ..., session_id: _Optional[str] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PublishLeaseResponse(_message.Message):
    __slots__ = ("lease", "evictions")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    evictions: _containers.RepeatedCompositeFieldContainer[EvictionCommand]
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., evictions: _Optional[_Iterable[_Union[EvictionCommand, _Mapping]]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "ttl_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_s: float
    def __init__(self, lease_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("deferred",)
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    deferred: bool
    def __init__(self, deferred: _Optional[bool] = ...) -> None: ...

class PinBlocksRequest(_message.Message):
    __slots__ = ("reader_engine_id", "lease_id", "num_blocks", "timeout_s")
    READER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    reader_engine_id: str
    lease_id: str
    num_blocks: int
    timeout_s: float
    def __init__(self, reader_engine_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PinBlocksResponse(_message.Message):
    __slots__ = ("pin_id", "block_ids", "expires_at_unix", "lease_expires_at_unix", "tier")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    expires_at_unix: float
    lease_expires_at_unix: float
    tier: Tier
    def __init__(self, pin_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., expires_at_unix: _Optional[float] = ..., lease_expires_at_unix: _Optional[float] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class CompleteTransferRequest(_message.Message):
    __slots__ = ("pin_id", "success", "bytes", "duration_s")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    success: bool
    bytes: int
    duration_s: float
    def __init__(self, pin_id: _Optional[str] = ..., success: _Optional[bool] = ..., bytes: _Optional[int] = ..., duration_s: _Optional[float] = ...) -> None: ...

class CompleteTransferResponse(_message.Message):
    __slots__ = ("lease_expires_at_unix",)
    LEASE_EXPIRES_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    lease_expires_at_unix: float
    def __init__(self, lease_expires_at_unix: _Optional[float] = ...) -> None: ...

class CompleteDemotionRequest(_message.Message):
    __slots__ = ("engine_id", "lease_id", "success")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    lease_id: str
    success: bool
    def __init__(self, engine_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., success: _Optional[bool] = ...) -> None: ...

class CompleteDemotionResponse(_message.Message):
    __slots__ = ("retained",)
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    retained: bool
    def __init__(self, retained: _Optional[bool] = ...) -> None: ...

class CompletePromotionRequest(_message.Message):
    __slots__ = ("engine_id", "lease_id", "pin_id", "success")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    lease_id: str
    pin_id: str
    success: bool
    def __init__(self, engine_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., pin_id: _Optional[str] = ..., success: _Optional[bool] = ...) -> None: ...

class CompletePromotionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PlaceRequest(_message.Message):
    __slots__ = ("session_id", "block_keys", "num_tokens", "layout_fingerprint", "block_size", "pin", "traceparent", "no_decode_local", "in_flight", "counts_in_flight", "router_id", "in_flight_tokens", "pd_residual_s", "decode_local_residual_s", "pd_residual_by_engine", "decode_local_residual_by_engine")
    class InFlightEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class InFlightTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PdResidualByEngineEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class DecodeLocalResidualByEngineEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    NO_DECODE_LOCAL_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    COUNTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PD_RESIDUAL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_LOCAL_RESIDUAL_S_FIELD_NUMBER: _ClassVar[int]
    PD_RESIDUAL_BY_ENGINE_FIELD_NUMBER: _ClassVar[int]
    DECODE_LOCAL_RESIDUAL_BY_ENGINE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: int
    layout_fingerprint: str
    block_size: int
    pin: bool
    traceparent: str
    no_decode_local: bool
    in_flight: _containers.ScalarMap[str, int]
    counts_in_flight: bool
    router_id: str
    in_flight_tokens: _containers.ScalarMap[str, int]
    pd_residual_s: float
    decode_local_residual_s: float
    pd_residual_by_engine: _containers.ScalarMap[str, float]
    decode_local_residual_by_engine: _containers.ScalarMap[str, float]
    def __init__(self, session_id: _Optional[str] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., num_tokens: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., pin: _Optional[bool] = ..., traceparent: _Optional[str] = ..., no_decode_local: _Optional[bool] = ..., in_flight: _Optional[_Mapping[str, int]] = ..., counts_in_flight: _Optional[bool] = ..., router_id: _Optional[str] = ..., in_flight_tokens: _Optional[_Mapping[str, int]] = ..., pd_residual_s: _Optional[float] = ..., decode_local_residual_s: _Optional[float] = ..., pd_residual_by_engine: _Optional[_Mapping[str, float]] = ..., decode_local_residual_by_engine: _Optional[_Mapping[str, float]] = ...) -> None: ...

class CostEstimate(_message.Message):
    __slots__ = ("transfer_s", "recompute_s", "bandwidth_bytes_per_s", "prefill_tokens_per_s", "bytes_per_block", "measured", "decode_local_s", "prefill_local_s", "transfer_path_s", "recompute_path_s", "prefill_queue_s", "decode_stall_s", "pd_residual_s", "decode_local_residual_s")
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    DECODE_LOCAL_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCAL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_PATH_S_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_PATH_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STALL_S_FIELD_NUMBER: _ClassVar[int]
    PD_RESIDUAL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_LOCAL_RESIDUAL_S_FIELD_NUMBER: _ClassVar[int]
    transfer_s: float
    recompute_s: float
    bandwidth_bytes_per_s: float
    prefill_tokens_per_s: float
    bytes_per_block: int
    measured: bool
    decode_local_s: float
    prefill_local_s: float
    transfer_path_s: float
    recompute_path_s: float
    prefill_queue_s: float
    decode_stall_s: float
    pd_residual_s: float
    decode_local_residual_s: float
    def __init__(self, transfer_s: _Optional[float] = ..., recompute_s: _Optional[float] = ..., bandwidth_bytes_per_s: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., bytes_per_block: _Optional[int] = ..., measured: _Optional[bool] = ..., decode_local_s: _Optional[float] = ..., prefill_local_s: _Optional[float] = ..., transfer_path_s: _Optional[float] = ..., recompute_path_s: _Optional[float] = ..., prefill_queue_s: _Optional[float] = ..., decode_stall_s: _Optional[float] = ..., pd_residual_s: _Optional[float] = ..., decode_local_residual_s: _Optional[float] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("decision", "reason", "source_engine_id", "source_addresses", "source_lease_id", "source_block_ids", "matched_blocks", "matched_tokens", "recompute_tokens", "prompt_blocks", "threshold_tokens", "cost", "prefill_engine_id", "prefill_addresses", "decode_engine_id", "decode_addresses", "decode_sticky", "session_id", "candidates", "error", "pin", "local_tokens", "pull_tokens", "decode_local_veto", "cached_tokens_seen", "error_code", "source_tier", "session_drops_generated", "prefetch")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    DECODE_STICKY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_LOCAL_VETO_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_SEEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TIER_FIELD_NUMBER: _ClassVar[int]
    SESSION_DROPS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    reason: str
    source_engine_id: str
    source_addresses: EngineAddresses
    source_lease_id: str
    source_block_ids: _containers.RepeatedScalarFieldContainer[int]
    matched_blocks: int
    matched_tokens: int
    recompute_tokens: int
    prompt_blocks: int
    threshold_tokens: int
    cost: CostEstimate
    prefill_engine_id: str
    prefill_addresses: EngineAddresses
    decode_engine_id: str
    decode_addresses: EngineAddresses
    decode_sticky: bool
    session_id: str
    candidates: int
    error: str
    pin: PinBlocksResponse
    local_tokens: int
    pull_tokens: int
    decode_local_veto: str
    cached_tokens_seen: int
    error_code: int
    source_tier: Tier
    session_drops_generated: bool
    prefetch: str
    def __init__(self, decision: _Optional[_Union[Decision, str]] = ..., reason: _Optional[str] = ..., source_engine_id: _Optional[str] = ..., source_addresses: _Optional[_Union[EngineAddresses, _Mapping]] = ..., source_lease_id: _Optional[str] = ..., source_block_ids: _Optional[_Iterable[int]] = ..., matched_blocks: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., recompute_tokens: _Optional[int] = ..., prompt_blocks: _Optional[int] = ..., threshold_tokens: _Optional[int] = ..., cost: _Optional[_Union[CostEstimate, _Mapping]] = ..., prefill_engine_id: _Optional[str] = ..., prefill_addresses: _Optional[_Union[EngineAddresses, _Mapping]] = ..., decode_engine_id: _Optional[str] = ..., decode_addresses: _Optional[_Union[EngineAddresses, _Mapping]] = ..., decode_sticky: _Optional[bool] = ..., session_id: _Optional[str] = ..., candidates: _Optional[int] = ..., error: _Optional[str] = ..., pin: _Optional[_Union[PinBlocksResponse, _Mapping]] = ..., local_tokens: _Optional[int] = ..., pull_tokens: _Optional[int] = ..., decode_local_veto: _Optional[str] = ..., cached_tokens_seen: _Optional[int] = ..., error_code: _Optional[int] = ..., source_tier: _Optional[_Union[Tier, str]] = ..., session_drops_generated: _Optional[bool] = ..., prefetch: _Optional[str] = ...) -> None: ...

class PlaceBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[PlaceRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[PlaceRequest, _Mapping]]] = ...) -> None: ...

class PlanBatch(_message.Message):
    __slots__ = ("plans",)
    PLANS_FIELD_NUMBER: _ClassVar[int]
    plans: _containers.RepeatedCompositeFieldContainer[Plan]
    def __init__(self, plans: _Optional[_Iterable[_Union[Plan, _Mapping]]] = ...) -> None: ...

class CacheEventBatch(_message.Message):
    __slots__ = ("engine_id", "incarnation", "seq", "reset", "cleared", "stored_keys", "removed_keys")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    STORED_KEYS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEYS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    incarnation: str
    seq: int
    reset: bool
    cleared: bool
    stored_keys: _containers.RepeatedScalarFieldContainer[bytes]
    removed_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, engine_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., seq: _Optional[int] = ..., reset: _Optional[bool] = ..., cleared: _Optional[bool] = ..., stored_keys: _Optional[_Iterable[bytes]] = ..., removed_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CacheEventAck(_message.Message):
    __slots__ = ("reset", "cached_blocks", "expected_seq")
    RESET_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    cached_blocks: int
    expected_seq: int
    def __init__(self, reset: _Optional[bool] = ..., cached_blocks: _Optional[int] = ..., expected_seq: _Optional[int] = ...) -> None: ...

class WatchEvictionsRequest(_message.Message):
    __slots__ = ("engine_id", "after_seq")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    after_seq: int
    def __init__(self, engine_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("engine", "load", "retained_blocks", "leases", "last_seen_unix", "last_eviction_seq", "cached_blocks", "cache_resets")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_EVICTION_SEQ_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_RESETS_FIELD_NUMBER: _ClassVar[int]
    engine: Engine
    load: EngineLoad
    retained_blocks: int
    leases: int
    last_seen_unix: float
    last_eviction_seq: int
    cached_blocks: int
    cache_resets: int
    def __init__(self, engine: _Optional[_Union[Engine, _Mapping]] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., retained_blocks: _Optional[int] = ..., leases: _Optional[int] = ..., last_seen_unix: _Optional[float] = ..., last_eviction_seq: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., cache_resets: _Optional[int] = ...) -> None: ...

class Pin(_message.Message):
    __slots__ = ("pin_id", "lease_id", "reader_engine_id", "num_blocks", "expires_at_unix")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    READER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    lease_id: str
    reader_engine_id: str
    num_blocks: int
    expires_at_unix: float
    def __init__(self, pin_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., reader_engine_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., expires_at_unix: _Optional[float] = ...) -> None: ...

class InspectResponse(_message.Message):
    __slots__ = ("engines", "leases", "pins", "store", "replica_id", "leader", "now_unix")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    NOW_UNIX_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    pins: _containers.RepeatedCompositeFieldContainer[Pin]
    store: str
    replica_id: str
    leader: bool
    now_unix: float
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., pins: _Optional[_Iterable[_Union[Pin, _Mapping]]] = ..., store: _Optional[str] = ..., replica_id: _Optional[str] = ..., leader: _Optional[bool] = ..., now_unix: _Optional[float] = ...) -> None: ...

class HintSessionRequest(_message.Message):
    __slots__ = ("session_id", "owner", "pause_s", "end", "priority", "keep_generated")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    KEEP_GENERATED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    owner: str
    pause_s: float
    end: bool
    priority: SessionPriority
    keep_generated: bool
    def __init__(self, session_id: _Optional[str] = ..., owner: _Optional[str] = ..., pause_s: _Optional[float] = ..., end: _Optional[bool] = ..., priority: _Optional[_Union[SessionPriority, str]] = ..., keep_generated: _Optional[bool] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id", "owner")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    owner: str
    def __init__(self, session_id: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class SessionState(_message.Message):
    __slots__ = ("session_id", "priority", "resume_at_unix", "hold_until_unix", "ended_at_unix", "leases", "blocks", "host_blocks", "pause_granted_s", "refused", "released_leases", "known", "drops_generated")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESUME_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    HOLD_UNTIL_UNIX_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_GRANTED_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_LEASES_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    DROPS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    priority: SessionPriority
    resume_at_unix: float
    hold_until_unix: float
    ended_at_unix: float
    leases: int
    blocks: int
    host_blocks: int
    pause_granted_s: float
    refused: _containers.RepeatedScalarFieldContainer[str]
    released_leases: int
    known: bool
    drops_generated: bool
    def __init__(self, session_id: _Optional[str] = ..., priority: _Optional[_Union[SessionPriority, str]] = ..., resume_at_unix: _Optional[float] = ..., hold_until_unix: _Optional[float] = ..., ended_at_unix: _Optional[float] = ..., leases: _Optional[int] = ..., blocks: _Optional[int] = ..., host_blocks: _Optional[int] = ..., pause_granted_s: _Optional[float] = ..., refused: _Optional[_Iterable[str]] = ..., released_leases: _Optional[int] = ..., known: _Optional[bool] = ..., drops_generated: _Optional[bool] = ...) -> None: ...
