"""A configuration's warm-up before its first load point: a few short chat sessions of its own text, so that what a
freshly started cluster pays once is not charged to the first point.

Once per process or engine pair, not per request: the first NIXL transfer between a prefill engine and a decode
engine (the agents exchange metadata and open their connection), the first prompt of a kind of length through each
engine (allocations, the CPU kernels' first use of a shape), the router's first placements. Measured at 769e59d
(router records, the 4-session point, nothing warm): the four first turns' prefills took 274-1,127 ms and their
decodes' first tokens 322-776 ms, where the same turns warm take ~65 ms and ~25 ms; with n = 104 those turns
are the point's TTFT p99. A cluster in service has paid them long before; the engine kvloop is held against
pays its own share of them (its first requests), so both sides are warmed the same way.

The text shares no prefix with the workload (its own words, not AIPerf's corpus), so nothing the workload
would find cached is put there: what the first point finds cached is the same with or without it. Sessions
are sent together (``sessions`` at once), and placement spreads such a burst over the prefill engines, so each
gets first turns and hands them to the decode engine (5-6 each in every run of 2026-12-06), and the second turns
are served from the decode engine's cache (DECODE_LOCAL): every path a point takes has run. Sent by this process
with aiohttp, outside AIPerf, so no point counts it.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvloop.shared import headers as hdr
from kvloop.shared.http import aiter_sse

WORDS = ("time", "year", "way", "day", "man", "child", "state", "family", "group", "hand", "part", "place", "case",
         "week", "system", "program", "work", "number", "point", "month", "right", "word", "issue", "side", "kind",
         "head", "hour", "line", "end", "member", "name", "body", "back", "level", "result", "change", "reason")
"""Common words that the tiny model's 4k-token vocabulary (and larger ones) keeps whole: a prompt of n of them is
about n tokens."""


@dataclass(frozen=True)
class WarmUp:
    sessions: int = 4
    """Sent together: at least the prefill engines' count, so that each gets a first turn."""
    turns: int = 2
    """The second turn finds the first's history on the decode engine."""
    rounds: int = 3
    """Rounds of ``sessions`` new sessions, one after another: a router prices each kind of path with the median of
    its last turns' measured residuals (``router.residuals``), so after three rounds that median is a warm turn's,
    not one of the first round's."""
    prompt_words: int = 1500
    turn_words: int = 200
    answer_tokens: int = 8
    seed: int = 1

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "rounds", "prompt_words", "turn_words", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def session_messages(spec: WarmUp, session: int) -> list[list[dict[str, str]]]:
    """Each turn's user message for one session (the history is built as the answers come)."""
    rng = random.Random(spec.seed * 1_000_003 + session)
    first = f"warm-up session {session}: " + words(rng, spec.prompt_words)
    return [[{"role": "user", "content": first}]] + [
        [{"role": "user", "content": words(rng, spec.turn_words)}] for _ in range(spec.turns - 1)]


async def chat_turn(http: aiohttp.ClientSession, url: str, model: str, messages: list[dict[str, str]],
                    session: str, max_tokens: int) -> str:
    """One streamed chat turn; the answer's text. Raises RuntimeError naming the status and body on an error."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True}
    text: list[str] = []
    async with http.post(f"{url}/v1/chat/completions", json=body, headers={hdr.SESSION_ID: session}) as reply:
        if reply.status != 200:
            raise RuntimeError(f"warm-up turn of {session}: HTTP {reply.status}: {(await reply.text())[:300]}")
        async for event in aiter_sse(reply.content):
            for choice in event.get("choices", []):
                text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


async def warm_up(url: str, model: str, spec: WarmUp = WarmUp(), timeout_s: float = 300.0) -> float:
    """Run the warm-up sessions against ``url`` (an OpenAI endpoint); its wall seconds. Raises RuntimeError when
    a turn fails: a configuration that cannot serve its warm-up cannot serve its load either."""
    started = time.monotonic()

    async def one(http: aiohttp.ClientSession, index: int) -> None:
        session = f"warmup-{spec.seed}-{index}"
        history: list[dict[str, str]] = []
        for user in session_messages(spec, index):
            history += user
            answer = await chat_turn(http, url, model, history, session, spec.answer_tokens)
            history.append({"role": "assistant", "content": answer})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        for first in range(0, spec.rounds * spec.sessions, spec.sessions):
            await asyncio.gather(*(one(http, first + i) for i in range(spec.sessions)))
    return time.monotonic() - started
