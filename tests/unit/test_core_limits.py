"""Properties of the broker core's request checks (broker/core/limits.py): a value is accepted exactly when it is
within its bound, and a refusal names the field to fix."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.broker.core import Addresses, EngineInfo, EngineRecord, Limits, Role
from kvloop.broker.core.limits import check_engine_info, check_publish, check_ttl
from kvloop.shared.errors import InvalidArgument, KvloopError, ResourceExhausted
from kvloop.shared.hashing import KEY_BYTES

PROPS = settings(max_examples=100, deadline=None)
LIM = Limits(max_block_size=64, max_block_keys=8)


def info(block_size: int = 4, budget: int = 8, grpc: str = "") -> EngineInfo:
    return EngineInfo("e", Role.BOTH, block_size, "fp", budget, Addresses(grpc=grpc))


@PROPS
@given(st.one_of(st.just(0.0), st.floats(allow_nan=True, allow_infinity=True)))
def test_a_ttl_is_its_default_within_bounds_or_refused(ttl: float) -> None:
    if ttl == 0:
        assert check_ttl(ttl, LIM) == LIM.default_ttl_s
    elif LIM.min_ttl_s <= ttl <= LIM.max_ttl_s:
        assert check_ttl(ttl, LIM) == ttl
    else:
        with pytest.raises(InvalidArgument) as err:
            check_ttl(ttl, LIM)
        assert err.value.field == "ttl_s" and (math.isnan(ttl) or str(ttl) in str(err.value))


@PROPS
@given(st.integers(-4, 100), st.integers(0, 70_000))
def test_a_registration_is_refused_exactly_for_the_field_out_of_bounds(block_size: int, port: int) -> None:
    fine_size, fine_port = 0 < block_size <= LIM.max_block_size, 0 < port <= 65535
    try:
        check_engine_info(info(block_size, grpc=f"host:{port}"), LIM)
        refused = ""
    except InvalidArgument as err:
        refused = err.field
    assert refused == ("" if fine_size and fine_port else
                       "engine.block_size" if not fine_size else "engine.addresses.grpc")


@PROPS
@given(n=st.integers(1, 10), bs=st.integers(1, 4), extra=st.integers(-1, 4), budget=st.integers(0, 10),
       ids=st.lists(st.integers(-1, 12), min_size=1, max_size=10))
def test_a_publication_passes_only_whole_blocks_distinct_ids_and_its_budget(n: int, bs: int, extra: int, budget: int,
                                                                          ids: list[int]) -> None:
    rec = EngineRecord(info(bs, budget), 0.0, 0.0)
    keys, block_ids = [bytes(KEY_BYTES)] * n, ids[:n]
    tokens = n * bs + extra
    expected = ("block_keys" if n > LIM.max_block_keys else
                "block_ids" if len(block_ids) != n or min(block_ids) < 0 or len(set(block_ids)) != n else
                "num_tokens" if not 0 <= extra < bs else
                "block_ids" if n > budget else "")
    if not expected:
        assert check_publish(rec, "s", keys, block_ids, tokens, 0.0, LIM) == LIM.default_ttl_s
        return
    with pytest.raises((InvalidArgument, ResourceExhausted)) as err:
        check_publish(rec, "s", keys, block_ids, tokens, 0.0, LIM)
    assert isinstance(err.value, KvloopError) and err.value.field == expected
