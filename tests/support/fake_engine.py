"""A fake OpenAI engine for router tests that need no vLLM: canned answers, and a count of what it was asked."""

from __future__ import annotations

import json
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

    async def start(self) -> None:
        app = web.Application()
        app.add_routes([web.post("/tokenize", self.tokenize), web.post("/v1/chat/completions", self.complete),
                        web.post("/v1/completions", self.complete)])
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
