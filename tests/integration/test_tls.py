"""Security between services: TLS and mutual TLS on the broker's, the sidecar's and the router's ports, the
broker's identity checks, and the router's API key.

A throwaway CA (and a second, foreign one) is made per module (``tests/integration/tlscerts.py``). Brokers are
real processes on ephemeral loopback ports; clients are real gRPC channels. The router runs in-process in
front of a fake OpenAI engine (``FakeEngine``: answers /tokenize and completions with canned JSON), so no vLLM
starts. Every refusal is followed by a valid call that is still served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio

from kvloop.router.config import RouterConfig
from kvloop.router.server import RunningRouter, start_router
from kvloop.shared import headers as hdr
from kvloop.shared import procs
from kvloop.shared.client import wait_serving
from kvloop.shared.errors import ConfigError
from kvloop.shared.tls import TlsFiles, insecure_or_secure_channel
from kvloop.shared.vocabulary import Fallback
from kvloop.v1 import broker_pb2 as pb
from kvloop.v1 import broker_pb2_grpc
from tests.integration.conftest import ModuleBrokerFactory
from tests.integration.helpers import SERVICE, StreamReader, engine, place_request, poll, publish_request, tokens
from tests.integration.tlscerts import Issued, TestCA
from tests.support.fake_engine import FakeEngine
from tests.support.sidecar_fakes import FakeConnector, hello, retained, running_sidecar

pytestmark = pytest.mark.slow
FP = "fp-tls"


@dataclass(frozen=True)
class PKI:
    ca: TestCA
    rogue: TestCA
    server: Issued      # the brokers', sidecar's and router's server certificate: localhost, 127.0.0.1
    router: Issued
    ops: Issued         # an admin identity
    eng_a: Issued
    eng_b: Issued
    eng_c: Issued       # valid, but not in the broker's allowed_engines
    eng_s: Issued       # the sidecar test's engine
    rogue_eng_a: Issued  # "eng-a", signed by a foreign CA

    def client(self, issued: Issued | None) -> TlsFiles:
        """Trust our CA and present ``issued`` (None: present nothing)."""
        return TlsFiles(issued.cert if issued else None, issued.key if issued else None, self.ca.cert)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    root = tmp_path_factory.mktemp("pki")
    ca, rogue = TestCA(root / "ca"), TestCA(root / "rogue", "rogue-ca")
    return PKI(ca=ca, rogue=rogue, server=ca.issue("localhost", ips=["127.0.0.1"]), router=ca.issue("router"),
               ops=ca.issue("ops"), eng_a=ca.issue("eng-a"), eng_b=ca.issue("eng-b"), eng_c=ca.issue("eng-c"),
               eng_s=ca.issue("eng-s"), rogue_eng_a=rogue.issue("eng-a"))


def tls_flags(pki: PKI, *, mutual: bool = True) -> list[str]:
    flags = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    return [*flags, "--tls-ca", str(pki.ca.cert)] if mutual else flags


@pytest.fixture(scope="module")
def mtls_broker(start_module_broker: ModuleBrokerFactory, pki: PKI) -> procs.Proc:
    return start_module_broker("mtls-broker", *tls_flags(pki), "--client-identities", "router",
                               "--admin-identities", "ops", "--allowed-engines", "eng-a,eng-b,eng-s,eng-t",
                               "--keepalive-interval-s", "0.5", "--engine-ttl-s", "5")


class Client:
    """One channel to a broker, with or without TLS."""

    def __init__(self, address: str, tls: TlsFiles | None) -> None:
        self.channel = insecure_or_secure_channel(address, tls)
        self.stub = broker_pb2_grpc.KVBrokerStub(self.channel)

    async def __aenter__(self) -> broker_pb2_grpc.KVBrokerStub:
        return self.stub

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()


async def refused(call: Any, code: grpc.StatusCode, match: str = "") -> str:
    """Await ``call``; assert it fails with ``code`` (and ``match`` in the details); return the details."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, (info.value.code(), info.value.details())
    details = info.value.details() or ""
    assert match in details, details
    return details


