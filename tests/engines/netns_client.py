"""The client side of ``test_netns_topology``: run inside the test's client network namespace
(``ip netns exec NS python -m tests.engines.netns_client ...``), so every request it makes crosses the test's
bridge to another namespace's real address. Not a test module (pytest does not collect it).

- ``wait --http URL --grpc HOST:PORT/SERVICE ... --timeout S``: poll until every HTTP URL answers 200 and every
  gRPC health service is SERVING; exit 0, or 1 with what was still missing when the time ran out.
- ``chat --router URL --prefill URL --broker HOST:PORT --model NAME --turns N``: the broker's engine list, then a
  multi-turn chat through the router (each turn's ``x-kvloop-*`` headers and reply, and the same request
  recomputed on the prefill engine alone for reference); one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

SYSTEM = " ".join(f"Rule {i}: the agent keeps its notes short, cites block {i * 3 % 17} and never guesses."
                  for i in range(40))  # ~700 tokens: every later turn matches well over the broker's threshold
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy, whatever the env says


def http_status(url: str, timeout_s: float = 2.0) -> int:
    try:
        with NO_PROXY.open(url, timeout=timeout_s) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


async def grpc_serving(target: str, timeout_s: float = 2.0) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address, _, service = target.partition("/")
    async with grpc.aio.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


async def wait(http: list[str], grpcs: list[str], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    missing = [*http, *grpcs]
    while True:
        missing = [u for u in http if await asyncio.to_thread(http_status, u) != 200]
        missing += [t for t in grpcs if not await grpc_serving(t)]
        if not missing or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.2)
    if missing:
        print(f"not ready after {timeout_s:.0f}s: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


def operator_token(path: str) -> str | None:
    from kvloop.shared.auth import read_token

    return read_token(Path(path)) if path else None


async def engine_addresses(broker: str, token: str | None) -> list[dict[str, str]]:
    from google.protobuf.json_format import MessageToDict

    from kvloop.shared.client import BrokerClient
    from kvloop.v1 import broker_pb2 as pb

    async with BrokerClient(broker, token=token) as client:
        reply = await client.call("Inspect", pb.InspectRequest())
    return [{"engine_id": e.engine.engine_id, "role": pb.EngineRole.Name(e.engine.role),
             **MessageToDict(e.engine.addresses)} for e in reply.engines]


async def lease_ids(broker: str, token: str | None) -> set[str]:
    from kvloop.shared.client import BrokerClient
    from kvloop.v1 import broker_pb2 as pb

    async with BrokerClient(broker, token=token) as client:
        reply = await client.call("Inspect", pb.InspectRequest())
    return {lease.lease_id for lease in reply.leases}


async def chat(router: str, prefill: str, broker: str, model: str, turns: int, token: str | None
               ) -> dict[str, Any]:
    import aiohttp

    from kvloop.shared import headers as hdr

    out: dict[str, Any] = {"engines": await engine_addresses(broker, token), "turns": []}
    messages = [{"role": "system", "content": SYSTEM}]
    async with aiohttp.ClientSession(trust_env=False, timeout=aiohttp.ClientTimeout(total=180)) as http:
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Question {turn}: which block holds note {turn * 7}?"})
            # A new cache_salt per turn keeps the prefill engine's own prefix cache out, so what turn N+1 reuses
            # is pulled from the decode engine's retained KV, over NIXL, across the namespaces.
            body = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": True,
                    "top_logprobs": 2, "cache_salt": f"netns-agent-turn-{turn}"}
            before = await lease_ids(broker, token)
            async with http.post(f"{router}/v1/chat/completions", json=body,
                                 headers={hdr.SESSION_ID: "netns-agent"}) as reply:
                status, headers, answer = reply.status, dict(reply.headers), await reply.json(content_type=None)
            if status != 200:
                out["turns"].append({"status": status, "reply": answer})
                break
            # The same chat recomputed on the prefill engine alone, no cache: the reference answer.
            async with http.post(f"{prefill}/v1/chat/completions",
                                 json={**body, "cache_salt": f"netns-recompute-{turn}",
                                       "kv_transfer_params": None}) as reply:
                reference = await reply.json(content_type=None)
            out["turns"].append({"status": status, "reply": answer, "reference": reference,
                                 "headers": {k.lower(): v for k, v in headers.items()
                                             if k.lower().startswith(hdr.PREFIX)}})
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            # The decode engine's sidecar publishes this turn's KV a few ms after the answer: wait for it (bounded)
            # so the next turn's placement sees it.
            for _ in range(300):
                if await lease_ids(broker, token) - before:
                    break
                await asyncio.sleep(0.05)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="netns_client")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wait")
    w.add_argument("--http", action="append", default=[])
    w.add_argument("--grpc", action="append", default=[], help="HOST:PORT/SERVICE ('' after the slash: liveness)")
    w.add_argument("--timeout", type=float, default=10.0)
    c = sub.add_parser("chat")
    for name in ("--router", "--prefill", "--broker", "--model"):
        c.add_argument(name, required=True)
    c.add_argument("--turns", type=int, default=3)
    c.add_argument("--token-file", default="", help="an operator's token for the broker's Inspect")
    args = parser.parse_args(argv)
    if args.command == "wait":
        return asyncio.run(wait(args.http, args.grpc, args.timeout))
    print(json.dumps(asyncio.run(chat(args.router.rstrip("/"), args.prefill.rstrip("/"), args.broker, args.model,
                                      args.turns, operator_token(args.token_file)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
