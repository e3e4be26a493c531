"""Properties of the broker core's engine book (broker/core/engines.py): the fleet lists exactly the live engines by
layout, expiry takes exactly the silent ones, and an engine's eviction stream replays every command after the one it
applied, in order, or tells it to resync when the log no longer covers the gap."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.broker.core import EngineInfo, EngineLoad, EvictionReason, Limits, Role
from kvloop.broker.core.changes import Journal
from kvloop.broker.core.engines import Engines

PROPS = settings(max_examples=80, deadline=None)
LOG = 3

ops = st.lists(st.one_of(
    st.tuples(st.just("register"), st.integers(0, 3), st.sampled_from(["a", "b"]), st.integers(0, 1)),
    st.tuples(st.just("keepalive"), st.integers(0, 3)),
    st.tuples(st.just("drop"), st.integers(0, 3)),
    st.tuples(st.just("issue"), st.integers(0, 3)),
    st.tuples(st.just("wait"), st.sampled_from([1.0, 4.0])),
), max_size=40)


def engine_info(n: int, fp: str = "a", incarnation: int = 0) -> EngineInfo:
    return EngineInfo(f"e{n}", Role.BOTH, 1, fp, 8, incarnation=f"i{incarnation}")


def register(book: Engines, info: EngineInfo, now: float) -> None:
    """The facade's steps (less the leases): a reconnect keeps the record, a new incarnation numbers on."""
    if book.reconnect(info, now) is None:
        old = book.records.get(info.engine_id)
        book.drop(info.engine_id)
        book.admit(info, now, old.eviction_seq if old else 0)


@PROPS
@given(ops)
def test_the_fleet_and_expiry_follow_registrations_and_keepalives(steps: list[tuple]) -> None:
    book, now = Engines(Limits(engine_ttl_s=5.0), Journal()), 0.0
    last_seen: dict[str, float] = {}
    for op, *args in steps:
        if op == "register":
            n, fp, inc = args
            if f"e{n}" in book.records and book.records[f"e{n}"].info.layout_fingerprint != fp:
                book.drop(f"e{n}")  # a live incarnation cannot change its layout
            register(book, engine_info(n, fp, inc), now)
            last_seen[f"e{n}"] = now
        elif op == "keepalive" and f"e{args[0]}" in book.records:
            book.keepalive(f"e{args[0]}", EngineLoad(running_requests=args[0]), now)
            last_seen[f"e{args[0]}"] = now
        elif op == "drop":
            book.drop(f"e{args[0]}")
            last_seen.pop(f"e{args[0]}", None)
        elif op == "wait":
            now += args[0]
            for engine_id in book.due(now):
                book.drop(engine_id)
                del last_seen[engine_id]
        assert set(book.records) == set(last_seen) and all(t > now - 5.0 for t in last_seen.values())
        for fp in ("a", "b"):
            assert book.fleet.members((fp, 1)) == {e for e, r in book.records.items()
                                                   if r.info.layout_fingerprint == fp}


@PROPS
@given(ops, st.integers(-1, 12), st.one_of(st.none(), st.integers(0, 12)))
def test_the_stream_replays_what_follows_or_resyncs(steps: list[tuple], after: int, durable: int | None) -> None:
    book = Engines(Limits(eviction_log_size=LOG), Journal())
    register(book, engine_info(0), 0.0)
    issued, log = [], []
    for op, *args in steps:
        if op == "issue":
            issued.append(book.issue("e0", f"l{len(issued)}", (len(issued),), EvictionReason.BUDGET))
            log = [*log, issued[-1]][-LOG:]
        elif op == "register" and args[0] == 0:
            if book.records["e0"].info.incarnation != f"i{args[2]}":
                log = []  # a new incarnation starts a new log
            register(book, engine_info(0, incarnation=args[2]), 0.0)
    assert [c.seq for c in issued] == list(range(1, len(issued) + 1))  # numbered on across incarnations
    last = book.records["e0"].eviction_seq
    got = book.commands_after("e0", after, durable, lambda: ["live"])
    if after == last:
        assert got == []
    elif after > last or not log or after < log[0].seq - 1:
        resync = [] if durable is not None and durable < last else [(EvictionReason.RESYNC, last, ("live",))]
        assert [(c.reason, c.seq, c.live_lease_ids) for c in got] == resync
    else:
        upto = last if durable is None else min(last, durable)
        assert got == [c for c in issued if after < c.seq <= upto]  # the log covers the gap: nothing missed
