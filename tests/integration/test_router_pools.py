"""One router in front of two model pools, each with its own broker group (issue 26's unit past one broker).

Two real broker processes on loopback, one per pool; each pool's engines are a fake OpenAI engine
(``tests/support/fake_engine.py``) registered with that pool's broker only, under the pool's model. The router runs
in-process with ``pools``: a request goes to its model's pool, placed by that pool's broker (the engines in the
answer's headers are the ones only that broker lists), never to the other pool's engines."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from kvloop.router.config import RouterConfig
from kvloop.router.server import RunningRouter, start_router
from kvloop.shared import headers as hdr
from kvloop.shared import procs
from kvloop.shared.client import wait_serving
from kvloop.shared.errors import ConfigError
from kvloop.shared.tls import insecure_or_secure_channel
from kvloop.shared.vocabulary import NO_PLAN
from kvloop.v1 import broker_pb2 as pb
from kvloop.v1 import broker_pb2_grpc
from tests.integration.conftest import ModuleBrokerFactory
from tests.integration.helpers import engine
from tests.support.fake_engine import FakeEngine

pytestmark = pytest.mark.slow

POOLS = ("model-a", "model-b")


@pytest.fixture(scope="module")
def brokers(start_module_broker: ModuleBrokerFactory) -> Iterator[dict[str, procs.Proc]]:
    yield {model: start_module_broker(f"broker-{model}", "--engine-ttl-s", "600") for model in POOLS}


@contextlib.asynccontextmanager
async def pool_engines(brokers: dict[str, procs.Proc]) -> AsyncIterator[dict[str, FakeEngine]]:
    """A fake engine per pool, registered as that pool's prefill and decode engine with that pool's broker."""
    fakes = {model: FakeEngine() for model in POOLS}
    for fake in fakes.values():
        await fake.start()
    try:
        for model, fake in fakes.items():
            address = brokers[model].extra["address"]
            await wait_serving(address)
            async with insecure_or_secure_channel(address, None) as channel:
                stub = broker_pb2_grpc.KVBrokerStub(channel)
                for role, name in ((pb.ENGINE_ROLE_PREFILL, "prefill"), (pb.ENGINE_ROLE_DECODE, "decode")):
                    info = engine(f"{model}-{name}", role, f"fp-{model}", bs=16)
                    info.addresses.http, info.model = fake.url, model
                    await stub.RegisterEngine(pb.RegisterEngineRequest(engine=info), timeout=5)
        yield fakes
    finally:
        for fake in fakes.values():
            await fake.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def pooled(brokers: dict[str, procs.Proc]) -> AsyncIterator[tuple[RunningRouter, dict[str, FakeEngine]]]:
    async with pool_engines(brokers) as fakes:
        spec = ";".join(f"{model}={proc.extra['address']}" for model, proc in brokers.items())
        router = await start_router(RouterConfig(listen="127.0.0.1:0", log_format="console", pools=spec,
                                                 refresh_s=0.2))
        try:
            yield router, fakes
        finally:
            await router.stop()


async def ask(url: str, model: str, path: str = "/v1/chat/completions") -> tuple[int, Any, dict[str, str]]:
    body = {"model": model, "messages": [{"role": "user", "content": f"hello from a {model} client"}]}
    async with aiohttp.ClientSession() as http, http.post(f"{url}{path}", json=body) as reply:
        return reply.status, await reply.json(content_type=None), dict(reply.headers)


async def test_each_model_is_served_by_its_own_pool(pooled: tuple[RunningRouter, dict[str, FakeEngine]]) -> None:
    router, fakes = pooled
    assert {m: set(r.directory.engines) for m, r in router.runners.items()} == {
        m: {f"{m}-prefill", f"{m}-decode"} for m in POOLS}
    for model in (*POOLS, "model-a"):
        before = {m: len(f.models) for m, f in fakes.items()}
        status, reply, headers = await ask(router.url, model)
        assert status == 200, reply
        # Placed by the model's broker: the only one that lists these engines (pools have no fallback URLs).
        assert headers[hdr.DECODE_ENGINE] == f"{model}-decode", headers
        assert headers[hdr.REASON] not in NO_PLAN, headers
        other = next(m for m in POOLS if m != model)
        assert len(fakes[other].models) == before[other]  # the other pool saw nothing
        assert fakes[model].models[before[model]:] and set(fakes[model].models[before[model]:]) == {model}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{router.url}/v1/models") as reply:
            assert sorted(m["id"] for m in (await reply.json())["data"]) == list(POOLS)
        async with http.get(f"{router.url}/health") as reply:
            health = await reply.json()
            assert reply.status == 200 and health["pools"] == {m: {"prefill": 1, "decode": 1} for m in POOLS}


async def test_a_model_no_pool_serves_gets_an_openai_404(pooled: tuple[RunningRouter, dict[str, FakeEngine]]
                                                          ) -> None:
    router, fakes = pooled
    calls = sum(f.calls for f in fakes.values())
    status, reply, _ = await ask(router.url, "model-c")
    assert status == 404 and reply["error"]["param"] == "model", reply
    assert "'model-a', 'model-b'" in reply["error"]["message"], reply
    assert sum(f.calls for f in fakes.values()) == calls


@pytest.mark.parametrize(("values", "field"), [
    ({"pools": "model-a=127.0.0.1:1", "broker": "127.0.0.1:2"}, "broker"),
    ({"pools": "model-a=127.0.0.1:1", "model": "model-a"}, "model"),
    ({"pools": "model-a=127.0.0.1:1", "tokenizer": "/models/a"}, "tokenizer"),
    ({"pools": "model-a"}, "pools"),
    ({"pools": "=127.0.0.1:1"}, "pools"),
    ({"pools": "model-a=127.0.0.1:1;model-a=127.0.0.1:2"}, "pools"),
    ({"pools": "model-a=not-an-address"}, "pools"),
])
def test_bad_pools_are_refused_naming_the_field(values: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        RouterConfig(listen="127.0.0.1:0", **values).validate()
    assert caught.value.field == field, caught.value


def test_pools_parse_to_one_broker_group_per_model() -> None:
    config = RouterConfig(pools=" model-a = 127.0.0.1:1, 127.0.0.1:2 ; model-b=127.0.0.1:3;")
    config.validate()
    assert config.pool_brokers() == {"model-a": "127.0.0.1:1,127.0.0.1:2", "model-b": "127.0.0.1:3"}
    assert config.for_pool("model-b", "127.0.0.1:3").broker == "127.0.0.1:3"
