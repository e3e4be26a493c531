"""Plan against actual: the path a turn reports follows what the engines measured."""

from __future__ import annotations

import pytest

from kvloop.router.truth import actual_path, plan_outcome, report_from_usage
from kvloop.shared.protocol import PrefillReport
from kvloop.shared.vocabulary import Path, PlanOutcome


@pytest.mark.parametrize(("planned", "report", "actual"), [
    (Path.TRANSFER, PrefillReport(pulled_tokens=320, local_tokens=0), Path.TRANSFER),
    (Path.TRANSFER, PrefillReport(pulled_tokens=0, local_tokens=320), Path.PREFILL_LOCAL),  # found locally after all
    (Path.TRANSFER, PrefillReport(pull_failed=True, computed_tokens=400), Path.RECOMPUTE),
    (Path.PREFILL_LOCAL, PrefillReport(local_tokens=0, computed_tokens=400), Path.RECOMPUTE),  # its cache lost them
    (Path.RECOMPUTE, PrefillReport(local_tokens=64), Path.PREFILL_LOCAL),
    (Path.DECODE_LOCAL, PrefillReport(local_tokens=0, computed_tokens=400), Path.DECODE_LOCAL),
])
def test_no_turn_is_reported_as_transfer_without_a_pull(planned: Path, report: PrefillReport, actual: Path) -> None:
    assert actual_path(planned, report) is actual
    assert actual_path(planned, report) != Path.TRANSFER or report.pulled_tokens > 0


def test_outcomes() -> None:
    assert plan_outcome(Path.TRANSFER, Path.TRANSFER, 320, 320, 16) is PlanOutcome.AS_PLANNED
    assert plan_outcome(Path.TRANSFER, Path.PREFILL_LOCAL, 320, 320, 16) is PlanOutcome.OTHER_PATH
    assert plan_outcome(Path.DECODE_LOCAL, Path.DECODE_LOCAL, 320, 305, 16) is PlanOutcome.AS_PLANNED  # one block
    assert plan_outcome(Path.DECODE_LOCAL, Path.DECODE_LOCAL, 320, 304, 16) is PlanOutcome.LESS_REUSED
    assert plan_outcome(Path.PREFILL_LOCAL, Path.PREFILL_LOCAL, 320, 640, 16) is PlanOutcome.AS_PLANNED
    assert plan_outcome(Path.TRANSFER, Path.RECOMPUTE, 320, 0, 16) == "other_path"  # the header's text


def test_report_from_usage() -> None:
    usage = {"prompt_tokens": 400, "prompt_tokens_details": {"cached_tokens": 384}}
    assert report_from_usage(usage, 400) == PrefillReport(local_tokens=384, computed_tokens=16)
    assert report_from_usage({"prompt_tokens": 400}, 400) is None
    assert report_from_usage(None, 400) is None
    assert report_from_usage({"prompt_tokens_details": {"cached_tokens": 999}}, 400) == PrefillReport(
        local_tokens=400, computed_tokens=0)
