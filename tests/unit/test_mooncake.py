"""Mooncake's trace format (kvloop.shared.mooncake) and ``kvloop analyze`` on it, on a trace small enough to work
out by hand in the comments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvloop.app.analyze import load
from kvloop.app.analyze.analysis import Options, analyze
from kvloop.app.analyze.main import main as analyze_main
from kvloop.app.cli import build_parser
from kvloop.shared import mooncake
from kvloop.shared.errors import ConfigError
from kvloop.shared.hashing import common_prefix_blocks

BS = 4
# r0 starts a conversation; r1 shares only its first block (a system prompt): a conversation of its own; r2
# repeats r0's whole blocks and replaces its partial last one: r0's next turn; r3 repeats r0 too, but r0 is no
# longer its conversation's latest turn and r3 does not extend r2: a fork, its own conversation.
TRACE = [
    {"timestamp": 0, "input_length": 9, "output_length": 3, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 6, "output_length": 2, "hash_ids": [0, 7]},
    {"timestamp": 2000, "input_length": 14, "output_length": 2, "hash_ids": [0, 1, 3, 4]},
    {"timestamp": 3000, "input_length": 13, "output_length": 1, "hash_ids": [0, 1, 2, 5]},
]


def rows() -> list[mooncake.TraceRow]:
    return mooncake.parse_lines([json.dumps(r) for r in TRACE])


def test_conversations_are_inferred_from_repeated_blocks() -> None:
    assert mooncake.conversations(rows()) == [0, 1, 0, 2]


def test_a_trace_is_cut_and_scaled_keeping_its_ids() -> None:
    out = mooncake.scaled(rows(), length_scale=0.5, time_scale=2.0, seconds=2.0)
    assert [(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) for r in out] == [
        (0, 5, 2, (0, 1, 2)), (2000, 3, 1, (0, 7)), (4000, 7, 1, (0, 1, 3, 4))]  # ceil; r3 (3 s) cut


@pytest.mark.parametrize(("line", "field"), [
    ('{"timestamp": 0, "input_length": 1, "hash_ids": []}', "output_length"),
    ('{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": []}', "timestamp"),
    ('{"timestamp": 0, "input_length": 1.5, "output_length": 1, "hash_ids": []}', "input_length"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
    ("[1]", "trace"), ("{not json", "trace")])
def test_bad_lines_are_refused_by_line_and_field(line: str, field: str) -> None:
    with pytest.raises(ConfigError, match="trace: line 2") as err:
        mooncake.parse_lines([json.dumps(TRACE[0]), line])
    assert err.value.field == field


def test_trace_requests_become_records() -> None:
    recs = load.trace_records(rows(), BS, turn_s=2.0)
    assert [r.session for r in recs] == ["conv-0", "conv-1", "conv-0", "conv-2"]
    # r0 ends where its conversation's next request starts (2 s), the others turn_s after they start.
    assert [(r.t, r.t_end) for r in recs] == [(0.0, 2.0), (1.0, 3.0), (2.0, 4.0), (3.0, 5.0)]
    # One key per whole block: 9 // 4 = 2, 6 // 4 = 1, 14 // 4 = 3, 13 // 4 = 3.
    assert [len(r.keys) for r in recs] == [2, 1, 3, 3]
    assert common_prefix_blocks(recs[0].keys, recs[2].keys) == 2 and recs[1].keys[0] == recs[0].keys[0]
    assert [r.output_tokens for r in recs] == [3, 2, 2, 1]


def test_analyze_reads_a_trace(tmp_path: Path) -> None:
    recs = load.trace_records(rows(), BS, turn_s=2.0)
    a = analyze(recs, Options(ttls=(100.0,), budgets=(1000,)))
    # Nothing evicted: r1 finds nothing (r0 is published when it ends, at 2 s), r2 finds r0's two blocks (8
    # tokens) and so does r3 (r2, still running, has published nothing).
    assert (a.ideal_hits.turns_needing, a.ideal_hits.tokens_ideal) == (2, 8 + 8)
    assert a.reuse_share == pytest.approx(16 / (9 + 6 + 14 + 13))
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    args = build_parser().parse_args(["analyze", str(path), "--trace-block-size", str(BS), "--ttls", "100",
                                      "--budgets", "1000", "--trace-slow", "2"])
    assert analyze_main(args) == 0
    text = (tmp_path / "trace-analysis" / "analysis.md").read_text()
    assert "4 turns in 3 sessions over 8.0 s" in text  # slowed twice: the last starts at 6 s and ends 2 s later
    assert "block size 4 tokens" in text


@pytest.mark.parametrize(("flags", "field"), [(["--trace-slow", "0"], "trace_slow"),
                                               (["--trace-length-scale", "-1"], "trace_length_scale"),
                                               (["--trace-seconds", "-5"], "trace_seconds"),
                                               (["--trace-length-scale", "0.0001"], "trace_block_size")])
def test_trace_flags_are_validated_by_name(tmp_path: Path, flags: list[str], field: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(TRACE[0]) + "\n")
    with pytest.raises(ConfigError) as err:
        analyze_main(build_parser().parse_args(["analyze", str(path), *flags]))
    assert err.value.field == field
