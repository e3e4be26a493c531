"""How each configuration of ``kvloop bench multiturn`` serves one turn, timed at the client.

Every client returns a :class:`Served`: the output token ids, the time to the first token, the end-to-end time,
the gaps between streamed tokens, and what the prefill engine reported (kvloop's connector runs on every P/D
configuration, so each prefill reply carries a :class:`~kvloop.shared.protocol.PrefillReport`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvloop.shared import headers as hdr
from kvloop.shared.http import sse_data, sse_measured
from kvloop.shared.protocol import PrefillReport, prefill_only_params
from kvloop.shared.vocabulary import Path

UPSTREAM_KEYS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                 "remote_num_tokens", "tp_size", "remote_blocks_expiry_time")


@dataclass
class Served:
    output_ids: list[int]
    ttft_s: float
    e2e_s: float
    decision: str
    itl_s: list[float] = field(default_factory=list)
    """Gaps between streamed chunks after the first (one token each here); empty when not streamed."""
    prefill_ttft_s: float | None = None
    """Upstream only: the time to the prefill engine's reply (its client cannot stream: see UpstreamClient)."""
    report: PrefillReport | None = None
    headers: dict[str, str] = field(default_factory=dict)
    prefill_engine: str = ""
    """The engine that computed the prompt (its URL, or the router's engine id); "" when unknown."""
    decode_engine: str = ""
    """The engine that streamed the answer."""
    cached_tokens: int | None = None
    """The aggregated engine's prefix-cache hit (``usage.prompt_tokens_details.cached_tokens``); None elsewhere."""


async def post_json(http: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
        data: dict[str, Any] = await reply.json(content_type=None)
        if reply.status >= 400:
            raise RuntimeError(f"{url} answered {reply.status}: {str(data)[:200]}")
        return data


USAGE_CACHED = "x-usage-cached-tokens"
"""Where :func:`stream` puts a usage chunk's ``prompt_tokens_details.cached_tokens`` among the headers."""


async def stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any], t0: float, timeout_s: float,
                 headers: dict[str, str] | None = None) -> tuple[list[int], float, list[float], dict[str, str]]:
    """A streamed completion: token ids, time to the first token since ``t0``, the gaps after it, the headers
    (with :data:`USAGE_CACHED` when the body asked for usage and the engine reported its cache hit)."""
    ids: list[int] = []
    stamps: list[float] = []
    async with http.post(url, json={**body, "stream": True, "return_token_ids": True}, headers=headers,
                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
        if reply.status >= 400:
            raise RuntimeError(f"{url} answered {reply.status}: {(await reply.text())[:200]}")
        got = dict(reply.headers)
        async for line in reply.content:
            measured = sse_measured(line)  # kvloop's DECODE_LOCAL streams: the engine's account, at the end
            if measured is not None:
                got.update({hdr.header(k): str(v) for k, v in measured.items()})
            chunk = sse_data(line)
            if chunk is None:
                continue
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"])[:200])
            usage = chunk.get("usage")
            details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                got[USAGE_CACHED] = str(details["cached_tokens"])
            for choice in chunk.get("choices", []):
                new = list(choice.get("token_ids") or [])
                if new:
                    stamps.append(time.perf_counter())
                ids += new
    ttft = (stamps[0] if stamps else time.perf_counter()) - t0
    return ids, ttft, [b - a for a, b in itertools.pairwise(stamps)], got


class Client:
    """One configuration's way of serving a turn."""

    def __init__(self, http: aiohttp.ClientSession, model: str, timeout_s: float) -> None:
        self.http, self.model, self.timeout_s = http, model, timeout_s

    def body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}

    async def turn(self, conv: str, prompt: list[int], max_tokens: int,
                   hints: Mapping[str, str] | None = None) -> Served:
        """Serve one turn; ``hints``: the session hints an agent would send with it (headers), which only a client
        that sends them (``RouterClient(hints=True)``) passes on."""
        raise NotImplementedError