async def test_valid_certificates_are_served(mtls_broker: procs.Proc, pki: PKI) -> None:
    address = mtls_broker.extra["address"]
    await wait_serving(address, SERVICE, timeout_s=20, tls=pki.client(pki.router))
    async with Client(address, pki.client(pki.eng_a)) as eng, Client(address, pki.client(pki.router)) as router:
        await eng.RegisterEngine(pb.RegisterEngineRequest(engine=engine("eng-a", pb.ENGINE_ROLE_DECODE, FP)), timeout=5)
        async with Client(address, pki.client(pki.eng_b)) as eng_b:
            await eng_b.RegisterEngine(pb.RegisterEngineRequest(engine=engine("eng-b", pb.ENGINE_ROLE_PREFILL, FP)),
                                       timeout=5)
        async with StreamReader(eng.WatchEvictions(pb.WatchEvictionsRequest(engine_id="eng-a"))) as stream:
            first = await eng.PublishLease(publish_request("eng-a", tokens(256), FP), timeout=5)
            await eng.KeepAlive(pb.KeepAliveRequest(engine_id="eng-a"), timeout=5)
            await eng.PublishLease(publish_request("eng-a", tokens(512), FP, first_block_id=10), timeout=5)
            (command,) = await stream.take(1)  # the longer lease supersedes the first, on eng-a's own stream
            assert command.lease_id == first.lease.lease_id and command.reason == pb.EVICTION_REASON_SUPERSEDED
        plan = await router.Place(place_request(tokens(640), FP), timeout=5)
        assert plan.source_engine_id == "eng-a" and plan.matched_blocks == 4
        pin = await router.PinBlocks(pb.PinBlocksRequest(reader_engine_id="eng-b", lease_id=plan.source_lease_id,
                                                         num_blocks=4), timeout=5)
        await router.CompleteTransfer(pb.CompleteTransferRequest(pin_id=pin.pin_id, success=True), timeout=5)
        call = router.PlaceStream()
        await call.write(pb.PlaceBatch(requests=[place_request(tokens(640), FP)]))
        reply = await call.read()
        assert reply.plans[0].source_engine_id == "eng-a" and not reply.plans[0].error
        call.cancel()
        assert {"eng-a", "eng-b"} <= {e.engine.engine_id for e in (await router.Inspect(pb.InspectRequest(),
                                                                                         timeout=5)).engines}
        await eng.DeregisterEngine(pb.DeregisterEngineRequest(engine_id="eng-a"), timeout=5)
    async with Client(address, pki.client(pki.ops)) as ops:  # an admin may act for any engine
        await ops.DeregisterEngine(pb.DeregisterEngineRequest(engine_id="eng-b"), timeout=5)


async def test_no_certificate_or_a_foreign_one_is_refused_at_the_handshake(mtls_broker: procs.Proc, pki: PKI) -> None:
    address = mtls_broker.extra["address"]
    foreign = TlsFiles(pki.rogue_eng_a.cert, pki.rogue_eng_a.key, pki.ca.cert)
    not_trusting = TlsFiles(pki.eng_a.cert, pki.eng_a.key, pki.rogue.cert)  # does not trust the broker's CA
    for tls in (None, pki.client(None), foreign, not_trusting):
        async with Client(address, tls) as stub:
            await refused(stub.Inspect(pb.InspectRequest(), timeout=5), grpc.StatusCode.UNAVAILABLE)
            await refused(stub.RegisterEngine(pb.RegisterEngineRequest(
                engine=engine("eng-a", pb.ENGINE_ROLE_DECODE, FP)), timeout=5), grpc.StatusCode.UNAVAILABLE)
    async with Client(address, pki.client(pki.router)) as router:  # the broker keeps serving
        assert "eng-a" not in {e.engine.engine_id for e in (await router.Inspect(pb.InspectRequest(),
                                                                                  timeout=5)).engines}
    assert mtls_broker.alive


