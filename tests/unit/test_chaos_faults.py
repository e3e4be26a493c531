"""kvloop bench chaos's pure pieces: the seeded schedule, recovery times, fault windows, divergence."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from kvloop.app.benchmarks.chaos import Run, add_arguments, soak_figures, validate, verdict
from kvloop.app.benchmarks.chaos_faults import (
    KINDS,
    FaultRecord,
    RequestRecord,
    first_divergence,
    in_window,
    recovered_at,
    schedule,
)


def test_the_schedule_is_seeded_and_fires_every_kind_each_round() -> None:
    a = schedule(3, 2, hold_s=8.0, unresponsive_s=5.0)
    assert a == schedule(3, 2, hold_s=8.0, unresponsive_s=5.0) != schedule(4, 2, hold_s=8.0, unresponsive_s=5.0)
    assert sorted(f.kind for f in a[: len(KINDS)]) == sorted(KINDS) == sorted(f.kind for f in a[len(KINDS):])
    stops = [f for f in a if f.kind == "decode_stop"]
    assert all(f.down_s > 8.0 for f in stops)  # a SIGSTOP outlasts the safety hold and the sidecar's patience
    assert all(1.0 <= f.delay_s <= 4.0 for f in a)
    with pytest.raises(ValueError, match="unknown"):
        schedule(0, 1, hold_s=1, unresponsive_s=1, kinds=["decode_kill", "meteor"])


def req(start: float, end: float, *, ok: bool = True, decode: str = "decode-2", reason: str = "transfer_cheaper"
        ) -> RequestRecord:
    return RequestRecord("s", 1, 0, start=start, end=end, status="ok" if ok else "http_503", decode_engine=decode,
                         prefill_engine="prefill-0", reason=reason)


def test_recovery_is_the_first_good_turn_on_the_repaired_part_after_its_repair() -> None:
    fault = FaultRecord("decode_kill", "decode-3", injected=10.0, repaired=30.0)
    turns = [req(31, 32, decode="decode-2"), req(29, 33, decode="decode-3"), req(31, 35, decode="decode-3", ok=False),
             req(32, 36, decode="decode-3"), req(33, 40, decode="decode-3")]
    assert recovered_at(fault, turns) == 36  # started before the repair or failed: not a recovery
    broker = FaultRecord("broker_leader_kill", "broker-a", injected=5.0, repaired=8.0)
    assert recovered_at(broker, [req(9, 10, reason="broker_unavailable"), req(9, 12)]) == 12
    assert recovered_at(FaultRecord("decode_kill", "decode-2", 1.0, 2.0), []) is None


def test_fault_windows_and_divergence() -> None:
    faults = [FaultRecord("etcd_stop", "etcd", injected=10.0, repaired=14.0),
              FaultRecord("decode_kill", "x", injected=50.0, repaired=60.0, fired=False)]
    assert in_window(req(9, 10.5), faults) and in_window(req(13, 20), faults)
    assert not in_window(req(1, 9.9), faults) and not in_window(req(55, 58), faults)  # not fired: no window
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 9, 3], [1, 2, 3]) == 1 and first_divergence([1, 2], [1, 2, 3]) == 2


def test_soak_growth_is_per_broker_process_and_fails_the_run_past_the_limit() -> None:
    # Replica a grows 1 MiB a minute, then is restarted (a new pid: a new series, too short to count); b is flat.
    rows = [{"t": float(t), "pids": {"a": 1 if t < 400 else 2, "b": 3},
             "rss": {"a": (100 * 2**20 + t * 2**20 // 60) if t < 400 else 50 * 2**20, "b": 80 * 2**20},
             "blocks": {"decode-2": t // 10}} for t in range(0, 700, 10)]
    soak = soak_figures(rows)
    assert [(g["replica"], g["span_s"], g["mb_per_min"]) for g in soak["broker_rss"]] == [("a", 390, 1.0),
                                                                                          ("b", 690, 0.0)]
    assert soak["decode_blocks"]["max"] == 69 and soak["decode_blocks"]["last"] == 69
    phase = {"hangs": 0, "errors": {}, "freed_while_pinned": [], "soak": soak,
             "books": {"settled": {"agree": True}, "after_ttl": {"baseline": True}}}
    assert verdict(phase, {"wrong": []}) == []  # 1.0 MB/min is the limit, not over it
    soak["broker_rss"][0]["mb_per_min"] = 1.5
    assert "broker memory grew" in verdict(phase, {"wrong": []})[0]


def test_outage_turns_caps_the_turns_that_start_while_an_engine_restarts() -> None:
    async def scenario() -> list[str]:
        run = Run(cluster=None, args=argparse.Namespace(outage_turns=2), faults=[])  # type: ignore[arg-type]
        started: list[str] = []

        async def turn(name: str) -> None:
            await run.outage_gate()
            started.append(name)

        await turn("before")  # no restart under way: never gated, not counted
        run.restarted.clear()
        run.outage_turns = 0
        waiting = [asyncio.create_task(turn(f"t{i}")) for i in range(4)]
        await asyncio.sleep(0.05)
        started.append("|restart done|")
        run.restarted.set()
        await asyncio.gather(*waiting)
        return started

    started = asyncio.run(scenario())
    assert started[:4] == ["before", "t0", "t1", "|restart done|"] and sorted(started[4:]) == ["t2", "t3"]


def test_the_tier_flags_are_checked_and_name_themselves() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert validate(parser.parse_args(["--host-tier-blocks", "128", "--retention-fraction", "0.02"])) == ""
    assert validate(parser.parse_args(["--host-tier-blocks", "-1"])).startswith("--host-tier-blocks")
    assert validate(parser.parse_args(["--retention-fraction", "0"])).startswith("--retention-fraction")
