"""Tokenizing in the router with the served model's own tokenizer and chat template: one HTTP round trip to an
engine (``/tokenize``) less on every turn's critical path.

The block keys must be exactly the token ids the engines compute, so the router renders only what it renders
the way vLLM 0.32 does (``tests/engines/test_router.py`` checks it equal to an engine's ``/tokenize``):

- chat: every message a plain string ``content`` with a ``role``; the model's chat template with
  ``add_generation_prompt`` (default true), then the text encoded without special tokens (vLLM's chat default);
- completions: a string prompt, encoded with special tokens (vLLM's completions default).

Anything else (tools, documents, a request's own ``chat_template`` or its kwargs, ``continue_final_message``,
``add_special_tokens``, content parts such as images) returns None, and the turn asks an engine's ``/tokenize``
as before. Loading happens once, at start (``RouterConfig.tokenizer``: the model's directory or hub name).
"""

from __future__ import annotations

from typing import Any

from kvloop.shared.errors import ConfigError

RENDERED_CHAT_FIELDS = frozenset({"add_generation_prompt"})
"""Chat-template fields the router renders itself; any other (router/engine_calls.py's CHAT_TEMPLATE_FIELDS) goes to
an engine."""


class RouterTokenizer:
    def __init__(self, name_or_path: str) -> None:
        from transformers import AutoTokenizer  # installed with vLLM; imported only when configured

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError) as exc:  # no such directory or hub name, or not a tokenizer
            raise ConfigError(f"tokenizer: cannot load {name_or_path!r}: {exc}", field="tokenizer") from None
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"tokenizer: {name_or_path!r} has no chat template", field="tokenizer")

    def tokens(self, kind: str, body: dict[str, Any], template_fields: tuple[str, ...]) -> list[int] | None:
        """The prompt's token ids, or None when this request needs an engine's rendering."""
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
        return list(self.tokenizer.encode(text, add_special_tokens=False))
