"""The compose cluster for real: images built, containers started, the demo through the router container, a pull
across containers, a look-alike engine refused by both brokers, a turn's trace in the trace backend, every
Prometheus target up, broker fail-over by killing the leader's container, and nothing left after ``down``.

Opt-in (minutes; needs Docker Compose v2 or podman):
``KVLOOP_CONTAINER_TESTS=1 pytest -q tests/deploy/test_containers.py``.
It drives ``deploy/compose/run.sh`` (``up`` before, ``down`` at the end) and so uses whatever that script picks: Docker
with the upstream images, or podman with the local stand-ins (Phoenix as the trace backend). See deploy/README.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.deploy.support import ROOT

pytestmark = pytest.mark.skipif(os.environ.get("KVLOOP_CONTAINER_TESTS") != "1",
                                reason="runs real containers: set KVLOOP_CONTAINER_TESTS=1 (see deploy/README.md)")

RUN = ROOT / "deploy" / "compose" / "run.sh"
ROUTER = "http://127.0.0.1:8080"
PROMETHEUS = "http://127.0.0.1:9090"
TRACES = "http://127.0.0.1:16686"
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\w+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)\s*$")


def run(*args: str, timeout: float = 600, check: bool = True) -> str:
    proc = subprocess.run([str(RUN), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"run.sh {' '.join(args)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def get_json(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and labels in line and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name:
                total += float(value)
    return total


def router_metrics() -> str:
    with urllib.request.urlopen(f"{ROUTER}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def exec_in(service: str, *argv: str) -> str:
    return run("exec", service, *argv)


def net_bytes(service: str) -> tuple[int, int]:
    """(received, sent) bytes of the container's eth0, from its own /proc/net/dev."""
    for line in exec_in(service, "cat", "/proc/net/dev").splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "eth0":
            fields = rest.split()
            return int(fields[0]), int(fields[8])
    raise AssertionError(f"{service}: no eth0 in /proc/net/dev")


def demo_rows(out: str) -> list[dict[str, Any]]:
    rows = []
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            rows.append({"turn": int(m[1]), "context": int(m[2]), "path": m[3], "reason": m[4],
                         "local": int(m[5]), "pulled": int(m[6]), "computed": int(m[7]), "engines": m[8],
                         "ttft_ms": float(m[9])})
    return rows


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    t0 = time.monotonic()
    run("up", timeout=3600)
    state: dict[str, Any] = {"up_s": time.monotonic() - t0}
    try:
        yield state
    finally:
        run("down", timeout=600, check=False)


def test_demo_through_the_router_container(cluster: dict[str, Any]) -> None:
    pulls0 = metric(router_metrics(), "kvloop_router_pull_bytes_total")
    tx0 = net_bytes("decode-0")[1]
    prx0 = [net_bytes(s)[0] for s in ("prefill-0", "prefill-1")]
    out = run("demo", timeout=900)
    rows = demo_rows(out)
    print(out)
    assert len(rows) == 6, out
    paths = [r["path"] for r in rows]
    # As on `kvloop up`: nothing cached at first; then the history is reused, locally or pulled.
    assert paths[0] == "RECOMPUTE", paths
    assert all(p in ("TRANSFER", "DECODE_LOCAL", "PREFILL_LOCAL") for p in paths[1:]), paths
    assert "TRANSFER" in paths and "DECODE_LOCAL" in paths, paths
    # A first turn as fast as on `kvloop up` once the cluster reports healthy (it took 17-59 s with every engine's
    # OpenMP workers on every core).
    assert rows[0]["ttft_ms"] < 2000, rows[0]
    transfer = next(r for r in rows if r["path"] == "TRANSFER")
    assert transfer["pulled"] > 0 and "->" in transfer["engines"], transfer
    # The pull crossed containers: the router counts the KV bytes pulled, and the decode engine's container sent at
    # least that much over its network interface while a prefill engine's container received it.
    pulled = metric(router_metrics(), "kvloop_router_pull_bytes_total") - pulls0
    assert pulled > 0
    tx1 = net_bytes("decode-0")[1]
    prx1 = [net_bytes(s)[0] for s in ("prefill-0", "prefill-1")]
    assert tx1 - tx0 >= pulled, (tx1 - tx0, pulled)
    assert max(b - a for a, b in zip(prx0, prx1, strict=True)) >= pulled, (prx0, prx1, pulled)
    cluster["rows"] = rows
    cluster["pulled_bytes"] = pulled
    # A second session (other tool results; the same system prompt, so its first turn reuses that) takes the
    # return path as well.
    again = demo_rows(run("demo", "--seed", "1", timeout=900))
    print(again)
    assert len(again) == 6 and again[0]["ttft_ms"] < 2000, again
    assert {"TRANSFER", "DECODE_LOCAL"} <= {r["path"] for r in again}, again


