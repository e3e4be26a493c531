"""Tokenizing in the router with the served model's own tokenizer and chat template: one HTTP round trip to an
engine (``/tokenize``) less on every turn's critical path.

The block keys must be exactly the token ids the engines compute, so the router renders only what it renders
the way vLLM 0.32 does (``tests/engines/test_router.py`` checks it equal to an engine's ``/tokenize``):

- chat: every message a plain string ``content`` with a ``role``; the model's chat template with
  ``add_generation_prompt`` (default true), then the text encoded without special tokens (vLLM's chat default),
  only what follows the part a session's last prompt already had (:class:`SessionPrefixes`);
- completions: a string prompt, encoded with special tokens (vLLM's completions default).

Anything else (tools, documents, a request's own ``chat_template`` or its kwargs, ``continue_final_message``,
``add_special_tokens``, content parts such as images) returns None, and the turn asks an engine's ``/tokenize``
as before. Loading happens once, at start (``RouterConfig.tokenizer``: the model's directory or hub name).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvloop.shared.errors import ConfigError

RENDERED_CHAT_FIELDS = frozenset({"add_generation_prompt"})
"""Chat-template fields the router renders itself; any other (router/engine_calls.py's CHAT_TEMPLATE_FIELDS) goes to
an engine."""


@dataclass(frozen=True, slots=True)
class RenderedPrefix:
    """A session's last rendered prompt up to its last boundary token: the text's length and digest, and its ids."""

    chars: int
    digest: bytes
    ids: array


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class SessionPrefixes:
    """Each session's next prompt repeats its last one: encode only what follows the last boundary token of it.

    A boundary token is an added token the tokenizer matches as a whole wherever its text appears and that leaves
    the text after it alone (special, not normalized, no ``lstrip``/``rstrip``/``single_word``: the chat template's
    ``<|im_end|>`` and the like). HF's fast tokenizers split a text at such tokens before anything else, so the ids
    up to one do not depend on what follows it: ids(text) == ids(text[:cut]) + ids(text[cut:]) for a cut just after
    one. A new prompt that starts with the remembered text up to the cut (by digest) reuses its ids; any other is
    encoded whole. An agent's 30k-token history then costs the router the new turn's tokens, not the whole history,
    every turn (``tests/unit/test_router_tokenizer.py`` holds it equal to a whole encode on random conversations).
    At most ``max_sessions`` are remembered, the least recently used forgotten."""

    def __init__(self, boundaries: Mapping[int, str], max_sessions: int) -> None:
        self.boundaries = dict(boundaries)
        self.max_sessions = max_sessions
        self._prefixes: OrderedDict[str, RenderedPrefix] = OrderedDict()
        self._lock = threading.Lock()  # long prompts are encoded in a thread (router/turn.py)

    def encode(self, session: str, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        with self._lock:
            known = self._prefixes.get(session) if session and self.max_sessions else None
        if known is not None and len(text) >= known.chars and _digest(text[:known.chars]) == known.digest:
            ids = known.ids.tolist() + encode(text[known.chars:])
        else:
            ids = encode(text)
        if session and self.max_sessions:
            self._remember(session, text, ids)
        return ids

    def _remember(self, session: str, text: str, ids: list[int]) -> None:
        last = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] in self.boundaries), None)
        if last is None:
            return
        mark = self.boundaries[ids[last]]
        chars = text.rfind(mark) + len(mark)  # every occurrence of a boundary's text is that token: this is the last
        prefix = RenderedPrefix(chars, _digest(text[:chars]), array("i", ids[:last + 1]))
        with self._lock:
            self._prefixes[session] = prefix
            self._prefixes.move_to_end(session)
            while len(self._prefixes) > self.max_sessions:
                self._prefixes.popitem(last=False)


def boundary_tokens(tokenizer: Any) -> dict[int, str]:
    """The tokenizer's added tokens that split a text cleanly (see :class:`SessionPrefixes`): id to text."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "get_added_tokens_decoder", None)
    if decoder is None or getattr(tokenizer, "split_special_tokens", False):
        return {}
    return {i: t.content for i, t in decoder().items()
            if t.special and not t.normalized and not (t.lstrip or t.rstrip or t.single_word) and t.content}


class RouterTokenizer:
    def __init__(self, name_or_path: str, prefix_sessions: int = 0) -> None:
        from transformers import AutoTokenizer  # installed with vLLM; imported only when configured

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError) as exc:  # no such directory or hub name, or not a tokenizer
            raise ConfigError(f"tokenizer: cannot load {name_or_path!r}: {exc}", field="tokenizer") from None
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"tokenizer: {name_or_path!r} has no chat template", field="tokenizer")
        self.prefixes = SessionPrefixes(boundary_tokens(self.tokenizer), prefix_sessions)

    def encode_chat(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def tokens(self, kind: str, body: dict[str, Any], template_fields: tuple[str, ...], session: str = ""
               ) -> list[int] | None:
        """The prompt's token ids, or None when this request needs an engine's rendering. A chat of a named
        ``session`` reuses the ids of what it repeats of the session's last prompt (:class:`SessionPrefixes`)."""
        if any(k in body for k in template_fields if k not in RENDERED_CHAT_FIELDS):
            return None
        if kind == "completion":
            prompt = body.get("prompt")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True)) if isinstance(prompt, str) else None
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and set(m) <= {"role", "content"} and isinstance(m.get("content"), str)
                and isinstance(m.get("role"), str) for m in messages):
            return None
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=bool(body.get("add_generation_prompt", True)))
        return self.prefixes.encode(session, text, self.encode_chat)
