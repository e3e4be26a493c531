"""``owned``: engines started in a worker thread for async code are never left behind by a cancelled caller."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from kvloop.app.engine_set import owned


class FakeEngines:
    """Stands in for an ``EngineSet``: records whether it was stopped."""

    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


async def test_a_caller_cancelled_while_engines_start_stops_them_once_they_are_up() -> None:
    started = threading.Event()
    engines = FakeEngines()

    def slow_start() -> Any:
        started.set()
        time.sleep(0.3)  # the engines' start-up, in the worker thread
        return engines

    caller = asyncio.create_task(owned(slow_start))
    await asyncio.to_thread(started.wait, 5)
    caller.cancel()  # as Ctrl-C or SIGTERM does to a benchmark mid-start
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert engines.stopped


async def test_an_uncancelled_caller_gets_the_engines_running_and_a_failed_start_raises() -> None:
    engines = FakeEngines()
    assert await owned(lambda: engines) is engines and not engines.stopped

    def failing() -> Any:
        raise RuntimeError("engine decode-2 exited early")

    with pytest.raises(RuntimeError, match="exited early"):
        await owned(failing)
