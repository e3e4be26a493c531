"""Properties of the broker core's journal (broker/core/changes.py): a batch holds each record's last write and every
command in order, however the writes are split into batches and merged again."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.broker.core import EngineInfo, EngineRecord, EvictionCommand, EvictionReason, Lease, Pin, Role
from kvloop.broker.core.changes import Changes, Journal

PROPS = settings(max_examples=100, deadline=None)

writes = st.lists(st.tuples(st.sampled_from(["engine", "lease", "pin", "command"]), st.integers(0, 3),
                            st.booleans()), max_size=30)


def apply(journal: Journal, kind: str, n: int, put: bool, step: int) -> None:
    rid = f"{kind}{n}"
    if kind == "command":
        journal.command(EvictionCommand(step, "e", rid, (), EvictionReason.BUDGET))
    elif kind == "engine":
        (journal.put_engine(EngineRecord(EngineInfo(rid, Role.BOTH, 1, "fp", 1), step, step)) if put
         else journal.drop_engine(rid))
    elif kind == "lease":
        journal.put_lease(Lease(rid, "e", "", (), (), 0, 1.0, step, step, step)) if put else journal.drop_lease(rid)
    else:
        journal.put_pin(Pin(rid, "l", "e", 1, step)) if put else journal.drop_pin(rid)


def expected(ops: list[tuple[str, int, bool]]) -> dict[str, Any]:
    last: dict[str, dict[str, Any]] = {"engine": {}, "lease": {}, "pin": {}}
    commands = []
    for step, (kind, n, put) in enumerate(ops):
        if kind == "command":
            commands.append((f"command{n}", step))
        else:
            last[kind][f"{kind}{n}"] = step if put else None
    return {**last, "command": commands}


def seen(changes: Changes) -> dict[str, Any]:
    return {"engine": {k: v and v.registered_at for k, v in changes.engines.items()},
            "lease": {k: v and v.created_at for k, v in changes.leases.items()},
            "pin": {k: v and v.expires_at for k, v in changes.pins.items()},
            "command": [(c.lease_id, c.seq) for c in changes.commands]}


@PROPS
@given(writes, st.integers(0, 30))
def test_a_batch_keeps_each_last_write_and_every_command_however_split(ops: list[tuple[str, int, bool]],
                                                                       cut: int) -> None:
    journal = Journal()
    for step, (kind, n, put) in enumerate(ops[:cut]):
        apply(journal, kind, n, put, step)
    first = journal.take()
    for step, (kind, n, put) in enumerate(ops[cut:], start=min(cut, len(ops))):
        apply(journal, kind, n, put, step)
    second = journal.take()
    assert not journal.take() and bool(first) == bool(ops[:cut]) and bool(second) == bool(ops[cut:])
    first.merge(second)
    assert seen(first) == expected(ops)
