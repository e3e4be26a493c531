"""``kvloop demo``: a scripted agent session through a running router, turn by turn.

An agent loop: a long system prompt, then turns that each add a tool result and a question, with the assistant's
answers kept in the history. Per turn it prints the context length, what the router decided and why, tokens
pulled, found in the prefill's local cache and computed, and TTFT (first streamed token), from the router's
``x-kvloop-*`` reply headers.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from kvloop.shared.http import aiter_sse

DEMO_SYSTEM = ("You are a coding agent. You read files, run tools and keep short notes. " * 60).strip()
TOOLS = ("ls src/", "grep -n retain engines/*.py", "pytest -q tests/unit", "cat broker/core/placement.py",
         "git log --oneline | head", "du -sh .kvloop")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", default="http://127.0.0.1:8080", help="router base URL")
    parser.add_argument("--model", default="", help="model name (default: the router's first)")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool-time-s", type=float, default=0.5, help="the agent's tool run between turns")


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
        print(f"\nkvloop demo: an agent session of {turns} turns through {router_url} (model {model})")
        print(f"{'turn':>4} {'context':>8} {'decision':<9} {'reason':<22} {'pulled':>7} {'local':>6} "
              f"{'computed':>8} {'TTFT ms':>8}")
        for turn in range(turns):
            tool = TOOLS[turn % len(TOOLS)]
            output = " ".join(f"{rng.choice(['ok', 'file', 'line', 'pass', 'note'])}{rng.randrange(999)}"
                              for _ in range(120))
            messages.append({"role": "user", "content": f"Tool `{tool}` returned: {output}\nWhat next?"})
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            t0 = time.perf_counter()
            ttft, text = 0.0, []
            async with http.post(f"{router_url}/v1/chat/completions", json=body,
                                 headers={"x-session-id": "demo-agent"}) as reply:
                if reply.status != 200:
                    raise RuntimeError(f"turn {turn + 1}: router answered {reply.status}: {await reply.text()}")
                h = reply.headers
                async for event in aiter_sse(reply.content):
                    ttft = ttft or time.perf_counter() - t0
                    for choice in event.get("choices", []):
                        text.append((choice.get("delta") or {}).get("content") or "")
            row = {"turn": turn + 1, "context_tokens": int(h.get("x-kvloop-prompt-tokens", 0)),
                   "decision": h.get("x-kvloop-decision", "?"), "reason": h.get("x-kvloop-reason", ""),
                   "pulled_tokens": int(h.get("x-kvloop-pulled-tokens", 0)),
                   "local_tokens": int(h.get("x-kvloop-local-tokens", 0)),
                   "computed_tokens": int(h.get("x-kvloop-computed-tokens", 0)), "ttft_ms": round(ttft * 1e3, 1)}
            rows.append(row)
            print(f"{row['turn']:>4} {row['context_tokens']:>8} {row['decision']:<9} {row['reason']:<22} "
                  f"{row['pulled_tokens']:>7} {row['local_tokens']:>6} {row['computed_tokens']:>8} "
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
