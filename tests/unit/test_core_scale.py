"""Placement at fleet scale: ``BrokerState.place`` prices the prefix's holders and the least loaded few, found through
the key-to-holders index and the fleet's load orders; here it is checked against the whole-fleet computation (every
live engine priced, each engine's prefix cache asked in turn) as the oracle, on random fleets of alike engines."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvloop.broker.core import (
    BrokerState,
    EngineInfo,
    EngineLoad,
    LruPolicy,
    PlaceInput,
    PlacementPolicy,
    Plan,
    Role,
    place,
)
from kvloop.broker.core.fleet import Ranking
from kvloop.shared.hashing import ExtraKeys, block_keys

PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LAYOUTS = (("fpA", 1), ("fpB", 1))
PATHS = [(1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 9, 9, 9), (5, 5, 5, 5, 5), tuple(range(20, 40))]


def chain(path: tuple[int, ...], fp: str) -> list[bytes]:
    return block_keys(list(path), 1, ExtraKeys(fp))


def oracle(state: BrokerState, request: PlaceInput, now: float) -> Plan:
    """The whole fleet priced: every live engine with its placed load, every engine's cache asked in turn."""
    matches, session_engine = state.lease_matches(request)
    return place(request, state.engines_as_placed(now), matches, state.placement_policy, session_engine,
                 cached=state.cached_prefixes(request))


engine_st = st.tuples(st.sampled_from([Role.PREFILL, Role.DECODE, Role.BOTH]), st.sampled_from(range(len(LAYOUTS))),
                      st.integers(0, 4), st.integers(0, 2), st.sampled_from([0.0, 0.25, 0.5, 0.5, 1.0]),
                      st.booleans())
op_st = st.one_of(
    st.tuples(st.just("publish"), st.integers(0, 30), st.sampled_from(range(len(PATHS))), st.integers(2, 20),
              st.sampled_from(["", "s1", "s2"])),
    st.tuples(st.just("cache"), st.integers(0, 30), st.sampled_from(range(len(PATHS))), st.integers(1, 20)),
    st.tuples(st.just("load"), st.integers(0, 30), st.integers(0, 6), st.sampled_from([0.0, 0.5, 1.0])),
    st.tuples(st.just("in_flight"), st.sampled_from(["r1", "r2"]),
              st.dictionaries(st.integers(0, 30), st.integers(0, 3), max_size=4),
              st.dictionaries(st.integers(0, 30), st.integers(0, 400), max_size=3)),
    st.tuples(st.just("drop"), st.integers(0, 30)),
)


@PROPS
@given(st.lists(engine_st, min_size=2, max_size=14), st.lists(op_st, max_size=25), st.integers(1, 3),
       st.lists(st.tuples(st.sampled_from(range(len(PATHS))), st.integers(1, 25), st.sampled_from(["", "s1", "s2"]),
                          st.booleans(), st.sampled_from(range(len(LAYOUTS)))), min_size=1, max_size=4))
def test_placement_over_the_index_equals_the_whole_fleet(engines: list[tuple[Any, ...]], ops: list[tuple[Any, ...]],
                                                         k: int, queries: list[tuple[Any, ...]]) -> None:
    state = BrokerState(LruPolicy(), PlacementPolicy(least_loaded_candidates=k, threshold_tokens=2))
    ids: list[str] = []
    # Alike engines: one prefill rate where reported, one transfer rate (the pull's price is the same from each).
    for i, (role, layout, running, waiting, kv, reports_rate) in enumerate(engines):
        fp, bs = LAYOUTS[layout]
        eid = f"e{i:02d}"
        state.register(EngineInfo(eid, role, bs, fp, 1000, incarnation="i"), 0.0)
        state.keepalive(eid, EngineLoad(running, waiting, kv, prefill_tokens_per_s=4000.0 if reports_rate else 0.0,
                                        transfer_bytes_per_s=1e9, bytes_per_block=4096), 0.0)
        ids.append(eid)
    now, seqs, block = 1.0, dict.fromkeys(ids, 0), itertools.count()
    for op in ops:
        eid = ids[op[1] % len(ids)] if op[0] != "in_flight" else ""
        if eid and eid not in state.engines:
            continue
        if op[0] == "publish":
            rec = state.engines[eid]
            keys = chain(PATHS[op[2]], rec.info.layout_fingerprint)[: op[3]]
            if rec.info.role.can_decode:
                state.publish(eid, op[4], keys, [next(block) for _ in keys], len(keys), 0, now)
        elif op[0] == "cache":
            keys = chain(PATHS[op[2]], state.engines[eid].info.layout_fingerprint)[: op[3]]
            seqs[eid] += 1
            state.report_cache_events(eid, "i", seqs[eid], reset=False, cleared=False, stored=keys, removed=[])
        elif op[0] == "load":
            old = state.engines[eid].load
            state.keepalive(eid, EngineLoad(op[2], 0, op[3], prefill_tokens_per_s=old.prefill_tokens_per_s,
                                            transfer_bytes_per_s=1e9, bytes_per_block=4096), now)
        elif op[0] == "in_flight":
            state.report_in_flight(op[1], {ids[e % len(ids)]: n for e, n in op[2].items()}, now,
                                   {ids[e % len(ids)]: n for e, n in op[3].items()})
        elif op[0] == "drop":
            state.deregister(eid, now)
        now += 0.5
    for path, n, session, decode_local, layout in queries:
        fp, bs = LAYOUTS[layout]
        keys = chain(PATHS[path], fp)[:n]
        request = PlaceInput(keys, len(keys) * bs + 1, fp, bs, session, decode_local)
        try:
            want = oracle(state, request, now)
        except Exception as exc:  # no live engine of a role: both must refuse alike
            try:
                state.place(request, now)
            except type(exc) as got:
                assert str(got) == str(exc)
                continue
            raise AssertionError(f"the whole fleet refused ({exc}); the index placed") from None
        assert state.place(request, now) == want