async def test_a_valid_certificate_acts_only_for_its_own_engine(mtls_broker: procs.Proc, pki: PKI) -> None:
    address = mtls_broker.extra["address"]
    denied = grpc.StatusCode.PERMISSION_DENIED
    async with Client(address, pki.client(pki.eng_a)) as eng_a, Client(address, pki.client(pki.eng_b)) as eng_b, \
            Client(address, pki.client(pki.router)) as router:
        await eng_a.RegisterEngine(pb.RegisterEngineRequest(engine=engine("eng-a", pb.ENGINE_ROLE_DECODE, FP)),
                                   timeout=5)
        await eng_b.RegisterEngine(pb.RegisterEngineRequest(engine=engine("eng-b", pb.ENGINE_ROLE_PREFILL, FP)),
                                   timeout=5)
        lease = (await eng_a.PublishLease(publish_request("eng-a", tokens(384), FP), timeout=5)).lease
        # eng-b's certificate, acting for eng-a: every engine RPC is refused, with both names in the message.
        details = await refused(eng_b.KeepAlive(pb.KeepAliveRequest(engine_id="eng-a"), timeout=5), denied,
                                "engine_id: KeepAlive for engine 'eng-a' refused")
        assert "['eng-b']" in details
        await refused(eng_b.RegisterEngine(pb.RegisterEngineRequest(engine=engine("eng-a", pb.ENGINE_ROLE_DECODE, FP,
                                                                                  incarnation="stolen")), timeout=5),
                      denied, "engine.engine_id: RegisterEngine for engine 'eng-a'")
        await refused(eng_b.PublishLease(publish_request("eng-a", tokens(256, 9000), FP), timeout=5), denied,
                      "engine_id: PublishLease")
        await refused(eng_b.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.lease_id), timeout=5), denied,
                      f"lease_id: ReleaseLease for lease '{lease.lease_id}' of engine 'eng-a'")
        await refused(eng_b.RenewLease(pb.RenewLeaseRequest(lease_id=lease.lease_id, ttl_s=1.0), timeout=5), denied,
                      "lease_id: RenewLease")
        await refused(eng_b.DeregisterEngine(pb.DeregisterEngineRequest(engine_id="eng-a"), timeout=5), denied,
                      "engine_id: DeregisterEngine")
        async with StreamReader(eng_b.WatchEvictions(pb.WatchEvictionsRequest(engine_id="eng-a"))) as stream:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stream.next()
            assert info.value.code() == denied and "WatchEvictions for engine 'eng-a'" in (info.value.details() or "")
        # A valid certificate for an engine the broker was not told about.
        async with Client(address, pki.client(pki.eng_c)) as eng_c:
            await refused(eng_c.RegisterEngine(pb.RegisterEngineRequest(
                engine=engine("eng-c", pb.ENGINE_ROLE_DECODE, FP)), timeout=5), denied, "not in allowed_engines")
        # Engines are not routers (client_identities = router).
        await refused(eng_a.Place(place_request(tokens(384), FP), timeout=5), denied,
                      "caller: Place is for routers; this caller is a certificate naming ['eng-a']")
        await refused(eng_a.Inspect(pb.InspectRequest(), timeout=5), denied, "caller: Inspect")
        # The broker refuses the stream when it opens, by the caller's certificate, before reading a batch. A batch
        # written here could race that refusal and fail on the client first (INTERNAL, seen once), so none is sent.
        stream_call = eng_a.PlaceStream()
        await refused(stream_call.read(), denied, "caller: PlaceStream")
        # The cluster keeps serving: eng-a's lease is intact and found, eng-a still acts for itself.
        await eng_a.KeepAlive(pb.KeepAliveRequest(engine_id="eng-a"), timeout=5)
        plan = await router.Place(place_request(tokens(512), FP), timeout=5)
        assert plan.source_lease_id == lease.lease_id and plan.matched_blocks == 3
        await eng_a.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.lease_id), timeout=5)
        async with Client(address, pki.client(pki.ops)) as ops:
            await ops.KeepAlive(pb.KeepAliveRequest(engine_id="eng-a"), timeout=5)
        await eng_a.DeregisterEngine(pb.DeregisterEngineRequest(engine_id="eng-a"), timeout=5)
        await eng_b.DeregisterEngine(pb.DeregisterEngineRequest(engine_id="eng-b"), timeout=5)
    assert mtls_broker.alive


async def test_server_only_tls_encrypts_without_identities(start_module_broker: ModuleBrokerFactory, pki: PKI
                                                           ) -> None:
    """cert and key without tls_ca: TLS, the broker proves itself, clients need no certificate, no identity checks."""
    proc = start_module_broker("tls-broker", *tls_flags(pki, mutual=False))
    address = proc.extra["address"]
    async with Client(address, None) as plain:
        await refused(plain.Inspect(pb.InspectRequest(), timeout=5), grpc.StatusCode.UNAVAILABLE)
    await wait_serving(address, SERVICE, timeout_s=20, tls=pki.client(None))
    async with Client(address, pki.client(None)) as stub:
        await stub.RegisterEngine(pb.RegisterEngineRequest(engine=engine("any-id", pb.ENGINE_ROLE_DECODE, FP)),
                                  timeout=5)
        await stub.DeregisterEngine(pb.DeregisterEngineRequest(engine_id="any-id"), timeout=5)