def _jaeger_spans() -> list[dict[str, Any]]:
    """Jaeger's query API (Docker, upstream images), as Phoenix-shaped spans: name, context, parent_id, attributes."""
    query = urllib.parse.urlencode({"service": "kvloop-router", "operation": "kvloop.turn", "limit": "50"})
    spans = []
    for trace in get_json(f"{TRACES}/api/traces?{query}").get("data", []):
        for span in trace["spans"]:
            parents = [r["spanID"] for r in span.get("references", []) if r.get("refType") == "CHILD_OF"]
            spans.append({"name": span["operationName"], "context": {"span_id": span["spanID"]},
                          "parent_id": parents[0] if parents else None,
                          "attributes": {t["key"]: t["value"] for t in span.get("tags", [])}})
    return spans


def _trace_spans() -> list[dict[str, Any]]:
    try:
        return _phoenix_spans()
    except urllib.error.HTTPError:        # not Phoenix: Jaeger's UI port answers 404 there
        return _jaeger_spans()


def _phoenix_spans() -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    cursor = ""
    for _ in range(20):
        query = {"limit": "1000", **({"cursor": cursor} if cursor else {})}
        page = get_json(f"{TRACES}/v1/projects/default/spans?{urllib.parse.urlencode(query)}")
        spans += page.get("data", [])
        cursor = page.get("next_cursor") or ""
        if not cursor:
            break
    return spans


def _turn_trace_problem(spans: list[dict[str, Any]]) -> str:
    """'' when a TRANSFER turn's kvloop.turn span is there with its children and decision attributes, next to a
    RECOMPUTE one; else what is missing."""
    turns = [s for s in spans if s.get("name") == "kvloop.turn"]
    if not turns:
        return f"no kvloop.turn span among {len(spans)} spans"
    children: dict[str, set[str]] = {}
    for s in spans:
        if s.get("parent_id"):
            children.setdefault(s["parent_id"], set()).add(s["name"])
    decisions = {t.get("attributes", {}).get("kvloop.decision") for t in turns}
    if "RECOMPUTE" not in decisions:
        return f"no RECOMPUTE turn (decisions: {decisions})"
    for turn in turns:
        attrs = turn.get("attributes", {})
        if attrs.get("kvloop.decision") != "TRANSFER":
            continue
        if not {"kvloop.tokenize", "kvloop.place", "kvloop.prefill", "kvloop.decode"} <= children.get(
                turn["context"]["span_id"], set()):
            continue
        if attrs.get("kvloop.reason") and attrs.get("kvloop.pulled_bytes", 0) > 0 and "kvloop.ttft_ms" in attrs:
            return ""
    return f"no TRANSFER kvloop.turn with its children and attributes yet (decisions: {decisions})"


def test_a_turn_trace_is_in_the_trace_backend(cluster: dict[str, Any]) -> None:
    # Spans leave the services in batches (every few seconds): wait for the demo's to arrive.
    deadline = time.monotonic() + 90
    problem = "no answer from the trace backend"
    while time.monotonic() < deadline:
        try:
            problem = _turn_trace_problem(_trace_spans())
        except OSError as exc:
            problem = f"trace backend: {exc}"
        if not problem:
            return
        time.sleep(3)
    raise AssertionError(problem)


