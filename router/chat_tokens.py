"""One rendering per turn: a plain chat turn goes to the engine as the token ids the router already rendered. Pure.

The router renders the chat template and tokenizes every turn to place it (:mod:`.tokenizer`); sent as a chat
request, the engine's API server rendered and tokenized it again (~12 ms of the API server's CPU a request here,
and a first token later on every turn). vLLM 0.32's chat endpoint takes no token ids, its completions endpoint
does: :func:`token_request` turns the chat request into a completions request of the same tokens and sampling,
and :func:`chat_reply` / :class:`ChatStream` turn the engine's answer back into the chat shape the client asked
for. The tokens are the engine's own (the router renders only what it renders as vLLM does, checked against an
engine's ``/tokenize`` in ``tests/engines/test_router.py``), so the answer is the chat endpoint's.

Which requests take which path (:func:`token_request` returns None for the chat path):

- **Tokens**: a chat the router rendered itself (string contents, no template arguments), with a token budget
  (``max_tokens`` or ``max_completion_tokens``: without one vLLM's chat answers up to the context's end, its
  completions 16 tokens, and the router does not know the context), one choice, and only fields of
  :data:`SAME_MEANING` (they mean the same to both endpoints).
- **Chat**: everything else, among them ``tools`` and ``tool_choice`` (vLLM parses tool calls in its chat layer),
  ``logprobs`` (the two endpoints shape them differently), ``echo``, ``n`` > 1, reasoning fields, multimodal
  content. Engines that run a reasoning parser split every chat answer into reasoning and content, so a router in
  front of them sets ``chat_as_tokens`` off (``RouterConfig``).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

SAME_MEANING = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "stream",
    "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty", "ignore_eos",
    "min_tokens", "user", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "priority", "request_id", "logit_bias", "bad_words", "allowed_token_ids", "kv_transfer_params", "cache_salt",
    "response_format", "structured_outputs", "truncate_prompt_tokens", "return_token_ids", "session_id"})
"""Fields vLLM 0.32's chat and completions requests share with one meaning."""

encode_json = msgspec.json.Encoder().encode
"""A tenth of ``json.dumps``' time on a chunk (0.6 against 6.3 us here), and this runs once per relayed token."""

CHAT_ONLY_RENDERED = frozenset({"messages", "add_generation_prompt"})
"""Chat fields already in the rendered tokens."""


def token_request(body: dict[str, Any], tokens: list[int]) -> dict[str, Any] | None:
    """The chat request ``body`` as a completions request of ``tokens``; None where it must stay a chat."""
    budget = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(budget, int) or isinstance(budget, bool):
        return None
    if body.get("n") not in (None, 1) or body.get("logprobs") not in (None, False):
        return None
    fields = set(body) - CHAT_ONLY_RENDERED - {"max_completion_tokens", "n", "logprobs"}
    if fields - SAME_MEANING:
        return None
    request = {k: body[k] for k in fields}
    request.update(prompt=list(tokens), max_tokens=budget)
    return request


def chat_id(completion_id: Any) -> str:
    return "chatcmpl-" + str(completion_id).removeprefix("cmpl-")


def _choice(choice: dict[str, Any], stream: bool) -> dict[str, Any]:
    text = choice.get("text") or ""
    out: dict[str, Any] = {"index": choice.get("index", 0)}
    if stream:
        out["delta"] = {"content": text} if text or choice.get("finish_reason") is None else {"content": ""}
    else:
        out["message"] = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                          "function_call": None, "reasoning": None}
    out.update(logprobs=None, finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"))
    if choice.get("token_ids") is not None:
        out["token_ids"] = choice["token_ids"]
    return out


def chat_reply(completion: dict[str, Any]) -> dict[str, Any]:
    """A completions answer as the chat answer of the same tokens."""
    reply = {k: v for k, v in completion.items() if k not in ("id", "object", "choices")}
    return {"id": chat_id(completion.get("id")), "object": "chat.completion", **reply,
            "choices": [_choice(c, stream=False) for c in completion.get("choices") or []]}


class ChatStream:
    """A streamed completions answer, line by line, as the chat stream of the same tokens: a first chunk with the
    assistant's role (as vLLM's chat stream opens), then one chat chunk per completions chunk."""

    def __init__(self) -> None:
        self.opened = False

    def line(self, raw: bytes, data: Any = None) -> bytes:
        """One line of the engine's SSE stream (as aiohttp reads it: a data line, then a blank line), converted;
        comments, blank lines, ``[DONE]`` and error objects as they are. ``data``: the line's JSON when the caller
        has parsed it already (:func:`.resume.relayed_data`), so that a chunk is parsed once."""
        if data is None:
            text = raw.decode()
            if not text.startswith("data:") or text[5:].strip() == "[DONE]":
                return raw
            data = json.loads(text[5:])
        if not isinstance(data, dict) or "choices" not in data:
            return raw  # an error object: the client gets it as the engine sent it
        chunk = {"id": chat_id(data.get("id")), "object": "chat.completion.chunk", "created": data.get("created"),
                 "model": data.get("model"),
                 "choices": [_choice(c, stream=True) for c in data["choices"]]}
        if "usage" in data:
            chunk["usage"] = data["usage"]
        # Compact UTF-8 JSON, as vLLM's own chat chunks are (its API server writes them with pydantic).
        out = b"data: " + encode_json(chunk) + b"\n"  # the engine's blank line follows
        if not self.opened and chunk["choices"]:
            self.opened = True
            role = {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                          "finish_reason": None}]}
            role.pop("usage", None)
            out = b"data: " + encode_json(role) + b"\n\n" + out
        return out
