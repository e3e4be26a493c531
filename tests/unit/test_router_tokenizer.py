"""The router's tokenizer encodes only what a session's next prompt adds (router/tokenizer.py's SessionPrefixes): the
ids are those of a whole encode on any conversation, and a prompt that does not repeat the last one is encoded
whole."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.router.tokenizer import RouterTokenizer, SessionPrefixes, boundary_tokens
from kvloop.shared.paths import IMPORT_ROOT

TINY = IMPORT_ROOT / ".kvloop" / "models" / "tiny"


class FakeEncoder:
    """A fake encoder: one id per character, ``<E>`` one id of its own; it records what it was asked to encode."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __call__(self, text: str) -> list[int]:
        self.asked.append(text)
        out, i = [], 0
        while i < len(text):
            if text.startswith("<E>", i):
                out.append(0)
                i += 3
            else:
                out.append(ord(text[i]))
                i += 1
        return out


def test_a_session_encodes_what_follows_its_last_boundary_and_a_changed_history_whole() -> None:
    fake, prefixes = FakeEncoder(), SessionPrefixes({0: "<E>"}, max_sessions=2)
    first = "sys<E>user one<E>ass"
    assert prefixes.encode("s", first, fake) == fake(first)
    fake.asked.clear()
    second = first + "wer<E>user two<E>ass"
    assert prefixes.encode("s", second, fake) == FakeEncoder()(second)
    assert fake.asked == ["asswer<E>user two<E>ass"]  # from the first prompt's last boundary on
    fake.asked.clear()
    edited = "SYS<E>user one<E>answer<E>user two<E>ass"  # the history changed: nothing is reused
    assert prefixes.encode("s", edited, fake) == FakeEncoder()(edited) and fake.asked == [edited]
    fake.asked.clear()
    assert prefixes.encode("", second, fake) == FakeEncoder()(second) and fake.asked == [second]  # no session


def test_the_least_recently_used_sessions_are_forgotten_past_the_bound() -> None:
    fake, prefixes = FakeEncoder(), SessionPrefixes({0: "<E>"}, max_sessions=2)
    for session in ("a", "b", "c"):
        prefixes.encode(session, f"{session}<E>x", fake)
    fake.asked.clear()
    prefixes.encode("a", "a<E>xy", fake)
    assert fake.asked == ["a<E>xy"]  # "a" was forgotten when "c" came
    fake.asked.clear()
    prefixes.encode("c", "c<E>xy", fake)
    assert fake.asked == ["xy"]
    off = SessionPrefixes({0: "<E>"}, max_sessions=0)
    off.encode("a", "a<E>x", fake)
    fake.asked.clear()
    off.encode("a", "a<E>xy", fake)
    assert fake.asked == ["a<E>xy"]


@pytest.fixture(scope="module")
def tiny() -> RouterTokenizer:
    if not (Path(TINY) / "tokenizer.json").exists():
        pytest.skip("the tiny model is built by `kvloop model tiny` (the test command's set-up)")
    return RouterTokenizer(str(TINY), prefix_sessions=64)


TEXT = st.lists(st.sampled_from([*"ab cd\n\t.,é字", "<|im_end|>", "<|im_start|>", "  ", "\n\n", "Ġ"]),
                max_size=30).map("".join)


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=5), system=TEXT)
def test_a_conversation_encoded_turn_by_turn_is_the_whole_encode(tiny: RouterTokenizer, turns: list[tuple[str, str]],
                                                                 system: str) -> None:
    assert boundary_tokens(tiny.tokenizer)  # the tiny model's <|im_start|>, <|im_end|>, <|endoftext|>
    session = f"s{hash((system, tuple(turns)))}"
    messages = [{"role": "system", "content": system}]
    for user, answer in turns:
        messages.append({"role": "user", "content": user})
        got = tiny.tokens("chat", {"messages": messages}, (), session)
        text = tiny.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert got == tiny.encode_chat(text)
        messages.append({"role": "assistant", "content": answer})
