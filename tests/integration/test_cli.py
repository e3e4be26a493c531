"""The ``kvloop`` command line, run as a real subprocess: status of a live broker and
configuration errors that exit 2 naming the field."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml

from kvloop.shared import procs
from kvloop.shared.client import wait_serving
from kvloop.v1 import broker_pb2 as pb
from tests.integration.conftest import ModuleBrokerFactory
from tests.integration.helpers import BS, SERVICE, Broker, engine, keys_for, place_request, publish_request, tokens

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FP = "fp-cli"


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without KVLOOP_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOP_")}
    env.update(extra)
    return env


async def kvloop(*args: str, env: dict[str, str] | None = None, timeout_s: float = 30.0
                 ) -> subprocess.CompletedProcess[str]:
    """``python -m kvloop.app.cli ARGS`` with a deadline (run in a thread: the event loop stays free)."""
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "kvloop.app.cli", *args], capture_output=True, text=True,
        timeout=timeout_s, env=env or clean_env(), cwd=REPO, stdin=subprocess.DEVNULL,
    )


async def test_broker_status(start_broker: ModuleBrokerFactory) -> None:
    # No keep-alives here: a long engine TTL keeps the engines registered however slow the CLI runs.
    proc = start_broker("status", "--engine-ttl-s", "600")
    address = proc.extra["address"]
    await wait_serving(address, SERVICE, timeout_s=20)
    b = Broker(address)
    try:
        for eid, role in (("prefill-0", pb.ENGINE_ROLE_PREFILL), ("decode-0", pb.ENGINE_ROLE_DECODE)):
            await b.stub.RegisterEngine(pb.RegisterEngineRequest(engine=engine(eid, role, FP)), timeout=5)
        lease = (await b.stub.PublishLease(publish_request("decode-0", tokens(3 * BS + 2), FP, session="conv-7"),
                                           timeout=5)).lease
    finally:
        await b.close()

    result = await kvloop("broker", "status", "--broker", address)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "store=memory" in out and "leader=yes" in out
    assert "engines: 2" in out and "leases: 1" in out and "pins: 0" in out
    lines = out.splitlines()
    decode_line = next(line for line in lines if line.strip().startswith("decode-0"))
    assert "decode" in decode_line.split()[1] and "retained 3/1000 blocks" in decode_line
    assert any(line.strip().startswith("prefill-0") and "prefill" in line for line in lines)
    lease_line = next(line for line in lines if lease.lease_id[:12] in line)
    assert "conv-7" in lease_line and "blocks    3" in lease_line and "decode-0" in lease_line

    result = await kvloop("broker", "status", "--broker", address, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["store"] == "memory" and data["leader"] is True
    assert sorted(e["engine"]["engine_id"] for e in data["engines"]) == ["decode-0", "prefill-0"]
    (leased,) = data["leases"]
    assert leased["lease_id"] == lease.lease_id and leased["session_id"] == "conv-7"
    assert [int(i) for i in leased["block_ids"]] == list(lease.block_ids)

    # Nobody listening: a clear error and exit 1.
    result = await kvloop("broker", "status", "--broker", f"127.0.0.1:{procs.free_port()}", "--timeout", "1")
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr and result.stdout == ""


BAD_CONFIG = [
    ("flag-negative", ["--threshold-tokens", "-1"], {}, None, "threshold_tokens"),
    ("flag-not-a-number", ["--default-ttl-s", "soon"], {}, None, "default_ttl_s"),
    ("flag-leader-ttl", ["--leader-ttl-s", "1"], {}, None, "leader_ttl_s"),
    ("flag-listen", ["--listen", "no-port-here"], {}, None, "listen"),
    ("flag-choice", ["--store", "nope"], {}, None, "--store"),
    ("env-store", [], {"KVLOOP_BROKER_STORE": "nope"}, None, "store"),
    ("env-bool", [], {"KVLOOP_BROKER_CONSOLE_SPANS": "maybe"}, None, "console_spans"),
    ("env-int", [], {"KVLOOP_BROKER_MAX_BLOCK_KEYS": "1.5"}, None, "max_block_keys"),
    ("yaml-unknown-key", [], {}, {"threshold_tokens": 10, "treshold_tokens": 5}, "treshold_tokens"),
    ("yaml-wrong-type", [], {}, {"threshold_tokens": [1, 2]}, "threshold_tokens"),
    ("yaml-null", [], {}, {"default_ttl_s": None}, "default_ttl_s"),
    ("yaml-invalid-value", [], {}, {"keepalive_interval_s": 30}, "keepalive_interval_s"),
]


@pytest.mark.parametrize(("flags", "env", "file", "field"), [c[1:] for c in BAD_CONFIG],
                         ids=[c[0] for c in BAD_CONFIG])
async def test_broker_serve_rejects_bad_config(tmp_path: Path, flags: list[str], env: dict[str, str],
                                               file: dict[str, object] | None, field: str) -> None:
    args = ["broker", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "", *flags]
    if file is not None:
        path = tmp_path / "broker.yaml"
        path.write_text(yaml.safe_dump(file))
        args += ["--config", str(path)]
    result = await kvloop(*args, env=clean_env(**env), timeout_s=15)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert field in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


async def test_yaml_config_is_honoured_below_env_and_flags(start_broker: ModuleBrokerFactory, tmp_path: Path) -> None:
    path = tmp_path / "broker.yaml"
    path.write_text(yaml.safe_dump({"threshold_tokens": 384, "default_ttl_s": 77.0, "max-block-keys": 100,
                                    "eviction_policy": "lru"}))
    # The file sets three values; the environment overrides one of them and a flag another.
    proc = start_broker("yaml", "--config", str(path), "--max-block-keys", "8",
                        env={"KVLOOP_BROKER_DEFAULT_TTL_S": "55"})
    await wait_serving(proc.extra["address"], SERVICE, timeout_s=20)
    b = Broker(proc.extra["address"])
    try:
        for eid, role in (("p", pb.ENGINE_ROLE_PREFILL), ("d", pb.ENGINE_ROLE_DECODE)):
            await b.stub.RegisterEngine(pb.RegisterEngineRequest(engine=engine(eid, role, FP)), timeout=5)
        lease = (await b.stub.PublishLease(publish_request("d", tokens(4 * BS), FP), timeout=5)).lease
        assert lease.ttl_s == 55.0  # env over file
        plan = await b.stub.Place(place_request(tokens(4 * BS + 1), FP), timeout=5)
        assert plan.threshold_tokens == 384  # from the file
        assert plan.decision == pb.DECISION_TRANSFER and plan.matched_tokens == 4 * BS
        plan = await b.stub.Place(place_request(tokens(3 * BS + 1), FP), timeout=5)
        assert plan.decision == pb.DECISION_TRANSFER  # 384 matched tokens: not below the threshold
        plan = await b.stub.Place(place_request(tokens(2 * BS + 1), FP), timeout=5)
        assert plan.decision == pb.DECISION_RECOMPUTE and plan.reason == "below_threshold"
        with pytest.raises(grpc.aio.AioRpcError) as exc:  # flag over file
            await b.stub.Place(pb.PlaceRequest(block_keys=keys_for(tokens(9 * BS), FP), num_tokens=9 * BS,
                                               layout_fingerprint=FP, block_size=BS), timeout=5)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "block_keys" in (exc.value.details() or "") and "limit of 8" in (exc.value.details() or "")
    finally:
        await b.close()
    assert '"policy": "lru"' in proc.log_tail()


def test_sigterm_stops_a_benchmark_as_ctrl_c_does() -> None:
    """SIGTERM's default action would skip the benchmark's finally blocks, which stop its engines and brokers."""
    proc = subprocess.Popen([sys.executable, "-m", "kvloop.app.cli", "bench", "broker-scale", "--engines", "1000",
                             "--blocks", "1000000", "--steps", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=clean_env(), cwd=REPO, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # it is running its first size: the handler is in place
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130, (first, proc.stderr.read() if proc.stderr else "")
    finally:
        proc.kill()
        proc.wait()
