"""The router's measure of the broker's cost model on its own turns: per kind of path, how much longer than the
plan's estimate the time from placement to first token was. Sent with each placement
(``PlaceRequest.pd_residual_s``, ``decode_local_residual_s``); the broker adds each to the paths of its kind.

Why: the broker's estimates are idle figures (``pd_hop_s``, the engines' measured rates). Under load a turn over
the P/D hop waits for two engines' HTTP servers and schedulers, the decode engine's read of the new blocks and its
next busy step; on the agent workload at 4 sessions its prefill request and first decode took 0.4-0.7 s where the
plan estimated ~0.1 s, while DECODE_LOCAL turns missed their estimates by ~0.1 s. Only the router sees both ends.

- Two kinds: ``pd`` (TRANSFER, PREFILL_LOCAL, RECOMPUTE: a prefill request, then the decode) and ``decode_local``.
- A turn's residual is its measured seconds (pin, prefill and the decode's first streamed line, as timed in
  ``TurnOutcome.timings_ms``) minus the plan's estimate of its path without the residual the broker had added
  (the plan's cost carries it), so the figure measures the model, not the previous correction.
- An exponentially weighted mean over turns (``weight`` per turn), starting at 0 (the model's own estimate, so a
  cold engine's first slow turn moves it by a fraction) and decaying back towards 0 with ``half_life_s`` since
  the kind's last turn: a kind its residual prices out is priced by the model again
  after a while, and the next turn of that kind measures it anew; a burst's figure does not stand forever.
- Only turns that ran as the broker planned count: no fallback, the planned engines answered, a first token
  streamed. Each turn's figure is clamped to ``bound_s`` (one stalled turn moves the mean by at most
  ``weight * bound_s``).

Pure: time is an argument. Tested in ``tests/unit/test_residuals.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvloop.shared.vocabulary import Path
from kvloop.v1 import broker_pb2 as pb

PD = "pd"
DECODE_LOCAL = "decode_local"
KINDS = (PD, DECODE_LOCAL)


def kind_of(path: str) -> str:
    return DECODE_LOCAL if path == Path.DECODE_LOCAL else PD


def turn_residual(path: str, cost: pb.CostEstimate, timings_ms: Mapping[str, float]) -> tuple[str, float] | None:
    """The kind and residual of a turn that ran its planned ``path`` (None when it cannot be measured: no
    estimate of that path, or no first token timed)."""
    if "decode_first" not in timings_ms:
        return None
    estimate = {Path.DECODE_LOCAL: cost.decode_local_s, Path.PREFILL_LOCAL: cost.prefill_local_s,
                Path.TRANSFER: cost.transfer_path_s, Path.RECOMPUTE: cost.recompute_path_s}.get(Path(path), 0.0)
    if estimate <= 0:
        return None
    kind = kind_of(path)
    applied = cost.decode_local_residual_s if kind == DECODE_LOCAL else cost.pd_residual_s
    measured_s = sum(timings_ms.get(step, 0.0) for step in ("pin", "prefill", "decode_first")) / 1e3
    return kind, measured_s - (estimate - applied)


@dataclass
class _Mean:
    value: float
    seen: float


class PathResiduals:
    def __init__(self, weight: float = 0.2, half_life_s: float = 30.0, bound_s: float = 30.0) -> None:
        if not (0 < weight <= 1 and half_life_s > 0 and bound_s > 0):
            raise ValueError("weight must be in (0, 1], half_life_s and bound_s positive")
        self.weight, self.half_life_s, self.bound_s = weight, half_life_s, bound_s
        self._means: dict[str, _Mean] = {}

    def observe(self, kind: str, residual_s: float, now: float) -> None:
        residual_s = max(-self.bound_s, min(self.bound_s, residual_s))
        current = self.estimate(kind, now)
        self._means[kind] = _Mean(current + self.weight * (residual_s - current), now)

    def estimate(self, kind: str, now: float) -> float:
        """The kind's residual now: 0 before any turn of it was measured."""
        mean = self._means.get(kind)
        if mean is None:
            return 0.0
        return mean.value * 0.5 ** (max(0.0, now - mean.seen) / self.half_life_s)
