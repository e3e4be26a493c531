"""The deployment topology on one machine, with no localhost shortcuts: etcd, the broker, the router, one prefill and
one decode engine (with their sidecars) and a client each run in their own network namespace, joined by veth pairs
to a bridge in a hub namespace, on a private subnet that exists only inside the namespaces this test creates.

Every service binds and advertises its namespace's address (etcd's client URLs, the broker's gRPC, the engines'
HTTP, NIXL side channel and sidecar gRPC, the router's HTTP), and NIXL's UCX runs over TCP on the engine's veth
only (``UCX_TLS=tcp,self``, ``UCX_NET_DEVICES``), as between two hosts. A 3-turn chat from the client namespace
through the router must decide TRANSFER on turns 2 and 3, answer token for token what the prefill engine alone
computes, and the pulled KV bytes must show up on the decode engine's veth.

No namespace has a route beyond the test subnet and the bridge has no uplink, so nothing can leave; the root
namespace is never touched (veth pairs are created inside the hub namespace, one end moved at once to the service's).
Teardown runs even when the test fails: the services are stopped, whatever is left in the namespaces is killed by
pid, and the namespaces are deleted with their interfaces. Skipped where ``ip netns add`` is not permitted.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvloop.engines.config import split_cores
from kvloop.shared import headers as hdr
from kvloop.shared.auth import ClusterCredentials
from kvloop.shared.vocabulary import Reason
from tests.engines.conftest import BROKER_FLAGS, EXTRA_CONFIG
from tests.support.engine_checks import assert_same_tokens

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "kvlnet"  # namespaces are named kvlnet<pytest pid>-<node>
SUBNET = "10.213.0"  # a /24 that exists only inside this test's namespaces
NODES = ("etcd", "broker", "router", "prefill", "decode", "client")
ADDRESS = {node: f"{SUBNET}.{i + 2}" for i, node in enumerate(NODES)}
ETCD_URL = f"http://{ADDRESS['etcd']}:2379"
BROKER = f"{ADDRESS['broker']}:50051"
ROUTER_URL = f"http://{ADDRESS['router']}:8080"
ENGINE_PORT, NIXL_PORT, SIDECAR_PORT = 8000, 5600, 50061
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
SERVICE_START_TIMEOUT_S = 60.0
ENGINE_START_TIMEOUT_S = 420.0  # ~70 s for both on an idle 2-core machine
CHAT_TIMEOUT_S = 300.0


def ip(*args: str, check: bool = True, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def netns_names() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
    env.update(no_proxy="*", NO_PROXY="*", **extra)
    return env


def remove_namespaces(names: list[str], errors: list[str]) -> None:
    """Kill what still runs in each namespace (by pid), then delete it; deleting a namespace deletes its interfaces
    (a veth's peer with it)."""
    for name in names:
        deadline = time.monotonic() + 15
        while True:
            pids = [int(p) for p in ip("netns", "pids", name, check=False).stdout.split()]
            if not pids:
                break
            if time.monotonic() > deadline:
                errors.append(f"processes {pids} survived SIGKILL in {name}")
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
    for name in reversed(names):
        result = ip("netns", "del", name, check=False)
        if result.returncode != 0 and name in netns_names():
            errors.append(f"ip netns del {name}: {result.stderr.strip()}")


def remove_stale_namespaces() -> None:
    """Namespaces left by an earlier run of this test whose pytest process is gone (it was SIGKILLed)."""
    stale = []
    for name in netns_names():
        owner = name[len(PREFIX):].split("-", 1)[0]
        if name.startswith(PREFIX) and owner.isdigit() and not Path(f"/proc/{owner}").exists():
            stale.append(name)
    remove_namespaces(stale, [])


def _term_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


@dataclass
class Service:
    node: str
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


@dataclass
class Topology:
    """One namespace per node, each with one veth (``kvl-NODE``, address ``ADDRESS[NODE]/24``) to bridge ``br0`` in
    the hub namespace (port ``p-NODE``)."""

    tag: str
    log_dir: Path
    namespaces: list[str] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    def ns(self, node: str) -> str:
        return f"{self.tag}-{node}"

    @staticmethod
    def dev(node: str) -> str:
        return f"kvl-{node}"

    def create(self) -> None:
        ip("netns", "add", self.hub)
        self.namespaces.append(self.hub)
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "link", "set", "br0", "up")
        for node in NODES:
            ns = self.ns(node)
            ip("netns", "add", ns)
            self.namespaces.append(ns)
            # Created inside the hub, the service's end moved straight into its namespace: never in the root one.
            ip("-n", self.hub, "link", "add", f"p-{node}", "type", "veth", "peer", "name", self.dev(node), "netns", ns)
            ip("-n", self.hub, "link", "set", f"p-{node}", "master", "br0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", f"{ADDRESS[node]}/24", "dev", self.dev(node))
            ip("-n", ns, "link", "set", self.dev(node), "up")

    def spawn(self, node: str, name: str, argv: list[str], env: dict[str, str] | None = None) -> Service:
        """``argv`` in ``node``'s namespace (``ip netns exec`` execs it: the process is the service itself), in its
        own session, SIGTERMed by Linux should this test process die without its teardown."""
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as log:
            popen = subprocess.Popen(["ip", "netns", "exec", self.ns(node), *argv], stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env or clean_env(),
                                     start_new_session=True, preexec_fn=_term_with_parent)
        service = Service(node, name, popen, log_path)
        self.services.append(service)
        return service

    def client(self, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """``python -m tests.engines.netns_client ARGS`` in the client namespace."""
        return subprocess.run(["ip", "netns", "exec", self.ns("client"), sys.executable, "-m",
                               "tests.engines.netns_client", *args], capture_output=True, text=True, cwd=ROOT,
                              env=clean_env(), timeout=timeout_s, stdin=subprocess.DEVNULL)

    def wait_ready(self, watched: list[Service], timeout_s: float, http: tuple[str, ...] = (),
                   grpc: tuple[str, ...] = ()) -> None:
        """Poll from the client namespace until every URL answers 200 and every gRPC health service is SERVING;
        fail at once, with its log, when a watched service exits."""
        args = [*(a for u in http for a in ("--http", u)), *(a for t in grpc for a in ("--grpc", t))]
        deadline = time.monotonic() + timeout_s
        while True:
            for service in watched:
                if service.popen.poll() is not None:
                    raise AssertionError(f"{service.name} exited with {service.popen.returncode}:\n"
                                         f"{service.log_tail()}")
            result = self.client("wait", *args, "--timeout", "5", timeout_s=60)
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {s.name}\n{s.log_tail(20)}" for s in watched)
                raise AssertionError(f"{result.stderr.strip()} (after {timeout_s:.0f}s)\n{tails}")

    def counters(self, node: str) -> dict[str, int]:
        (link,) = json.loads(ip("-j", "-s", "-n", self.ns(node), "link", "show", "dev", self.dev(node)).stdout)
        return {"rx": int(link["stats64"]["rx"]["bytes"]), "tx": int(link["stats64"]["tx"]["bytes"])}

    def routes(self, node: str, family: str = "-4") -> list[dict[str, Any]]:
        """The main routing table of ``node``'s namespace."""
        return list(json.loads(ip(family, "-j", "-n", self.ns(node), "route", "show").stdout))

    def listeners(self, node: str) -> set[str]:
        result = subprocess.run(["ip", "netns", "exec", self.ns(node), "ss", "-Hltn"], capture_output=True, text=True,
                                timeout=30, check=True)
        # gRPC binds dual-stack: an IPv4 address shows as [::ffff:10.213.0.3]:50051.
        return {line.split()[3].replace("[::ffff:", "").replace("]:", ":") for line in result.stdout.splitlines()
                if line.strip()}

    def stop_services(self, errors: list[str]) -> None:
        """SIGTERM in reverse start order (router, engines, broker, etcd), each bounded; engines stop together
        (each stops its sidecar, then vLLM's process group)."""
        groups: list[list[Service]] = []
        for service in reversed(self.services):
            if groups and service.node in ("prefill", "decode") and groups[-1][0].node in ("prefill", "decode"):
                groups[-1].append(service)
            else:
                groups.append([service])
        for group in groups:
            for service in group:
                if service.popen.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        service.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 45
            for service in group:
                try:
                    service.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    errors.append(f"{service.name} ignored SIGTERM")
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(service.popen.pid, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        service.popen.wait(10)

    def teardown(self) -> list[str]:
        errors: list[str] = []
        try:
            self.stop_services(errors)
        finally:
            remove_namespaces(self.namespaces, errors)
        left = [name for name in netns_names() if name.startswith(f"{self.tag}-")]
        if left:
            errors.append(f"namespaces left: {left}")
        return errors


@pytest.fixture(scope="session")
def netns_permitted() -> None:
    """Skips (with the reason) unless this process may create network namespaces; tried, not guessed. Session
    scope, so it runs before the tiny model is built."""
    if sys.platform != "linux" or shutil.which("ip") is None:
        pytest.skip("network namespaces need Linux and iproute2's ip")
    if shutil.which("ss") is None:
        pytest.skip("iproute2's ss is not installed")
    if shutil.which("etcd") is None and not Path("/usr/bin/etcd").exists():
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    probe = f"{PREFIX}{os.getpid()}-probe"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"`ip netns add` is not permitted here (uid {os.geteuid()}): {result.stderr.strip()}")
    ip("netns", "del", probe)
    remove_stale_namespaces()


@pytest.fixture
def topology(netns_permitted: None, tmp_path: Path) -> Iterator[Topology]:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    topo = Topology(tag=f"{PREFIX}{os.getpid()}", log_dir=log_dir)
    try:
        topo.create()
        yield topo
    finally:
        errors = topo.teardown()
        assert not errors, errors


def kv_bytes_per_token(model_dir: Path) -> int:
    """K and V over all layers in float32, the engines' dtype here."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * int(config["num_hidden_layers"]) * int(config["num_key_value_heads"]) * int(head_dim) * 4


def test_services_in_separate_namespaces_transfer_over_the_test_subnet(netns_permitted: None, topology: Topology,
                                                                        tiny_model: Path, tmp_path: Path) -> None:
    topo = topology
    t0 = time.monotonic()
    py = [sys.executable, "-m", "kvloop.app.cli"]

    # etcd, then the broker on the etcd store: each binds and advertises its own namespace's address.
    etcd = topo.spawn("etcd", "etcd", [
        shutil.which("etcd") or "/usr/bin/etcd", "--name", "kvlnet", "--data-dir", str(tmp_path / "etcd"),
        "--listen-client-urls", ETCD_URL, "--advertise-client-urls", ETCD_URL,
        "--listen-peer-urls", f"http://{ADDRESS['etcd']}:2380",
        "--initial-advertise-peer-urls", f"http://{ADDRESS['etcd']}:2380",
        "--initial-cluster", f"kvlnet=http://{ADDRESS['etcd']}:2380", "--log-level", "warn"])
    topo.wait_ready([etcd], SERVICE_START_TIMEOUT_S, http=(f"{ETCD_URL}/health",))
    # Every caller of the broker with its own token, as in kvloop up (kvloop.shared.auth).
    auth = ClusterCredentials(tmp_path / "auth")
    broker = topo.spawn("broker", "broker", [
        *py, "broker", "serve", "--auth-secret-file", str(auth.secret_file),
        "--listen", BROKER, "--advertise", BROKER,
        "--metrics-listen", f"{ADDRESS['broker']}:9460", "--store", "etcd",
        "--etcd-endpoint", f"{ADDRESS['etcd']}:2379", "--etcd-prefix", f"/{topo.tag}/", "--log-format", "json",
        *BROKER_FLAGS])
    topo.wait_ready([etcd, broker], SERVICE_START_TIMEOUT_S, grpc=(f"{BROKER}/kvloop.v1.KVBroker",))

    # The engines on disjoint cores; NIXL's UCX over TCP on the namespace's veth only, as between two hosts.
    engines = []
    for role, cpus in zip(("prefill", "decode"), split_cores(2), strict=True):
        host = ADDRESS[role]
        env = clean_env(UCX_TLS="tcp,self", UCX_NET_DEVICES=topo.dev(role), VLLM_HOST_IP=host)
        engines.append(topo.spawn(role, f"engine-{role}", [
            *py, "engine", "--role", role, "--model", str(tiny_model), "--engine-id", f"{role}-netns",
            "--dtype", "float32", "--max-model-len", "4096", "--omp-threads-bind", cpus,
            "--kv-connector-extra-config", EXTRA_CONFIG, "--host", host, "--port", str(ENGINE_PORT),
            "--nixl-host", host, "--nixl-port", str(NIXL_PORT), "--sidecar-listen", f"{host}:{SIDECAR_PORT}",
            "--broker", BROKER, "--broker-token-file", str(auth.token_file("engine", f"{role}-netns")),
            "--work-dir", str(tmp_path / "work"), "--startup-timeout-s",
            str(int(ENGINE_START_TIMEOUT_S)), "--log-format", "json"], env=env))
    topo.wait_ready([etcd, broker, *engines], ENGINE_START_TIMEOUT_S,
                    http=tuple(f"http://{ADDRESS[r]}:{ENGINE_PORT}/health" for r in ("prefill", "decode")),
                    grpc=tuple(f"{ADDRESS[r]}:{SIDECAR_PORT}/kvloop.v1.EngineLink" for r in ("prefill", "decode")))
    router = topo.spawn("router", "router", [
        *py, "router", "--listen", ROUTER_URL.removeprefix("http://"), "--broker", BROKER, "--refresh-s", "0.5",
        "--broker-token-file", str(auth.token_file("router", "router")),
        "--no-decode-local",  # this test is about the pull across hosts: strict P/D
        "--log-format", "json"])
    topo.wait_ready([etcd, broker, *engines, router], SERVICE_START_TIMEOUT_S, http=(f"{ROUTER_URL}/health",))
    started_s = time.monotonic() - t0

    # Nothing can leave: each namespace routes only the test subnet, on its own veth (no default route).
    for node in NODES:
        routes = topo.routes(node)
        assert [(r["dst"], r["dev"]) for r in routes] == [(f"{SUBNET}.0/24", topo.dev(node))], (node, routes)
        assert all(r["dst"] != "default" for r in topo.routes(node, "-6")), (node, topo.routes(node, "-6"))
    hub = json.loads(ip("-4", "-j", "-n", topo.hub, "addr", "show").stdout)
    assert not [a for link in hub for a in link.get("addr_info", [])], hub  # the hub (bridge) has no IPv4 address
    # Services listen on their namespace's address, not on a wildcard or loopback.
    assert {f"{ADDRESS['etcd']}:2379"} <= topo.listeners("etcd")
    assert {BROKER, f"{ADDRESS['broker']}:9460"} <= topo.listeners("broker")
    assert f"{ADDRESS['router']}:8080" in topo.listeners("router")
    for role in ("prefill", "decode"):
        host = ADDRESS[role]
        assert {f"{host}:{ENGINE_PORT}", f"{host}:{NIXL_PORT}", f"{host}:{SIDECAR_PORT}"} <= topo.listeners(role)

    before = {role: topo.counters(role) for role in ("prefill", "decode")}
    result = topo.client("chat", "--router", ROUTER_URL, "--prefill", f"http://{ADDRESS['prefill']}:{ENGINE_PORT}",
                         "--broker", BROKER, "--model", tiny_model.name, "--turns", "3",
                         "--token-file", str(auth.token_file("operator", "operator")), timeout_s=CHAT_TIMEOUT_S)
    after = {role: topo.counters(role) for role in ("prefill", "decode")}
    logs = "\n".join([*(f"--- {s.name}\n{s.log_tail(15)}" for s in topo.services),
                      *(f"--- {p.name}\n{chr(10).join(p.read_text(errors='replace').splitlines()[-15:])}"
                        for p in sorted((tmp_path / "work" / "logs").glob("*.log")))])
    assert result.returncode == 0, f"{result.stderr}\n{logs}"
    out = json.loads(result.stdout)

    # The broker holds the engines' real addresses: gRPC (sidecar), HTTP and NIXL side channel.
    assert sorted((e["engine_id"], e["role"]) for e in out["engines"]) == [
        ("decode-netns", "ENGINE_ROLE_DECODE"), ("prefill-netns", "ENGINE_ROLE_PREFILL")], out["engines"]
    for role in ("prefill", "decode"):
        (engine,) = [e for e in out["engines"] if e["engine_id"] == f"{role}-netns"]
        host = ADDRESS[role]
        assert engine["grpc"] == f"{host}:{SIDECAR_PORT}", engine
        assert engine["http"] == f"http://{host}:{ENGINE_PORT}", engine
        assert engine["nixl"] == f"{host}:{NIXL_PORT}", engine

    turns = out["turns"]
    assert [t["status"] for t in turns] == [200, 200, 200], turns
    decisions = [t["headers"][hdr.DECISION] for t in turns]
    assert decisions[0] == "RECOMPUTE" and decisions[1:] == ["TRANSFER", "TRANSFER"], (decisions, logs)
    pulled = 0
    for turn in turns[1:]:
        h = turn["headers"]
        assert h[hdr.REASON] == Reason.TRANSFER_CHEAPER, h
        assert int(h[hdr.PULLED_TOKENS]) == int(h[hdr.MATCHED_TOKENS]) > 300, h
        assert int(h[hdr.COMPUTED_TOKENS]) < int(h[hdr.PROMPT_TOKENS]), h
        pulled += int(h[hdr.PULLED_TOKENS])
    for turn in turns:  # the answers are what the prefill engine computes alone, from scratch
        assert_same_tokens(turn["reply"], turn["reference"])
    # The pulled KV crossed the decode engine's veth (prefill reads it from decode over UCX/TCP).
    kv = pulled * kv_bytes_per_token(tiny_model)
    sent = after["decode"]["tx"] - before["decode"]["tx"]
    received = after["prefill"]["rx"] - before["prefill"]["rx"]
    assert sent >= kv and received >= kv, (kv, before, after)
    print(f"netns topology: services ready in {started_s:.0f}s, chat in {time.monotonic() - t0 - started_s:.0f}s; "
          f"pulled {pulled} tokens ({kv} B KV), decode veth sent {sent} B")
