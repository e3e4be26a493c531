"""The bounds on what the broker accepts, and the checks that hold each request to them. Every error names the field
to fix, so a caller can tell which of its values was refused."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvloop.broker.core.model import EngineInfo, EngineLoad, EngineRecord
from kvloop.broker.core.placement import PlaceInput
from kvloop.shared.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvloop.shared.hashing import KEY_BYTES


@dataclass(frozen=True, slots=True)
class Limits:
    max_block_keys: int = 8192
    min_ttl_s: float = 1.0
    max_ttl_s: float = 86400.0
    default_ttl_s: float = 480.0
    default_pin_timeout_s: float = 10.0
    max_pin_timeout_s: float = 120.0
    engine_ttl_s: float = 10.0
    max_id_len: int = 256
    eviction_log_size: int = 4096
    soft_index_max_blocks: int = 65536
    max_cache_event_keys: int = 4096
    # What a registration may claim. Generous for any real engine; a value past them is a bug or a forgery, and
    # one accepted engine's layout or rates otherwise steer every placement (block sizes multiply into token
    # counts, a budget into eviction arithmetic, a rate into every cost estimate).
    max_block_size: int = 4096
    max_retention_budget_blocks: int = 1 << 24
    max_prefill_tokens_per_s: float = 1e8
    max_transfer_bytes_per_s: float = 1e13
    max_host_tier_blocks: int = 1 << 26
    max_step_tokens: int = 1 << 24
    max_residual_s: float = 60.0
    """Largest measured residual a Place may carry, either sign (a router's median of seconds to first token): the
    wire's ``kvloop.shared.protocol.MAX_RESIDUAL_S``, which routers clamp to (the core imports no protocol module;
    tests/unit/test_residuals.py holds the two equal)."""
    host_ttl_s: float = 0.0
    """Retention TTL of a lease once demoted to a host tier (0: the lease's own TTL)."""
    demotion_timeout_s: float = 30.0
    """A demotion the engine has not reported in this long is dropped (its host slots freed); a promotion not
    reported in this long ends its pin, the lease staying on the host tier."""
    # Sessions (``broker.core.sessions``): what one caller's hints may hold.
    max_sessions: int = 100_000
    max_sessions_per_owner: int = 10_000
    max_high_sessions_per_owner: int = 64
    max_session_pause_s: float = 900.0
    """A longer pause is granted this long: a tool that takes longer is better served by recompute or the host tier
    than by a pool lease it holds for a quarter of an hour."""
    session_resume_margin_s: float = 30.0
    """A pause keeps the leases this long past the stated resume (an agent's estimate of its tool's time)."""
    session_idle_s: float = 480.0
    """A session not hinted for this long (after its pause) is forgotten, as a lease's default TTL."""
    session_end_memory_s: float = 60.0
    """An ended session is remembered this long, so its last turn's lease, published after the end, is freed."""
    session_prefetch_lead_s: float = 5.0
    """This long before a paused session's stated resume, its host-tier lease is promoted back into its decode
    engine's pool, in room its budget has free or leases lower in the eviction order hold (``broker.core.prefetch``);
    0: never."""


def check_id(value: str, name: str, limit: int, *, required: bool = True) -> None:
    if required and not value:
        raise InvalidArgument(f"{name}: must not be empty", field=name)
    if len(value) > limit:
        raise InvalidArgument(f"{name}: longer than {limit} characters", field=name)
    if not value.isprintable():
        raise InvalidArgument(f"{name}: must be printable text", field=name)


FINGERPRINT = re.compile(r"[A-Za-z0-9._:+-]{1,64}")
"""A token of at most 64 characters (``kvloop.shared.hashing.layout_fingerprint`` gives 24 hex digits). A made-up but
well-formed fingerprint cannot be told from a real one here; what keeps it from steering real turns is that the
router places each request with the layout of the engines serving its model, and mTLS on who may register."""
HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")
HTTP_URL = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(:[0-9]{1,5})?(/[\x21-\x7e]*)?")


def _check_address(value: str, name: str, pattern: re.Pattern[str], shape: str) -> None:
    if not value:
        return
    match = pattern.fullmatch(value)
    port = match and (match.group(2) or ":1").lstrip(":")
    if not match or not port or not 0 < int(port) <= 65535:
        raise InvalidArgument(f"{name}: expected {shape} (got {value[:80]!r})", field=name)


def check_engine_info(info: EngineInfo, lim: Limits) -> None:
    """A registration's bounds; every error names the field."""
    check_id(info.engine_id, "engine.engine_id", lim.max_id_len)
    check_id(info.incarnation, "engine.incarnation", lim.max_id_len, required=False)
    check_id(info.model, "engine.model", lim.max_id_len, required=False)
    if not FINGERPRINT.fullmatch(info.layout_fingerprint):
        raise InvalidArgument("engine.layout_fingerprint: expected 1 to 64 letters, digits or ._:+- "
                              f"(got {info.layout_fingerprint[:80]!r})",
                              field="engine.layout_fingerprint")
    if not 0 < info.block_size <= lim.max_block_size:
        raise InvalidArgument(f"engine.block_size: must be within 1..{lim.max_block_size} tokens",
                              field="engine.block_size")
    if not 0 <= info.retention_budget_blocks <= lim.max_retention_budget_blocks:
        raise InvalidArgument(f"engine.retention_budget_blocks: must be within 0..{lim.max_retention_budget_blocks}",
                              field="engine.retention_budget_blocks")
    if not 0 <= info.host_tier_blocks <= lim.max_host_tier_blocks:
        raise InvalidArgument(f"engine.host_tier_blocks: must be within 0..{lim.max_host_tier_blocks}",
                              field="engine.host_tier_blocks")
    if not 0 <= info.host_tier_first_id < 1 << 40:
        raise InvalidArgument("engine.host_tier_first_id: must be within 0..2^40-1", field="engine.host_tier_first_id")
    if not 0 <= info.step_tokens <= lim.max_step_tokens:
        raise InvalidArgument(f"engine.step_tokens: must be within 0..{lim.max_step_tokens}",
                              field="engine.step_tokens")
    _check_address(info.addresses.grpc, "engine.addresses.grpc", HOST_PORT, "host:port")
    _check_address(info.addresses.nixl, "engine.addresses.nixl", HOST_PORT, "host:port")
    _check_address(info.addresses.http, "engine.addresses.http", HTTP_URL, "an http(s)://host[:port] URL")


def check_same_engine(old: EngineInfo, info: EngineInfo) -> None:
    """A reconnect of a live incarnation may change its addresses and budgets, not what its blocks mean."""
    changed = ("engine.layout_fingerprint" if old.layout_fingerprint != info.layout_fingerprint
               else "engine.block_size" if old.block_size != info.block_size
               else "engine.role" if old.role != info.role
               else "engine.model" if old.model != info.model else "")
    if changed:
        raise FailedPrecondition(
            f"{changed}: engine {info.engine_id!r} is registered with role "
            f"{old.role.value}, fingerprint {old.layout_fingerprint!r} and block size "
            f"{old.block_size}; a live incarnation cannot change them",
            field=changed,
        )


def check_load(load: EngineLoad, lim: Limits) -> None:
    if not 0.0 <= load.kv_usage <= 1.0:
        raise InvalidArgument("load.kv_usage: must be within 0..1", field="load.kv_usage")
    for name, most in (("prefill_tokens_per_s", lim.max_prefill_tokens_per_s),
                       ("transfer_bytes_per_s", lim.max_transfer_bytes_per_s)):
        if not 0 <= getattr(load, name) <= most:  # NaN fails too: it would poison every cost estimate
            raise InvalidArgument(f"load.{name}: must be within 0..{most:g}", field=f"load.{name}")


def check_ttl(ttl_s: float, lim: Limits, name: str = "ttl_s") -> float:
    """The TTL to apply: ``ttl_s``, or the default for 0."""
    if ttl_s == 0:
        return lim.default_ttl_s
    if not lim.min_ttl_s <= ttl_s <= lim.max_ttl_s:
        raise InvalidArgument(f"{name}: {ttl_s} is outside {lim.min_ttl_s}..{lim.max_ttl_s} seconds", field=name)
    return ttl_s


def _check_key_bytes(keys: Sequence[bytes], name: str) -> None:
    for i, key in enumerate(keys):
        if len(key) != KEY_BYTES:
            raise InvalidArgument(f"{name}[{i}]: a block key is {KEY_BYTES} bytes, got {len(key)}", field=name)


def check_keys(keys: Sequence[bytes], lim: Limits, name: str = "block_keys") -> None:
    if not keys:
        raise InvalidArgument(f"{name}: must not be empty", field=name)
    if len(keys) > lim.max_block_keys:
        raise ResourceExhausted(f"{name}: {len(keys)} keys exceed the limit of {lim.max_block_keys}", field=name)
    _check_key_bytes(keys, name)


def check_publish(rec: EngineRecord, session_id: str, keys: Sequence[bytes], block_ids: Sequence[int],
                  num_tokens: int, ttl_s: float, lim: Limits) -> float:
    """A publication's bounds, for engine ``rec``; returns the TTL to apply."""
    check_id(session_id, "session_id", lim.max_id_len, required=False)
    check_keys(keys, lim)
    if len(block_ids) != len(keys):
        raise InvalidArgument(
            f"block_ids: {len(block_ids)} ids for {len(keys)} keys; give one id per key", field="block_ids"
        )
    if min(block_ids) < 0 or len(set(block_ids)) != len(block_ids):
        raise InvalidArgument("block_ids: ids must be non-negative and distinct", field="block_ids")
    bs = rec.info.block_size
    if not len(keys) * bs <= num_tokens < (len(keys) + 1) * bs:
        raise InvalidArgument(
            f"num_tokens: {num_tokens} tokens do not fit {len(keys)} full blocks of {bs}", field="num_tokens"
        )
    ttl = check_ttl(ttl_s, lim)
    budget = rec.info.retention_budget_blocks
    if len(block_ids) > budget:
        raise ResourceExhausted(
            f"block_ids: {len(block_ids)} blocks exceed engine {rec.info.engine_id!r}'s retention budget of {budget}",
            field="block_ids",
        )
    return ttl


def check_pull(nbytes: int, duration_s: float) -> None:
    """A completed pin's report of its pull."""
    if nbytes < 0 or duration_s < 0:
        name = "bytes" if nbytes < 0 else "duration_s"
        raise InvalidArgument(f"{name}: must not be negative", field=name)


def check_place(request: PlaceInput, lim: Limits) -> None:
    check_id(request.session_id, "session_id", lim.max_id_len, required=False)
    if request.keys:
        check_keys(request.keys, lim)
    if request.block_size <= 0:
        raise InvalidArgument("block_size: must be positive", field="block_size")
    if not len(request.keys) * request.block_size <= request.num_tokens:
        raise InvalidArgument(
            f"num_tokens: {request.num_tokens} tokens cannot hold {len(request.keys)} full blocks",
            field="num_tokens",
        )
    for name in ("pd_residual_s", "decode_local_residual_s"):
        check_residual(name, getattr(request, name), lim)
    for name in ("pd_residual_by_engine", "decode_local_residual_by_engine"):
        by_engine: Mapping[str, float] = getattr(request, name)
        if len(by_engine) > lim.max_block_keys:
            raise InvalidArgument(f"{name}: {len(by_engine)} engines, more than {lim.max_block_keys}", field=name)
        for engine_id, value in by_engine.items():
            check_id(engine_id, name, lim.max_id_len, required=True)
            check_residual(f"{name}[{engine_id}]", value, lim, field=name)


def check_residual(name: str, value: float, lim: Limits, field: str = "") -> None:
    if not math.isfinite(value) or abs(value) > lim.max_residual_s:
        raise InvalidArgument(f"{name}: {value} is not within +-{lim.max_residual_s} s", field=field or name)


def check_in_flight(router: str, tokens: Mapping[str, int], lim: Limits) -> None:
    """A router's in-flight report: no engine's tokens past ``max_block_keys`` blocks of the largest block size (no
    prompt is longer)."""
    check_id(router, "router_id", lim.max_id_len)
    most = lim.max_block_keys * 1024
    for engine_id, n in tokens.items():
        if n > most:
            raise InvalidArgument(f"in_flight_tokens[{engine_id!r}]: {n} tokens in flight exceed {most}",
                                  field="in_flight_tokens")


def check_cache_events(rec: EngineRecord, incarnation: str, seq: int, stored: Sequence[bytes],
                       removed: Sequence[bytes], lim: Limits) -> None:
    """A batch of engine ``rec``'s prefix-cache events: from its live incarnation, numbered, of bounded size."""
    if incarnation != rec.info.incarnation:
        raise FailedPrecondition(
            f"incarnation: engine {rec.info.engine_id!r} is registered with incarnation {rec.info.incarnation!r}, "
            f"not {incarnation!r}; register the new incarnation first", field="incarnation")
    if seq < 1:
        raise InvalidArgument("seq: batches are numbered from 1", field="seq")
    for keys, name in ((stored, "stored_keys"), (removed, "removed_keys")):
        if len(keys) > lim.max_cache_event_keys:
            raise InvalidArgument(
                f"{name}: {len(keys)} keys exceed the limit of {lim.max_cache_event_keys} per batch; "
                "send more batches", field=name)
        _check_key_bytes(keys, name)
