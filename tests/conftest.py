"""Fixtures that start real servers: etcd (Debian etcd-server) and broker processes on loopback.

Readiness is polled (etcd /health, the broker's port file and gRPC health), never slept for.
Everything started here is stopped at teardown, even when a test fails.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvloop.shared import procs


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real etcd for the whole test session (tests isolate themselves by key prefix)."""
    work = tmp_path_factory.mktemp("etcd")
    proc = procs.start_etcd(work / "data", work)
    try:
        yield proc.extra["endpoint"]
    finally:
        proc.stop()


@pytest.fixture
def etcd_prefix() -> str:
    return f"/kvloop-test-{uuid.uuid4().hex[:8]}/"


BrokerFactory = Callable[..., procs.Proc]


@pytest.fixture
def start_broker(tmp_path: Path) -> Iterator[BrokerFactory]:
    """``start_broker(name, *flags, env=None)`` runs ``kvloop broker serve`` on a free loopback port and
    returns its Proc (``.extra['address']``). Stopped with SIGTERM at teardown."""
    started: list[procs.Proc] = []

    def start(name: str = "broker", *flags: str, env: dict[str, str] | None = None) -> procs.Proc:
        proc = procs.start_broker(name, flags, tmp_path / "run", env=env)
        started.append(proc)
        return proc

    yield start
    for proc in reversed(started):
        proc.stop()


def _busy_core_seconds() -> float:
    """Machine-wide busy CPU time so far (every core's user, nice, system, irq and softirq ticks), in seconds."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """With ``KVLOOP_TEST_CPU_LOG=FILE``: one JSON line per test (wall seconds and the machine's busy core-seconds
    over its setup, call and teardown), because the suite is bound by CPU work, and --durations shows only time."""
    out = os.environ.get("KVLOOP_TEST_CPU_LOG")
    if not out:
        yield
        return
    t0, c0 = time.monotonic(), _busy_core_seconds()
    yield
    line = {"test": item.nodeid, "wall_s": round(time.monotonic() - t0, 1),
            "core_s": round(_busy_core_seconds() - c0, 1)}
    with open(out, "a") as f:
        f.write(json.dumps(line) + "\n")
