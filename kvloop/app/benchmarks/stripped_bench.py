"""``kvloop bench stripped``: a reasoning model's sessions, whose next turn never repeats the last answer (the client
strips the thinking and keeps a short final word), with and without the ``keep_generated: false`` hint
(docs/sessions.md).

One cluster (1 prefill and 1 decode engine, the router, the broker in this process) serves both configurations,
sessions alternating between them. Every turn asks for ``--answer-tokens`` tokens (``ignore_eos``: the thinking);
the next turn's history has each earlier answer as one short assistant message instead. After each turn the bench
reads the session's lease from the broker; the next turn's reply headers say how much of the prompt the engines
found (local plus pulled tokens). Figures per configuration:

- **retained, never reused**: of the blocks a turn's lease held, those the session's next turn did not reuse
  (the last turn's lease, which no turn follows, is left out);
- blocks retained, and reused, in all;
- **answers equal to a recompute**: each session's last turn sent again to the prefill engine alone with a cache salt
  of its own (nothing cached), temperature 0: equal text, counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvloop.app.cluster import LocalCluster, pd_configs
from kvloop.engines.config import default_work_dir
from kvloop.engines.model import ensure_tiny_model
from kvloop.shared import headers as hdr
from kvloop.shared.vocabulary import Role

CONFIGS = ("no_hint", "keep_generated_false")
FINAL_WORD = "Done."
"""What the client keeps of each answer in the next turn's history (a reasoning model's final answer)."""


@dataclass
class TurnFigures:
    """One turn: the blocks its lease held, and the prompt tokens its next turn found (None: no next turn)."""

    retained_blocks: int
    next_reused_tokens: int | None = None


@dataclass
class ConfigFigures:
    turns: list[TurnFigures] = field(default_factory=list)
    answers_equal: int = 0
    answers_compared: int = 0

    def summary(self, block_size: int) -> dict[str, Any]:
        followed = [t for t in self.turns if t.next_reused_tokens is not None]
        never = [max(0, t.retained_blocks - t.next_reused_tokens // block_size) for t in followed
                 if t.next_reused_tokens is not None]
        return {"turns_followed": len(followed), "retained_blocks": sum(t.retained_blocks for t in followed),
                "retained_never_reused_blocks": sum(never),
                "reused_blocks": sum(t.retained_blocks for t in followed) - sum(never),
                "answers_equal_to_recompute": f"{self.answers_equal} of {self.answers_compared}"}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(("plan", "tool", "file", "read", "line", "note", "call", "test")) for _ in range(n))


def history(system: str, users: list[str]) -> list[dict[str, str]]:
    """The messages of a turn: each earlier answer stripped to :data:`FINAL_WORD`."""
    messages = [{"role": "system", "content": system}]
    for i, user in enumerate(users):
        if i:
            messages.append({"role": "assistant", "content": FINAL_WORD})
        messages.append({"role": "user", "content": user})
    return messages


def lease_ids(cluster: LocalCluster, session: str) -> dict[str, int]:
    """The session's leases, by id, and their blocks. The broker runs in this process: read from its state."""
    assert cluster.broker is not None
    leases = cluster.broker.runtime.read(lambda s, now: s.session_leases(session))
    return {x.lease_id: len(x.block_ids) for x in leases}


async def new_lease_blocks(cluster: LocalCluster, session: str, before: set[str], timeout_s: float = 30.0) -> int:
    """Blocks of the lease the decode engine publishes for the turn just answered (one not in ``before``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        fresh = [n for lease_id, n in lease_ids(cluster, session).items() if lease_id not in before]
        if fresh:
            return max(fresh)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no new lease of session {session} in {timeout_s:g} s")
        await asyncio.sleep(0.05)


async def run_session(http: Any, cluster: LocalCluster, url: str, model: str, args: argparse.Namespace,
                      session: str, hinted: bool, seed: int, figures: ConfigFigures
                      ) -> tuple[list[dict[str, str]], str]:
    """One session of ``args.turns`` turns; the last turn's messages and answer, for the recompute."""
    rng = random.Random(seed)
    system, users = words(rng, args.system_words), []
    extra = {hdr.SESSION_KEEP_GENERATED: "false"} if hinted else {}
    answer = ""
    for turn in range(args.turns):
        users.append(words(rng, args.user_words))
        body = {"model": model, "messages": history(system, users), "max_tokens": args.answer_tokens,
                "temperature": 0, "ignore_eos": True}
        before = set(lease_ids(cluster, session))
        async with http.post(f"{url}/v1/chat/completions", json=body,
                             headers={hdr.SESSION_ID: session, **extra}) as reply:
            got = await reply.json()
            if reply.status != 200:
                raise RuntimeError(f"turn {turn} of {session}: {reply.status} {got}")
            found = int(reply.headers.get(hdr.LOCAL_TOKENS, 0)) + int(reply.headers.get(hdr.PULLED_TOKENS, 0))
        if turn:
            figures.turns[-1].next_reused_tokens = found
        figures.turns.append(TurnFigures(retained_blocks=await new_lease_blocks(cluster, session, before)))
        answer = got["choices"][0]["message"]["content"]
    return history(system, users), answer


