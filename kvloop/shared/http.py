"""Reading what engines and routers send over HTTP: server-sent events of streamed completions, and the
Prometheus text of ``/metrics``. One reader of each, for the services, the demo, the benchmarks and the tests."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

import aiohttp
import msgspec

ENGINE_KEEPALIVE_S = 75
"""How long an engine's HTTP server keeps an idle connection (the launcher sets vLLM's
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s by default, to this)."""

CLIENT_KEEPALIVE_S = 30.0
"""How long kvloop's HTTP clients of engines (the router, the benchmarks) keep an idle pooled connection:
well under :data:`ENGINE_KEEPALIVE_S`. A client that keeps a connection longer than the server sends its next
request on a socket the server is closing and gets "Server disconnected" (it did, with aiohttp's 15 s against
vLLM's 5 s: a decode request failed while its prompt's blocks stayed held on the prefill engine until their
transfer lease expired)."""


def engine_client_connector(limit: int = 256) -> aiohttp.TCPConnector:
    """A connection pool for calls to engines, with :data:`CLIENT_KEEPALIVE_S`."""
    return aiohttp.TCPConnector(limit=limit, keepalive_timeout=CLIENT_KEEPALIVE_S)


def sse_data(line: bytes | str) -> dict[str, Any] | None:
    """The JSON object of one ``data: {...}`` line of an event stream; None for anything else (comments, blank
    lines, ``data: [DONE]``)."""
    # Bytes are parsed as they come, not decoded first: the router relays every streamed token through here.
    raw = line.strip() if isinstance(line, bytes) else line.strip().encode()
    if not raw.startswith(b"data:"):
        return None
    payload = raw[5:].lstrip()
    if not payload.startswith(b"{"):
        return None
    # msgspec's decoder: a quarter of json's time on a chunk (1.3 against 5.5 us here), once per relayed token.
    event: dict[str, Any] = msgspec.json.decode(payload)
    return event


MEASURED_PREFIX = ": kvloop "
"""An SSE comment the router sends before ``[DONE]`` when a stream's measured figures came only with its end
(DECODE_LOCAL); clients that do not know it ignore it, as SSE says comments are."""


def sse_measured(line: bytes | str) -> dict[str, Any] | None:
    """The router's measured-figures comment (``: kvloop {...}``); None for any other line."""
    text = (line.decode() if isinstance(line, bytes) else line).strip()
    if not text.startswith(MEASURED_PREFIX.strip()):
        return None
    body: dict[str, Any] = json.loads(text[len(MEASURED_PREFIX.strip()):].strip())
    return body


def iter_sse(lines: Iterable[bytes | str]) -> Iterator[dict[str, Any]]:
    """Every JSON event of a stream read line by line (``urllib``'s reply, a list of lines)."""
    for line in lines:
        event = sse_data(line)
        if event is not None:
            yield event


async def aiter_sse(lines: AsyncIterable[bytes]) -> AsyncIterator[dict[str, Any]]:
    """Every JSON event of a stream read line by line (``aiohttp``'s ``reply.content``)."""
    async for line in lines:
        event = sse_data(line)
        if event is not None:
            yield event


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> ``{'name{labels}': value}``, samples only."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def metric_total(samples: dict[str, float], name: str) -> float:
    """The sum of ``name`` over all its label sets."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def metric_labels(samples: dict[str, float], name: str) -> dict[str, str] | None:
    """The labels of ``name``'s first sample (an info metric such as vLLM's ``vllm:cache_config_info``); None when
    there is none."""
    key = next((k for k in samples if k.startswith(name + "{")), None)
    if key is None:
        return None
    labels = key[key.index("{") + 1: key.rindex("}")]
    return {label: value.strip('"') for label, _, value in (p.partition("=") for p in labels.split('",'))}


def metric_by_label(samples: dict[str, float], name: str, label: str) -> dict[str, float]:
    """``name`` summed per value of ``label``."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        if key.startswith(name + "{") and f'{label}="' in key:
            which = key.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[which] = out.get(which, 0.0) + value
    return out


def read_metrics(base_url: str, timeout_s: float = 30.0, attempts: int = 1) -> dict[str, float]:
    """``GET base_url/metrics``, parsed (blocking: run it in a thread from async code). A time-out is retried on
    a new connection ``attempts - 1`` times."""
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s) as reply:
                return parse_metrics(reply.read().decode())
        except TimeoutError:
            if attempt == attempts - 1:
                raise
    raise ValueError("attempts must be at least 1")
