"""router.chat_tokens: which chat turns go to the engine as token ids, and their answers back in the chat shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvloop.router.chat_tokens import ChatStream, chat_reply, token_request
from kvloop.router.resume import relayed_data

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "kv_transfer_params": {"x": 1}}


def test_a_plain_chat_becomes_a_completion_of_its_tokens() -> None:
    request = token_request(CHAT, [5, 6, 7])
    assert request == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "kv_transfer_params": {"x": 1}}
    assert token_request({**CHAT, "max_completion_tokens": 3, "max_tokens": 9}, [1])["max_tokens"] == 3
    assert token_request({**CHAT, "n": 1, "logprobs": False}, [1]) is not None


@pytest.mark.parametrize("change", [
    {"max_tokens": None},  # no budget: chat answers to the context's end, completions 16 tokens
    {"tools": [{"type": "function"}]}, {"tool_choice": "auto"}, {"logprobs": True}, {"top_logprobs": 2},
    {"n": 2}, {"echo": True}, {"reasoning_effort": "low"}, {"chat_template_kwargs": {}}, {"use_beam_search": True},
    {"prompt_logprobs": 1}, {"some_future_field": 1}])
def test_what_the_chat_layer_shapes_stays_a_chat(change: dict[str, Any]) -> None:
    body = {k: v for k, v in {**CHAT, **change}.items() if v is not None}
    assert token_request(body, [1, 2]) is None


def test_a_completion_answer_reads_as_the_chat_answer() -> None:
    completion = {"id": "cmpl-abc", "object": "text_completion", "created": 7, "model": "m",
                  "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length",
                               "stop_reason": None}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    reply = chat_reply(completion)
    assert reply["id"] == "chatcmpl-abc" and reply["object"] == "chat.completion" and reply["created"] == 7
    assert reply["choices"][0]["message"]["content"] == "ok" and reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["choices"][0]["finish_reason"] == "length" and reply["usage"] == completion["usage"]


def sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n".encode()


def events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


def test_a_completion_stream_reads_as_the_chat_stream() -> None:
    stream, out = ChatStream(), b""
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    for line in (sse({**chunk, "choices": [{"index": 0, "text": "o", "finish_reason": None}]}), b"\n",
                 sse({**chunk, "choices": [{"index": 0, "text": "k", "finish_reason": None}]}), b"\n",
                 sse({**chunk, "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}), b"\n",
                 sse({**chunk, "choices": [], "usage": {"total_tokens": 4}}), b"\n", b": kvloop {}\n", b"\n",
                 b"data: [DONE]\n", b"\n"):
        out += stream.line(line)
    got = events(out)
    assert [e["object"] for e in got] == ["chat.completion.chunk"] * 5 and {e["id"] for e in got} == {"chatcmpl-1"}
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in got[1:4]) == "ok"
    assert got[3]["choices"][0]["finish_reason"] == "stop" and got[4] == {**got[4], "choices": [],
                                                                           "usage": {"total_tokens": 4}}
    assert out.endswith(b": kvloop {}\n\ndata: [DONE]\n\n")  # comments and the end as they came
    error = b'data: {"error": {"message": "boom"}}\n'
    assert ChatStream().line(error) == error
    # Parsed once by the relay (resume.relayed_data): the same bytes as when the stream parses the line itself.
    again = ChatStream()
    lines = [sse({**chunk, "choices": [{"index": 0, "text": t, "finish_reason": None}]}) for t in "ok"]
    assert [again.line(x, relayed_data(x)) for x in lines] == [ChatStream().line(lines[0]), stream.line(lines[1])]
