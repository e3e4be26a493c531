"""Properties of the broker core's lease book (broker/core/leases.py) under random publications, renewals, releases,
pins, pressure, demotion reports and time: its holdings match a recount of its leases, budgets and host tiers hold,
every lease that ends gets one command, and nothing due outlives a tick unless a pin holds it."""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from functools import cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvloop.broker.core import EngineInfo, EvictionCommand, EvictionReason, Lease, Limits, LruPolicy, Role, Tier
from kvloop.broker.core.changes import Journal
from kvloop.broker.core.engines import Engines
from kvloop.broker.core.leases import LeaseBook
from kvloop.broker.core.limits import check_publish
from kvloop.broker.core.pins import PinBook
from kvloop.shared.errors import KvloopError
from kvloop.shared.hashing import ExtraKeys, block_keys

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXTRA = ExtraKeys("fp")
FIRST = 100
LIM = Limits(demotion_timeout_s=3.0, max_pin_timeout_s=60.0)


@cache
def chain(path: tuple[int, ...]) -> tuple[bytes, ...]:
    return tuple(block_keys(list(path), 1, EXTRA))


ops = st.lists(st.one_of(
    st.tuples(st.just("publish"), st.integers(0, 1), st.lists(st.integers(0, 1), min_size=1, max_size=4).map(tuple),
              st.sampled_from([2.0, 5.0, 20.0])),
    st.tuples(st.just("renew"), st.integers(0, 30), st.sampled_from([0.0, 3.0])),
    st.tuples(st.just("release"), st.integers(0, 30)),
    st.tuples(st.just("pin"), st.integers(0, 30), st.sampled_from([1.0, 10.0])),
    st.tuples(st.just("unpin"), st.integers(0, 30)),
    st.tuples(st.just("pressure"), st.integers(0, 1), st.integers(0, 3)),
    st.tuples(st.just("copied"), st.integers(0, 30), st.booleans()),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 2.0, 6.0])),
), min_size=5, max_size=50)


class World:
    def __init__(self, budgets: tuple[int, int], hosts: tuple[int, int]) -> None:
        journal, counter = Journal(), itertools.count()
        self.engines = Engines(LIM, journal)
        self.pins = PinBook(LIM, journal, lambda: f"p{next(counter)}")
        self.book = LeaseBook(LruPolicy(), LIM, self.engines, self.pins, journal, lambda: f"l{next(counter)}")
        self.journal, self.now, self.ended = journal, 0.0, Counter[str]()
        for i in (0, 1):
            self.engines.admit(EngineInfo(f"e{i}", Role.BOTH, 1, "fp", budgets[i], host_tier_blocks=hosts[i],
                                          host_tier_first_id=FIRST), 0.0, 0)
            self.book.open(f"e{i}")
        self.alloc: dict[tuple[str, bytes], int] = {}

    def lease(self, n: int) -> Lease | None:
        live = sorted(self.book.leases)
        return self.book.leases[live[n % len(live)]] if live else None

    def step(self, op: str, args: list) -> None:
        if op == "publish":
            engine, path, ttl = args
            keys = chain(path)
            ids = [self.alloc.setdefault((f"e{engine}", k), len(self.alloc)) for k in keys]
            rec = self.engines.records[f"e{engine}"]
            check_publish(rec, "s", keys, ids, len(keys), ttl, LIM)
            self.book.publish(rec, "s", keys, ids, len(keys), ttl, self.now)
            if not any(x.pinned for x in self.book.leases.values() if x.engine_id == f"e{engine}"):
                assert self.book.retained_blocks(f"e{engine}") <= rec.info.retention_budget_blocks
        elif op == "tick":
            self.now += args[0]
            self.book.expire(self.now)
            for x in self.book.leases.values():
                assert x.pinned or x.pending is not None or x.expires_at > self.now
                assert x.pinned or not x.demoting_until or x.demoting_until > self.now
        elif op == "pressure":
            self.book.evict_for(f"e{args[0]}", args[1], EvictionReason.MEMORY_PRESSURE, self.now)
        elif op == "unpin":
            pins = sorted(self.pins.pins)
            if pins:
                self.book.unpinned(self.pins.pop(pins[args[0] % len(pins)]), self.now)
        elif (lease := self.lease(args[0])) is not None:
            if op == "renew":
                self.book.renew(lease.lease_id, args[1], self.now)
            elif op == "release":
                self.book.release(lease.lease_id)
            elif op == "pin":
                rec = self.engines.records[lease.engine_id]
                self.pins.open(rec, lease, rec, False, 1, args[1], self.now)
            elif op == "copied":
                self.book.complete_demotion(lease.engine_id, lease.lease_id, args[1])

    def check(self, commands: list[EvictionCommand]) -> None:
        for cmd in commands:
            if cmd.demote_to:
                assert self.book.leases[cmd.lease_id].tier is Tier.HOST
            else:
                self.ended[cmd.lease_id] += 1
                assert cmd.lease_id not in self.book.leases
        assert all(n == 1 for n in self.ended.values())
        for e in ("e0", "e1"):
            mine = [x for x in self.book.leases.values() if x.engine_id == e]
            pool = {b for x in mine if x.tier is Tier.POOL for b in x.block_ids}
            slots = [b for x in mine if x.tier is Tier.HOST for b in x.block_ids]
            capacity = self.engines.records[e].info.host_tier_blocks
            assert self.book.retained_blocks(e) == len(pool) and self.book.lease_ids(e) == sorted(x.lease_id
                                                                                                 for x in mine)
            assert self.book.host_blocks(e) == len(slots) == len(set(slots)) <= capacity
            assert all(FIRST <= s < FIRST + capacity for s in slots)
        assert set(self.pins.pins) == {p for x in self.book.leases.values() for p in x.pin_ids}


@PROPS
@given(ops, st.tuples(st.integers(1, 6), st.integers(2, 8)), st.tuples(st.sampled_from([0, 4]),
                                                                       st.sampled_from([0, 2, 8])))
def test_the_lease_book_keeps_its_books_budgets_and_commands(steps: list[tuple], budgets: tuple[int, int],
                                                             hosts: tuple[int, int]) -> None:
    world = World(budgets, hosts)
    for op, *args in steps:
        with contextlib.suppress(KvloopError):  # refused (a pinned lease, one being demoted): the books still hold
            world.step(op, args)
        world.check(world.journal.take().commands)
