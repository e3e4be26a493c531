"""The cluster ``kvloop bench chaos`` runs and breaks: a local etcd, two broker replicas on it (one leader), prefill
and decode engines with their sidecars, and the router in this process, all on loopback.

Every part keeps its address across a restart (fixed ports below the ephemeral range), as a container keeps its
service name: what a fault tests is recovery, not rediscovery. Each method that breaks a part returns at once;
each that restores one waits until the part is back (healthy, registered, the leader known).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvloop.engines.config import EngineConfig, role_cores
from kvloop.engines.launcher import EngineProcess, pick_port, plan_engine, spawn_engine, spawn_sidecar
from kvloop.router.config import RouterConfig
from kvloop.router.server import RunningRouter, start_router
from kvloop.shared import procs
from kvloop.shared.client import BrokerClient
from kvloop.shared.http import metric_labels, metric_total, read_metrics
from kvloop.shared.vocabulary import Role
from kvloop.v1 import broker_pb2 as pb

REPLICAS = ("a", "b")


@dataclass(frozen=True)
class ChaosSettings:
    prefill: int = 2
    decode: int = 2
    hold_s: float = 8.0
    """The decode engines' safety hold: short, so a SIGSTOP can outlast it within a short run."""
    lease_ttl_s: float = 20.0
    engine_ttl_s: float = 4.0
    leader_ttl_s: int = 2
    engine_unresponsive_s: float = 5.0
    engine_stall_s: float = 15.0
    max_model_len: int = 16384
    host_tier_blocks: int = 0
    """Each decode engine's host tier (0: none): evictions for room demote into it."""
    retention_fraction: float = 0.5
    """Each decode engine's retention budget as a share of its pool: small, evictions for room come often."""