def test_prometheus_scrapes_every_target(cluster: dict[str, Any]) -> None:
    deadline = time.monotonic() + 60
    while True:
        targets = get_json(f"{PROMETHEUS}/api/v1/targets")["data"]["activeTargets"]
        down = [(t["labels"]["instance"], t["health"], t.get("lastError")) for t in targets if t["health"] != "up"]
        if not down or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert len(targets) == 9, [t["labels"]["instance"] for t in targets]
    assert not down, down


def _leader() -> str:
    result = get_json(f"{PROMETHEUS}/api/v1/query?query=kvloop_broker_leader%3D%3D1")["data"]["result"]
    return str(result[0]["metric"]["instance"].split(":")[0]) if len(result) == 1 else ""


def _ask(text: str) -> int:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 8,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{ROUTER}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json", "x-session-id": "failover"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        answer = json.loads(reply.read())
        assert answer["choices"][0]["message"]["content"] is not None
        return int(reply.status)


LOOK_ALIKE = """
import grpc, sys
from kvloop.shared.auth import read_token
from kvloop.v1 import broker_pb2 as pb, broker_pb2_grpc
engine = pb.Engine(engine_id="impostor-0", role=pb.ENGINE_ROLE_PREFILL, block_size=128, model="tiny",
                   layout_fingerprint="x", addresses=pb.EngineAddresses(http="http://router:9", nixl="router:9"))
for what, token in (("none", None), ("router", read_token("/auth/token"))):
    metadata = [("authorization", f"Bearer {token}")] if token else []
    for broker in ("broker-0:50051", "broker-1:50051"):
        stub = broker_pb2_grpc.KVBrokerStub(grpc.insecure_channel(broker))
        try:
            stub.RegisterEngine(pb.RegisterEngineRequest(engine=engine), metadata=metadata, timeout=10)
            print(what, broker, "ACCEPTED")
        except grpc.RpcError as exc:
            print(what, broker, exc.code().name)
"""


def test_the_brokers_refuse_a_look_alike_engine(cluster: dict[str, Any]) -> None:
    """From inside the cluster's network (the router's container): a registration with no token, or with the
    router's own token, is refused by both brokers (the follower refuses before it would redirect)."""
    out = exec_in("router", "python", "-c", LOOK_ALIKE)
    lines = sorted(line.split() for line in out.splitlines() if line.strip())
    assert lines == [["none", "broker-0:50051", "UNAUTHENTICATED"], ["none", "broker-1:50051", "UNAUTHENTICATED"],
                     ["router", "broker-0:50051", "PERMISSION_DENIED"],
                     ["router", "broker-1:50051", "PERMISSION_DENIED"]], out
    status = exec_in("broker-0", "kvloop", "broker", "status", "--broker", "broker-0:50051,broker-1:50051",
                     "--token-file", "/operator/token", "--json")
    listed = {e["engine"]["engine_id"] for e in json.loads(status)["engines"]}
    assert listed == {"prefill-0", "prefill-1", "decode-0"}, listed


def test_killing_the_leader_broker_fails_over(cluster: dict[str, Any]) -> None:
    deadline = time.monotonic() + 60
    while not (leader := _leader()) and time.monotonic() < deadline:
        time.sleep(2)
    assert leader in ("broker-0", "broker-1"), leader
    other = "broker-1" if leader == "broker-0" else "broker-0"
    t0 = time.monotonic()
    run("compose", "kill", "-s", "SIGKILL", leader)
    while _leader() != other and time.monotonic() - t0 < 120:
        time.sleep(2)
    assert _leader() == other, "the other broker did not take over"
    cluster["failover_s"] = round(time.monotonic() - t0, 1)
    assert _ask("After the fail-over: still there?") == 200


def test_down_leaves_nothing(cluster: dict[str, Any]) -> None:
    out = run("down", timeout=600)
    assert "left behind" not in out
    print(f"up {cluster['up_s']:.0f} s; fail-over {cluster.get('failover_s')} s; rows {cluster.get('rows')}")

