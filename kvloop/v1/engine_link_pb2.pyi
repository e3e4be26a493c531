from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConnectorHello(_message.Message):
    __slots__ = ("engine_id", "incarnation", "block_size", "num_blocks", "bytes_per_block", "kv_role_decode", "host_tier_blocks", "host_tier_first_id", "step_tokens")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_ROLE_DECODE_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_FIRST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    incarnation: str
    block_size: int
    num_blocks: int
    bytes_per_block: int
    kv_role_decode: bool
    host_tier_blocks: int
    host_tier_first_id: int
    step_tokens: int
    def __init__(self, engine_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., kv_role_decode: _Optional[bool] = ..., host_tier_blocks: _Optional[int] = ..., host_tier_first_id: _Optional[int] = ..., step_tokens: _Optional[int] = ...) -> None: ...

class Retained(_message.Message):
    __slots__ = ("request_id", "token_ids", "block_ids", "session_id", "hold_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    session_id: str
    hold_s: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., session_id: _Optional[str] = ..., hold_s: _Optional[float] = ...) -> None: ...

class Freed(_message.Message):
    __slots__ = ("request_id", "why")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    why: str
    def __init__(self, request_id: _Optional[str] = ..., why: _Optional[str] = ...) -> None: ...

class Demoted(_message.Message):
    __slots__ = ("request_id", "ok")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ok: bool
    def __init__(self, request_id: _Optional[str] = ..., ok: _Optional[bool] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("request_id", "computed_tokens", "compute_s", "pulled_blocks", "pulled_bytes", "pull_s", "pull_failed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    PULLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PULLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PULL_S_FIELD_NUMBER: _ClassVar[int]
    PULL_FAILED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    computed_tokens: int
    compute_s: float
    pulled_blocks: int
    pulled_bytes: int
    pull_s: float
    pull_failed: bool
    def __init__(self, request_id: _Optional[str] = ..., computed_tokens: _Optional[int] = ..., compute_s: _Optional[float] = ..., pulled_blocks: _Optional[int] = ..., pulled_bytes: _Optional[int] = ..., pull_s: _Optional[float] = ..., pull_failed: _Optional[bool] = ...) -> None: ...

class ConnectorEvent(_message.Message):
    __slots__ = ("hello", "retained", "freed", "prefill_done", "demoted")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_FIELD_NUMBER: _ClassVar[int]
    hello: ConnectorHello
    retained: Retained
    freed: Freed
    prefill_done: PrefillDone
    demoted: Demoted
    def __init__(self, hello: _Optional[_Union[ConnectorHello, _Mapping]] = ..., retained: _Optional[_Union[Retained, _Mapping]] = ..., freed: _Optional[_Union[Freed, _Mapping]] = ..., prefill_done: _Optional[_Union[PrefillDone, _Mapping]] = ..., demoted: _Optional[_Union[Demoted, _Mapping]] = ...) -> None: ...

class ConnectorCommand(_message.Message):
    __slots__ = ("release_request_ids", "hold_request_ids", "hold_s", "demote")
    RELEASE_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    HOLD_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    DEMOTE_FIELD_NUMBER: _ClassVar[int]
    release_request_ids: _containers.RepeatedScalarFieldContainer[str]
    hold_request_ids: _containers.RepeatedScalarFieldContainer[str]
    hold_s: float
    demote: _containers.RepeatedCompositeFieldContainer[Demotion]
    def __init__(self, release_request_ids: _Optional[_Iterable[str]] = ..., hold_request_ids: _Optional[_Iterable[str]] = ..., hold_s: _Optional[float] = ..., demote: _Optional[_Iterable[_Union[Demotion, _Mapping]]] = ...) -> None: ...

class Demotion(_message.Message):
    __slots__ = ("request_id", "to_block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TO_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    to_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., to_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...
