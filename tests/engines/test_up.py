"""``kvloop up``: the README's main job as a real subprocess. It starts a broker, one prefill and one decode engine on
the test model, their sidecars and the router, runs the demo session, serves, and stops everything on SIGTERM. Its
traces go to a real OTLP receiver on loopback: every turn's tree (router, broker, engines) must arrive. Its broker
is closed to every process that is not one of its own callers."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvloop.shared import headers as hdr
from kvloop.shared.auth import mint, read_token
from kvloop.shared.tls import insecure_or_secure_channel
from kvloop.v1 import broker_pb2 as pb
from kvloop.v1 import broker_pb2_grpc
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.vllm
def test_up_runs_the_demo_and_is_closed_to_a_look_alike_engine(tiny_model: Path, tmp_path: Path) -> None:
    """``kvloop up`` (serving after its demo) while a look-alike engine, a loopback listener with the model's real
    layout, tries to join its broker without a credential, with another cluster's token and with a real engine's
    token for its own id, and claims to be idle: every registration is refused, the broker lists only the real
    engines, and no prompt reaches the listener over the demo's 6 turns and 14 more; every turn is answered by a
    real engine. Then SIGTERM stops everything."""
    with OtlpReceiver() as otlp, Listener() as listener:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OTEL_BSP_SCHEDULE_DELAY": "200"}
        up = UpProcess(tiny_model, tmp_path, env)
        try:
            broker = up.wait_for(r"kvloop up: broker (127\.0\.0\.1:\d+)")
            auth = tmp_path / "up" / "auth"
            router = up.wait_for(r"kvloop up: router (http://127\.0\.0\.1:\d+)")  # the demo starts now
            impostor = LookAlike(broker, listener.url, tiny_model, auth / "engine-prefill-0.token")
            impostor.start()
            up.wait_for(r"kvloop up: serving")
            answered = more_turns(router, tiny_model.name, 14)
            impostor.stop()
            status = subprocess.run([sys.executable, "-m", "kvloop.app.cli", "broker", "status", "--broker", broker,
                                     "--json", "--token-file", str(auth / "operator-operator.token")], cwd=ROOT,
                                    capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            anonymous = subprocess.run([sys.executable, "-m", "kvloop.app.cli", "broker", "status", "--broker", broker],
                                       cwd=ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        finally:
            result = up.stop()
        check_demo(result, tmp_path)
        assert impostor.refusals == {"no credential": "UNAUTHENTICATED", "another cluster's token": "UNAUTHENTICATED",
                                     "prefill-0's token": "PERMISSION_DENIED",
                                     "keep-alive": "PERMISSION_DENIED"}, impostor.refusals
        assert listener.requests == [], listener.requests
        assert all(code == 200 and engines <= {"prefill-0", "decode-1"} and engines for code, engines in answered)
        assert status.returncode == 0, status.stderr
        listed = {e["engine"]["engine_id"] for e in json.loads(status.stdout)["engines"]}
        assert listed == {"prefill-0", "decode-1"}, listed
        assert anonymous.returncode == 1 and "UNAUTHENTICATED" in anonymous.stderr, anonymous.stderr
        check_traces(otlp, expected=20)


class Listener:
    """A loopback HTTP server that records every request it gets (the look-alike engine's address)."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                outer.requests.append(self.path)
                self.send_response(500)
                self.end_headers()

            do_GET = do_POST

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Listener:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class UpProcess:
    """``kvloop up`` as a subprocess whose output is read as it comes."""

    def __init__(self, tiny_model: Path, tmp_path: Path, env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "kvloop.app.cli", "up", "--prefill", "1", "--decode", "1", "--demo-turns", "6",
             "--model", str(tiny_model), "--router-listen", "127.0.0.1:0", "--max-model-len", "4096",
             "--work-dir", str(tmp_path / "up")],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=env)
        self.lines: list[str] = []
        self.errors: list[str] = []
        self.changed = threading.Condition()
        self.readers = [threading.Thread(target=self._read, args=(stream, into), daemon=True)
                        for stream, into in ((self.popen.stdout, self.lines), (self.popen.stderr, self.errors))]
        for reader in self.readers:
            reader.start()

    def _read(self, stream: Any, into: list[str]) -> None:
        for line in stream:
            with self.changed:
                into.append(line)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, pattern: str, timeout_s: float = 900.0) -> str:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while True:
                for line in self.lines:
                    found = re.search(pattern, line)
                    if found:
                        return found.group(1) if found.groups() else line
                if self.popen.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"no {pattern!r} in kvloop up's output:\n{''.join(self.lines)}"
                                         f"{''.join(self.errors)[-3000:]}")
                self.changed.wait(timeout=1.0)

    def stop(self) -> subprocess.CompletedProcess[str]:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        for reader in self.readers:  # they end at EOF, once the process has exited
            reader.join(timeout=30)
        return subprocess.CompletedProcess(self.popen.args, self.popen.returncode, "".join(self.lines),
                                           "".join(self.errors))


