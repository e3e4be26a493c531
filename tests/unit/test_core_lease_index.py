"""Properties of the broker core's lease index (broker/core/lease_index.py), against a walk over every lease: the
longest usable match, what a publication supersedes, and the session's latest engine, as leases come and go."""

from __future__ import annotations

from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.broker.core import EvictionReason, Lease
from kvloop.broker.core.lease_index import LeaseIndex
from kvloop.shared.hashing import ExtraKeys, block_keys, common_prefix_blocks

PROPS = settings(max_examples=100, deadline=None)
EXTRA = ExtraKeys("fp")


@cache
def chain(path: tuple[int, ...]) -> tuple[bytes, ...]:
    return tuple(block_keys(list(path), 1, EXTRA))


paths = st.lists(st.integers(0, 1), min_size=1, max_size=5).map(tuple)
ops = st.lists(st.tuples(st.booleans(), st.integers(0, 7), paths, st.sampled_from(["e0", "e1"]),
                         st.sampled_from(["", "s0", "s1"]), st.booleans()), max_size=30)


@PROPS
@given(ops, paths, st.integers(0, 6), st.sampled_from(["", "s0", "s1"]))
def test_the_index_agrees_with_a_walk_over_every_lease(steps: list[tuple], query: tuple[int, ...], usable: int,
                                                       session: str) -> None:
    index, leases = LeaseIndex(), {}
    for t, (add, n, path, engine, sess, evicting) in enumerate(steps):
        lid = f"l{n}"
        if lid in leases:
            index.remove(leases.pop(lid))
        if add:
            leases[lid] = Lease(lid, engine, sess, chain(path), tuple(range(len(path))), len(path), 1.0, 1.0,
                                float(t), 0.0, pending=EvictionReason.BUDGET if evicting else None)
            index.add(leases[lid])
    keys = chain(query)

    def eligible(lease: Lease) -> bool:
        return lease.engine_id == "e0"

    depth = {lid: common_prefix_blocks(x.keys, keys) for lid, x in leases.items() if eligible(x)}
    best = max(depth.values(), default=0)
    got = {(m.lease.lease_id, m.blocks) for m in index.matches(keys, usable, leases, eligible)}
    if best == 0:
        assert got == set()
    else:
        cut = usable if 0 < usable < best else best
        assert got == {(lid, cut) for lid, d in depth.items() if d >= cut}
    assert {x.lease_id for x in index.superseded(keys, "e1", leases)} == {
        lid for lid, x in leases.items()
        if x.engine_id == "e1" and x.pending is None and keys[:len(x.keys)] == x.keys}
    mine = [x for x in leases.values() if session and x.session_id == session]
    assert index.session_engine(session, leases) == (max(mine, key=lambda x: x.last_used).engine_id if mine else "")
