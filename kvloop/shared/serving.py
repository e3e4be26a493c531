"""Small pieces every kvloop service shell shares: running a service's coroutine with its logging and
tracing set up, the heap frozen once it has started, the port file a launcher waits for, and the wait for
SIGTERM/SIGINT that starts a graceful shutdown."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop where it is installed (a faster event loop for the gRPC services)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def run_service(name: str, config: Any, serve: Callable[[Any], Coroutine[Any, Any, None]], *,
                console_spans: bool = False) -> int:
    """Configure logging (from ``config.log_format``/``log_level``) and tracing for service ``name``, run
    ``serve(config)`` until it returns, then flush the spans. Returns the exit code 0."""
    from kvloop.shared.telemetry import configure_logging, configure_tracing

    configure_logging(config.log_format, config.log_level)
    provider = configure_tracing(name, console_spans=console_spans)
    try:
        run_async(serve(config))
    finally:
        if provider is not None:
            provider.shutdown()
    return 0


def freeze_started_heap() -> int:
    """Move every object alive now out of the collector's reach (``gc.freeze``); the count moved. Called by each
    service once it has started (imports, tokenizer, app, clients): those objects live as long as the process, and
    scanning them is what makes a full collection slow. With transformers and torch imported (the router's
    tokenizer) a full collection scanned ~386k objects and took ~190 ms on an idle core here, ~1 ms after the
    freeze; in the router such a pause would stall its event loop and every turn in flight. vLLM's API server
    freezes its start-up heap for the same reason. (The router's rare 100-700 ms stalls under ``kvloop bench
    load`` were still there with the freeze: those are not the collector's.)"""
    gc.collect()
    gc.freeze()
    if not _UNFREEZE_AT_EXIT:
        # Frozen objects are never collected, not even as the interpreter ends: Triton's (imported with torch) then
        # outlive its nanobind bindings, which print pages of "nanobind: leaked ..." at every exit. Handing them
        # back to the collector at exit ends them as before the freeze.
        atexit.register(gc.unfreeze)
        _UNFREEZE_AT_EXIT.append(True)
    return gc.get_freeze_count()


_UNFREEZE_AT_EXIT: list[bool] = []


def write_port_file(path: Path | str, port: int) -> None:
    """Write ``port`` to ``path`` atomically (a reader never sees half a number)."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(port))
    tmp.replace(path)


async def wait_for_stop(stop: asyncio.Event | None = None) -> None:
    """Return on SIGTERM or SIGINT (or when ``stop`` is set); the handlers are removed afterwards."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
