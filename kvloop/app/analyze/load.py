"""Reading what to analyze: the router's records (JSONL of :class:`~kvloop.router.records.TurnRecord`),
OpenAI-style conversations (JSONL, one conversation a line) or a Mooncake-format trace (:mod:`kvloop.shared.mooncake`)
turned into the same records.

A conversation line is ``{"id": ..., "messages": [...], "start": s, "think_s": s or [s, ...]}`` or a bare list of
messages. Each user message starts a turn whose prompt is the conversation up to it, rendered with the model's chat
template (``tokenize``). A turn's time is its user message's ``timestamp`` (Unix seconds) when given; else the
conversation's ``start`` (default 0) plus, per earlier turn, ``turn_s`` (an assumed turn duration) and its think
time. A turn ends ``turn_s`` after it starts, or at the next turn's start if that is sooner. Its output tokens are
the next assistant message's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvloop.router.records import KEY_HEX, TurnRecord, key_digests
from kvloop.shared import mooncake
from kvloop.shared.errors import ConfigError
from kvloop.shared.hashing import ExtraKeys, block_keys

Tokenize = Callable[[list[dict[str, Any]]], list[int]]
"""Messages -> the prompt's token ids (with the generation prompt)."""
Count = Callable[[str], int]
"""Text -> its token count (an answer's length)."""


def read_lines(path: Path) -> list[tuple[int, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"records: cannot read {path}: {exc.strerror}", field="records") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((n, json.loads(line)))
            except ValueError as exc:
                raise ConfigError(f"records: {path}:{n}: not JSON ({exc})", field="records") from None
    if not out:
        raise ConfigError(f"records: {path} holds no records", field="records")
    return out


def is_conversations(lines: Sequence[tuple[int, Any]]) -> bool:
    first = lines[0][1]
    return isinstance(first, list) or (isinstance(first, dict) and "messages" in first)


def is_trace(lines: Sequence[tuple[int, Any]]) -> bool:
    return mooncake.is_trace_line(lines[0][1])


def hash_id_key(hash_id: int) -> str:
    """A trace block's key digest: the trace's ids already name a block with its prefix (equal ids are the same KV),
    so one hash of the id stands for the chained key kvloop computes from tokens."""
    return hashlib.sha256(b"mooncake:%d" % hash_id).hexdigest()[:KEY_HEX]


def trace_records(rows: Sequence[mooncake.TraceRow], block_size: int, turn_s: float) -> list[TurnRecord]:
    """One record per request, in arrival order. Sessions are the conversations :func:`mooncake.conversations`
    infers; a request ends ``turn_s`` after it arrives (the trace has no end times), or at its conversation's next
    request if that is sooner. Keys: one per whole block of the prompt, from its hash ids."""
    ordered = sorted(rows, key=lambda r: r.timestamp_ms)
    convs = mooncake.conversations(ordered)
    following: dict[int, float] = {}  # conversation -> the start of its request after the one at hand
    ends = [0.0] * len(ordered)
    for i in range(len(ordered) - 1, -1, -1):
        t = ordered[i].timestamp_ms / 1000
        nxt = following.get(convs[i])
        ends[i] = t + turn_s if nxt is None else max(t, min(t + turn_s, nxt))
        following[convs[i]] = t
    out: list[TurnRecord] = []
    for row, conv, end in zip(ordered, convs, ends, strict=True):
        whole = min(len(row.hash_ids), row.input_length // block_size)
        out.append(TurnRecord(t=row.timestamp_ms / 1000, t_end=end, session=f"conv-{conv}",
                              prompt_tokens=row.input_length, block_size=block_size,
                              keys=tuple(hash_id_key(h) for h in row.hash_ids[:whole]),
                              output_tokens=row.output_length))
    return out


def records_from(lines: Sequence[tuple[int, Any]], path: Path) -> list[TurnRecord]:
    out = []
    for n, raw in lines:
        if not isinstance(raw, dict):
            raise ConfigError(f"records: {path}:{n}: expected a JSON object", field="records")
        out.append(TurnRecord.from_dict(raw, f"records: {path}:{n}"))
    return out


def _think(raw: Any, turn: int, where: str) -> float:
    value = raw[turn] if isinstance(raw, list) and turn < len(raw) else 0.0 if isinstance(raw, list) else raw
    if not isinstance(value, int | float) or value < 0:
        raise ConfigError(f"{where}: think_s: expected seconds >= 0", field="think_s")
    return float(value)


def conversation_records(lines: Sequence[tuple[int, Any]], tokenize: Tokenize, count: Count, block_size: int,
                         turn_s: float, where: str = "conversations") -> list[TurnRecord]:
    extra = ExtraKeys("analyze")
    out: list[TurnRecord] = []
    for n, raw in lines:
        here = f"{where}:{n}"
        messages = raw.get("messages") if isinstance(raw, dict) else raw
        meta = raw if isinstance(raw, dict) else {}
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ConfigError(f"{here}: expected a list of OpenAI messages", field="messages")
        cuts = [i for i, m in enumerate(messages) if m["role"] == "user"]
        t = float(meta.get("start", 0.0))
        starts: list[float] = []
        for turn, cut in enumerate(cuts):
            stamp = messages[cut].get("timestamp")
            if stamp is not None and not isinstance(stamp, int | float):
                raise ConfigError(f"{here}: messages[{cut}].timestamp: expected Unix seconds", field="timestamp")
            if stamp is not None:
                t = float(stamp)
            elif turn:
                t += turn_s + _think(meta.get("think_s", 0.0), turn - 1, here)
            starts.append(t)
        for turn, cut in enumerate(cuts):
            tokens = list(tokenize(messages[: cut + 1]))
            answer = next((m for m in messages[cut + 1:] if m["role"] == "assistant"), None)
            end = starts[turn] + turn_s
            if turn + 1 < len(starts):
                end = max(starts[turn], min(end, starts[turn + 1]))
            out.append(TurnRecord(
                t=starts[turn], t_end=end, session=str(meta.get("id", f"conv-{n}")), prompt_tokens=len(tokens),
                block_size=block_size, keys=key_digests(block_keys(tokens, block_size, extra)),
                output_tokens=count(str(answer.get("content") or "")) if answer else 0))
    return out


def model_tokenizer(model: str) -> tuple[Tokenize, Count]:
    """The served model's tokenizer and chat template, rendered as the router renders them."""
    from kvloop.router.tokenizer import RouterTokenizer

    tok = RouterTokenizer(model)

    def tokenize(messages: list[dict[str, Any]]) -> list[int]:
        plain = [{"role": str(m["role"]), "content": str(m.get("content") or "")} for m in messages]
        tokens = tok.tokens("chat", {"messages": plain}, ())
        assert tokens is not None  # plain string messages always render here
        return tokens

    return tokenize, lambda text: len(tok.tokenizer.encode(text, add_special_tokens=False))
