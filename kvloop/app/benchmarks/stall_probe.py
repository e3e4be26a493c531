"""Concurrent streamed sessions against one engine, timed per token: does any request or stream stall?

The load that exposed vLLM's lost queue wake-ups (see ``engines.connector.patches.cap_ipc_spin``): a few
sessions at once, each turn's prompt the previous one grown by a new tail, streamed answers of varied length,
and short irregular pauses between turns, so the engine keeps going idle between steps and waking again. A
healthy engine answers each turn within its compute time; a lost wake-up shows as a time to first token or a
gap between tokens of about vLLM's 5 s recheck interval.

Deterministic for a seed (lengths and pauses); the timings are what is measured.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import aiohttp

from kvloop.app.benchmarks.clients import stream


@dataclass(frozen=True)
class ProbeShape:
    sessions: int = 3
    turns: int = 20
    first_tokens: int = 1536
    tail_tokens: tuple[int, int] = (128, 320)
    max_prompt_tokens: int = 6144
    answer_tokens: tuple[int, int] = (32, 256)
    pause_s: tuple[float, float] = (0.2, 1.5)
    vocab: int = 4000


@dataclass(frozen=True)
class ProbeRequest:
    session: int
    turn: int
    prompt_tokens: int
    ttft_s: float
    max_gap_s: float
    tokens: int


async def _session(http: aiohttp.ClientSession, url: str, model: str, index: int, shape: ProbeShape, seed: int,
                   timeout_s: float) -> list[ProbeRequest]:
    rng = random.Random(seed * 1000 + index)
    prompt = [rng.randrange(10, shape.vocab) for _ in range(shape.first_tokens)]
    out: list[ProbeRequest] = []
    for turn in range(shape.turns):
        answer = rng.randint(*shape.answer_tokens)
        body = {"model": model, "prompt": prompt, "max_tokens": answer, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        ids, ttft, gaps, _ = await stream(http, f"{url}/v1/completions", body, t0, timeout_s)
        out.append(ProbeRequest(index, turn, len(prompt), ttft, max(gaps, default=0.0), len(ids)))
        prompt = prompt + ids + [rng.randrange(10, shape.vocab) for _ in range(rng.randint(*shape.tail_tokens))]
        if len(prompt) > shape.max_prompt_tokens:  # a new conversation, as agents compact or restart
            prompt = [rng.randrange(10, shape.vocab) for _ in range(shape.first_tokens)]
        await asyncio.sleep(rng.uniform(*shape.pause_s))
    return out


async def probe(url: str, model: str, shape: ProbeShape = ProbeShape(), seed: int = 0,
                timeout_s: float = 120.0) -> list[ProbeRequest]:
    """Every request of ``shape.sessions`` concurrent sessions against the engine at ``url``."""
    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(_session(http, url, model, i, shape, seed, timeout_s)
                                         for i in range(shape.sessions)))
    return [r for session in results for r in session]


def summary(requests: list[ProbeRequest], bound_s: float) -> dict[str, float | int]:
    """How many requests broke ``bound_s`` (time to first token, or any gap between tokens), and the worst of each."""
    return {"requests": len(requests),
            "over_bound": sum(1 for r in requests if r.ttft_s > bound_s or r.max_gap_s > bound_s),
            "max_ttft_s": round(max((r.ttft_s for r in requests), default=0.0), 3),
            "max_gap_s": round(max((r.max_gap_s for r in requests), default=0.0), 3),
            "bound_s": bound_s}


def main(cores: str = "auto", seeds: tuple[int, ...] = (0, 1, 2), bound_s: float = 1.0) -> dict[int, dict[str, object]]:
    """The probe as measured for docs/engine-patches.md: one engine with no connector bound to ``cores`` (``auto``:
    every core; ``0``: one), ``ProbeShape()`` for each seed; prints and returns each run's summary and the requests
    over ``bound_s``. ``python -m kvloop.app.benchmarks.stall_probe [CORES]``."""
    import json
    import urllib.request
    from dataclasses import asdict
    from pathlib import Path

    from kvloop.app.benchmarks.multiturn import Sizing, engine_config
    from kvloop.app.engine_set import start_engines
    from kvloop.engines.config import default_work_dir
    from kvloop.engines.model import ensure_tiny_model
    from kvloop.shared.vocabulary import Role

    model = ensure_tiny_model(None)
    size = Sizing(max_model_len=8192, prefill_blocks=0, decode_blocks=None, retention_fraction=0.5)
    config = engine_config(model, Path(default_work_dir()) / "stall-probe", Role.BOTH, 0, connector="none",
                           broker="", size=size, blocks=None, extra={}, cores=cores)
    engines = start_engines([config])
    out: dict[int, dict[str, object]] = {}
    try:
        url = engines.by_id("both-0").url
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as reply:
            served = json.load(reply)["data"][0]["id"]
        for seed in seeds:
            requests = asyncio.run(probe(url, served, ProbeShape(), seed=seed))
            out[seed] = {"summary": summary(requests, bound_s),
                         "over_bound": [asdict(r) for r in requests if r.ttft_s > bound_s or r.max_gap_s > bound_s]}
            print(f"seed {seed}: {json.dumps(out[seed])}", flush=True)
    finally:
        engines.stop()
    return out


if __name__ == "__main__":
    import sys

    main(sys.argv[1] if len(sys.argv) > 1 else "auto")
