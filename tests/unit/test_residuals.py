"""The router's measured residuals of the broker's estimates (router/residuals.py): what a turn's residual is,
and how its estimate follows turns, ignores a stall and forgets old turns."""

from __future__ import annotations

import pytest

from kvloop.router.residuals import DECODE_LOCAL, PD, DriftAlarm, PathResiduals, kind_of, turn_residual
from kvloop.v1 import broker_pb2 as pb


def test_a_turns_residual_is_its_measured_time_less_the_estimate_the_broker_made_before_its_correction() -> None:
    # The broker priced TRANSFER at 0.3 s, 0.2 s of which was this router's own P/D residual: the model said 0.1 s.
    cost = pb.CostEstimate(transfer_path_s=0.3, decode_local_s=0.05, pd_residual_s=0.2)
    timings = {"tokenize": 9.0, "place": 3.0, "pin": 1.0, "prefill": 300.0, "decode_first": 99.0}
    kind, residual = turn_residual("TRANSFER", cost, timings) or ("", 0.0)
    assert kind == PD and residual == pytest.approx(0.4 - 0.1)
    kind, residual = turn_residual("DECODE_LOCAL", cost, {"decode_first": 80.0}) or ("", 0.0)
    assert kind == DECODE_LOCAL and residual == pytest.approx(0.08 - 0.05)
    assert turn_residual("TRANSFER", cost, {"prefill": 300.0}) is None  # no first token timed
    assert turn_residual("RECOMPUTE", cost, timings) is None  # the broker priced no such path
    assert [kind_of(p) for p in ("RECOMPUTE", "PREFILL_LOCAL", "TRANSFER", "DECODE_LOCAL")] == [PD, PD, PD,
                                                                                                DECODE_LOCAL]


def test_the_estimate_is_the_median_of_the_kinds_recent_turns() -> None:
    r = PathResiduals(window_s=10.0, samples=5, min_samples=1)
    assert r.estimate(PD, 0.0) == 0.0
    for t, x in enumerate((0.3, 0.5, 0.4)):
        r.observe(PD, x, float(t))
    assert r.estimate(PD, 3.0) == pytest.approx(0.4)
    assert r.estimate(DECODE_LOCAL, 3.0) == 0.0  # each kind its own
    for t in range(3, 8):  # only the last 5 count
        r.observe(PD, 0.1, float(t))
    assert r.estimate(PD, 8.0) == pytest.approx(0.1)


def test_the_turns_one_stall_holds_up_together_do_not_move_the_price() -> None:
    """Eleven ordinary DECODE_LOCAL turns 0.1 s over, then five held 5 s by one engine stall."""
    r = PathResiduals(window_s=30.0, samples=16)
    for t in range(11):
        r.observe(DECODE_LOCAL, 0.1, float(t))
    for t in range(5):
        r.observe(DECODE_LOCAL, 5.0, 11.0 + t / 10)
    assert r.estimate(DECODE_LOCAL, 12.0) == pytest.approx(0.1)


def test_thin_evidence_moves_the_price_a_little_and_old_turns_age_out() -> None:
    r = PathResiduals(window_s=10.0, samples=16, min_samples=4)
    r.observe(PD, 0.8, 100.0)
    assert r.estimate(PD, 100.0) == pytest.approx(0.2)  # one turn of the four the median needs in full
    r.observe(PD, 0.8, 101.0)
    assert r.estimate(PD, 101.0) == pytest.approx(0.4)
    assert r.estimate(PD, 110.5) == pytest.approx(0.2)  # the first turn has aged out
    assert r.estimate(PD, 111.5) == 0.0  # back to the model's own estimate


def test_the_estimate_stays_within_what_the_broker_accepts() -> None:
    """Turns held past the broker's bound (a stalled engine, a 600 s request timeout) must not get the router's
    placements refused: the estimate is clamped to it."""
    from kvloop.broker.core.state import Limits
    from kvloop.shared.protocol import MAX_RESIDUAL_S

    assert Limits().max_residual_s == MAX_RESIDUAL_S
    r = PathResiduals(window_s=1000.0, samples=4, min_samples=1)
    for t in range(4):
        r.observe(PD, 500.0, float(t))
        r.observe(DECODE_LOCAL, -500.0, float(t))
    assert r.estimate(PD, 4.0) == MAX_RESIDUAL_S and r.estimate(DECODE_LOCAL, 4.0) == -MAX_RESIDUAL_S


@pytest.mark.parametrize("args", [(0.0, 16, 4), (30.0, 0, 1), (30.0, 4, 5), (30.0, 16, 0)])
def test_bad_settings_are_refused(args: tuple[float, int, int]) -> None:
    with pytest.raises(ValueError):
        PathResiduals(*args)


def test_the_drift_alarm_speaks_once_when_a_kind_goes_past_its_bound_and_once_when_it_returns() -> None:
    alarm = DriftAlarm(0.5)
    assert alarm.crossing(PD, 0.2) is None
    assert alarm.crossing(PD, 0.7) is True
    assert alarm.crossing(PD, 1.4) is None  # still past it: no second line
    assert alarm.crossing(DECODE_LOCAL, -0.6) is True  # either way, each kind apart
    assert alarm.crossing(PD, 0.5) is False
    assert alarm.crossing(PD, 0.1) is None
    assert alarm.crossing(DECODE_LOCAL, -0.6) is None