@given(st.lists(st.tuples(st.integers(0, 9), st.sampled_from([0.0, 0.5, 1.0, 2.0])), max_size=60))
def test_a_ranking_stays_ordered_as_keys_change(moves: list[tuple[int, float]]) -> None:
    ranking, model = Ranking(), {}
    for i, key in moves:
        if key == 2.0:
            ranking.discard(f"e{i}")
            model.pop(f"e{i}", None)
        else:
            ranking.set(f"e{i}", key)
            model[f"e{i}"] = key
    assert list(ranking.ids()) == [e for _, e in sorted((v, e) for e, v in model.items())]
    assert ranking.first(2, lambda e: e.endswith("1")) == [e for _, e in sorted(
        (v, e) for e, v in model.items() if not e.endswith("1"))][:2]


def test_leases_on_different_engines_share_one_int_per_block_id() -> None:
    """The pool's ids repeat across engines; each value is kept once (broker memory per retained block)."""
    state = BrokerState(LruPolicy())
    for eid in ("d1", "d2"):
        state.register(EngineInfo(eid, Role.DECODE, 1, "fpA", 64), 0.0)
    # int(str) builds a fresh object each time: equal values, different objects, as two requests' ids arrive.
    first = state.publish("d1", "s1", chain((1, 2, 3), "fpA"), [int("1000"), int("1001"), int("1002")], 3, 0, 0.0)
    second = state.publish("d2", "s2", chain((4, 5, 6), "fpA"), [int("1000"), int("1001"), int("1002")], 3, 0, 0.0)
    a, b = state.leases[first[0].lease_id], state.leases[second[0].lease_id]
    assert a.block_ids == b.block_ids == (1000, 1001, 1002)
    assert all(x is y for x, y in zip(a.block_ids, b.block_ids, strict=True))


@PROPS
@given(st.lists(st.tuples(st.booleans(), st.sets(st.sampled_from([0, 1, 7, 8, 9, 63, 64, 200, 1023, 1024, 5000]),
                                                  max_size=6)), max_size=40))
def test_block_refs_count_as_a_counter_does(ops: list[tuple[bool, set[int]]]) -> None:
    """BlockRefs (a bitmap for blocks held once, a dict past that or past its limit) against a Counter as the oracle;
    the limit of 1,024 puts some ids in the dict alone."""
    from collections import Counter

    from kvloop.broker.core.holders import BlockRefs

    refs, oracle = BlockRefs(limit=1024), Counter[int]()
    for hold, blocks in ops:
        if hold:
            refs.hold(blocks)
            oracle.update(blocks)
        else:
            refs.release(blocks)
            oracle.subtract(blocks)
            oracle = Counter({b: n for b, n in oracle.items() if n > 0})
        assert len(refs) == len(oracle)
        for block in (0, 1, 7, 8, 9, 63, 64, 200, 1023, 1024, 5000, 10**9):
            assert refs[block] == refs.get(block, 0) == oracle[block]
