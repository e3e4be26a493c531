"""``kvloop demo``: a scripted agent session through a running router, turn by turn.

An agent loop: a long system prompt, then turns that each add a tool result and a question, with the assistant's
answers kept in the history. The script is shaped so that each of kvloop's paths shows up (on the default
cluster, 2 prefill and 1 decode engines, with the broker's default knobs):

1. the first turn: nothing is cached anywhere (RECOMPUTE, ``no_match``);
2. a short tool result: the decode engine holds the history and computes the tail itself (DECODE_LOCAL);
3. a long tool result: the tail is over ``decode_local_max_tokens``, so a prefill engine computes it and pulls
   the history beyond its own cache from the decode engine (TRANSFER);
4. a short one again (DECODE_LOCAL);
5. the agent compacts its history (system prompt + a long summary): a prefill engine's own prefix cache holds
   the system prompt, nothing is left to pull (PREFILL_LOCAL, from the broker's soft index of engine caches);
6. a short one on the compacted history (DECODE_LOCAL).

Per turn it prints the context length, the path the turn took (measured by the engines) and the plan's reason,
the tokens found in the serving engine's own cache, pulled and computed, the engines, and TTFT (first streamed
token), from the router's ``x-kvloop-*`` reply headers and, for DECODE_LOCAL streams, its closing comment.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from kvloop.shared import headers as hdr
from kvloop.shared.http import sse_data, sse_measured

DEMO_SYSTEM = ("You are a coding agent. You read files, run tools and keep short notes. " * 60).strip()
TOOLS = ("ls src/", "grep -n retain engines/*.py", "pytest -q tests/unit", "cat broker/core/placement.py",
         "git log --oneline | head", "du -sh .kvloop")
SCRIPT = (("tool", 60), ("tool", 60), ("tool", 250), ("tool", 60), ("compact", 220), ("tool", 60))
"""(kind, words of tool output or summary) per turn; longer sessions repeat it from turn 2. The tiny model's
tokenizer makes ~3.5 tokens of a word here: 60 words are a ~210-token tail (DECODE_LOCAL), 250 and 220 words
are 770-870 tokens, over the broker's decode_local_max_tokens (512)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", default="http://127.0.0.1:8080", help="router base URL")
    parser.add_argument("--model", default="", help="model name (default: the router's first)")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool-time-s", type=float, default=0.5, help="the agent's tool run between turns")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"{rng.choice(['ok', 'file', 'line', 'pass', 'note'])}{rng.randrange(999)}" for _ in range(n))


def next_messages(messages: list[dict[str, str]], turn: int, rng: random.Random) -> list[dict[str, str]]:
    kind, words = SCRIPT[turn] if turn < len(SCRIPT) else SCRIPT[1 + (turn - 1) % (len(SCRIPT) - 1)]
    if kind == "compact":
        summary = f"Summary of the work so far: {_words(rng, words)}\nContinue from the summary."
        return [messages[0], {"role": "user", "content": summary}]
    tool = TOOLS[turn % len(TOOLS)]
    return [*messages, {"role": "user", "content": f"Tool `{tool}` returned: {_words(rng, words)}\nWhat next?"}]


async def run_demo(router_url: str, *, model: str = "", turns: int = 6, max_tokens: int = 24, seed: int = 0,
                   tool_time_s: float = 0.5) -> list[dict[str, Any]]:
    import aiohttp

    rng = random.Random(seed)
    rows = []
    async with aiohttp.ClientSession() as http:
        if not model:
            async with http.get(f"{router_url}/v1/models") as reply:
                model = (await reply.json())["data"][0]["id"]
        messages = [{"role": "system", "content": DEMO_SYSTEM}]
        print(f"\nkvloop demo: an agent session of {turns} turns through {router_url} (model {model}); each turn "
              f"says its tool's pause ({hdr.SESSION_PAUSE}), the last one ends the session ({hdr.SESSION_END})")
        print(f"{'turn':>4} {'context':>7} {'path':<13} {'reason':<20} {'local':>6} {'pulled':>6} {'computed':>8} "
              f"{'engines':<22} {'TTFT ms':>8}")
        for turn in range(turns):
            messages = next_messages(messages, turn, rng)
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            t0 = time.perf_counter()
            ttft, text, measured = 0.0, [], None
            # The agent says what it will need (docs/sessions.md): the tool run before its next turn, or its end.
            hints = {hdr.SESSION_END: "true"} if turn == turns - 1 else {hdr.SESSION_PAUSE: f"{tool_time_s:g}"}
            async with http.post(f"{router_url}/v1/chat/completions", json=body,
                                 headers={hdr.SESSION_ID: "demo-agent", **hints}) as reply:
                if reply.status != 200:
                    raise RuntimeError(f"turn {turn + 1}: router answered {reply.status}: {await reply.text()}")
                h = reply.headers
                async for line in reply.content:
                    measured = sse_measured(line) or measured
                    event = sse_data(line)
                    if event is None:
                        continue
                    ttft = ttft or time.perf_counter() - t0
                    for choice in event.get("choices", []):
                        text.append((choice.get("delta") or {}).get("content") or "")
            figures = {k: int(h.get(k, 0)) for k in (hdr.LOCAL_TOKENS, hdr.PULLED_TOKENS, hdr.COMPUTED_TOKENS)}
            if measured:  # a DECODE_LOCAL stream: the decode engine's own account came with its end
                figures = {k: int(measured.get(hdr.field(k), 0)) for k in figures}
            prefill, decode = h.get(hdr.PREFILL_ENGINE, ""), h.get(hdr.DECODE_ENGINE, "")
            row = {"turn": turn + 1, "context_tokens": int(h.get(hdr.PROMPT_TOKENS, 0)),
                   "decision": (measured or {}).get(hdr.field(hdr.DECISION)) or h.get(hdr.DECISION, "?"),
                   "planned": h.get(hdr.PLANNED, ""), "reason": h.get(hdr.REASON, ""),
                   "local_tokens": figures[hdr.LOCAL_TOKENS], "pulled_tokens": figures[hdr.PULLED_TOKENS],
                   "computed_tokens": figures[hdr.COMPUTED_TOKENS], "prefill_engine": prefill, "decode_engine": decode,
                   "ttft_ms": round(ttft * 1e3, 1)}
            rows.append(row)
            engines = decode if prefill in ("", decode) else f"{prefill}->{decode}"
            print(f"{row['turn']:>4} {row['context_tokens']:>7} {row['decision']:<13} {row['reason']:<20} "
                  f"{row['local_tokens']:>6} {row['pulled_tokens']:>6} {row['computed_tokens']:>8} {engines:<22} "
                  f"{row['ttft_ms']:>8}", flush=True)
            messages.append({"role": "assistant", "content": "".join(text)})
            # The agent runs its next tool before it asks again. (The decode engine's sidecar publishes the
            # turn's KV a few milliseconds after the answer; a turn sent before that would recompute, correctly.)
            await asyncio.sleep(tool_time_s)
    return rows


def demo_main(args: argparse.Namespace) -> int:
    asyncio.run(run_demo(args.router.rstrip("/"), model=args.model, turns=args.turns, max_tokens=args.max_tokens,
                         seed=args.seed, tool_time_s=args.tool_time_s))
    return 0
