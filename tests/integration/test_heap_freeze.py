"""A started service freezes its start-up heap (``kvloop.shared.serving.freeze_started_heap``): the router, here
in this process in front of a fake engine, and the helper itself."""

from __future__ import annotations

import gc

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