class OneWayClient(Client):
    """P/D without a return path: prefill engines round-robin (their local prefix caches still help), then the
    decode engine pulls the prompt's KV from the prefill engine."""

    def __init__(self, http: aiohttp.ClientSession, model: str, timeout_s: float, prefills: list[str], decode: str
                 ) -> None:
        super().__init__(http, model, timeout_s)
        self.prefills, self.decode = prefills, decode
        self._next = itertools.cycle(range(len(prefills)))

    async def prefill(self, prompt: list[int], params: dict[str, Any]
                      ) -> tuple[dict[str, Any], PrefillReport | None, str]:
        """The prefill's returned params, its report, and the prefill engine's URL."""
        url = self.prefills[next(self._next)]
        body = {**self.body(prompt, 1), "kv_transfer_params": params}
        returned = dict((await post_json(self.http, f"{url}/v1/completions", body, self.timeout_s)).get(
            "kv_transfer_params") or {})
        return returned, PrefillReport.pop_from(returned), url

    async def turn(self, conv: str, prompt: list[int], max_tokens: int,
                   hints: Mapping[str, str] | None = None) -> Served:
        t0 = time.perf_counter()
        params, report, prefill = await self.prefill(prompt, prefill_only_params())
        ids, ttft, itl, _ = await stream(self.http, f"{self.decode}/v1/completions",
                                         {**self.body(prompt, max_tokens), "kv_transfer_params": params}, t0,
                                         self.timeout_s)
        return Served(ids, ttft, time.perf_counter() - t0, Path.RECOMPUTE, itl, report=report,
                      prefill_engine=prefill, decode_engine=self.decode)


class UpstreamClient(OneWayClient):
    """vLLM's own decode-to-prefill mode driven as its example proxy does: the decode's returned params kept per
    conversation id and used once on its next turn, a fixed TTL, no broker. vLLM 0.32 returns those params only
    on non-streamed replies, so this client cannot stream: its first token arrives with the whole answer (its
    TTFT), and :attr:`Served.prefill_ttft_s` is the prefill engine's part."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.retained: dict[str, dict[str, Any]] = {}

    async def turn(self, conv: str, prompt: list[int], max_tokens: int,
                   hints: Mapping[str, str] | None = None) -> Served:
        t0 = time.perf_counter()
        params = prefill_only_params()
        kept = self.retained.pop(conv, None)
        decision = Path.RECOMPUTE
        if kept and kept.get("remote_block_ids"):
            params.update({k: kept[k] for k in UPSTREAM_KEYS if k in kept})
            decision = Path.TRANSFER
        p_params, report, prefill = await self.prefill(prompt, params)
        prefill_ttft = time.perf_counter() - t0
        reply = await post_json(self.http, f"{self.decode}/v1/completions",
                                {**self.body(prompt, max_tokens), "kv_transfer_params": p_params,
                                 "return_token_ids": True}, self.timeout_s)
        e2e = time.perf_counter() - t0
        if reply.get("kv_transfer_params"):
            self.retained[conv] = reply["kv_transfer_params"]
        return Served(list(reply["choices"][0].get("token_ids") or []), e2e, e2e, decision,
                      prefill_ttft_s=prefill_ttft, report=report, prefill_engine=prefill, decode_engine=self.decode)


class RouterClient(Client):
    """kvloop: the router (streamed), with the session id as a hint; its ``x-kvloop-*`` headers kept."""

    def __init__(self, http: aiohttp.ClientSession, model: str, timeout_s: float, router: str,
                 hints: bool = False) -> None:
        super().__init__(http, model, timeout_s)
        self.router, self.hints = router, hints

    async def turn(self, conv: str, prompt: list[int], max_tokens: int,
                   hints: Mapping[str, str] | None = None) -> Served:
        t0 = time.perf_counter()
        ids, ttft, itl, headers = await stream(self.http, f"{self.router}/v1/completions",
                                               self.body(prompt, max_tokens), t0, self.timeout_s,
                                               headers={hdr.SESSION_ID: conv,
                                                        **(hints if hints and self.hints else {})})
        detail = hdr.of_reply(headers)
        return Served(ids, ttft, time.perf_counter() - t0, detail.get(hdr.field(hdr.DECISION), "?"), itl,
                      headers=detail, prefill_engine=detail.get(hdr.field(hdr.PREFILL_ENGINE), ""),
                      decode_engine=detail.get(hdr.field(hdr.DECODE_ENGINE), ""))


class AggregatedClient(Client):
    """One engine with its local prefix cache: the limit no transfer can beat."""

    def __init__(self, http: aiohttp.ClientSession, model: str, timeout_s: float, engine: str) -> None:
        super().__init__(http, model, timeout_s)
        self.engine = engine

    async def turn(self, conv: str, prompt: list[int], max_tokens: int,
                   hints: Mapping[str, str] | None = None) -> Served:
        t0 = time.perf_counter()
        # Usage at the stream's end (after the last token): the engine's prefix-cache hit, so the stall check
        # (kvloop.app.benchmarks.stalls) knows what the turn computed.
        body = {**self.body(prompt, max_tokens), "stream_options": {"include_usage": True}}
        ids, ttft, itl, got = await stream(self.http, f"{self.engine}/v1/completions", body, t0, self.timeout_s)
        cached = got.get(USAGE_CACHED)
        return Served(ids, ttft, time.perf_counter() - t0, "LOCAL", itl, prefill_engine=self.engine,
                      decode_engine=self.engine, cached_tokens=int(cached) if cached is not None else None)
