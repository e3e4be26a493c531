"""``kvloop bench load``'s warm-up: its text, its rounds and what it sends, against a fake OpenAI engine (no vLLM);
the bench runs it for real in ``tests/engines/test_load.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvloop.app.benchmarks.warmup import WarmUp, session_messages, warm_up
from kvloop.shared import headers as hdr
from tests.support.fake_engine import FakeEngine


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine()
    await fake.start()
    yield fake
    await fake.stop()


def test_each_session_has_its_own_text_of_the_asked_length() -> None:
    spec = WarmUp(prompt_words=50, turn_words=7, turns=3)
    first, other = session_messages(spec, 0), session_messages(spec, 1)
    assert len(first) == 3 and all(len(turn) == 1 and turn[0]["role"] == "user" for turn in first)
    assert len(first[0][0]["content"].split()) == 3 + 50  # "warm-up session 0:" and the words
    assert [len(t[0]["content"].split()) for t in first[1:]] == [7, 7]
    assert first != other and first == session_messages(spec, 0)  # distinct, and the same on every run


@pytest.mark.parametrize("field", ["sessions", "turns", "rounds", "prompt_words", "turn_words", "answer_tokens"])
def test_each_count_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        WarmUp(**{field: 0})


async def test_rounds_of_sessions_each_turn_carrying_the_history(engine: FakeEngine) -> None:
    spec = WarmUp(sessions=3, turns=2, rounds=2, prompt_words=10, turn_words=5, answer_tokens=4)
    seconds = await warm_up(engine.url, "tiny", spec)
    assert seconds > 0 and len(engine.requests) == 3 * 2 * 2
    sessions = {h[hdr.SESSION_ID] for h, _ in engine.requests}
    assert len(sessions) == 6
    for _, body in engine.requests:
        assert body["stream"] is True and body["max_tokens"] == 4 and body["model"] == "tiny"
    second = [b for h, b in engine.requests if len(b["messages"]) > 1]
    assert len(second) == 6
    # The second turn carries the first, the streamed answer ("o" + "k") and the new user message.
    assert all([m["role"] for m in b["messages"]] == ["user", "assistant", "user"] for b in second)
    assert all(b["messages"][1]["content"] == "ok" for b in second)
    # The second round starts after the first: its sessions' first turns come after every turn of the first round.
    order = [h[hdr.SESSION_ID] for h, _ in engine.requests]
    assert max(i for i, s in enumerate(order) if s.endswith(("-0", "-1", "-2"))) < \
        min(i for i, s in enumerate(order) if s.endswith(("-3", "-4", "-5")))


async def test_a_failed_turn_is_an_error_naming_the_status(engine: FakeEngine) -> None:
    engine.fail_status = 503
    with pytest.raises(RuntimeError, match="HTTP 503"):
        await warm_up(engine.url, "tiny", WarmUp(sessions=1, rounds=1, prompt_words=5, turn_words=5))
