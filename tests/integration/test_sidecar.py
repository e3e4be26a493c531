"""The engine sidecar against a real broker process, with a fake connector on its Unix socket.

``FakeConnector`` speaks the connector's side of ``kvloop.v1.EngineLink`` the way the connector
(``kvloop.engines.connector.link``) does (hello, retained, freed) and records the commands it gets; everything
else is real: the sidecar's gRPC server, the broker, leases, TTL expiry, the eviction stream.
``EngineLinkClient`` (the connector's thread) is tested against the real sidecar too.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvloop.engines.connector.link import EngineLinkClient
from kvloop.engines.sidecar import SidecarConfig
from kvloop.shared.hashing import ExtraKeys, block_keys
from kvloop.v1 import broker_pb2 as pb
from kvloop.v1 import engine_link_pb2 as lpb
from tests.integration.conftest import ModuleBrokerFactory
from tests.integration.helpers import Broker, engine, lease_by_id, poll, publish_request
from tests.support.sidecar_fakes import FP, FakeConnector, hello, retained, running_sidecar

pytestmark = pytest.mark.slow


async def engine_status(broker: Broker, engine_id: str) -> pb.EngineStatus | None:
    reply = await broker.inspect()
    return next((e for e in reply.engines if e.engine.engine_id == engine_id), None)


async def leases(broker: Broker, engine_id: str) -> list[pb.Lease]:
    return [lease for lease in (await broker.inspect()).leases if lease.engine_id == engine_id]


@pytest.fixture(scope="module")
def broker_address(start_module_broker: ModuleBrokerFactory) -> str:
    proc = start_module_broker("sidecar-broker", "--keepalive-interval-s", "0.5", "--engine-ttl-s", "3",
                               "--tick-interval-s", "0.1")
    return proc.extra["address"]


async def test_registers_publishes_and_relays_expiry(tmp_path: Path, broker_address: str) -> None:
    broker = Broker(broker_address)
    connector = FakeConnector(tmp_path / "s.sock")
    try:
        async with running_sidecar(tmp_path, broker_address, "dec-a"):
            await connector.attach(hello("dec-a", blocks=100))
            status = await poll(lambda: engine_status(broker, "dec-a"), lambda s: s is not None, timeout_s=10,
                                what="engine registered")
            assert status is not None and status.engine.retention_budget_blocks == 50
            assert status.engine.addresses.nixl == "127.0.0.1:5600" and status.engine.layout_fingerprint == FP
            connector.events.put_nowait(retained("req-1", 300))  # two full blocks and a partial one
            (lease,) = await poll(lambda: leases(broker, "dec-a"), lambda ls: len(ls) == 1, timeout_s=10,
                                  what="lease published")
            assert list(lease.block_keys) == block_keys(list(range(256)), 128, ExtraKeys(FP))
            assert list(lease.block_ids) == [0, 1] and lease.num_tokens == 256 and lease.session_id == "sess"
            # The sidecar renews the engine-side hold while the lease lives.
            await poll(lambda: asyncio.sleep(0, connector.held()), lambda h: "req-1" in h, timeout_s=10,
                       what="hold renewed")
            await broker.stub.RenewLease(pb.RenewLeaseRequest(lease_id=lease.lease_id, ttl_s=1.0), timeout=5)
            await poll(lambda: asyncio.sleep(0, connector.released()), lambda r: "req-1" in r, timeout_s=10,
                       what="release command after the lease expired")
    finally:
        await connector.close()
        await broker.close()


async def test_detached_connector_drops_the_engine_and_its_leases(tmp_path: Path, broker_address: str) -> None:
    broker = Broker(broker_address)
    connector = FakeConnector(tmp_path / "s.sock")
    try:
        async with running_sidecar(tmp_path, broker_address, "dec-b"):
            await connector.attach(hello("dec-b"))
            connector.events.put_nowait(retained("req-2", 512))
            await poll(lambda: leases(broker, "dec-b"), lambda ls: len(ls) == 1, timeout_s=10, what="lease")
            await connector.close()  # the EngineCore died
            await poll(lambda: engine_status(broker, "dec-b"), lambda s: s is None, timeout_s=10,
                       what="engine deregistered")
            assert await leases(broker, "dec-b") == []
    finally:
        await broker.close()


async def test_publication_refused_releases_the_blocks(tmp_path: Path, broker_address: str) -> None:
    """Budget 2 blocks: a 4-block lease is refused by the broker, and the connector is told to free it."""
    broker = Broker(broker_address)
    connector = FakeConnector(tmp_path / "s.sock")
    try:
        async with running_sidecar(tmp_path, broker_address, "dec-c", retention_fraction=0.5):
            await connector.attach(hello("dec-c", blocks=4))
            await poll(lambda: engine_status(broker, "dec-c"), lambda s: s is not None, timeout_s=10, what="engine")
            connector.events.put_nowait(retained("req-big", 4 * 128))
            await poll(lambda: asyncio.sleep(0, connector.released()), lambda r: "req-big" in r, timeout_s=10,
                       what="release of a lease the broker refused")
            assert await leases(broker, "dec-c") == []
    finally:
        await connector.close()
        await broker.close()


def test_bad_sidecar_config_names_the_field(tmp_path: Path) -> None:
    from kvloop.shared.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^retention_fraction"):
        SidecarConfig.load({}, env={"KVLOOP_SIDECAR_ENGINE_ID": "e", "KVLOOP_SIDECAR_BROKER": "127.0.0.1:1",
                                    "KVLOOP_SIDECAR_SOCKET": str(tmp_path / "s"),
                                    "KVLOOP_SIDECAR_ENGINE_URL": "http://x:1",
                                    "KVLOOP_SIDECAR_LAYOUT_FINGERPRINT": "f",
                                    "KVLOOP_SIDECAR_RETENTION_FRACTION": "1.5"})
    with pytest.raises(ConfigError, match=r"^broker"):
        SidecarConfig.load({}, env={"KVLOOP_SIDECAR_ENGINE_ID": "e", "KVLOOP_SIDECAR_BROKER": "nohost",
                                    "KVLOOP_SIDECAR_SOCKET": str(tmp_path / "s"),
                                    "KVLOOP_SIDECAR_ENGINE_URL": "http://x:1",
                                    "KVLOOP_SIDECAR_LAYOUT_FINGERPRINT": "f"})


async def test_books_that_differ_from_the_brokers_are_resynced(tmp_path: Path, broker_address: str) -> None:
    """A lost eviction command or a lost publication reply leaves the sidecar and the broker listing different
    leases (seen in kvloop bench chaos: an engine held 20 blocks no lease named, and renewed their hold for ever).
    The keep-alive reply says how many leases the broker lists; two differing replies in a row make the sidecar
    register again and resync both ways."""
    broker = Broker(broker_address)
    connector = FakeConnector(tmp_path / "s.sock")
    async with running_sidecar(tmp_path, broker_address, "books-1"):
        await connector.attach(hello("books-1"))
        await poll(lambda: engine_status(broker, "books-1"), lambda s: s is not None, timeout_s=10,
                   what="registration")
        connector.events.put_nowait(retained("req-a", 256))
        (lease,) = await poll(lambda: leases(broker, "books-1"), bool, timeout_s=10, what="the lease")
        # The broker drops the lease without a command to the sidecar (as a lost eviction would).
        await broker.stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.lease_id), timeout=5)
        await poll(lambda: asyncio.sleep(0, connector.released()), lambda r: "req-a" in r, timeout_s=15,
                   what="the engine told to free what no lease names any more")
        # The broker lists a lease the engine does not hold (as a publication whose reply was lost would).
        await broker.stub.PublishLease(publish_request("books-1", list(range(512)), FP, first_block_id=40), timeout=5)
        await poll(lambda: leases(broker, "books-1"), lambda ls: not ls, timeout_s=15,
                   what="the broker told to drop the lease the engine never held")
        await connector.close()


async def test_a_pinned_lease_the_sidecar_never_knew_is_released_without_a_false_alarm(
        tmp_path: Path, broker_address: str, capfd: pytest.CaptureFixture[str]) -> None:
    """A restarted sidecar finds leases it never knew, and a reader may have pinned one meanwhile (seen in kvloop
    bench chaos: a sidecar killed while the broker's leader changed). Its release is deferred to the pin's end;
    the engine did not free those blocks, so this is not ``lease.freed_while_pinned`` (which fails the chaos run)."""
    broker = Broker(broker_address)
    connector = FakeConnector(tmp_path / "s.sock")
    stop_reader = asyncio.Event()

    async def keep_reader_alive() -> None:
        while not stop_reader.is_set():
            await broker.stub.KeepAlive(pb.KeepAliveRequest(engine_id="unknown-reader"), timeout=5)
            await asyncio.sleep(0.5)

    await broker.stub.RegisterEngine(pb.RegisterEngineRequest(
        engine=engine("unknown-reader", pb.ENGINE_ROLE_PREFILL, FP)), timeout=5)
    reader = asyncio.create_task(keep_reader_alive())
    seen = ""
    try:
        async with running_sidecar(tmp_path, broker_address, "unknown-1"):
            await connector.attach(hello("unknown-1"))
            await poll(lambda: engine_status(broker, "unknown-1"), lambda s: s is not None, timeout_s=10,
                       what="registration")
            # The broker lists a lease this sidecar never published (as a restarted sidecar finds), and a reader
            # pins it before the sidecar's keep-alives notice and it registers again to resync.
            reply = await broker.stub.PublishLease(publish_request("unknown-1", list(range(512)), FP,
                                                                   first_block_id=40), timeout=5)
            await broker.stub.PinBlocks(pb.PinBlocksRequest(reader_engine_id="unknown-reader",
                                                            lease_id=reply.lease.lease_id, num_blocks=2,
                                                            timeout_s=30), timeout=5)

            async def logged() -> str:
                nonlocal seen
                seen += capfd.readouterr().out
                return seen

            await poll(logged, lambda out: "lease.unknown_released_while_pinned" in out, timeout_s=15,
                       what="the unknown pinned lease released at the broker")
            lease = lease_by_id(await broker.inspect(), reply.lease.lease_id)
            assert lease is not None and lease.pending_eviction != pb.EVICTION_REASON_UNSPECIFIED  # ends with its pin
            assert "lease.freed_while_pinned" not in seen
            await connector.close()
    finally:
        stop_reader.set()
        await reader


def retained_tokens(request_id: str, tokens: list[int], first_block: int) -> lpb.ConnectorEvent:
    return lpb.ConnectorEvent(retained=lpb.Retained(
        request_id=request_id, token_ids=tokens, session_id="sess", hold_s=60,
        block_ids=list(range(first_block, first_block + len(tokens) // 128))))


async def test_a_budget_eviction_is_copied_to_the_host_tier_and_reported(tmp_path: Path, broker_address: str) -> None:
    """The sidecar's half of a demotion: the broker's command becomes a copy command to the connector, the
    connector's report becomes CompleteDemotion, and a lease on the tier is neither released nor renewed."""
    broker = Broker(broker_address)
    connector = FakeConnector(tmp_path / "s.sock")
    tiered = lpb.ConnectorHello(engine_id="tier-1", incarnation="inc-tier", block_size=128, num_blocks=100,
                                bytes_per_block=4096, kv_role_decode=True, host_tier_blocks=4, host_tier_first_id=100,
                                step_tokens=256)
    try:
        async with running_sidecar(tmp_path, broker_address, "tier-1", retention_fraction=0.02):  # 2 pool blocks
            await connector.attach(tiered)
            status = await poll(lambda: engine_status(broker, "tier-1"), lambda s: s is not None, timeout_s=10,
                                what="engine registered")
            assert status is not None and (status.engine.host_tier_blocks, status.engine.host_tier_first_id) == (4, 100)
            assert status.engine.step_tokens == 256  # the engine's step size, relayed for placement
            connector.events.put_nowait(retained_tokens("req-1", list(range(256)), 0))
            (first,) = await poll(lambda: leases(broker, "tier-1"), lambda ls: len(ls) == 1, timeout_s=10,
                                  what="the first lease")
            connector.events.put_nowait(retained_tokens("req-2", list(range(1000, 1256)), 2))
            demotes = await poll(lambda: asyncio.sleep(0, [d for c in connector.commands for d in c.demote]), bool,
                                 timeout_s=10, what="a copy command")
            assert [(d.request_id, list(d.to_block_ids)) for d in demotes] == [("req-1", [100, 101])]
            assert "req-1" not in connector.released()  # copied, not dropped
            connector.events.put_nowait(lpb.ConnectorEvent(demoted=lpb.Demoted(request_id="req-1", ok=True)))
            connector.events.put_nowait(lpb.ConnectorEvent(freed=lpb.Freed(request_id="req-1", why="demoted")))
            ready = await poll(lambda: leases(broker, "tier-1"),
                               lambda ls: any(x.lease_id == first.lease_id and not x.demoting for x in ls),
                               timeout_s=10, what="the demotion reported")
            on_tier = next(x for x in ready if x.lease_id == first.lease_id)
            assert on_tier.tier == pb.TIER_HOST and list(on_tier.block_ids) == [100, 101]
            # A third lease demotes the second; its copy fails: the broker drops it, the tier keeps the first.
            connector.events.put_nowait(retained_tokens("req-3", list(range(2000, 2256)), 4))
            await poll(lambda: asyncio.sleep(0, [d.request_id for c in connector.commands for d in c.demote]),
                       lambda ids: "req-2" in ids, timeout_s=10, what="the second copy command")
            connector.events.put_nowait(lpb.ConnectorEvent(demoted=lpb.Demoted(request_id="req-2", ok=False)))
            held = await poll(lambda: leases(broker, "tier-1"), lambda ls: len(ls) == 2, timeout_s=10,
                              what="the failed copy dropped")
            assert {(x.tier, tuple(x.block_ids)) for x in held} == {(pb.TIER_HOST, (100, 101)), (pb.TIER_POOL, (4, 5))}
            assert not connector.released() & {"req-1", "req-2"}
    finally:
        await connector.close()
        await broker.close()


class FreezableEngine:
    """An engine's /health stand-in (fake) on loopback: answers 200 until frozen, then holds every request
    unanswered, as a SIGSTOPped engine does."""

    def __init__(self) -> None:
        import http.server

        self.thawed = threading.Event()
        self.thawed.set()
        self.answered = 0
        """GETs answered: the sidecar counts an engine that has never answered as starting, so responsive."""
        thawed, engine = self.thawed, self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                thawed.wait(30)
                self.send_response(200)
                self.end_headers()
                engine.answered += 1

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.thawed.set()
        self.server.shutdown()
        self.server.server_close()


async def test_an_unresponsive_engine_is_let_expire_and_comes_back(tmp_path: Path, broker_address: str) -> None:
    """A frozen engine keeps its sockets open and answers nothing: its sidecar withholds keep-alives, the broker
    lets it expire (nothing more is placed on it, its leases go), and it registers again once it answers."""
    broker = Broker(broker_address)
    engine = FreezableEngine()
    connector = FakeConnector(tmp_path / "s.sock")
    try:
        async with running_sidecar(tmp_path, broker_address, "frozen-1", engine_url=engine.url,
                                   engine_unresponsive_s=1.0):
            await connector.attach(hello("frozen-1"))
            await poll(lambda: engine_status(broker, "frozen-1"), lambda s: s is not None, timeout_s=10,
                       what="registration")
            connector.events.put_nowait(retained("req-f", 256))
            await poll(lambda: leases(broker, "frozen-1"), bool, timeout_s=10, what="the lease")
            # Frozen only once it has answered: until then the sidecar takes it for an engine still starting (on a
            # loaded CI machine the first probe came after the freeze, and the keep-alives went on).
            await poll(lambda: asyncio.sleep(0, engine.answered), lambda n: n >= 1, timeout_s=10,
                       what="the engine's first answer")
            engine.thawed.clear()
            await poll(lambda: engine_status(broker, "frozen-1"), lambda s: s is None, timeout_s=15,
                       what="the frozen engine to expire at the broker")
            assert not await leases(broker, "frozen-1")
            engine.thawed.set()
            await poll(lambda: engine_status(broker, "frozen-1"), lambda s: s is not None, timeout_s=15,
                       what="the engine to register again")
            await connector.close()
    finally:
        engine.close()


def test_link_client_releases_on_its_own_when_the_hold_runs_out(tmp_path: Path) -> None:
    """The connector's thread with no sidecar at all: a tracked request whose safety hold passes is released,
    and the engine is woken to apply it; ``send`` never blocks."""
    woken = threading.Event()
    client = EngineLinkClient(str(tmp_path / "nobody.sock"), hello("x"), woken.set, tick_s=0.05)
    client.start()
    try:
        client.track("req-x", time.monotonic() + 0.2)
        assert client.send(retained("req-x", 256))  # queued for a sidecar that is not there
        assert woken.wait(5), "the engine was not woken"
        commands = client.commands()
        assert [c.release for c in commands] == [["req-x"]]
        assert not client.pending()
    finally:
        client.stop()


FROZEN_LINK = """
import sys, threading, time
from kvloop.engines.connector.link import EngineLinkClient
from kvloop.v1 import engine_link_pb2 as lpb

woken = threading.Event()
client = EngineLinkClient(sys.argv[1], lpb.ConnectorHello(engine_id="x"), woken.set, tick_s=0.05)
client.start()
deadline = time.monotonic() + 1.0
client.track("req-x", deadline)
print("tracked", flush=True)
woken.wait(30)
print(f"released {time.monotonic() - deadline:.2f}", flush=True)
"""


def test_a_frozen_engine_does_not_count_its_freeze_against_the_hold(tmp_path: Path) -> None:
    """SIGSTOP past the hold, then SIGCONT: the sidecar's renewals of that time sit unread on the socket, so the
    deadline moves on by the freeze instead of freeing blocks the broker may still have pinned."""
    child = subprocess.Popen([sys.executable, "-c", FROZEN_LINK, str(tmp_path / "nobody.sock")],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "tracked"
        child.send_signal(signal.SIGSTOP)
        time.sleep(2.5)  # the freeze itself is what is tested: it ends 1.5 s past the hold's deadline
        child.send_signal(signal.SIGCONT)
        late = float(child.stdout.readline().split()[1])
        # Counted against the hold, it is released on SIGCONT, 1.5 s after the deadline; moved on, ~2.5 s.
        assert late >= 2.0, f"released {late:.2f}s after the deadline: the freeze counted against the hold"
    finally:
        child.kill()
        child.wait()


def test_link_client_reports_to_a_real_sidecar(tmp_path: Path, broker_address: str) -> None:
    """EngineLinkClient (the connector's thread) against the real sidecar: hello registers, retained
    publishes, and the sidecar's hold commands extend the safety hold past its first deadline."""
    done = threading.Event()
    result: dict[str, Any] = {}

    async def scenario() -> None:
        broker = Broker(broker_address)
        async with running_sidecar(tmp_path, broker_address, "dec-d"):
            client = EngineLinkClient(str(tmp_path / "s.sock"), hello("dec-d"), lambda: None, tick_s=0.05)
            client.start()
            try:
                client.track("req-d", time.monotonic() + 1.5)
                client.send(retained("req-d", 384))
                result["leases"] = await poll(lambda: leases(broker, "dec-d"), lambda ls: len(ls) == 1,
                                              timeout_s=10, what="lease via the link client")
                await asyncio.sleep(2.5)  # past the first deadline: holds from the sidecar must have extended it
                result["released"] = [c.release for c in client.commands() if c.release]
            finally:
                client.stop()
                await broker.close()
        done.set()

    asyncio.run(scenario())
    assert done.is_set() and len(result["leases"][0].block_keys) == 3
    assert result["released"] == [], "the safety hold ran out although the sidecar renewed it"
