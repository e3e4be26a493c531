"""Fixtures that start real servers: etcd (Debian etcd-server) and broker processes on loopback.

Readiness is polled (etcd /health, the broker's port file and gRPC health), never slept for.
Everything started here is stopped at teardown, even when a test fails.
"""

from __future__ import annotations

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
