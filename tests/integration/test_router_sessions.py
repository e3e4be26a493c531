"""Session hints end to end on real parts: a real broker process on loopback, the router in-process with two
tenants' API keys, and a fake OpenAI engine (``tests/support/fake_engine.py``) registered as the pool's prefill and
decode engine. Leases are published as the decode engine publishes them (``PublishLease`` under the router's scoped
session id), so what the hints do to them is the broker's own bookkeeping, read back with ``Inspect``."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from kvloop.router.config import RouterConfig
from kvloop.router.server import RunningRouter, start_router
from kvloop.shared import headers as hdr
from kvloop.shared import procs
from kvloop.shared.client import wait_serving
from kvloop.shared.protocol import KEEP_GENERATED_KEY
from kvloop.shared.tls import insecure_or_secure_channel
from kvloop.v1 import broker_pb2 as pb
from kvloop.v1 import broker_pb2_grpc
from tests.integration.conftest import ModuleBrokerFactory
from tests.integration.helpers import engine, poll, publish_request, tokens
from tests.support.fake_engine import FakeEngine

pytestmark = pytest.mark.slow

MODEL = "m"
FP = "fp-sessions"
BS = 16
KEYS = {"a": "key-of-tenant-a", "b": "key-of-tenant-b"}
TTL = 30.0


@pytest.fixture(scope="module")
def broker(start_module_broker: ModuleBrokerFactory) -> Iterator[procs.Proc]:
    yield start_module_broker("broker-sessions", "--engine-ttl-s", "600", "--max-sessions-per-owner", "100",
                              "--max-session-pause-s", "600")


@pytest_asyncio.fixture(loop_scope="session")
async def cluster(broker: procs.Proc, tmp_path: Path) -> AsyncIterator[tuple[RunningRouter, FakeEngine, Any]]:
    fake = FakeEngine()
    await fake.start()
    address = broker.extra["address"]
    await wait_serving(address)
    keys = tmp_path / "keys"
    keys.write_text(f"{KEYS['a']} tenant-a\n{KEYS['b']} tenant-b\n")
    async with insecure_or_secure_channel(address, None) as channel:
        stub = broker_pb2_grpc.KVBrokerStub(channel)
        for role, name in ((pb.ENGINE_ROLE_PREFILL, "prefill"), (pb.ENGINE_ROLE_DECODE, "decode")):
            info = engine(f"s-{name}", role, FP, bs=BS)
            info.addresses.http, info.model = fake.url, MODEL
            await stub.RegisterEngine(pb.RegisterEngineRequest(engine=info), timeout=5)
        router = await start_router(RouterConfig(listen="127.0.0.1:0", log_format="console", broker=address,
                                                 refresh_s=0.2, api_key_file=keys))
        try:
            yield router, fake, stub
        finally:
            await router.stop()
            await fake.stop()


async def call(router: RunningRouter, tenant: str, method: str, path: str, *, body: Any = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    auth = {"Authorization": f"Bearer {KEYS[tenant]}", **(headers or {})}
    async with aiohttp.ClientSession() as http, http.request(method, f"{router.url}{path}", json=body,
                                                            headers=auth) as reply:
        return reply.status, await reply.json(content_type=None)


def chat(text: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


async def lease_of(stub: Any, session: str) -> pb.Lease | None:
    view = await stub.Inspect(pb.InspectRequest(), timeout=5)
    return next((lease for lease in view.leases if lease.session_id == session), None)


async def test_a_turns_pause_holds_its_lease_and_the_rest_resource_reads_and_ends_it(
        cluster: tuple[RunningRouter, FakeEngine, Any]) -> None:
    router, _, stub = cluster
    before = time.time()
    status, reply = await call(router, "a", "POST", "/v1/chat/completions", body=chat(),
                               headers={hdr.SESSION_ID: "agent-1", hdr.SESSION_PAUSE: "120"})
    assert status == 200, reply
    # The decode engine's publication of the turn's lease, under the router's scoped id.
    await stub.PublishLease(publish_request("s-decode", tokens(2 * BS), FP, session="tenant-a/agent-1", bs=BS,
                                            ttl_s=TTL), timeout=5)

    # The hint goes to the broker as the turn ends, after the client has its answer.
    _, state = await poll(lambda: call(router, "a", "GET", "/v1/sessions/agent-1"),
                          lambda got: got[0] == 200 and bool(got[1]["resume_at"]), timeout_s=10.0,
                          what="the turn's pause at the broker")
    assert state["id"] == "agent-1" and state["priority"] == "normal" and state["leases"] == 1
    assert state["blocks"] == 2 and before + 120 <= state["resume_at"] <= time.time() + 120
    lease = await lease_of(stub, "tenant-a/agent-1")
    assert lease is not None and lease.expires_at_unix >= state["resume_at"] > time.time() + TTL

    status, ended = await call(router, "a", "DELETE", "/v1/sessions/agent-1")
    assert status == 200 and ended["deleted"] is True and ended["released_leases"] == 1, ended
    assert await lease_of(stub, "tenant-a/agent-1") is None


async def test_another_tenant_can_neither_read_nor_end_a_session(
        cluster: tuple[RunningRouter, FakeEngine, Any]) -> None:
    router, _, stub = cluster
    status, reply = await call(router, "a", "POST", "/v1/sessions/agent-2", body={"priority": "high"})
    assert status == 200 and reply["priority"] == "high", reply
    await stub.PublishLease(publish_request("s-decode", tokens(BS, 5000), FP, session="tenant-a/agent-2", bs=BS,
                                            first_block_id=100), timeout=5)
    for method in ("GET", "DELETE"):
        status, reply = await call(router, "b", method, "/v1/sessions/agent-2")
        assert status == 404 and reply["error"]["param"] == "session_id", reply
    # b's hints name b's own session of that name, never a's.
    status, reply = await call(router, "b", "POST", "/v1/sessions/agent-2", body={"pause_s": 5})
    assert status == 200 and reply["leases"] == 0, reply
    status, reply = await call(router, "a", "GET", "/v1/sessions/agent-2")
    assert status == 200 and reply["priority"] == "high" and reply["leases"] == 1 and not reply["resume_at"]
    assert await lease_of(stub, "tenant-a/agent-2") is not None


@pytest.mark.parametrize(("headers", "extra", "param"), [
    ({hdr.SESSION_ID: "s", hdr.SESSION_PAUSE: "soon"}, {}, hdr.SESSION_PAUSE),
    ({hdr.SESSION_ID: "s", hdr.SESSION_PAUSE: "1e12"}, {}, hdr.SESSION_PAUSE),
    ({}, {"metadata": {"session_id": "s", "session_priority": "urgent"}}, "metadata.session_priority"),
    ({hdr.SESSION_END: "true"}, {}, hdr.SESSION_ID),
    ({hdr.SESSION_ID: "s", hdr.SESSION_END: "true", hdr.SESSION_PAUSE: "3"}, {}, hdr.SESSION_END),
    ({}, {"metadata": "not an object"}, "metadata"),
])
async def test_a_bad_hint_is_a_400_naming_it_before_any_engine_is_asked(
        cluster: tuple[RunningRouter, FakeEngine, Any], headers: dict[str, str], extra: dict[str, Any],
        param: str) -> None:
    router, fake, _ = cluster
    calls = fake.calls
    status, reply = await call(router, "a", "POST", "/v1/chat/completions", body=chat(**extra), headers=headers)
    assert status == 400 and reply["error"]["param"] == param, reply
    assert fake.calls == calls


async def test_metadata_hints_are_taken_and_kept_from_the_engines(
        cluster: tuple[RunningRouter, FakeEngine, Any]) -> None:
    router, fake, _ = cluster
    body = chat(metadata={"session_id": "agent-3", "session_priority": "low", "trace": "kept"})
    status, reply = await call(router, "a", "POST", "/v1/chat/completions", body=body)
    assert status == 200, reply
    sent = fake.requests[-1][1]
    assert sent.get("metadata") == {"trace": "kept"}, sent

    await poll(lambda: call(router, "a", "GET", "/v1/sessions/agent-3"),
               lambda got: got[0] == 200 and got[1]["priority"] == "low", timeout_s=10.0,
               what="the turn's priority at the broker")


async def test_the_broker_grants_a_long_pause_shorter_and_says_so(
        cluster: tuple[RunningRouter, FakeEngine, Any]) -> None:
    router, _, _ = cluster
    status, reply = await call(router, "a", "POST", "/v1/sessions/agent-4",
                               body={"pause_s": 5000, "keep_generated": False})
    assert status == 200, reply
    assert reply["pause_granted_s"] == 600 and any(r.startswith("pause_s:") for r in reply["refused"]), reply
    assert not any(r.startswith("keep_generated:") for r in reply["refused"]) and not reply["keep_generated"], reply
    for bad, param in (({"pause": 3}, "pause"), ({"pause_s": math.inf}, "pause_s"), ([], "body")):
        status, reply = await call(router, "a", "POST", "/v1/sessions/agent-4", body=bad)
        assert status == 400 and reply["error"]["param"] == param, reply


async def test_a_session_that_drops_its_answers_says_so_to_the_decode_engine_on_every_turn(
        cluster: tuple[RunningRouter, FakeEngine, Any]) -> None:
    """``keep_generated: false`` said once (by REST) reaches the decode request of each later turn through the
    broker's plan; a turn's own hint wins; another tenant's session of the same name is its own."""
    router, fake, _ = cluster

    def decode_params() -> dict[str, Any]:
        return dict(fake.requests[-1][1].get("kv_transfer_params") or {})

    status, reply = await call(router, "a", "POST", "/v1/sessions/agent-7", body={"keep_generated": False})
    assert status == 200 and reply["keep_generated"] is False, reply
    for text in ("turn one", "turn two"):
        status, _ = await call(router, "a", "POST", "/v1/chat/completions", body=chat(text),
                               headers={hdr.SESSION_ID: "agent-7"})
        assert status == 200 and decode_params().get(KEEP_GENERATED_KEY) is False, decode_params()
    status, _ = await call(router, "a", "POST", "/v1/chat/completions", body=chat("turn three"),
                           headers={hdr.SESSION_ID: "agent-7", hdr.SESSION_KEEP_GENERATED: "true"})
    assert status == 200 and KEEP_GENERATED_KEY not in decode_params(), decode_params()
    status, _ = await call(router, "b", "POST", "/v1/chat/completions", body=chat("another tenant"),
                           headers={hdr.SESSION_ID: "agent-7"})
    assert status == 200 and KEEP_GENERATED_KEY not in decode_params(), decode_params()


async def test_a_flood_of_sessions_is_bounded_per_tenant(cluster: tuple[RunningRouter, FakeEngine, Any]) -> None:
    router, _, _ = cluster
    statuses = []
    async with aiohttp.ClientSession() as http:
        for i in range(120):
            async with http.post(f"{router.url}/v1/sessions/flood-{i}", json={"pause_s": 86400},
                                 headers={"Authorization": f"Bearer {KEYS['b']}"}) as reply:
                statuses.append(reply.status)
                if reply.status != 200:
                    body = await reply.json()
                    assert reply.status == 429 and body["error"]["param"] is None, body
                    assert "sessions" in body["error"]["message"], body
    assert 429 in statuses and statuses.count(200) <= 100
    status, _ = await call(router, "a", "POST", "/v1/sessions/after-flood", body={"pause_s": 1})
    assert status == 200  # another tenant's room is its own
