"""Module-scoped broker processes, for tests that can share one replica (distinct engine ids each)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvloop.shared import procs

ModuleBrokerFactory = Callable[..., procs.Proc]


@pytest.fixture(scope="module")
def start_module_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleBrokerFactory]:
    """Like ``start_broker`` but the processes live for the whole module. Stopped with SIGTERM at teardown."""
    run_dir = tmp_path_factory.mktemp("module-brokers")
    started: list[procs.Proc] = []

    def start(name: str = "broker", *flags: str, env: dict[str, str] | None = None) -> procs.Proc:
        proc = procs.start_broker(name, flags, run_dir, env=env)
        started.append(proc)
        return proc

    yield start
    for proc in reversed(started):
        proc.stop()
