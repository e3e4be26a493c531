"""The host a CPU engine shares (kvloop.shared.engine_model.host): no background, no stretch; background work goes
to the cores by the room the engines leave there and stretches those cores' steps by 1 / (1 - share), the share
capped; a GPU fleet (no shared cores) is never stretched; bad figures are refused by name."""

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
    host = HostShare(HostSpec(cores=2), {"p": (0,), "d": (1,)})
    assert busy_for(host, "d", 30.0) == pytest.approx(30.0)


def test_engines_on_their_own_hardware_are_never_stretched() -> None:
    host = HostShare(HostSpec(cores=0, client_cores=0.0, turn_cpu_s=1.0), {"d": ()})
    for t in range(100):
        host.charge(float(t), 5.0)
    assert host.step("d", 100.0, 0.25) == 0.25


def test_background_work_goes_where_the_engines_leave_room() -> None:
    """The decode engine busy on core 1, the prefill engine idle on core 0: half a core of background work lands
    mostly on core 0, where it would slow a prefill step, and slows the decode steps little."""
    host = HostShare(HostSpec(cores=2, client_cores=0.5, window_s=2.0), {"p": (0,), "d": (1,)})
    busy_for(host, "d", 30.0)
    prefill_core, decode_core = host.core_shares()
    assert prefill_core > 0.45 and decode_core < 0.05
    assert host.step("d", 1000.0, 0.01) < host.step("p", 1000.0, 0.01)


def test_a_shared_core_stretches_its_steps_by_processor_sharing() -> None:
    """One core, its engine busy, 0.3 of a core beside it: the background has nowhere else to go, and a step
    lasts 1 / 0.7 as long."""
    host = HostShare(HostSpec(cores=1, client_cores=0.3, window_s=2.0), {"d": (0,)})
    busy_for(host, "d", 30.0)
    assert host.core_shares() == [pytest.approx(0.3)]
    assert host.step("d", 1000.0, 0.01) == pytest.approx(0.01 / 0.7)


def test_the_share_is_capped() -> None:
    host = HostShare(HostSpec(cores=1, client_cores=0.9, max_share=0.5), {"d": (0,)})
    busy_for(host, "d", 40.0)
    assert host.background_share("d") == pytest.approx(0.5)


def test_each_engine_counts_its_processes_beside_its_worker() -> None:
    host = HostShare(HostSpec(cores=2, client_cores=0.2, engine_process_cores=0.1), {"p": (0,), "d": (1,)})
    assert host.demand() == pytest.approx(0.4)


def test_an_engine_bound_to_a_core_the_host_lacks_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        HostShare(HostSpec(cores=2), {"p": (0,), "d": (2,)})
    assert err.value.field == "cores"


@settings(max_examples=60, deadline=None)
@given(charges=st.lists(st.tuples(st.floats(0, 100), st.floats(0, 3)), max_size=30),
       client=st.floats(0, 0.9), step=st.floats(0.001, 1.0))
def test_a_step_never_shrinks_nor_grows_past_the_cap(charges: list[tuple[float, float]], client: float,
                                                      step: float) -> None:
    host = HostShare(HostSpec(cores=1, client_cores=client, max_share=0.5), {"d": (0,)})
    for t, cpu in sorted(charges):
        host.charge(t, cpu)
    wall = host.step("d", 100.0, step)
    assert step <= wall <= step / 0.5 + 1e-12 and math.isfinite(wall)


@pytest.mark.parametrize(("changes", "field"), [
    ({"cores": -1}, "cores"),
    ({"cores": 2, "client_cores": 2.0}, "client_cores"),
    ({"turn_cpu_s": -0.1}, "turn_cpu_s"),
    ({"engine_process_cores": float("nan")}, "engine_process_cores"),
    ({"window_s": 0.0}, "window_s"),
    ({"max_share": 1.0}, "max_share"),
])
def test_an_impossible_host_is_refused_by_name(changes: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        HostSpec(**changes)  # type: ignore[arg-type]
    assert err.value.field == field


def test_engines_on_one_core_share_it_while_both_compute() -> None:
    host = HostShare(HostSpec(cores=2), {"p0": (0,), "p1": (0,), "d": (1,)})
    assert host.step("p0", 0.0, 1.0) == pytest.approx(1.0)  # alone on core 0
    assert host.step("p1", 0.5, 1.0) == pytest.approx(1.5)  # half a second of p0's step still to run beside it
    assert host.step("d", 0.5, 1.0) == pytest.approx(1.0)  # core 1 is its own
    assert host.step("p0", 1.0, 0.2) == pytest.approx(0.4)  # p1 runs to 2.0: at most its own time again
    assert host.step("p0", 5.0, 1.0) == pytest.approx(1.0)  # both idle by then


@given(st.lists(st.tuples(st.sampled_from(["p0", "p1"]), st.floats(0.0, 2.0), st.floats(0.001, 1.0)), max_size=30))
@settings(max_examples=100, deadline=None)
def test_a_shared_core_never_speeds_a_step_nor_more_than_doubles_it(steps: list[tuple[str, float, float]]) -> None:
    host = HostShare(HostSpec(cores=1), {"p0": (0,), "p1": (0,)})
    now = 0.0
    for engine, gap, seconds in steps:
        now += gap
        wall = host.step(engine, now, seconds)
        assert seconds <= wall <= 2 * seconds + 1e-9
