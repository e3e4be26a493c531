"""The soft index (broker/core/soft_index.py) against a plain model, and BrokerState's checks and hooks around it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvloop.broker.core import (
    BrokerState,
    EngineInfo,
    Limits,
    LruPolicy,
    PlaceInput,
    ResetReason,
    Role,
    SoftAck,
    SoftIndex,
)
from kvloop.shared.errors import FailedPrecondition, InvalidArgument, NotFound
from kvloop.shared.hashing import ExtraKeys, block_keys

PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXTRA = ExtraKeys("soft-fp")
# Chained keys of two token paths that share their first two blocks: prefixes and near misses.
PATH_A = block_keys([1, 2, 3, 4, 5, 6], 1, EXTRA)
PATH_B = block_keys([1, 2, 7, 8], 1, EXTRA)
POOL = list(dict.fromkeys([*PATH_A, *PATH_B]))


@dataclass
class ModelEngine:
    """What the index should hold, the plain way: a list, oldest-stored first."""

    incarnation: str
    expected: int = 1
    started: bool = False
    resets: int = 0
    keys: list[bytes] = field(default_factory=list)


batch_st = st.fixed_dictionaries({
    "engine": st.sampled_from(["e0", "e1"]),
    "incarnation": st.sampled_from(["i1", "i1", "i1", "i2"]),
    "seq_shift": st.sampled_from([0, 0, 0, 0, 1, -1, 5]),  # 0: the expected seq; else a gap
    "reset": st.booleans(),
    "cleared": st.sampled_from([False, False, False, True]),
    "stored": st.lists(st.sampled_from(POOL), max_size=6),
    "removed": st.lists(st.sampled_from(POOL), max_size=3),
})


@PROPS
@given(st.lists(batch_st, max_size=40), st.integers(1, 6), st.lists(st.sampled_from([PATH_A, PATH_B]), min_size=1))
def test_matches_a_plain_model(batches: list[dict[str, Any]], cap: int, queries: list[list[bytes]]) -> None:
    index = SoftIndex(cap)
    model: dict[str, ModelEngine] = {}
    for b in batches:
        eng = model.setdefault(b["engine"], ModelEngine(b["incarnation"]))
        seq = max(1, eng.expected + b["seq_shift"])
        ack = index.apply(b["engine"], b["incarnation"], seq, reset=b["reset"], cleared=b["cleared"],
                          stored=b["stored"], removed=b["removed"])
        reason = (ResetReason.INCARNATION if b["incarnation"] != eng.incarnation
                  else ResetReason.REQUESTED if b["reset"]
                  else ResetReason.GAP if seq != eng.expected else None)
        assert ack.reset == (reason is not None) and ack.reason == reason
        assert ack.counted == (reason is not None and (eng.started or reason is not ResetReason.REQUESTED))
        if reason is not None or b["cleared"]:
            eng.keys = []
        eng.incarnation, eng.resets = b["incarnation"], eng.resets + int(ack.counted)
        for key in b["stored"]:
            if key in eng.keys:
                eng.keys.remove(key)
            eng.keys.append(key)
        eng.keys = [k for k in eng.keys if k not in b["removed"]]
        dropped = max(0, len(eng.keys) - cap)
        eng.keys = eng.keys[dropped:]
        eng.expected, eng.started = seq + 1, True

        assert ack.dropped == dropped and ack.expected_seq == seq + 1
        assert index.keys(b["engine"]) == eng.keys
        assert ack.cached_blocks == len(eng.keys) <= cap
    for eid in ("e0", "e1", "ghost"):
        eng = model.get(eid, ModelEngine(""))
        assert index.resets(eid) == eng.resets and index.cached_blocks(eid) == len(eng.keys)
        for query in queries:
            leading = 0
            while leading < len(query) and query[leading] in eng.keys:
                leading += 1
            assert index.cached_prefix(eid, query) == leading
    for query in queries:  # the walk over the key-to-engines map agrees with every engine's own answer
        assert index.prefixes(query) == {e: n for e in ("e0", "e1") if (n := index.cached_prefix(e, query))}
    for eid in ("e0", "e1"):
        index.drop(eid)
    assert index.prefixes(PATH_A) == {} and len(index._holders) == 0  # nothing left behind


def test_reset_rules_one_by_one() -> None:
    index = SoftIndex(100)
    first = index.apply("e", "i1", 1, reset=True, cleared=False, stored=PATH_A[:3], removed=[])
    assert first.reset and not first.counted and first.cached_blocks == 3  # the stream's first batch: nothing lost
    assert not index.apply("e", "i1", 2, reset=False, cleared=False, stored=PATH_A[3:4], removed=[]).reset
    gap = index.apply("e", "i1", 4, reset=False, cleared=False, stored=PATH_B[:1], removed=[])
    assert gap.reset and gap.counted and gap.reason is ResetReason.GAP and index.keys("e") == PATH_B[:1]
    asked = index.apply("e", "i1", 5, reset=True, cleared=False, stored=[], removed=[])
    assert asked.counted and asked.reason is ResetReason.REQUESTED and asked.cached_blocks == 0
    index.apply("e", "i1", 6, reset=False, cleared=False, stored=PATH_A, removed=[])
    restarted = index.apply("e", "i2", 7, reset=False, cleared=False, stored=[], removed=[])
    assert restarted.reason is ResetReason.INCARNATION and restarted.cached_blocks == 0
    assert index.resets("e") == 3
    cleared = index.apply("e", "i2", 8, reset=False, cleared=True, stored=PATH_B[:2], removed=[])
    assert not cleared.reset and index.keys("e") == PATH_B[:2] and index.resets("e") == 3
    assert index.cached_prefix("e", PATH_A) == 2 and index.cached_prefix("e", PATH_A[2:]) == 0
    index.drop("e")
    assert index.cached_blocks("e") == 0 and index.resets("e") == 0


def test_cap_drops_the_oldest_stored_first() -> None:
    index = SoftIndex(3)
    index.apply("e", "i", 1, reset=False, cleared=False, stored=PATH_A[:3], removed=[])
    index.apply("e", "i", 2, reset=False, cleared=False, stored=[PATH_A[0]], removed=[])  # stored again: newest
    ack = index.apply("e", "i", 3, reset=False, cleared=False, stored=[PATH_A[3]], removed=[])
    assert ack.dropped == 1 and index.keys("e") == [PATH_A[2], PATH_A[0], PATH_A[3]]
    assert index.cached_prefix("e", PATH_A) == 1  # the run stops at the dropped second block


# ---------------------------------------------------------------------------------------- BrokerState around it

def engine(eid: str, incarnation: str = "i1", fp: str = "soft-fp", bs: int = 1) -> EngineInfo:
    return EngineInfo(eid, Role.BOTH, bs, fp, 100, incarnation=incarnation)


def report(state: BrokerState, eid: str, seq: int, stored: list[bytes], incarnation: str = "i1", *,
           removed: list[bytes] | None = None) -> SoftAck:
    return state.report_cache_events(eid, incarnation, seq, reset=False, cleared=False, stored=stored,
                                     removed=removed or [])


def test_state_checks_name_the_field() -> None:
    state = BrokerState(LruPolicy(), limits=Limits(max_cache_event_keys=4))
    state.register(engine("e"), 0.0)
    state.take_changes()
    with pytest.raises(NotFound, match=r"^engine_id"):
        report(state, "ghost", 1, [])
    with pytest.raises(FailedPrecondition, match=r"^incarnation"):
        report(state, "e", 1, [], incarnation="i0")
    with pytest.raises(InvalidArgument, match=r"^seq"):
        report(state, "e", 0, [])
    with pytest.raises(InvalidArgument, match=r"^stored_keys\[1\]"):
        report(state, "e", 1, [PATH_A[0], b"short"])
    with pytest.raises(InvalidArgument, match=r"^stored_keys"):
        report(state, "e", 1, PATH_A[:5])
    with pytest.raises(InvalidArgument, match=r"^removed_keys"):
        report(state, "e", 1, [], removed=PATH_A[:5])
    assert state.soft.cached_blocks("e") == 0 and not state.take_changes()


def test_state_drops_the_index_with_the_engine_and_persists_nothing() -> None:
    state = BrokerState(LruPolicy(), limits=Limits(engine_ttl_s=5.0))
    for eid in ("a", "b", "c"):
        state.register(engine(eid), 0.0)
    state.take_changes()
    for eid in ("a", "b", "c"):
        report(state, eid, 1, PATH_A[:3])
    assert not state.take_changes()  # the soft index is never written to a store
    state.register(engine("a", incarnation="i2"), 1.0)  # a restart: its cache is gone
    state.deregister("b", 1.0)
    state.register(engine("c"), 1.0)  # the same incarnation again: a reconnect keeps it
    assert [state.soft.cached_blocks(e) for e in ("a", "b", "c")] == [0, 0, 3]
    state.tick(10.0)  # c went silent
    assert "c" not in state.engines and state.soft.cached_blocks("c") == 0


def test_cached_prefixes_for_placement() -> None:
    state = BrokerState(LruPolicy())
    state.register(engine("a"), 0.0)
    state.register(engine("b"), 0.0)
    state.register(engine("other-layout", fp="fp-2"), 0.0)
    state.register(engine("none"), 0.0)
    report(state, "a", 1, PATH_A[:4])
    report(state, "b", 1, [*PATH_B[:2], *PATH_A[3:]])  # holds later blocks of A but not its third
    report(state, "other-layout", 1, PATH_A)
    request = PlaceInput(keys=PATH_A, num_tokens=len(PATH_A) + 1, layout_fingerprint="soft-fp", block_size=1)
    assert state.cached_prefixes(request) == {"a": 4, "b": 2}
    assert state.cached_prefixes(PlaceInput(keys=[], num_tokens=3, layout_fingerprint="soft-fp", block_size=1)) == {}
    wrong_size = PlaceInput(keys=PATH_A, num_tokens=20, layout_fingerprint="soft-fp", block_size=2)
    assert state.cached_prefixes(wrong_size) == {}
