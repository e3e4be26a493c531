"""``kvloop analyze`` on a small record set whose figures are worked out by hand in the comments."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvloop.app.analyze import costs, load, retention, shape
from kvloop.app.analyze.analysis import Options, analyze
from kvloop.app.analyze.main import main as analyze_main
from kvloop.app.analyze.report import hints_said
from kvloop.app.analyze.retention import Fleet, Setting
from kvloop.app.analyze.verdict import verdict
from kvloop.app.cli import build_parser
from kvloop.router.directory import EngineInfo
from kvloop.router.outcome import Turn, TurnOutcome
from kvloop.router.plan import TurnPlan
from kvloop.router.records import KEY_HEX, RecordWriter, TurnRecord, turn_record
from kvloop.shared.engine_model import dump_profile
from kvloop.shared.errors import ConfigError
from kvloop.shared.hashing import common_prefix_blocks
from kvloop.shared.protocol import PrefillReport
from kvloop.shared.vocabulary import Path as TurnPath
from kvloop.shared.vocabulary import Reason
from tests.support.fleet import FAKE_PROFILE

BS = 4


def k(name: str) -> str:
    return name.encode().hex().ljust(KEY_HEX, "0")


def rec(session: str, t: float, t_end: float, prompt: int, keys: list[str], **kw: object) -> TurnRecord:
    return TurnRecord(t=t, t_end=t_end, session=session, prompt_tokens=prompt, block_size=BS,
                      keys=tuple(k(x) for x in keys), **kw)  # type: ignore[arg-type]


# Session a grows by a block a turn; session b's second turn keeps only its first block.
RECORDS = [
    rec("a", 0.0, 1.0, 10, ["k1", "k2"]),
    rec("b", 2.0, 2.5, 9, ["m1", "m2"]),
    rec("a", 3.0, 4.0, 14, ["k1", "k2", "k3"]),
    rec("b", 5.0, 6.0, 9, ["m1", "x"]),
    rec("a", 100.0, 101.0, 18, ["k1", "k2", "k3", "k4"]),
]
FLEET = Fleet(decode_engines=1, prefill_engines=1, bytes_per_block=1000)


def test_prefix_shares_gaps_and_rate() -> None:
    by_session = shape.sessions(RECORDS)
    shares = {(s.session, s.index): (s.shared_tokens, s.share) for s in shape.prefix_shares(by_session)}
    # a2 repeats a1's 2 blocks (8 of 14 tokens), a3 a2's 3 (12 of 18), b2 b1's first block (4 of 9).
    assert shares == {("a", 1): (8, 8 / 14), ("a", 2): (12, 12 / 18), ("b", 1): (4, 4 / 9)}
    curve = shape.share_curve(shape.prefix_shares(by_session))
    assert [(p.index, p.turns, p.p10, p.p50, p.p90) for p in curve] == [
        (1, 2, 4 / 9, 4 / 9, 8 / 14), (2, 1, 12 / 18, 12 / 18, 12 / 18)]
    assert sorted(shape.gaps(by_session)) == [2.0, 2.5, 96.0]  # 3-1, 5-2.5, 100-4
    assert shape.turn_rate(RECORDS) == (5 / 101, 101.0)


def matched(run: retention.Replay) -> list[int]:
    return [o.matched_blocks for o in run.outcomes]


def test_retention_replays_ttls_through_the_core() -> None:
    best = retention.ideal(RECORDS, FLEET)
    assert matched(best) == [0, 0, 2, 1, 3]
    short = retention.replay(RECORDS, Setting(10.0, 1000), FLEET)
    # a2's lease (published at 4, TTL 10) is gone by a3 at 100; the others are found within 10 s.
    assert matched(short) == [0, 0, 2, 1, 0]
    hits = retention.hits(short, best, BS)
    assert (hits.turns_needing, hits.turns_found, hits.tokens_found, hits.tokens_ideal) == (3, 2, 12, 24)
    # a2 superseded a1; b1, a2 and b2 ran out by 100 (b2 extends no earlier lease: m1 then x, not m1 m2).
    assert short.evictions["ttl_expired"] == 3 and short.evictions["superseded"] == 1
    assert matched(retention.replay(RECORDS, Setting(100.0, 1000), FLEET)) == [0, 0, 2, 1, 3]


def test_a_lease_holds_the_answer_blocks_the_next_prompt_names() -> None:
    # a's first turn: 10 prompt tokens and a 5-token answer: 14 tokens with KV, 3 full blocks of 4; the next prompt
    # (k1 k2 k3) extends it, so the lease holds k1 k2 k3. b's next prompt does not extend its first (m2 -> x): its
    # prompt's keys only. A last turn has no next prompt: its own keys.
    records = [rec("a", 0.0, 1.0, 10, ["k1", "k2"], output_tokens=5), rec("b", 2.0, 2.5, 9, ["m1", "m2"],
                                                                           output_tokens=8),
               rec("a", 3.0, 4.0, 14, ["k1", "k2", "k3"]), rec("b", 5.0, 6.0, 9, ["m1", "x"])]
    assert retention.retained_keys(records) == [(k("k1"), k("k2"), k("k3")), (k("m1"), k("m2")),
                                                (k("k1"), k("k2"), k("k3")), (k("m1"), k("x"))]
    # A 1-token answer fills no new block: (10 + 1 - 1) // 4 = 2.
    records[0] = rec("a", 0.0, 1.0, 10, ["k1", "k2"], output_tokens=1)
    assert retention.retained_keys(records)[0] == (k("k1"), k("k2"))


def test_retention_budget_evicts_the_least_recently_used() -> None:
    # Budget 4: b1 joins a1 (4 blocks); a2 (3 blocks, superseding a1) evicts b1; b2 evicts a2: only a2 finds its.
    assert matched(retention.replay(RECORDS, Setting(1000.0, 4), FLEET)) == [0, 0, 2, 0, 0]
    # Budget 3: b1 already evicts a1.
    run = retention.replay(RECORDS, Setting(1000.0, 3), FLEET)
    assert matched(run) == [0, 0, 0, 0, 0]
    assert max(n for _, n in run.held) == 3


def test_interconnect_bytes() -> None:
    model = costs.CostModel(bytes_per_block=1000, bandwidth_bytes_per_s=1e6, pull_overhead_s=0.0)
    link = costs.interconnect(matched(retention.ideal(RECORDS, FLEET)), model, 101.0)
    # 2 + 1 + 3 blocks of 1000 bytes over 101 s; at 1 MB/s the 2000-byte pull takes 2 ms.
    assert (link.turns_pulling, link.total_bytes) == (3, 6000)
    assert link.needed_bytes_per_s == pytest.approx(6000 / 101)
    assert link.bytes_per_turn["p50"] == 2000 and link.pull_ms["p50"] == pytest.approx(2.0)


def test_fit_recovers_a_known_cost_line_and_checks_it() -> None:
    # TTFT = 50 ms + computed / 1000 tokens/s (+ the pull on TRANSFER); pulls at 2000 bytes in 2 ms = 1 MB/s.
    timed = [rec("s", i, i + 1, n, [], path="RECOMPUTE", computed_tokens=n, ttft_ms=50 + n) for i, n in
             enumerate((100, 300, 700))]
    timed.append(rec("s", 9, 10, 900, [], path="TRANSFER", computed_tokens=200, pulled_bytes=2000, pulled_blocks=2,
                     pull_ms=2.0, ttft_ms=252.0))
    model = costs.fit(timed, {"pull_overhead_s": 0.0})
    assert model.prefill_tokens_per_s == pytest.approx(1000.0)
    assert model.hop_s == pytest.approx(0.05)
    assert model.bandwidth_bytes_per_s == pytest.approx(1e6) and model.bytes_per_block == 1000
    assert model.sources["prefill_tokens_per_s"] == "fitted (4 turns)" and model.sources["pull_overhead_s"] == "given"
    check = costs.check(timed, model)
    assert check is not None and check.worst_gap() == pytest.approx(0.0, abs=1e-9)


def test_holdout_fits_on_every_other_session_and_prices_the_rest() -> None:
    # Sessions a and c (every other by name) follow TTFT = 50 ms + n / 1000 tokens/s; session b's turns take
    # 80 ms + 1.2 ms a token: 200 / 560 / 920 ms, which the model fitted on a and c prices 150 / 450 / 750 ms.
    # Nearest-rank p50/p95/p99 of three: the middle, the largest, the largest: gaps 110/560 and 170/920.
    def turns(session: str, hop: float, per_token: float) -> list[TurnRecord]:
        return [rec(session, i, i + 1, n, [], path="RECOMPUTE", computed_tokens=n, ttft_ms=hop + n * per_token)
                for i, n in enumerate((100, 400, 700))]
    records = turns("a", 50, 1.0) + turns("b", 80, 1.2) + turns("c", 50, 1.0)
    held = costs.holdout_check(records, {})
    assert held is not None and held.turns == 3
    assert held.predicted == pytest.approx({"p50": 450.0, "p95": 750.0, "p99": 750.0})
    assert held.measured == pytest.approx({"p50": 560.0, "p95": 920.0, "p99": 920.0})
    assert held.worst_gap() == pytest.approx(110 / 560)
    assert costs.holdout_check(turns("a", 50, 1.0), {}) is None  # one session: nothing to hold out


def test_verdicts() -> None:
    grid = [retention.hits(retention.replay(RECORDS, Setting(ttl, b), FLEET), retention.ideal(RECORDS, FLEET), BS)
            for b in (3, 1000) for ttl in (10.0, 100.0)]
    # Only 1000 blocks with a TTL of 100 s finds all three prefixes; the smallest setting finds none.
    v = verdict(0.4, grid, 100, 200, 150, 300, 0.01)
    assert v.kind == "pays_above" and v.start == Setting(100.0, 1000)
    assert verdict(0.05, grid, 100, 200, 150, 300, 0.01).kind == "does_not_pay"
    assert verdict(0.4, grid, 190, 200, 150, 300, 0.01).kind == "does_not_pay"


def test_whole_analysis_and_the_command(tmp_path: Path) -> None:
    a = analyze(RECORDS, Options(ttls=(10.0, 100.0), budgets=(3, 1000), given={"bytes_per_block": 1000}))
    assert a.ideal_hits.tokens_ideal == 24 and a.reuse_share == pytest.approx(24 / 60)
    assert [(h.setting, h.turns_found) for h in a.grid] == [
        (Setting(10.0, 3), 0), (Setting(100.0, 3), 0), (Setting(10.0, 1000), 2), (Setting(100.0, 1000), 3)]
    path = tmp_path / "turns.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in RECORDS))
    args = build_parser().parse_args(["analyze", str(path), "--ttls", "10,100", "--budgets", "3,1000",
                                      "--bytes-per-block", "1000"])
    assert analyze_main(args) == 0
    text = (tmp_path / "turns-analysis" / "analysis.md").read_text()
    assert "| 1000 | 100 | 100.0% | 100.0% |" in text
    assert {p.name for p in (tmp_path / "turns-analysis").glob("*.png")} == {
        "prefix_share.png", "sessions.png", "retention.png"}


@pytest.mark.parametrize(("flags", "field"), [(["--ttls", "0"], "ttls"), (["--budgets", "x"], "budgets"),
                                               (["--bandwidth", "-1"], "bandwidth"),
                                               (["--eviction-policy", "fifo"], "eviction_policy")])
def test_flags_are_validated_by_name(tmp_path: Path, flags: list[str], field: str) -> None:
    args = build_parser().parse_args(["analyze", str(tmp_path / "x.jsonl"), *flags])
    with pytest.raises(ConfigError) as err:
        analyze_main(args)
    assert err.value.field == field


def test_records_round_trip_and_reject_bad_lines(tmp_path: Path) -> None:
    writer = RecordWriter(tmp_path / "r" / "turns.jsonl")
    writer.write(RECORDS[2])
    writer.close()
    lines = load.read_lines(tmp_path / "r" / "turns.jsonl")
    assert load.records_from(lines, tmp_path) == [RECORDS[2]]
    bad = json.loads(RECORDS[2].to_json()) | {"keys": ["abc"]}
    with pytest.raises(ConfigError) as err:
        TurnRecord.from_dict(bad)
    assert err.value.field == "keys"
    with pytest.raises(ConfigError) as err:
        TurnRecord.from_dict({"t": 1})
    assert err.value.field == "t_end"


def test_the_router_record_of_a_turn_holds_digests_not_tokens() -> None:
    engine = EngineInfo("d0", "decode", "http://d0")
    plan = TurnPlan(kind="chat", session="s", model="tiny", path=TurnPath.TRANSFER, reason=Reason.TRANSFER_CHEAPER,
                    prompt_tokens=14, block_size=4, prefill=EngineInfo("p0", "prefill", "http://p0"),
                    decodes=(engine,), keys=(bytes(32),) * 3)
    prepared = Turn(body={"model": "tiny", "messages": [{"content": "secret"}]}, plan=plan, span=None, started=0.0,
                    outcome=TurnOutcome(prefill_engine="p0", timings_ms={"place": 0.2}, report=PrefillReport(
                        local_tokens=8, pulled_tokens=4, pulled_blocks=1, pulled_bytes=512, computed_tokens=2,
                        pull_ms=1.5)))
    r = turn_record(prepared, now=100.0, elapsed_s=0.5, output_tokens=7, ttft_s=0.25, error="")
    assert (r.t, r.t_end, r.keys, r.ttft_ms, r.pulled_bytes) == (99.5, 100.0, ("0" * KEY_HEX,) * 3, 250.0, 512)
    assert "secret" not in r.to_json()
    assert (r.path, r.planned, r.decode_engine, r.model) == ("TRANSFER", "TRANSFER", "d0", "tiny")


def test_conversations_become_records() -> None:
    def tokenize(messages: list[dict[str, object]]) -> list[int]:
        return [ord(c) for m in messages for c in f"<{m['role']}>{m.get('content', '')}"]

    conv = {"id": "c", "start": 10.0, "think_s": [1.5], "messages": [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "more"}]}
    first, second = load.conversation_records([(1, conv)], tokenize, len, BS, 2.0)
    assert (first.session, first.t, first.t_end, first.output_tokens) == ("c", 10.0, 12.0, 8)
    assert second.t == 13.5  # start + one turn (2 s) + its think time (1.5 s)
    assert (first.prompt_tokens, second.prompt_tokens) == (11, 40)  # "<user>hello", + "<assistant>hi there<user>more"
    assert common_prefix_blocks(first.keys, second.keys) == 2  # the first 8 tokens' 2 whole blocks


def test_a_trace_gets_the_fleet_models_queueing_prediction_with_a_profile(tmp_path: Path) -> None:
    """``--profile``: the report adds the trace's TTFT as the fleet model predicts it, labelled predicted, with n and
    the profile's sources; records have no schedule to replay, and a missing profile is refused by name."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 400 * i, "input_length": 200 + 100 * i, "output_length": 20,
                                         "hash_ids": list(range(2 + i))}) + "\n" for i in range(8)))
    profile = tmp_path / "profile.json"
    dump_profile(FAKE_PROFILE, profile)
    args = build_parser().parse_args(["analyze", str(trace), "--trace-block-size", "100", "--profile", str(profile)])
    assert analyze_main(args) == 0
    text = (tmp_path / "trace-analysis" / "analysis.md").read_text()
    assert "## Queueing prediction (fleet model)" in text and "Predicted, not measured" in text
    assert "| kvloop | 8 |" in text and "| one_way | 8 |" in text and "fake: the fleet tests' figures" in text
    records = tmp_path / "turns.jsonl"
    records.write_text("".join(r.to_json() + "\n" for r in RECORDS))
    for path, prof in ((records, profile), (trace, tmp_path / "missing.json")):
        with pytest.raises(ConfigError) as err:
            analyze_main(build_parser().parse_args(["analyze", str(path), "--profile", str(prof)]))
        assert err.value.field == "profile"


def test_the_report_says_what_sessions_hinted() -> None:
    base = TurnRecord(t=0.0, t_end=1.0, session="s", prompt_tokens=0, block_size=16, keys=())
    assert hints_said([base]) == ""
    records = [base, replace(base, hints={"pause_s": 40.0}),
               replace(base, hints={"pause_s": 100.0, "priority": "high"}), replace(base, hints={"end": True}),
               replace(base, hints={"keep_generated": False})]
    text = hints_said(records)
    assert "4 turns said something" in text and "2 paused (median 40 s, max 100 s)" in text
    assert "1 ended" in text and "1 said high priority" in text and "1 said their answer will not be repeated" in text
    assert "prefetch" not in text
    prefetched = hints_said([*records, replace(base, prefetch="used"), replace(base, prefetch="unused")])
    assert "2 turns followed a prefetch of their session's blocks, 1 used it." in prefetched
    assert TurnRecord.from_dict(json.loads(replace(base, prefetch="used").to_json())).prefetch == "used"
