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
- The estimate is the median of the kind's last ``samples`` turns within ``window_s``: robust to the turns one
  engine stall holds up together (an exponentially weighted mean, tried first, took five DECODE_LOCAL turns held
  5 s by one stall as a 3 s price and sent every turn over the hop for the rest of the run). With fewer than
  ``min_samples`` turns the median is scaled by their share of ``min_samples``, so thin evidence moves the price
  a little. With none in the window it is 0 (the model's own estimate): a kind its residual priced out is priced
  by the model again once its turns have aged out, and its next turn measures it anew.
- Per engine too (P/D turns by their prefill engine, DECODE_LOCAL turns by their decode engine), sent beside the
  kinds' figures; the broker prices each engine by its own, so one engine's stall reprices that engine only.
- Only turns that ran as the broker planned count: no fallback, the planned engines answered, a first token
  streamed. The estimate is clamped to the wire's bound (``MAX_RESIDUAL_S``): past it the broker would refuse
  the placements themselves.

Pure: time is an argument. Tested in ``tests/unit/test_residuals.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from statistics import median

from kvloop.shared.protocol import MAX_RESIDUAL_S
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


class PathResiduals:
    def __init__(self, window_s: float = 30.0, samples: int = 16, min_samples: int = 4) -> None:
        if not (window_s > 0 and samples >= 1 and 1 <= min_samples <= samples):
            raise ValueError("window_s must be positive, 1 <= min_samples <= samples")
        self.window_s, self.samples, self.min_samples = window_s, samples, min_samples
        self._turns: dict[str, deque[tuple[float, float]]] = {}
        self._by_engine: dict[str, dict[str, deque[tuple[float, float]]]] = {}

    def observe(self, kind: str, residual_s: float, now: float, engine: str = "") -> None:
        """A turn of ``kind`` measured; ``engine``: the engine it is measured by (P/D: its prefill engine,
        DECODE_LOCAL: its decode engine), whose own estimate it also feeds."""
        self._turns.setdefault(kind, deque(maxlen=self.samples)).append((now, residual_s))
        if engine:
            self._by_engine.setdefault(kind, {}).setdefault(engine, deque(maxlen=self.samples)).append(
                (now, residual_s))

    def estimate(self, kind: str, now: float) -> float:
        """The kind's residual now: 0 with no turn of it in the window."""
        return self._estimate(self._turns.get(kind), now)

    def by_engine(self, kind: str, now: float) -> dict[str, float]:
        """Each engine's residual of ``kind`` now, for the engines with a turn of it in the window."""
        engines = self._by_engine.get(kind, {})
        out = {}
        for engine, turns in list(engines.items()):
            value = self._estimate(turns, now)  # ages its turns out first
            if turns:
                out[engine] = value
            else:
                del engines[engine]  # aged out: an engine gone from the fleet leaves nothing behind
        return out

    def _estimate(self, turns: deque[tuple[float, float]] | None, now: float) -> float:
        while turns and now - turns[0][0] > self.window_s:
            turns.popleft()
        if not turns:
            return 0.0
        estimate = median(r for _, r in turns) * min(1.0, len(turns) / self.min_samples)
        return max(-MAX_RESIDUAL_S, min(MAX_RESIDUAL_S, estimate))


class DriftAlarm:
    """When a kind's residual (the model's drift on this router's turns) goes past ``bound_s`` either way, and when
    it returns within: one log line at each crossing, not one a turn."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self._over: set[str] = set()

    def crossing(self, kind: str, estimate_s: float) -> bool | None:
        """True: the kind's drift went past the bound; False: it came back within; None: no crossing."""
        over = abs(estimate_s) > self.bound_s
        if over == (kind in self._over):
            return None
        (self._over.add if over else self._over.discard)(kind)
        return over
