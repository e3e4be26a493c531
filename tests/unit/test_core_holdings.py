"""Properties of the broker core's per-engine holdings (broker/core/holdings.py): pool blocks are counted once however
many leases share them, host slots are the union of the host leases' slots, and a demotion's slots are the lowest
free ones of the tier."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.broker.core import Lease, Tier
from kvloop.broker.core.holdings import Holdings

PROPS = settings(max_examples=100, deadline=None)
FIRST, CAPACITY = 100, 6


def lease(n: int, tier: Tier, block_ids: tuple[int, ...]) -> Lease:
    return Lease(f"l{n}", "e", "", (b"k",) * len(block_ids), block_ids, len(block_ids), 1.0, 1.0, 0.0, 0.0,
                 tier=tier)


ops = st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.sampled_from([Tier.POOL, Tier.HOST]),
                         st.sets(st.integers(0, 7), min_size=1, max_size=4)), max_size=30)


@PROPS
@given(ops, st.integers(0, 8))
def test_holdings_match_a_recount_of_the_leases(steps: list[tuple], need: int) -> None:
    holdings, held = Holdings(), {}
    for add, n, tier, ids in steps:
        lid = f"l{n}"
        if add and lid not in held:
            block_ids = tuple(sorted(ids)) if tier is Tier.POOL else tuple(FIRST + i for i in sorted(ids)
                                                                          if FIRST + i not in holdings.host_slots)
            if block_ids:
                held[lid] = lease(n, tier, block_ids)
                holdings.add(held[lid])
        elif not add and lid in held:
            holdings.remove(held.pop(lid))
        pool = {b for x in held.values() if x.tier is Tier.POOL for b in x.block_ids}
        assert len(holdings.refs) == len(pool) and all(holdings.refs[b] == sum(
            b in x.block_ids for x in held.values() if x.tier is Tier.POOL) for b in pool)
        assert holdings.host_slots == {b for x in held.values() if x.tier is Tier.HOST for b in x.block_ids}
        assert holdings.lease_ids == set(held)
    slots = holdings.free_slots(FIRST, CAPACITY, need)
    free = [s for s in range(FIRST, FIRST + CAPACITY) if s not in holdings.host_slots]
    assert slots == tuple(free[:need])
    assert len(holdings.slot_counts()) == len(holdings.host_slots)