@dataclass
class ChaosCluster:
    work: Path
    settings: ChaosSettings
    etcd: procs.Proc | None = None
    broker_ports: dict[str, int] = field(default_factory=dict)
    brokers: dict[str, procs.Proc] = field(default_factory=dict)
    engines: dict[str, EngineProcess] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    """Each sidecar's Prometheus port (fixed, so the books can be read after a restart)."""
    router: RunningRouter | None = None

    @property
    def broker_addresses(self) -> str:
        return ",".join(f"127.0.0.1:{self.broker_ports[r]}" for r in REPLICAS)

    # Start and stop.

    @classmethod
    async def start(cls, model: Path, work: Path, settings: ChaosSettings) -> ChaosCluster:
        cluster = cls(work=work, settings=settings)
        try:
            cluster.etcd = await asyncio.to_thread(procs.start_etcd, work / "etcd" / "data", work / "etcd")
            for replica in REPLICAS:
                cluster.broker_ports[replica] = pick_port()
                await cluster.start_broker(replica)
            await cluster.wait_leader()
            configs = [cluster.engine_config(model, role, i) for i, role in
                       enumerate([Role.PREFILL] * settings.prefill + [Role.DECODE] * settings.decode)]
            for config in configs:
                plan = plan_engine(config)
                if plan.sidecar_env is not None:
                    port = pick_port()
                    cluster.metrics_ports[plan.engine_id] = port
                    plan.sidecar_env["KVLOOP_SIDECAR_METRICS_LISTEN"] = f"127.0.0.1:{port}"
                    plan.sidecar_env["KVLOOP_SIDECAR_ENGINE_UNRESPONSIVE_S"] = str(settings.engine_unresponsive_s)
                    plan.sidecar_env["KVLOOP_SIDECAR_LOG_LEVEL"] = "info"  # every lease's story, for the books
                cluster.engines[plan.engine_id] = spawn_engine(plan, die_with_parent=False)
            await asyncio.gather(*(cluster.wait_engine(eid) for eid in cluster.engines))
            cluster.router = await start_router(RouterConfig.load({
                "listen": "127.0.0.1:0", "broker": cluster.broker_addresses, "refresh_s": 0.5, "log_level": "warning",
                "request_timeout_s": 300.0, "engine_stall_s": settings.engine_stall_s, "broker_timeout_s": 2.0}))
            while len(cluster.router.runner.directory.engines) < len(configs):
                await cluster.router.runner.refresh()
                await asyncio.sleep(0.1)
        except BaseException:
            await cluster.stop()
            raise
        return cluster

    def engine_config(self, model: Path, role: Role, index: int) -> EngineConfig:
        s = self.settings
        return EngineConfig(role=role, model=model, engine_id=f"{role}-{index}", work_dir=self.work, dtype="float32",
                            broker=self.broker_addresses, connector="kvloop", max_model_len=s.max_model_len,
                            omp_threads_bind=role_cores(role), hold_s=s.hold_s, lease_ttl_s=s.lease_ttl_s,
                            log_level="warning", port=pick_port(), nixl_port=pick_port(),
                            host_tier_blocks=s.host_tier_blocks if role == Role.DECODE else 0,
                            retention_fraction=s.retention_fraction)

    async def start_broker(self, replica: str) -> None:
        s = self.settings
        assert self.etcd is not None
        flags = ["--listen", f"127.0.0.1:{self.broker_ports[replica]}", "--store", "etcd",
                 "--etcd-endpoint", self.etcd.extra["endpoint"], "--replica-id", replica,
                 "--leader-ttl-s", str(s.leader_ttl_s), "--engine-ttl-s", str(s.engine_ttl_s),
                 "--keepalive-interval-s", "1", "--log-level", "warning"]
        self.brokers[replica] = await asyncio.to_thread(procs.start_broker, f"broker-{replica}", flags,
                                                        self.work / "brokers")

    async def stop(self) -> None:
        if self.router is not None:
            await self.router.stop()
        await asyncio.gather(*(asyncio.to_thread(e.stop) for e in self.engines.values()))
        for proc in self.brokers.values():
            proc.stop()
        if self.etcd is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.etcd.popen.pid, signal.SIGCONT)  # a fault may have left it stopped
            self.etcd.stop()

    # What is up.

    async def inspect(self, replica: str, timeout_s: float = 2.0) -> pb.InspectResponse | None:
        with contextlib.suppress(Exception):
            async with BrokerClient(f"127.0.0.1:{self.broker_ports[replica]}", timeout_s=timeout_s) as client:
                reply: pb.InspectResponse = await client.call("Inspect", pb.InspectRequest())
                return reply
        return None

    async def leader(self) -> tuple[str, pb.InspectResponse] | None:
        for replica in REPLICAS:
            reply = await self.inspect(replica)
            if reply is not None and reply.leader:
                return replica, reply
        return None

    async def wait_leader(self, timeout_s: float = 60.0) -> tuple[str, pb.InspectResponse]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = await self.leader()
            if found is not None:
                return found
            await asyncio.sleep(0.2)
        raise TimeoutError(f"no broker leader after {timeout_s}s")

    async def wait_engine(self, engine_id: str, timeout_s: float = 600.0) -> None:
        """Until the engine answers its /health and the leader lists it (its sidecar registered)."""
        engine = self.engines[engine_id]
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(engine.healthy, 2.0):
            if not engine.alive or time.monotonic() > deadline:
                raise RuntimeError(f"engine {engine_id} did not come up:\n{engine.log_tail()}")
            await asyncio.sleep(0.5)
        while time.monotonic() < deadline:
            if not engine.alive:  # it died after its first /health: say so now, with its log, not at the deadline
                raise RuntimeError(f"engine {engine_id} exited before it registered:\n{engine.log_tail()}")
            found = await self.leader()
            if found is not None and any(e.engine.engine_id == engine_id for e in found[1].engines):
                return
            await asyncio.sleep(0.3)
        raise TimeoutError(f"engine {engine_id} never registered with the leader:\n{engine.log_tail()}")

    def roles(self, role: Role) -> list[str]:
        return sorted(eid for eid, e in self.engines.items() if e.plan.config.role == role)

    def sidecar_metrics(self, engine_id: str) -> dict[str, float]:
        port = self.metrics_ports.get(engine_id)
        return read_metrics(f"http://127.0.0.1:{port}", timeout_s=5.0) if port else {}

    def engine_blocks(self, engine_id: str) -> tuple[int, int]:
        """(blocks allocated now, blocks in all) of an engine, from vLLM's own metrics."""
        samples = read_metrics(self.engines[engine_id].plan.url, timeout_s=10.0)
        total = int(float((metric_labels(samples, "vllm:cache_config_info") or {}).get("num_gpu_blocks", 0)))
        return round(metric_total(samples, "vllm:kv_cache_usage_perc") * total), total

    def engine_requests(self, engine_id: str) -> dict[str, float]:
        """Requests the engine's scheduler has, running and waiting (a request stuck there holds blocks)."""
        samples = read_metrics(self.engines[engine_id].plan.url, timeout_s=10.0)
        return {name: metric_total(samples, f"vllm:num_requests_{name}") for name in ("running", "waiting")}

    # Faults and repairs.

    def signal_engine(self, engine_id: str, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.engines[engine_id].pgid, sig)

    async def restart_engine(self, engine_id: str) -> None:
        """After a kill: reap the old process group and its sidecar, start both again, wait until registered."""
        old = self.engines[engine_id]
        self.signal_engine(engine_id, signal.SIGKILL)
        await asyncio.to_thread(old.stop, 10.0)
        self.engines[engine_id] = spawn_engine(replace(old.plan), die_with_parent=False)
        await self.wait_engine(engine_id)

    def kill_sidecar(self, engine_id: str) -> None:
        sidecar = self.engines[engine_id].sidecar
        if sidecar is not None:
            sidecar.kill()

    async def restart_sidecar(self, engine_id: str) -> None:
        engine = self.engines[engine_id]
        engine.sidecar = spawn_sidecar(engine.plan)
        await self.wait_engine(engine_id)

    def kill_broker(self, replica: str) -> None:
        self.brokers[replica].kill()

    def signal_etcd(self, sig: int) -> None:
        assert self.etcd is not None
        os.kill(self.etcd.popen.pid, sig)

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of each broker replica (the books the soak watches)."""
        out = {}
        for replica, proc in self.brokers.items():
            with contextlib.suppress(OSError):
                pages = int(Path(f"/proc/{proc.popen.pid}/statm").read_text().split()[1])
                out[replica] = pages * os.sysconf("SC_PAGE_SIZE")
        return out

    def log_lines(self, needle: str) -> list[str]:
        """Lines containing ``needle`` in every engine's and sidecar's log (restarts append to the same files)."""
        found: list[str] = []
        for path in sorted((self.work / "logs").glob("*.log")):
            with contextlib.suppress(OSError), path.open(errors="replace") as f:
                found += [f"{path.name}: {line.strip()}" for line in f if needle in line]
        return found

    def describe(self) -> dict[str, Any]:
        return {"engines": {eid: e.plan.config.role for eid, e in self.engines.items()}, "brokers": list(REPLICAS),
                "store": "etcd", "settings": self.settings.__dict__}
