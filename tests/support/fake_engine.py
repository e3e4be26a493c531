"""A fake OpenAI engine for router tests that need no vLLM: canned answers, and a count of what it was asked.

``python -m tests.support.fake_engine PORT_FILE [ANSWER_DELAY_S]`` serves one in a process of its own (one a test
can SIGSTOP), writing its port to PORT_FILE once it listens."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web


class FakeEngine:
    """A fake OpenAI engine: /tokenize gives one token per character, completions answer "ok" (streamed as two
    chunks when asked); ``fail_status`` answers every completion with that HTTP status instead."""

    def __init__(self) -> None:
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.calls = 0
        self.models: list[str] = []
        """The ``model`` of each completion request, in order."""
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        """Each completion request's headers and body, in order."""
        self.fail_status = 0
        self.answer_delay_s = 0.0
        """A non-streamed answer takes this long (a long generation); the step counter moves meanwhile."""
        self.busy_since: float | None = None
        self.steps = 0.0
        self.scrapes = 0
        """How often /metrics was asked for."""

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = json.dumps(body.get("messages") or body.get("prompt"))
        return web.json_response({"tokens": [ord(c) % 256 for c in text], "count": len(text)})

    async def complete(self, request: web.Request) -> web.Response:
        self.calls += 1
        body = await request.json()
        self.models.append(str(body.get("model")))
        self.requests.append((dict(request.headers), body))
        if self.fail_status:
            return web.json_response({"error": {"message": "fake failure"}}, status=self.fail_status)
        if body.get("stream"):
            return await self.stream(request)
        if self.answer_delay_s and int(body.get("max_tokens") or 0) != 1:  # a prefill (max_tokens 1) is quick
            self.busy_since = time.monotonic()
            await asyncio.sleep(self.answer_delay_s)
            self.steps += time.monotonic() - self.busy_since
            self.busy_since = None
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        if "messages" in body:
            choice["message"] = {"role": "assistant", "content": "ok"}
        else:
            choice["text"] = "ok"
        return web.json_response({"id": "fake-1", "object": "chat.completion", "model": body.get("model"),
                                  "choices": [choice], "kv_transfer_params": {},
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        for piece in ("o", "k"):
            chunk = {"id": "fake-1", "choices": [{"index": 0, "delta": {"content": piece}}]}
            await reply.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await reply.write(b"data: [DONE]\n\n")
        await reply.write_eof()
        return reply

    async def metrics(self, request: web.Request) -> web.Response:
        """vLLM's step counter, moving every 100 ms while an answer is being computed."""
        self.scrapes += 1
        busy = 0.0 if self.busy_since is None else time.monotonic() - self.busy_since
        steps = int((self.steps + busy) * 10)
        return web.Response(text=f'vllm:iteration_tokens_total_count{{engine="0"}} {steps}.0\n')

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.add_routes([web.post("/tokenize", self.tokenize), web.post("/v1/chat/completions", self.complete),
                        web.post("/v1/completions", self.complete), web.get("/metrics", self.metrics)])
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def serve(port_file: Path, answer_delay_s: float) -> None:
    engine = FakeEngine()
    engine.answer_delay_s = answer_delay_s
    await engine.start()
    partial = port_file.with_suffix(".partial")
    partial.write_text(engine.url.rsplit(":", 1)[1])
    partial.rename(port_file)  # whole or absent: the test polls for it
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0))