async def recompute_equal(http: Any, prefill_url: str, model: str, messages: list[dict[str, str]], answer: str,
                          answer_tokens: int, salt: str) -> bool:
    body = {"model": model, "messages": messages, "max_tokens": answer_tokens, "temperature": 0, "ignore_eos": True,
            "cache_salt": salt}
    async with http.post(f"{prefill_url}/v1/chat/completions", json=body) as reply:
        got = await reply.json()
    return bool(reply.status == 200 and got["choices"][0]["message"]["content"] == answer)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    work = (args.work_dir or default_work_dir() / "bench-stripped").absolute()
    model_dir = await asyncio.to_thread(ensure_tiny_model, args.model)
    cluster = await LocalCluster.start(
        lambda broker: pd_configs(model_dir, work, broker, prefill=1, decode=1, max_model_len=args.max_model_len,
                                  log_level="warning"),
        work, router={"listen": "127.0.0.1:0", "tokenizer": str(model_dir)})
    figures = {c: ConfigFigures() for c in CONFIGS}
    started = time.monotonic()
    try:
        assert cluster.router is not None
        url, model = cluster.router.url, next(iter(sorted(cluster.router.runner.directory.models())), "")
        prefill_url = cluster.engines.of_role(Role.PREFILL)[0].url
        async with aiohttp.ClientSession() as http:
            for i in range(args.sessions):
                for c, config in enumerate(CONFIGS if i % 2 == 0 else CONFIGS[::-1]):
                    fig = figures[config]
                    session = f"{config}-{i}"
                    messages, answer = await run_session(http, cluster, url, model, args, session,
                                                         config != "no_hint", seed=1000 * args.seed + 2 * i + c,
                                                         figures=fig)
                    fig.answers_compared += 1
                    fig.answers_equal += await recompute_equal(http, prefill_url, model, messages, answer,
                                                               args.answer_tokens, salt=f"recompute-{session}")
                    print(f"session {i + 1}/{args.sessions} {config}: "
                          f"{[t.retained_blocks for t in fig.turns[-args.turns:]]} blocks retained", flush=True)
    finally:
        await cluster.stop()
    summary = {c: figures[c].summary(args.block_size) for c in CONFIGS}
    base = summary["no_hint"]["retained_never_reused_blocks"]
    hinted = summary["keep_generated_false"]["retained_never_reused_blocks"]
    return {"cluster": "1 prefill + 1 decode engine (tiny model), one broker, the router",
            "workload": {k: getattr(args, k) for k in ("sessions", "turns", "system_words", "user_words",
                                                       "answer_tokens", "seed")},
            "configs": summary, "never_reused_hinted_over_no_hint": round(hinted / base, 3) if base else None,
            "turns": {c: [asdict(t) for t in figures[c].turns] for c in CONFIGS},
            "wall_s": round(time.monotonic() - started, 1)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--sessions", type=int, default=3, help="sessions of each configuration")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-words", type=int, default=500)
    parser.add_argument("--user-words", type=int, default=100)
    parser.add_argument("--answer-tokens", type=int, default=200, help="each answer (the thinking), ignore_eos")
    parser.add_argument("--block-size", type=int, default=128, help="the engines' block size")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")


def main(args: argparse.Namespace) -> int:
    if min(args.sessions, args.turns - 1, args.system_words, args.user_words, args.answer_tokens) < 1:
        print("kvloop bench stripped: --sessions, --system-words, --user-words, --answer-tokens: at least 1; "
              "--turns: at least 2", file=sys.stderr)
        return 2
    result = asyncio.run(bench(args))
    print(json.dumps({"configs": result["configs"],
                      "never_reused_hinted_over_no_hint": result["never_reused_hinted_over_no_hint"]}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0
