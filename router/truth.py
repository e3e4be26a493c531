"""What a turn actually did, from the engines' own measurements, next to what the broker planned. Pure.

The broker plans from its indexes; the engines measure. They can differ: a prefill engine's cache may have lost
blocks the soft index still listed, a pull may fail (the prefill then recomputes), a TRANSFER's blocks may turn
out to be in the prefill engine's own cache already. Every report (headers, the ``kvloop.turn`` span, metrics,
the demo) shows the *actual* path; the plan and the outcome of comparing them go beside it.

- The **actual path** of a P/D turn follows the prefill engine's report: pulled tokens > 0 is TRANSFER, else
  tokens found in its own cache is PREFILL_LOCAL, else RECOMPUTE. So no turn is reported as TRANSFER with
  nothing pulled. A DECODE_LOCAL turn ran on the decode engine whatever it found there: its actual path stays
  DECODE_LOCAL, with the cached tokens vLLM measured (``usage.prompt_tokens_details.cached_tokens``).
- The **outcome** (:class:`~kvloop.shared.vocabulary.PlanOutcome`): ``as_planned``; ``other_path`` (the actual
  path differs); ``less_reused`` (same path, but fewer tokens reused than planned, by more than one block: the
  last, partial block is always computed).
"""

from __future__ import annotations

from kvloop.shared.protocol import PrefillReport
from kvloop.shared.vocabulary import Path, PlanOutcome

PATHS = (Path.DECODE_LOCAL, Path.PREFILL_LOCAL, Path.TRANSFER, Path.RECOMPUTE)


def actual_path(planned: Path, report: PrefillReport) -> Path:
    if planned == Path.DECODE_LOCAL:
        return Path.DECODE_LOCAL
    if report.pulled_tokens > 0:
        return Path.TRANSFER
    return Path.PREFILL_LOCAL if report.local_tokens > 0 else Path.RECOMPUTE


def plan_outcome(planned: Path, actual: Path, planned_reused: int, measured_reused: int, block_size: int
                 ) -> PlanOutcome:
    if actual != planned:
        return PlanOutcome.OTHER_PATH
    if measured_reused + max(1, block_size) <= planned_reused:
        return PlanOutcome.LESS_REUSED
    return PlanOutcome.AS_PLANNED


def report_from_usage(usage: dict[str, object] | None, prompt_tokens: int) -> PrefillReport | None:
    """A DECODE_LOCAL turn's account, from the decode engine's usage (``--enable-prompt-tokens-details``);
    None when the engine gave none."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict) or not isinstance(details.get("cached_tokens"), int):
        return None
    cached = min(int(details["cached_tokens"]), prompt_tokens)
    return PrefillReport(local_tokens=cached, computed_tokens=prompt_tokens - cached)
