"""The router's stream ledger: a broken stream resumed on another engine gives the client each token once."""

from __future__ import annotations

import json
from typing import Any

from kvloop.router.resume import StreamLedger, relayed_data


def chat(content: str | None, *, role: bool = False, finish: str | None = None) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": content}
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).encode()


def completion(text: str, ids: list[int], finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
    return b"data: " + json.dumps({"choices": [choice]}).encode()


def client_text(lines: list[bytes]) -> str:
    out = []
    for line in lines:
        data = json.loads(line[6:])
        for choice in data.get("choices", []):
            out.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return "".join(out)


def relay_all(ledger: StreamLedger, lines: list[bytes]) -> list[bytes]:
    return [out for line in lines if (out := ledger.relay(line, relayed_data(line))) is not None]


def test_a_chat_stream_resumed_by_text_is_delivered_once() -> None:
    first = [chat(None, role=True), chat("Hel"), chat("lo, "), chat("wor")]  # the engine dies here
    second = [chat(None, role=True), chat("Hel"), chat("lo, wo"), chat("rld"), chat("", finish="stop"), b"data: [DONE]"]
    ledger = StreamLedger()
    got = relay_all(ledger, first)
    ledger.resume()
    got += relay_all(ledger, second)
    assert client_text([g for g in got if g.startswith(b"data: {")]) == "Hello, world"
    assert got[-1] == b"data: [DONE]" and not ledger.diverged
    roles = [g for g in got if b'"role"' in g]
    assert len(roles) == 1  # the new stream's opening chunk is not sent again


def test_a_completion_stream_resumed_by_token_ids() -> None:
    first = [completion("a", [1]), completion("b", [2]), completion("c", [3])]
    second = [completion("a", [1]), completion("bc", [2, 3]), completion("d", [4]), completion("e", [5], "length")]
    ledger = StreamLedger()
    got = relay_all(ledger, first)
    ledger.resume()
    got += relay_all(ledger, second)
    ids = [i for g in got for i in json.loads(g[6:])["choices"][0]["token_ids"]]
    assert ids == [1, 2, 3, 4, 5] and client_text(got) == "abcde"


def test_a_chunk_that_crosses_the_boundary_is_cut() -> None:
    ledger = StreamLedger()
    relay_all(ledger, [completion("ab", [1, 2])])
    ledger.resume()
    (cut,) = relay_all(ledger, [completion("abc", [1, 2, 3])])
    assert json.loads(cut[6:])["choices"][0]["token_ids"] == [3]


def test_a_divergent_replay_is_flagged_and_relayed_from_the_cut() -> None:
    ledger = StreamLedger()
    relay_all(ledger, [chat("The cat")])
    ledger.resume()
    got = relay_all(ledger, [chat("The dog sat"), chat(".", finish="stop")])
    assert ledger.diverged and client_text(got) == " sat."


def test_usage_and_error_chunks_pass_as_they_are() -> None:
    ledger = StreamLedger()
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3}}'
    assert ledger.relay(usage, relayed_data(usage)) == usage and ledger.relay(b"\n", relayed_data(b"\n")) == b"\n"
    assert not ledger.started and relayed_data(b"data: [DONE]") is None and relayed_data(b"data: {bad") is None
