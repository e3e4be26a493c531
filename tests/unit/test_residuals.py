"""The router's measured residuals of the broker's estimates (router/residuals.py): what a turn's residual is,
and how the moving mean follows turns and decays when none come."""

from __future__ import annotations

import pytest

from kvloop.router.residuals import DECODE_LOCAL, PD, PathResiduals, kind_of, turn_residual
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


def test_the_mean_starts_at_the_models_estimate_and_follows_turns() -> None:
    r = PathResiduals(weight=0.5, half_life_s=10.0)
    assert r.estimate(PD, 0.0) == 0.0
    r.observe(PD, 0.4, 0.0)
    assert r.estimate(PD, 0.0) == pytest.approx(0.2)
    r.observe(PD, 0.4, 0.0)
    assert r.estimate(PD, 0.0) == pytest.approx(0.3)
    assert r.estimate(DECODE_LOCAL, 0.0) == 0.0  # each kind its own


def test_the_mean_decays_to_the_models_estimate_while_no_turn_of_its_kind_comes() -> None:
    r = PathResiduals(weight=1.0, half_life_s=10.0)
    r.observe(PD, 0.4, 100.0)
    assert r.estimate(PD, 110.0) == pytest.approx(0.2)
    assert r.estimate(PD, 130.0) == pytest.approx(0.05)
    r.observe(PD, 0.1, 110.0)  # from the decayed figure, not the stale one
    assert r.estimate(PD, 110.0) == pytest.approx(0.1)


def test_one_stalled_turn_moves_the_mean_by_a_bounded_step() -> None:
    r = PathResiduals(weight=0.2, half_life_s=30.0, bound_s=5.0)
    r.observe(DECODE_LOCAL, 3600.0, 0.0)
    assert r.estimate(DECODE_LOCAL, 0.0) == pytest.approx(1.0)


@pytest.mark.parametrize("args", [(0.0, 30.0), (1.5, 30.0), (0.2, 0.0)])
def test_bad_settings_are_refused(args: tuple[float, float]) -> None:
    with pytest.raises(ValueError):
        PathResiduals(*args)
