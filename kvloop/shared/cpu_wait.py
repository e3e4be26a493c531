"""How long threads have waited, runnable, for a core: the second field of Linux's ``schedstat`` (nanoseconds on a
run queue). A step that took longer than its own CPU time either waited for something (I/O, a lock) or for a core;
this tells the two apart. Where the kernel has no schedstat (not Linux, or built without it) the readers answer None.
"""

from __future__ import annotations

import time
from pathlib import Path

THREAD_SCHEDSTAT = "/proc/thread-self/schedstat"


def wait_ns(schedstat_text: str) -> int:
    """Run-queue wait in ns from a ``schedstat`` line: "<ns on cpu> <ns waiting on a run queue> <timeslices>"."""
    return int(schedstat_text.split()[1])


def thread_wait_s() -> float | None:
    """Seconds the calling thread has waited runnable for a core since it started; None where unknown."""
    try:
        with open(THREAD_SCHEDSTAT) as f:
            return wait_ns(f.read()) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def process_wait_ns(pid: int | str) -> int | None:
    """Run-queue wait in ns summed over a process's live threads (a thread that ended takes its wait with it);
    None where unknown."""
    total, seen = 0, False
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            total += wait_ns((task / "schedstat").read_text())
            seen = True
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return total if seen else None


class ThreadLaps:
    """The calling thread's CPU time and run-queue wait between laps, written into a turn's timings as
    ``<step>_cpu`` and ``<step>_cpu_wait`` (ms). On an event loop's thread the CPU includes the other coroutines'
    work within the step: a step's wall time less both is time nothing on that thread could run (it awaited I/O)."""

    def __init__(self) -> None:
        self.cpu, self.wait = time.thread_time(), thread_wait_s()

    def lap(self, timings: dict[str, float], step: str) -> None:
        cpu, wait = time.thread_time(), thread_wait_s()
        timings[f"{step}_cpu"] = round((cpu - self.cpu) * 1e3, 3)
        if wait is not None and self.wait is not None:
            timings[f"{step}_cpu_wait"] = round((wait - self.wait) * 1e3, 3)
        self.cpu, self.wait = cpu, wait
