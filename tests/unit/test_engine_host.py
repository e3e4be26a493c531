"""The host a CPU engine shares (kvloop.shared.engine_model.host): no background, no stretch; background work first
fills the cores the engines leave idle; what spills over stretches every step by 1 / (1 - share), the share capped;
a GPU fleet (no shared cores) is never stretched; bad figures are refused by name."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.shared.engine_model import HostShare, HostSpec
from kvloop.shared.errors import ConfigError


def busy_for(host: HostShare, engine: str, seconds: float, step: float = 0.05) -> float:
    """Runs ``engine`` back to back for ``seconds`` of idle-host work from t=0; the wall time it took."""
    t = 0.0
    done = 0.0
    while done < seconds:
        t += host.step(engine, t, step)
        done += step
    return t


def test_without_background_work_a_step_keeps_its_time() -> None:
    host = HostShare(HostSpec(cores=2), {"p": 1.0, "d": 1.0})
    assert busy_for(host, "d", 30.0) == pytest.approx(30.0)


def test_engines_on_their_own_hardware_are_never_stretched() -> None:
    host = HostShare(HostSpec(cores=0, client_cores=0.0, turn_cpu_s=1.0), {"d": 1.0})
    for t in range(100):
        host.charge(float(t), 5.0)
    assert host.step("d", 100.0, 0.25) == 0.25


def test_background_work_first_takes_the_idle_core() -> None:
    """One engine busy, one idle: half a core of background work fits on the idle one and slows no step."""
    host = HostShare(HostSpec(cores=2, client_cores=0.5), {"p": 1.0, "d": 1.0})
    assert busy_for(host, "d", 30.0) == pytest.approx(30.0)


def test_what_spills_over_stretches_every_step() -> None:
    """Both engines busy and 0.6 of a core beside them: each core gives up 0.3, so a step lasts 1 / 0.7 as long."""
    host = HostShare(HostSpec(cores=2, client_cores=0.6, window_s=2.0), {"p": 1.0, "d": 1.0})
    t = 0.0
    for _ in range(2000):  # both back to back, in lock step
        a = host.step("p", t, 0.01)
        b = host.step("d", t, 0.01)
        t += max(a, b)
    assert host.background_share() == pytest.approx(0.3, abs=0.02)
    assert host.step("d", t, 0.01) == pytest.approx(0.01 / 0.7, rel=0.03)


def test_the_share_is_capped() -> None:
    host = HostShare(HostSpec(cores=1, client_cores=0.9, max_share=0.5), {"d": 1.0})
    busy_for(host, "d", 40.0)
    assert host.background_share() == pytest.approx(0.5)


@settings(max_examples=60, deadline=None)
@given(charges=st.lists(st.tuples(st.floats(0, 100), st.floats(0, 3)), max_size=30),
       client=st.floats(0, 0.9), step=st.floats(0.001, 1.0))
def test_a_step_never_shrinks_nor_grows_past_the_cap(charges: list[tuple[float, float]], client: float,
                                                      step: float) -> None:
    host = HostShare(HostSpec(cores=1, client_cores=client, max_share=0.5), {"d": 1.0})
    for t, cpu in sorted(charges):
        host.charge(t, cpu)
    wall = host.step("d", 100.0, step)
    assert step <= wall <= step / 0.5 + 1e-12 and math.isfinite(wall)


@pytest.mark.parametrize(("changes", "field"), [
    ({"cores": -1}, "cores"),
    ({"cores": 2, "client_cores": 2.0}, "client_cores"),
    ({"turn_cpu_s": -0.1}, "turn_cpu_s"),
    ({"engine_request_cpu_s": float("nan")}, "engine_request_cpu_s"),
    ({"window_s": 0.0}, "window_s"),
    ({"max_share": 1.0}, "max_share"),
])
def test_an_impossible_host_is_refused_by_name(changes: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        HostSpec(**changes)  # type: ignore[arg-type]
    assert err.value.field == field
