"""Small pieces every kvloop service shell shares: the port file a launcher waits for, and the wait for
SIGTERM/SIGINT that starts a graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path


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