class LookAlike:
    """A process that reaches the broker and pretends to be an idle prefill engine at the listener's address."""

    def __init__(self, broker: str, url: str, model: Path, stolen_token: Path) -> None:
        from kvloop.engines.layout import engine_fingerprint

        self.broker, self.stolen = broker, stolen_token
        self.engine = pb.Engine(engine_id="impostor-0", role=pb.ENGINE_ROLE_PREFILL, block_size=128,
                                layout_fingerprint=engine_fingerprint(model, dtype="auto", block_size=128),
                                model=model.name, retention_budget_blocks=1000, incarnation="x",
                                addresses=pb.EngineAddresses(grpc="127.0.0.1:9", http=url, nixl="127.0.0.1:9"))
        self.refusals: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        asyncio.run(self._attempts())

    async def _attempts(self) -> None:
        forged = mint(b"another cluster's secret, long enough to be one", "engine", "impostor-0", time.time())
        tries = {"no credential": None, "another cluster's token": forged,
                 "prefill-0's token": read_token(self.stolen)}
        while not self._stop.is_set():  # again and again while the cluster serves: never listed
            for what, token in tries.items():
                async with insecure_or_secure_channel(self.broker, None, token=token) as channel:
                    stub = broker_pb2_grpc.KVBrokerStub(channel)
                    try:
                        await stub.RegisterEngine(pb.RegisterEngineRequest(engine=self.engine), timeout=5)
                        self.refusals[what] = "ACCEPTED"
                    except grpc.aio.AioRpcError as exc:
                        self.refusals[what] = exc.code().name
                    if what == "prefill-0's token":
                        try:
                            await stub.KeepAlive(pb.KeepAliveRequest(engine_id="impostor-0", load=pb.EngineLoad(
                                prefill_tokens_per_s=1e9)), timeout=5)
                            self.refusals["keep-alive"] = "ACCEPTED"
                        except grpc.aio.AioRpcError as exc:
                            self.refusals["keep-alive"] = exc.code().name
            await asyncio.sleep(0.5)


def more_turns(router: str, model: str, turns: int) -> list[tuple[int, set[str]]]:
    """``turns`` chat turns of one conversation through the router; each reply's status and the engines it names."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a careful agent. " * 40}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Tool result {turn}: " + "ok " * 30 + "What next?"})
        body = json.dumps({"model": model, "messages": messages, "max_tokens": 12, "temperature": 0}).encode()
        request = urllib.request.Request(f"{router}/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as reply:
            answer = json.loads(reply.read())
            named = {reply.headers.get(h, "") for h in (hdr.PREFILL_ENGINE, hdr.DECODE_ENGINE)} - {""}
            out.append((reply.status, named))
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    return out


def check_demo(result: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"kvloop up: broker 127\.0\.0\.1:\d+", out) and "kvloop up: router http://127.0.0.1:" in out
    # turn, context, path, reason, local, pulled, computed, engines, TTFT
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\s+[A-Z_]+\s", line)]
    assert [r[0] for r in rows] == ["1", "2", "3", "4", "5", "6"], out
    # The scripted session shows every path (kvloop/app/demo.py says which turn should take which).
    assert [r[2] for r in rows] == ["RECOMPUTE", "DECODE_LOCAL", "TRANSFER", "DECODE_LOCAL", "PREFILL_LOCAL",
                                    "DECODE_LOCAL"], out
    assert rows[0][3] == "no_match" and int(rows[0][4]) == int(rows[0][5]) == 0
    for r in rows:
        local, pulled, computed = int(r[4]), int(r[5]), int(r[6])
        assert local + pulled + computed == int(r[1]), r
        assert (pulled > 0) == (r[2] == "TRANSFER"), r  # no TRANSFER without a pull, no pull without TRANSFER
        assert r[2] in ("RECOMPUTE",) or local + pulled > 0, r
    assert "kvloop up: stopped." in out
    # No library noise among kvloop's own lines (gRPC's fork handlers printed "Other threads are currently calling
    # into gRPC, skipping fork() handlers" each time an engine started).
    assert "fork() handlers" not in out + result.stderr, result.stderr[-2000:]
    # Nothing of the cluster is left running.
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "up")], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", leftovers.stdout


def check_traces(otlp: OtlpReceiver, expected: int = 6) -> None:
    """Each turn's ``kvloop.turn`` span (the router in ``kvloop up``'s process) with its decision, the broker's
    placement span in the same trace, and the engines' own spans (vLLM, through ``traceparent``) in it too."""
    deadline = time.monotonic() + 30  # the engines' exporters flush on their own schedule
    while True:
        spans = otlp.snapshot()
        turns = [s for s in spans if s.name == "kvloop.turn"]
        trees = {t.trace_id: [s for s in spans if s.trace_id == t.trace_id] for t in turns}
        if (len(turns) == expected and all(engine_spans(tree) for tree in trees.values())) or \
                time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(turns) == expected, sorted({(s.service, s.name) for s in spans})
    paths = {t.attributes["kvloop.path"] for t in turns}
    assert paths == {"RECOMPUTE", "DECODE_LOCAL", "TRANSFER", "PREFILL_LOCAL"}, paths
    for turn in turns:
        tree = trees[turn.trace_id]
        assert turn.service == "kvloop-up" and turn.scope == "kvloop.router"
        for key in ("kvloop.planned", "kvloop.reason", "kvloop.plan_vs_actual", "kvloop.local_tokens",
                    "kvloop.pulled_tokens", "kvloop.recomputed_tokens", "kvloop.decode_engine"):
            assert key in turn.attributes, (key, turn.attributes)
        placements = [s for s in tree if s.scope == "kvloop.broker" and s.name.endswith("/PlaceStream")]
        assert placements and "kvloop.decision" in placements[0].attributes, sorted((s.scope, s.name) for s in tree)
        assert engine_spans(tree), sorted((s.service, s.name) for s in tree)


def engine_spans(tree: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return [s for s in tree if s.service not in ("kvloop-up", "")]
