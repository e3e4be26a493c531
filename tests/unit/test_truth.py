"""Plan against actual: the path a turn reports follows what the engines measured."""

from __future__ import annotations

import pytest

from kvloop.router.truth import actual_path, plan_outcome, report_from_usage
from kvloop.shared.protocol import PrefillReport


@pytest.mark.parametrize(("planned", "report", "actual"), [
    ("TRANSFER", PrefillReport(pulled_tokens=320, local_tokens=0), "TRANSFER"),
    ("TRANSFER", PrefillReport(pulled_tokens=0, local_tokens=320), "PREFILL_LOCAL"),  # found it locally after all
    ("TRANSFER", PrefillReport(pull_failed=True, computed_tokens=400), "RECOMPUTE"),
    ("PREFILL_LOCAL", PrefillReport(local_tokens=0, computed_tokens=400), "RECOMPUTE"),  # its cache lost them
    ("RECOMPUTE", PrefillReport(local_tokens=64), "PREFILL_LOCAL"),
    ("DECODE_LOCAL", PrefillReport(local_tokens=0, computed_tokens=400), "DECODE_LOCAL"),
])
def test_no_turn_is_reported_as_transfer_without_a_pull(planned: str, report: PrefillReport, actual: str) -> None:
    assert actual_path(planned, report) == actual
    assert actual_path(planned, report) != "TRANSFER" or report.pulled_tokens > 0


def test_outcomes() -> None:
    assert plan_outcome("TRANSFER", "TRANSFER", 320, 320, 16) == "as_planned"
    assert plan_outcome("TRANSFER", "PREFILL_LOCAL", 320, 320, 16) == "other_path"
    assert plan_outcome("DECODE_LOCAL", "DECODE_LOCAL", 320, 305, 16) == "as_planned"  # within one block
    assert plan_outcome("DECODE_LOCAL", "DECODE_LOCAL", 320, 304, 16) == "less_reused"
    assert plan_outcome("PREFILL_LOCAL", "PREFILL_LOCAL", 320, 640, 16) == "as_planned"


def test_report_from_usage() -> None:
    usage = {"prompt_tokens": 400, "prompt_tokens_details": {"cached_tokens": 384}}
    assert report_from_usage(usage, 400) == PrefillReport(local_tokens=384, computed_tokens=16)
    assert report_from_usage({"prompt_tokens": 400}, 400) is None
    assert report_from_usage(None, 400) is None
    assert report_from_usage({"prompt_tokens_details": {"cached_tokens": 999}}, 400) == PrefillReport(
        local_tokens=400, computed_tokens=0)
