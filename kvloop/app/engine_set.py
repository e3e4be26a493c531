"""Starting a set of vLLM engines: the one way ``kvloop up``, every benchmark and the engine tests do it.

All engines are spawned at once (their start-ups overlap), then waited on until each answers ``/health``; on
any failure, or an interrupt, every engine of the set is stopped before the error propagates. Stopping is
parallel. Core binding on one machine is decided in :func:`kvloop.engines.config.role_cores`, and nowhere else.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvloop.engines.config import EngineConfig
from kvloop.engines.launcher import EngineProcess, plan_engine, spawn_engine
from kvloop.shared.vocabulary import Role


@dataclass
class EngineSet:
    engines: list[EngineProcess] = field(default_factory=list)

    def __iter__(self) -> Iterator[EngineProcess]:
        return iter(self.engines)

    def __len__(self) -> int:
        return len(self.engines)

    def of_role(self, role: Role) -> list[EngineProcess]:
        return [e for e in self.engines if e.plan.config.role == role]

    def by_id(self, engine_id: str) -> EngineProcess:
        return next(e for e in self.engines if e.engine_id == engine_id)

    def add(self, engine: EngineProcess) -> None:
        """An engine started later (a replacement); stopped with the others."""
        self.engines.append(engine)

    def stop(self) -> None:
        stop_all(self.engines)

    def __enter__(self) -> EngineSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_all(engines: Iterable[EngineProcess]) -> None:
    """Stop every engine (sidecar, then its process group), in parallel; idempotent."""
    threads = [threading.Thread(target=e.stop, name=f"stop-{e.engine_id}") for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def start_engines(configs: Sequence[EngineConfig], *, timeout_s: float | None = None) -> EngineSet:
    """Spawn every engine, then wait until each is healthy (``timeout_s``, default each config's
    ``startup_timeout_s``). On any failure all are stopped and the error (with the failing engine's log tail)
    is raised.

    Linux's parent-death signal is asked for only from the main thread: it fires when the *thread* that spawned
    the engine ends, which from a worker thread (``asyncio.to_thread``) is right after the spawn."""
    die_with_parent = threading.current_thread() is threading.main_thread()
    started = EngineSet()
    try:
        for config in configs:
            started.add(spawn_engine(plan_engine(config), die_with_parent=die_with_parent))
        for engine in started:
            engine.wait_ready(timeout_s if timeout_s is not None else engine.plan.config.startup_timeout_s)
    except BaseException:
        started.stop()
        raise
    return started


async def start_engines_async(configs: Sequence[EngineConfig], *, timeout_s: float | None = None) -> EngineSet:
    """:func:`start_engines` from async code, in a worker thread, never leaving engines behind (:func:`owned`)."""
    return await owned(lambda: start_engines(configs, timeout_s=timeout_s))


async def owned(start: Callable[[], EngineSet]) -> EngineSet:
    """Run ``start`` in a worker thread and return what it started. A cancelled caller (Ctrl-C or SIGTERM while
    engines start) cannot stop the thread: it waits for the thread, stops the engines it started, and is cancelled
    then. Without this, a benchmark interrupted while a configuration's engines started left them running (they run
    in sessions of their own, so nothing else stops them)."""
    job = asyncio.ensure_future(asyncio.to_thread(start))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        try:
            engines = await job
        except Exception:  # the start failed: it stopped what it had started
            raise asyncio.CancelledError() from None
        await asyncio.to_thread(engines.stop)
        raise
