"""``kvloop.shared.cpu_wait``: reading the run-queue wait of Linux's schedstat, and the router's per-step laps."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvloop.shared import cpu_wait


def test_wait_ns_is_the_second_field() -> None:
    assert cpu_wait.wait_ns("123456 7890 12\n") == 7890
    with pytest.raises(IndexError):
        cpu_wait.wait_ns("123456\n")


def test_readers_answer_none_where_there_is_no_schedstat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_wait, "THREAD_SCHEDSTAT", "/nonexistent/schedstat")
    assert cpu_wait.thread_wait_s() is None
    assert cpu_wait.process_wait_ns(2**31 - 1) is None  # no such process
    timings: dict[str, float] = {}
    laps = cpu_wait.ThreadLaps()
    laps.lap(timings, "place")
    assert "place_cpu" in timings and "place_cpu_wait" not in timings


@pytest.mark.skipif(not sys.platform.startswith("linux") or cpu_wait.thread_wait_s() is None,
                    reason="needs Linux schedstat")
def test_a_busy_step_shows_its_cpu_and_a_thread_kept_off_its_core_shows_its_wait() -> None:
    cores = os.sched_getaffinity(0)
    core = min(cores)
    os.sched_setaffinity(0, {core})
    try:
        timings: dict[str, float] = {}
        laps = cpu_wait.ThreadLaps()
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        laps.lap(timings, "tokenize")
        assert timings["tokenize_cpu"] >= 45.0

        # Another process spinning on the same core: this thread, runnable too, waits for its slices.
        spinner = subprocess.Popen([sys.executable, "-c", f"import os, time\nos.sched_setaffinity(0, {{{core}}})\n"
                                    "end = time.monotonic() + 0.5\nwhile time.monotonic() < end: pass"])
        try:
            laps.lap(timings, "idle")
            end = time.monotonic() + 0.4
            while time.monotonic() < end:
                pass
            laps.lap(timings, "place")
        finally:
            spinner.wait()
        assert timings["place_cpu_wait"] > 20.0
        process_ns = cpu_wait.process_wait_ns(os.getpid())
        assert process_ns is not None and process_ns >= int(timings["place_cpu_wait"] * 1e6)
    finally:
        os.sched_setaffinity(0, cores)
