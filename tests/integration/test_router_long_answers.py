"""A busy engine is not a frozen one (issue 49): a non-streamed answer that takes longer than ``engine_stall_s`` is
waited for while its engine's step counters move, a frozen engine (SIGSTOP) is still replaced, and a call past
``request_timeout_s`` answers 504 naming the deadline. The router runs in this process in front of fake engines
(``tests/support/fake_engine.py``): one in this process, one in a process of its own that the test stops."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from kvloop.router.config import RouterConfig
from kvloop.router.server import start_router
from tests.support.fake_engine import FakeEngine

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STALL_S = 1.0
"""The router's engine_stall_s here: the answers below take several times as long."""


@pytest_asyncio.fixture
async def live() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine()
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.fixture
def stopped_engine(tmp_path: Path) -> Iterator[str]:
    """A fake engine in a process of its own, stopped with SIGSTOP once it listens: its URL."""
    port_file = tmp_path / "frozen.port"
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.fake_engine", str(port_file)], cwd=ROOT,
                            stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the fake engine did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGSTOP)
        yield f"http://127.0.0.1:{port_file.read_text()}"
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


async def ask(url: str, content: str) -> tuple[int, dict[str, Any], float]:
    body = {"model": "fake", "messages": [{"role": "user", "content": content}], "max_tokens": 4000}
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/chat/completions", json=body) as reply:
        return reply.status, await reply.json(content_type=None), time.monotonic() - t0


def router_config(prefill: str, decode: str, **values: Any) -> RouterConfig:
    return RouterConfig(listen="127.0.0.1:0", log_format="console", prefill_urls=prefill, decode_urls=decode,
                        engine_stall_s=STALL_S, **values)


async def test_a_long_non_streamed_answer_is_waited_for_not_retried(live: FakeEngine) -> None:
    live.answer_delay_s = 4 * STALL_S  # no byte for four stall periods; the step counter moves
    router = await start_router(router_config(live.url, live.url))
    try:
        status, reply, took = await ask(router.url, "a long answer")
    finally:
        await router.stop()
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"] == "ok" and took >= live.answer_delay_s
    decodes = [b for _, b in live.requests if b.get("max_tokens") != 1]
    assert len(decodes) == 1, decodes  # computed once, never cut and sent again
    assert live.scrapes >= 3  # watched while it computed


async def test_a_quick_answer_costs_the_engine_no_scrape(live: FakeEngine) -> None:
    router = await start_router(router_config(live.url, live.url))
    try:
        for i in range(3):
            status, reply, _ = await ask(router.url, f"a quick answer {i}")
            assert status == 200, reply
    finally:
        await router.stop()
    assert live.scrapes == 0


async def test_a_frozen_decode_engine_is_replaced(live: FakeEngine, stopped_engine: str) -> None:
    router = await start_router(router_config(live.url, f"{stopped_engine},{live.url}"))
    try:
        replies = [await ask(router.url, f"question {i}") for i in range(2)]  # round robin: one meets the frozen
    finally:
        await router.stop()
    assert [status for status, _, _ in replies] == [200, 200], replies
    assert max(took for _, _, took in replies) >= STALL_S  # one waited for the frozen engine to be given up
    assert len([b for _, b in live.requests if b.get("max_tokens") != 1]) == 2  # both answered by the live one


async def test_a_call_past_its_deadline_answers_504_naming_it(live: FakeEngine) -> None:
    live.answer_delay_s = 4 * STALL_S
    router = await start_router(router_config(live.url, live.url, request_timeout_s=2 * STALL_S))
    try:
        status, reply, took = await ask(router.url, "too long for the deadline")
    finally:
        await router.stop()
    assert status == 504, reply
    assert "request_timeout_s" in reply["error"]["message"] and "2 s" in reply["error"]["message"], reply
    assert took < live.answer_delay_s
