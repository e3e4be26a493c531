"""What this router has learned from its own turns and tells the broker with each placement: the engine requests it
has in flight (:mod:`.in_flight`), the turns it just answered (:mod:`.recent`) and its measure of the broker's
estimates (:mod:`.residuals`).

The :class:`~kvloop.router.turn.TurnRunner` owns the books and writes them as its turns run (:meth:`TurnBooks.track`,
:meth:`TurnBooks.answered`, :meth:`TurnBooks.observe_residual`); the :class:`~kvloop.router.placement.Placer` reads
them into each placement (:meth:`TurnBooks.stamp`, :meth:`TurnBooks.expected`). Neither reaches into the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager

from kvloop.router.config import RouterConfig
from kvloop.router.in_flight import InFlightCounts
from kvloop.router.recent import RecentTurns
from kvloop.router.residuals import DECODE_LOCAL, PD, DriftAlarm, PathResiduals, turn_residual
from kvloop.v1 import broker_pb2 as pb


class TurnBooks:
    def __init__(self, config: RouterConfig) -> None:
        self.in_flight = InFlightCounts()
        """Prefill and decode requests this router has sent and not yet seen end, per engine (sent with each
        placement: the broker prices load on them)."""
        self.recent = RecentTurns(config.publication_wait_s)
        self.residuals = PathResiduals(config.residual_window_s, config.residual_samples) \
            if config.residual_window_s > 0 else None
        """This router's measure of the broker's estimates, sent with each placement (None: measures none)."""
        self.drift = DriftAlarm(config.drift_log_s)

    def track(self, engine_id: str, tokens: int = 0) -> AbstractContextManager[Callable[[], None]]:
        """Counts one request to ``engine_id`` in flight while the block runs, and its ``tokens`` to compute until
        the block calls the function it is given (:meth:`InFlightCounts.track`)."""
        return self.in_flight.track(engine_id, tokens)

    def answered(self, prompt_keys: Sequence[bytes], now: float) -> None:
        """A turn whose prompt had these full-block keys has just been answered (:mod:`.recent`)."""
        self.recent.answered(prompt_keys, now)

    def observe_residual(self, path: str, cost: pb.CostEstimate, timings_ms: Mapping[str, float], now: float,
                         engine: str = "") -> tuple[str, float, float] | None:
        """A turn that ran its planned ``path`` as the broker planned it: its kind, its residual and the kind's
        estimate after it; None when this router measures no residuals or the turn cannot be measured
        (:func:`.residuals.turn_residual`); ``engine``: see :meth:`.PathResiduals.observe`."""
        if self.residuals is None:
            return None
        measured = turn_residual(path, cost, timings_ms)
        if measured is None:
            return None
        kind, residual_s = measured
        self.residuals.observe(kind, residual_s, now, engine)
        return kind, residual_s, self.residuals.estimate(kind, now)

    def stamp(self, request: pb.PlaceRequest, now: float) -> None:
        """A placement's figures from these books: the requests and prompt tokens in flight per engine, and the
        residual per kind of path when this router measures them."""
        request.in_flight.update(self.in_flight.snapshot())
        request.counts_in_flight = True
        request.in_flight_tokens.update(self.in_flight.tokens())
        if self.residuals is not None:
            request.pd_residual_s = self.residuals.estimate(PD, now)
            request.decode_local_residual_s = self.residuals.estimate(DECODE_LOCAL, now)
            request.pd_residual_by_engine.update(self.residuals.by_engine(PD, now))
            request.decode_local_residual_by_engine.update(self.residuals.by_engine(DECODE_LOCAL, now))

    def expected(self, prompt_keys: Sequence[bytes], now: float) -> tuple[int, float]:
        """(blocks the broker's match should reach, deadline to wait for it) (:meth:`RecentTurns.expected`)."""
        return self.recent.expected(prompt_keys, now)
