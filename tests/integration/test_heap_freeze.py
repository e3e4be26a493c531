"""A started service freezes its start-up heap (``kvloop.shared.serving.freeze_started_heap``): the router, here
in this process in front of a fake engine, and the helper itself."""

from __future__ import annotations

import gc

import pytest

from kvloop.router.config import RouterConfig
from kvloop.router.server import start_router
from kvloop.shared.serving import freeze_started_heap
from tests.support.fake_engine import FakeEngine


def test_the_helper_moves_the_live_heap_out_of_the_collector() -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    kept = [object() for _ in range(1000)]
    assert freeze_started_heap() >= len(kept) and gc.get_freeze_count() >= len(kept)


async def test_a_started_router_has_frozen_its_heap() -> None:
    engine = FakeEngine()
    await engine.start()
    gc.unfreeze()
    try:
        running = await start_router(RouterConfig(listen="127.0.0.1:0", log_format="console",
                                                  prefill_urls=engine.url, decode_urls=engine.url))
        try:
            assert gc.get_freeze_count() > 0
        finally:
            await running.stop()
    finally:
        await engine.stop()


FROZEN_WITH_TRITON = """
import triton.language  # as torch pulls it into the router's process with its tokenizer
from kvloop.shared.serving import freeze_started_heap
assert freeze_started_heap() > 0
print("frozen")
"""


def test_a_frozen_process_exits_without_nanobinds_leak_report() -> None:
    """Frozen objects outlive the interpreter unless handed back at exit: Triton's then outlived its nanobind
    bindings, which printed pages of "nanobind: leaked ..." at the exit of every process that froze its heap."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    result = subprocess.run([sys.executable, "-c", FROZEN_WITH_TRITON], capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0 and "frozen" in result.stdout, result.stderr[-2000:]
    assert "nanobind" not in result.stderr, result.stderr[-2000:]
