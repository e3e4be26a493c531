"""Properties of the broker core's pin book (broker/core/pins.py): every pin is on its lease's ``pin_ids``, a pin is
opened only on a lease a reader may pull, timeouts are found exactly, and a lease is held in a store until its last
pin's timeout."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.broker.core import EngineInfo, EngineRecord, EvictionReason, Lease, Limits, Role
from kvloop.broker.core.changes import Journal
from kvloop.broker.core.pins import PinBook
from kvloop.shared.errors import FailedPrecondition, InvalidArgument

PROPS = settings(max_examples=80, deadline=None)
LIM = Limits(max_pin_timeout_s=30.0)

ops = st.lists(st.one_of(
    st.tuples(st.just("open"), st.integers(0, 2), st.integers(0, 4), st.sampled_from([0.0, 1.0, 5.0, 60.0]),
              st.sampled_from(["a", "b"])),
    st.tuples(st.just("pop"), st.integers(0, 9)),
    st.tuples(st.just("drop"), st.integers(0, 2)),
    st.tuples(st.just("wait"), st.sampled_from([0.5, 3.0])),
), max_size=40)


def record(engine_id: str, fp: str = "a") -> EngineRecord:
    return EngineRecord(EngineInfo(engine_id, Role.BOTH, 1, fp, 8), 0.0, 0.0)


@PROPS
@given(ops, st.lists(st.sampled_from([None, EvictionReason.BUDGET]), min_size=3, max_size=3))
def test_pins_stay_on_their_leases_and_time_out_exactly(steps: list[tuple],
                                                        pending: list[EvictionReason | None]) -> None:
    counter = itertools.count()
    book, now = PinBook(LIM, Journal(), lambda: f"p{next(counter)}"), 0.0
    leases = [Lease(f"l{i}", "src", "", (b"k",) * 3, (0, 1, 2), 3, 60.0, 10.0 * i, 0.0, 0.0, pending=pending[i])
              for i in range(3)]
    source = record("src")
    for op, *args in steps:
        if op == "open":
            i, num_blocks, timeout, fp = args
            lease = leases[i]
            refused = (lease.pending is not None or fp != "a" or not 1 <= num_blocks <= 3
                       or not 0 < (timeout or LIM.default_pin_timeout_s) <= LIM.max_pin_timeout_s)
            if refused:
                with pytest.raises((FailedPrecondition, InvalidArgument)):
                    book.open(record("reader", fp), lease, source, False, num_blocks, timeout, now)
            else:
                pin = book.open(record("reader", fp), lease, source, False, num_blocks, timeout, now)
                assert pin.expires_at == now + (timeout or LIM.default_pin_timeout_s)
        elif op == "pop" and f"p{args[0]}" in book.pins:
            pin = book.pop(f"p{args[0]}")
            leases[int(pin.lease_id[1:])].pin_ids.discard(pin.pin_id)  # the lease book's part
        elif op == "drop":
            book.drop(leases[args[0]].pin_ids)
            leases[args[0]].pin_ids = set()
        elif op == "wait":
            now += args[0]
            assert {p.pin_id for p in book.due(now)} == {p.pin_id for p in book.pins.values() if p.expires_at <= now}
        assert set(book.pins) == {p for lease in leases for p in lease.pin_ids}
        assert all(book.pins[p].lease_id == lease.lease_id for lease in leases for p in lease.pin_ids)
        assert book.of_reader("reader") == list(book.pins.values()) and book.of_reader("src") == []
        for lease in leases:
            assert book.hold_until(lease) == max([lease.expires_at,
                                                  *(book.pins[p].expires_at for p in lease.pin_ids)])


def test_an_unheard_or_demoting_source_cannot_be_pinned() -> None:
    book = PinBook(LIM, Journal(), lambda: "p")
    lease = Lease("l", "src", "", (b"k",), (0,), 1, 60.0, 60.0, 0.0, 0.0)
    with pytest.raises(FailedPrecondition, match="kept alive"):
        book.open(record("r"), lease, record("src"), True, 1, 0.0, 0.0)
    lease.demoting_until = 5.0
    with pytest.raises(FailedPrecondition, match="host tier"):
        book.open(record("r"), lease, record("src"), False, 1, 0.0, 0.0)
    assert not book.pins and not lease.pin_ids
