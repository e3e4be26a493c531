"""Tokens on a real broker process (``--auth-secret-file``): who may call what, refusals counted, nothing changed.

Each caller gets a token minted with the cluster secret (``kvloop auth token``); a channel carries it on every call
(:func:`kvloop.shared.tls.insecure_or_secure_channel`). The broker runs exactly as ``kvloop up`` runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvloop.shared.auth import mint, read_secrets, read_token
from kvloop.shared.tls import insecure_or_secure_channel
from kvloop.v1 import broker_pb2 as pb
from kvloop.v1 import broker_pb2_grpc
from tests.integration.helpers import engine, place_request, publish_request, tokens

pytestmark = pytest.mark.slow
FP = "fp-auth"
ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvloop.app.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def stub(address: str, token: str | None) -> tuple[grpc.aio.Channel, broker_pb2_grpc.KVBrokerStub]:
    channel = insecure_or_secure_channel(address, None, token=token)
    return channel, broker_pb2_grpc.KVBrokerStub(channel)


def refusals(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith("kvloop_broker_auth_refusals_total{")}


async def test_each_role_gets_its_calls_and_nothing_else(start_broker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    secret = tmp_path / "secret"
    assert cli("auth", "secret", "--out", str(secret)).returncode == 0
    assert oct(secret.stat().st_mode & 0o777) == "0o600"
    files = {}
    for role, subject in (("engine", "dec-1"), ("router", "router"), ("operator", "ops")):
        files[role] = tmp_path / f"{role}.token"
        done = cli("auth", "token", "--secret-file", str(secret), "--role", role, "--subject", subject,
                   "--out", str(files[role]))
        assert done.returncode == 0, done.stderr
    proc = start_broker("auth-broker", "--auth-secret-file", str(secret))
    address = proc.extra["address"]
    listening = next(json.loads(line) for line in proc.log_tail(200).splitlines() if "broker.listening" in line)
    assert listening["auth"] == "token"
    metrics_url = f"http://127.0.0.1:{listening['metrics_port']}/metrics"

    anonymous, anon = stub(address, None)
    forged_channel, forged = stub(address, mint(b"not this cluster's secret, but long enough", "engine", "dec-1", 0))
    eng_channel, eng = stub(address, read_token(files["engine"]))
    router_channel, router = stub(address, read_token(files["router"]))
    op_channel, op = stub(address, read_token(files["operator"]))
    try:
        register = pb.RegisterEngineRequest(engine=engine("dec-1", pb.ENGINE_ROLE_DECODE, FP))
        impostor = pb.RegisterEngineRequest(engine=engine("impostor", pb.ENGINE_ROLE_PREFILL, FP))
        for client, request, code, words in (
                (anon, register, grpc.StatusCode.UNAUTHENTICATED, "no credential"),
                (forged, register, grpc.StatusCode.UNAUTHENTICATED, "does not verify"),
                (eng, impostor, grpc.StatusCode.PERMISSION_DENIED, "not an engine token for 'impostor'"),
                (router, register, grpc.StatusCode.PERMISSION_DENIED, "a token for router")):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.RegisterEngine(request, timeout=5)
            assert refused.value.code() == code and words in (refused.value.details() or ""), refused.value
        assert len((await op.Inspect(pb.InspectRequest(), timeout=5)).engines) == 0  # the refusals changed nothing
        counted = refusals(metrics_url)
        assert counted == {'kvloop_broker_auth_refusals_total{code="UNAUTHENTICATED",method="RegisterEngine"}': 2.0,
                           'kvloop_broker_auth_refusals_total{code="PERMISSION_DENIED",method="RegisterEngine"}': 2.0}

        await eng.RegisterEngine(register, timeout=5)
        await op.RegisterEngine(pb.RegisterEngineRequest(engine=engine("pre-1", pb.ENGINE_ROLE_PREFILL, FP)),
                                timeout=5)  # an operator may act for any engine
        await eng.PublishLease(publish_request("dec-1", tokens(512), FP, session="s"), timeout=5)
        for client in (anon, eng):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.Place(place_request(tokens(640), FP, session="s"), timeout=5)
            assert refused.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
        plan = await router.Place(place_request(tokens(640), FP, session="s"), timeout=5)
        assert plan.matched_blocks == 4 and plan.source_engine_id == "dec-1"
        # The busy veto on a router's in-flight counts: the decode engine's report says it queues a request; the
        # router, which has nothing in flight there, places the short tail on it anyway.
        await eng.KeepAlive(pb.KeepAliveRequest(engine_id="dec-1", load=pb.EngineLoad(waiting_requests=1)),
                            timeout=5)
        local = place_request(tokens(640), FP, session="s", decode_local=True)
        assert (await router.Place(local, timeout=5)).decode_local_veto == "decode_busy"
        local.counts_in_flight, local.router_id = True, "any name: the token names the router"
        idle = await router.Place(local, timeout=5)
        assert (idle.decision, idle.decode_local_veto) == (pb.DECISION_DECODE_LOCAL, "")
        # 100 streams held up by the 128-token tail's 26 ms (the default 5,000 tokens/s): over the 2 s budget.
        local.in_flight["dec-1"] = 100
        assert (await router.Place(local, timeout=5)).decode_local_veto == "decode_busy"
        # 2 streams, but 20,000 tokens queued there (4 s): the tail is cheaper elsewhere.
        local.in_flight["dec-1"], local.in_flight_tokens["dec-1"] = 2, 20_000
        queued = await router.Place(local, timeout=5)
        assert queued.decode_local_veto == "costlier" and queued.cost.decode_local_s > 4.0
        local.in_flight_tokens["dec-1"] = 1 << 40
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await router.Place(local, timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "in_flight_tokens" in (
            refused.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await eng.Inspect(pb.InspectRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        routed = await router.Inspect(pb.InspectRequest(), timeout=5)
        assert [e.engine.engine_id for e in routed.engines] == ["dec-1", "pre-1"]
        assert not routed.leases and not routed.pins
        full = await op.Inspect(pb.InspectRequest(), timeout=5)
        assert len(full.leases) == 1 and len(full.leases[0].block_ids) == 4
    finally:
        for channel in (anonymous, forged_channel, eng_channel, router_channel, op_channel):
            await channel.close()

    status = cli("broker", "status", "--broker", address, "--token-file", str(files["operator"]))
    assert status.returncode == 0 and "dec-1" in status.stdout and "leases: 1" in status.stdout, status.stderr
    status = cli("broker", "status", "--broker", address)
    assert status.returncode == 1 and "UNAUTHENTICATED" in status.stderr, status.stderr
    assert read_secrets(secret)  # still one good secret


def test_a_broker_with_no_check_of_callers_will_not_start(tmp_path: Path) -> None:
    done = cli("broker", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "")
    assert done.returncode == 2 and "auth_secret_file: the broker authenticates its callers" in done.stderr, done
