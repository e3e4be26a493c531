"""Start real kvloop and etcd processes on loopback, wait for their health, stop them in order.

Used by ``kvloop up``, the benchmarks and the test fixtures. Readiness is polled (etcd's /health,
gRPC health), never slept for.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

OWN_SESSION = True
"""Children start in a session of their own (``start_new_session``), as containers each get a cgroup. Linux's
autogroup scheduler (on by default in many kernels, this machine's 6.18 included) shares a CPU between sessions
first, then between a session's processes, so a service left in its parent's session shares one share with whatever
else runs there (in the load bench: AIPerf's processes). Measured on the load bench's kvloop point at 16 sessions
(2 cores, saturated): the router's and broker's event loops waited runnable in the run queue (from
``/proc/thread-self/schedstat``) in bursts of 70-650 ms either way; in sessions of their own the waits over 20 ms
summed 8.9-11.7 s for the router (12.8 s before) and 5.6-7.3 s for the broker (10.5 s before), and goodput went from
2.58/s to 4.18-4.96/s (one run before, two after). The parent stops its children itself (a session of its own gets no
terminal signals)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> int:
        """Signal, wait, then kill if it does not exit in time. Returns the exit code."""
        if self.alive:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return int(self.popen.returncode)

    def kill(self) -> None:
        if self.alive:
            self.popen.kill()
            self.popen.wait()


def spawn(name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None,
           cpus: set[int] | None = None) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    log_file = log_path.open("ab")

    def pin() -> None:
        if cpus:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, cpus)

    popen = subprocess.Popen(list(argv), stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, **(env or {})}, preexec_fn=pin if cpus else None,
                             start_new_session=OWN_SESSION)
    log_file.close()
    return Proc(name, popen, log_path)


def etcd_binary() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if path is None:
        raise FileNotFoundError("etcd is not installed (Debian: apt-get install etcd-server)")
    return path


def start_etcd(data_dir: Path, log_dir: Path, timeout_s: float = 20.0, cpus: set[int] | None = None) -> Proc:
    """A single-member etcd on free loopback ports; ``proc.extra['endpoint']`` is host:port."""
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    argv = [etcd_binary(), "--name", "kvloop-test", "--data-dir", str(data_dir),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"kvloop-test=http://127.0.0.1:{peer}", "--log-level", "warn"]
    proc = spawn(f"etcd-{client}", argv, log_dir, cpus=cpus)
    proc.extra["endpoint"] = f"127.0.0.1:{client}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive:
            raise RuntimeError(f"etcd exited early:\n{proc.log_tail()}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
            if b'"health":"true"' in reply.read():
                return proc
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"etcd not healthy after {timeout_s}s:\n{proc.log_tail()}")


def start_broker(name: str, args: Sequence[str], run_dir: Path, env: dict[str, str] | None = None,
                 cpus: set[int] | None = None, timeout_s: float = 30.0) -> Proc:
    """``kvloop broker serve`` on a free port; waits until its gRPC port is bound and the process
    answers health (the overall service: a follower replica is up but not the leader).
    ``proc.extra['address']`` is host:port. For tests and benchmarks on loopback: unless ``args`` (or ``env``)
    turn on tokens or mutual TLS, the broker runs with ``--dev-no-auth``, which it logs."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port_file = run_dir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    authenticated = any(a.split("=")[0] in ("--auth-secret-file", "--tls-ca") for a in args) or any(
        k in (env or {}) for k in ("KVLOOP_BROKER_AUTH_SECRET_FILE", "KVLOOP_BROKER_TLS_CA"))
    argv = [sys.executable, "-m", "kvloop.app.cli", "broker", "serve", "--listen", "127.0.0.1:0",
            "--port-file", str(port_file), "--metrics-listen", "127.0.0.1:0", "--log-format", "json",
            *([] if authenticated else ["--dev-no-auth"]), *args]
    proc = spawn(name, argv, run_dir, env=env, cpus=cpus)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive:
            raise RuntimeError(f"broker {name} exited early ({proc.popen.returncode}):\n{proc.log_tail()}")
        if port_file.exists():
            proc.extra["address"] = f"127.0.0.1:{port_file.read_text().strip()}"
            metrics = [a.split("=", 1)[1] for a in args if a.startswith("--metrics-listen=")]
            if metrics and not metrics[-1].endswith(":0"):  # a port the caller chose, to read
                proc.extra["metrics_url"] = f"http://{metrics[-1]}"
            return proc
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"broker {name} did not bind a port in {timeout_s}s:\n{proc.log_tail()}")
