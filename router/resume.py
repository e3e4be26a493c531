"""Resuming a streamed answer on another decode engine when the first dies mid-stream. Pure: no I/O.

A decode engine can die (or stall past ``engine_stall_s``) after the client has had part of the answer. The
router then sends the same request to another decode engine, recomputing the prompt there (never with the first
engine's transfer params: the prefill engine may have freed, and reused, the blocks they name once the first
decode read them), and relays only what the client has not had yet. At temperature 0 the second engine
generates the same tokens again (up to near-ties, as any recompute); sampled answers continue from the same
point with another draw, which is as good an answer as the first engine's.

The ledger counts what was delivered of choice 0: token ids when the chunks carry them (``return_token_ids``),
else text. A replayed chunk that lies wholly inside what was delivered is dropped; the chunk that crosses the
boundary is cut. Only ``n == 1`` answers are resumed (several choices interleave in one stream).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvloop.shared.http import sse_data


def relayed_data(line: bytes) -> Any:
    """The JSON of a relayed SSE line (:func:`kvloop.shared.http.sse_data`), None also for one that does not parse
    (the relay passes it on as it came). Parsed once per chunk, for the ledger and the chat conversion."""
    try:
        return sse_data(line)
    except ValueError:
        return None


def chunk_choice(data: Any) -> dict[str, Any] | None:
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice: dict[str, Any] = choices[0]
    return choice


def choice_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return str(delta.get("content") or "")
    return str(choice.get("text") or "")


def set_choice_text(choice: dict[str, Any], text: str) -> None:
    if isinstance(choice.get("delta"), dict):
        choice["delta"]["content"] = text
    else:
        choice["text"] = text


@dataclass
class StreamLedger:
    """What the client has had of one streamed answer, and, after a resume, what of the new stream to drop."""

    delivered_parts: list[str] = field(default_factory=list)
    """The text delivered, chunk by chunk: appending to one string copied it whole at every chunk (a 32,000-chunk
    answer cost 550 ms of the router's CPU in the ledger alone); joined only when a resume needs it."""
    delivered_chars: int = 0
    delivered_tokens: int = 0
    chunks: int = 0
    skip_text: int = 0
    skip_tokens: int = 0
    replaying: bool = False
    diverged: bool = False
    """The replayed text differed from what was delivered (a near-tie on the new engine): relayed from the cut."""

    @property
    def started(self) -> bool:
        return self.chunks > 0

    @property
    def delivered_text(self) -> str:
        if len(self.delivered_parts) > 1:
            self.delivered_parts[:] = ["".join(self.delivered_parts)]
        return self.delivered_parts[0] if self.delivered_parts else ""

    def resume(self) -> None:
        """A new stream begins: drop what was delivered (and the new stream's opening chunks without content)."""
        self.skip_text, self.skip_tokens, self.replaying = self.delivered_chars, self.delivered_tokens, True

    def relay(self, line: bytes, data: Any) -> bytes | None:
        """The line to send the client (None: drop it), recording what it delivers; ``data``: the line's
        :func:`relayed_data`, rewritten in place when a replayed chunk is cut."""
        if data is None:
            return line
        choice = chunk_choice(data)
        if choice is None:
            return line  # a usage chunk or an error: passed on as is
        text = choice_text(choice)
        ids = choice.get("token_ids")
        ids = list(ids) if isinstance(ids, list) else None
        if self.replaying:
            cut = self._cut(choice, text, ids)
            if cut is None:
                return None
            text, ids = cut
            line = b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n"
        if text:
            self.delivered_parts.append(text)
            self.delivered_chars += len(text)
        self.delivered_tokens += len(ids) if ids is not None else 0
        self.chunks += 1
        return line

    def _cut(self, choice: dict[str, Any], text: str, ids: list[int] | None) -> tuple[str, list[int] | None] | None:
        """Drop the part of a replayed chunk the client already has; None when nothing of it is new."""
        if not text and not ids and not choice.get("finish_reason"):
            return None  # an opening chunk (the role) or an empty one: the client had its own
        if ids is not None and self.skip_tokens:
            if len(ids) <= self.skip_tokens and not choice.get("finish_reason"):
                self.skip_tokens -= len(ids)
                self.skip_text = max(0, self.skip_text - len(text))
                return None
            keep = ids[self.skip_tokens:]
            # The text of a chunk of several tokens cannot be split exactly without the tokenizer: keep it whole
            # only when all its tokens are new, else keep none of it (the ids are exact either way).
            text = text if self.skip_tokens == 0 else ""
            self.skip_tokens, self.skip_text, self.replaying = 0, 0, False
            choice["token_ids"] = keep
            set_choice_text(choice, text)
            return text, keep
        seen = self.delivered_text[self.delivered_chars - self.skip_text:]
        if len(text) <= self.skip_text and not choice.get("finish_reason"):
            if not seen.startswith(text):
                self.diverged = True
            self.skip_text -= len(text)
            return None
        if not text.startswith(seen):
            self.diverged = True
        text = text[self.skip_text:]
        self.skip_text, self.skip_tokens, self.replaying = 0, 0, False
        set_choice_text(choice, text)
        return text, ids