def test_broker_status_command_with_tls(mtls_broker: procs.Proc, pki: PKI, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    from kvloop.app.cli import main

    address = mtls_broker.extra["address"]
    assert main(["broker", "status", "--broker", address]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert main(["broker", "status", "--broker", address, "--tls-ca", str(pki.ca.cert), "--tls-cert",
                 str(pki.ops.cert), "--tls-key", str(pki.ops.key), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["store"] == "memory"


# Configuration: every bad path or pair names its field.

def test_bad_tls_files_name_the_field(pki: PKI, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvloop.app.cli import main
    from kvloop.broker.config import BrokerConfig
    from kvloop.engines.sidecar import SidecarConfig

    def broker(**env: str) -> None:
        BrokerConfig.load({}, env={f"KVLOOP_BROKER_{k.upper()}": v for k, v in env.items()})

    cert, key = str(pki.server.cert), str(pki.server.key)
    with pytest.raises(ConfigError, match=r"^tls_cert: no such file"):
        broker(tls_cert=str(tmp_path / "missing.crt"), tls_key=key)
    with pytest.raises(ConfigError, match=r"^tls_key: does not match tls_cert"):
        broker(tls_cert=cert, tls_key=str(pki.eng_a.key))
    with pytest.raises(ConfigError, match=r"^tls_key: required with tls_cert"):
        broker(tls_cert=cert)
    with pytest.raises(ConfigError, match=r"^tls_cert: required with tls_ca"):
        broker(tls_ca=str(pki.ca.cert))
    with pytest.raises(ConfigError, match=r"^tls_key: .* holds no PEM private key"):
        broker(tls_cert=cert, tls_key=cert)
    with pytest.raises(ConfigError, match=r"^tls_ca: .* holds no PEM CA certificate"):
        broker(tls_cert=cert, tls_key=key, tls_ca=key)
    (tmp_path / "junk.crt").write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    with pytest.raises(ConfigError, match=r"^tls_ca: .* is not a valid PEM certificate"):
        broker(tls_cert=cert, tls_key=key, tls_ca=str(tmp_path / "junk.crt"))
    with pytest.raises(ConfigError, match=r"^engine_identity: must contain \{engine_id\}"):
        broker(engine_identity="engine")
    broker(tls_cert=cert, tls_key=key, tls_ca=str(pki.ca.cert))  # a good set loads
    assert main(["broker", "serve", "--tls-cert", str(tmp_path / "nope.crt"), "--tls-key", key]) == 2
    assert "tls_cert: no such file" in capsys.readouterr().err

    router = dict(listen="127.0.0.1:0", prefill_urls="http://127.0.0.1:9", decode_urls="http://127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"^broker_tls_key: required with broker_tls_cert"):
        RouterConfig(**router, broker_tls_cert=pki.router.cert).validate()
    (tmp_path / "keys").write_text("# no keys yet\n\n")
    with pytest.raises(ConfigError, match=r"^api_key_file: .* holds no key"):
        RouterConfig(**router, api_key_file=tmp_path / "keys").validate()
    with pytest.raises(ConfigError, match=r"^api_key_file: cannot read"):
        RouterConfig(**router, api_key_file=tmp_path / "nokeys").validate()
    with pytest.raises(ConfigError, match=r"^open_paths"):
        RouterConfig(**router, open_paths="health").validate()
    assert "sk-secret" not in repr(RouterConfig(**router, api_key="sk-secret"))

    sidecar = dict(engine_id="e", broker="127.0.0.1:1", socket=tmp_path / "s.sock", engine_url="http://x:1",
                   layout_fingerprint="f")
    with pytest.raises(ConfigError, match=r"^broker_tls_ca: no such file"):
        SidecarConfig(**sidecar, broker_tls_ca=tmp_path / "none.crt").validate()
    with pytest.raises(ConfigError, match=r"^tls_key: does not match tls_cert"):
        SidecarConfig(**sidecar, tls_cert=pki.server.cert, tls_key=pki.eng_b.key).validate()


# The sidecar: a TLS client of the broker (identity = its engine id) and a TLS server on its gRPC port.

def refusals_for(proc: procs.Proc, engine_id: str) -> list[dict[str, Any]]:
    out = []
    for line in proc.log_path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("event") == "rpc.refused" and f"'{engine_id}'" in record.get("error", ""):
                out.append(record)
    return out


async def test_sidecar_registers_over_mtls_and_a_wrong_identity_is_refused(mtls_broker: procs.Proc, pki: PKI,
                                                                          tmp_path: Path) -> None:
    address = mtls_broker.extra["address"]
    link = {"broker_tls_ca": pki.ca.cert, "broker_tls_cert": pki.eng_s.cert, "broker_tls_key": pki.eng_s.key}
    server = {"tls_cert": pki.server.cert, "tls_key": pki.server.key, "tls_ca": pki.ca.cert}
    (tmp_path / "s").mkdir()
    (tmp_path / "t").mkdir()
    good = FakeConnector(tmp_path / "s" / "s.sock")
    bad = FakeConnector(tmp_path / "t" / "s.sock")
    # An operator's certificate: a router's Inspect shows no leases (broker.access).
    async with Client(address, pki.client(pki.ops)) as router:
        async def engines() -> set[str]:
            return {e.engine.engine_id for e in (await router.Inspect(pb.InspectRequest(), timeout=5)).engines}

        try:
            async with running_sidecar(tmp_path / "s", address, "eng-s", port_file=tmp_path / "s.port",
                                       **link, **server):
                await good.attach(hello("eng-s"))  # the Unix socket: plaintext, private to the engine
                await poll(engines, lambda ids: "eng-s" in ids, timeout_s=10, what="eng-s registered over mTLS")
                good.events.put_nowait(retained("req-1", 256))
                sidecar_address = f"127.0.0.1:{(tmp_path / 's.port').read_text().strip()}"
                await wait_serving(sidecar_address, "kvloop.v1.EngineLink", timeout_s=10, tls=pki.client(pki.ops))
                async with Client(sidecar_address, None) as plain:  # its gRPC port refuses plaintext
                    await refused(plain.Inspect(pb.InspectRequest(), timeout=5), grpc.StatusCode.UNAVAILABLE)
                # A second sidecar presenting eng-s's certificate for engine eng-t: the broker refuses it.
                async with running_sidecar(tmp_path / "t", address, "eng-t", **link):
                    await bad.attach(hello("eng-t"))
                    await poll(lambda: asyncio.sleep(0, refusals_for(mtls_broker, "eng-t")), bool, timeout_s=10,
                               what="the broker's refusal of eng-t")
                    (first, *_) = refusals_for(mtls_broker, "eng-t")
                    assert first["method"] == "RegisterEngine" and first["code"] == "PERMISSION_DENIED"
                    assert "['eng-s']" in first["error"]
                    assert "eng-t" not in await engines()
                    await bad.close()
                # eng-s kept serving throughout: registered, its lease published and found.
                reply = await poll(lambda: router.Inspect(pb.InspectRequest(), timeout=5),
                                   lambda r: any(x.engine_id == "eng-s" for x in r.leases), timeout_s=10,
                                   what="eng-s's lease")
                (lease,) = [x for x in reply.leases if x.engine_id == "eng-s"]
                assert lease.num_tokens == 256 and "eng-s" in {e.engine.engine_id for e in reply.engines}
        finally:
            await good.close()
            await bad.close()


# The router: HTTPS (with client certificates) and the API key, in front of a fake engine.

@pytest_asyncio.fixture(loop_scope="session")
async def fake_engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine()
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


@contextlib.asynccontextmanager
async def running_router(**values: Any) -> AsyncIterator[RunningRouter]:
    running = await start_router(RouterConfig(**{"listen": "127.0.0.1:0", "log_format": "console", **values}))
    try:
        yield running
    finally:
        await running.stop()


def client_ssl(pki: PKI, issued: Issued | None, ca: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca or pki.ca.cert))
    if issued is not None:
        context.load_cert_chain(issued.cert, issued.key)
    return context


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


async def chat(url: str, *, key: str | None = None, ssl_context: ssl.SSLContext | None = None
               ) -> tuple[int, Any, dict[str, str]]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers,
                                                          ssl=ssl_context if ssl_context is not None else False) as r:
        return r.status, await r.json(content_type=None), dict(r.headers)


@pytest.fixture
def keys_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "api-keys"
    path.write_text("# rotated keys, one a line\nsk-old-key\nsk-new-key\n")
    yield path


async def test_router_https_client_certificates_and_api_key(fake_engine: FakeEngine, pki: PKI, keys_file: Path
                                                            ) -> None:
    async with running_router(prefill_urls=fake_engine.url, decode_urls=fake_engine.url, tls_cert=pki.server.cert,
                              tls_key=pki.server.key, tls_ca=pki.ca.cert, api_key="sk-good",
                              api_key_file=keys_file) as router:
        assert router.url.startswith("https://127.0.0.1:")
        good = client_ssl(pki, pki.router)
        status, body, _ = await chat(router.url, key="sk-good", ssl_context=good)
        assert status == 200 and body["choices"][0]["message"]["content"] == "ok"
        assert (await chat(router.url, key="sk-new-key", ssl_context=good))[0] == 200  # api_key_file's keys too
        # Missing or wrong key: OpenAI's 401, before any engine is touched.
        calls = fake_engine.calls
        status, body, headers = await chat(router.url, ssl_context=good)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key"
        assert body["error"]["param"] is None and "didn't provide an API key" in body["error"]["message"]
        status, body, _ = await chat(router.url, key="sk-goo", ssl_context=good)
        assert status == 401 and body["error"]["message"] == "Incorrect API key provided."
        assert fake_engine.calls == calls
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{router.url}/v1/models", ssl=good) as reply:  # every path but open_paths
                assert reply.status == 401
            async with http.get(f"{router.url}/health", ssl=good) as reply:  # open_paths: no key needed
                assert reply.status == 200
            async with http.get(f"{router.url}/metrics", ssl=good) as reply:
                assert reply.status == 200 and 'kvloop_router_requests_total{endpoint="auth",status="401"}' in \
                    await reply.text()
        # No client certificate, one from a foreign CA, plain HTTP: refused at the connection.
        for context in (client_ssl(pki, None), client_ssl(pki, pki.rogue_eng_a)):
            with pytest.raises((aiohttp.ClientError, ssl.SSLError, ConnectionError)):
                await chat(router.url, key="sk-good", ssl_context=context)
        with pytest.raises(aiohttp.ClientError):
            await chat(router.url.replace("https://", "http://"), key="sk-good")
        # The router does not trust a client that does not trust it either way: a client expecting another CA.
        with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
            await chat(router.url, key="sk-good", ssl_context=client_ssl(pki, pki.router, ca=pki.rogue.cert))
        # ... and it keeps serving.
        assert (await chat(router.url, key="sk-old-key", ssl_context=good))[0] == 200


async def test_router_api_key_over_plain_http(fake_engine: FakeEngine) -> None:
    async with running_router(prefill_urls=fake_engine.url, decode_urls=fake_engine.url, api_key="sk-plain",
                              open_paths="") as router:
        assert (await chat(router.url, key="sk-plain"))[0] == 200
        assert (await chat(router.url, key="wrong"))[0] == 401
        async with aiohttp.ClientSession() as http, http.get(f"{router.url}/health") as reply:
            assert reply.status == 401  # open_paths empty: health needs the key too


@pytest.fixture(scope="module")
def router_broker(start_module_broker: ModuleBrokerFactory, pki: PKI) -> procs.Proc:
    return start_module_broker("router-mtls-broker", *tls_flags(pki), "--client-identities", "router",
                               "--admin-identities", "ops", "--engine-ttl-s", "60")


async def test_router_reaches_an_mtls_broker(router_broker: procs.Proc, fake_engine: FakeEngine, pki: PKI) -> None:
    """The router's broker link with its certificate: engines learned and turns placed by the broker. Routers
    without a certificate, or with an engine's, are refused by the broker and fall back; the first keeps going."""
    address = router_broker.extra["address"]
    async with Client(address, pki.client(pki.ops)) as ops:
        for eid, role in (("fake-p", pb.ENGINE_ROLE_PREFILL), ("fake-d", pb.ENGINE_ROLE_DECODE)):
            info = engine(eid, role, FP, bs=16)
            info.addresses.http = fake_engine.url
            await ops.RegisterEngine(pb.RegisterEngineRequest(engine=info), timeout=5)
    link = {"broker": address, "broker_tls_ca": pki.ca.cert, "refresh_s": 0.2}
    async with running_router(**link, broker_tls_cert=pki.router.cert, broker_tls_key=pki.router.key) as router:
        assert set(router.runner.directory.engines) == {"fake-p", "fake-d"}  # Inspect over mTLS
        status, _, headers = await chat(router.url)
        assert status == 200 and headers[hdr.REASON] != Fallback.BROKER_UNAVAILABLE, headers
        for refused_link in ({}, {"broker_tls_cert": pki.eng_a.cert, "broker_tls_key": pki.eng_a.key}):
            async with running_router(**link, **refused_link) as other:
                assert other.runner.directory.engines == {}  # Inspect refused: no engines, /health says so
                async with aiohttp.ClientSession() as http, http.get(f"{other.url}/health") as reply:
                    assert reply.status == 503
        status, _, headers = await chat(router.url)
        assert status == 200 and headers[hdr.REASON] != Fallback.BROKER_UNAVAILABLE, headers
    assert router_broker.alive
