"""Stage this machine's pip configuration for the image builds: ``python3 pipconf.py OUT_DIR [--builder B]``.

Reads what ``pip config list`` reports (files and ``PIP_*`` variables; a variable wins over a file, as in pip) and
writes ``OUT_DIR/pip.conf`` for the builds' ``PIP_CONFIG_FILE`` (build argument ``PIP_DIR``), with the local files it
names copied under ``OUT_DIR/files`` and their paths rewritten to ``/pip/files/...``: the certificate bundle
(``cert``, ``client-cert``), constraint and requirement files, and ``find-links`` folders (hard links where the file
system allows: no copy). Local ``file://`` indexes (``index-url``, ``extra-index-url``) are whole PyPI mirrors, too
big to copy into a build context: with podman they keep their path and this prints ``volume PATH`` for each, which
run.sh passes to ``podman build --volume PATH:PATH:ro``; with Docker (no volumes in builds) they are left out, with
a note. Everything else (``timeout``, ``retries``, ``trusted-host``, http(s) indexes, ...) is copied as it is.
Standard library only: it runs with the machine's ``python3`` before any venv exists.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# pip's scopes, lowest precedence first (pip: global < user < site < environment variables).
SCOPES = ("global", "user", "site", ":env:")
FILE_KEYS = {"cert", "client-cert", "constraint", "constraints", "requirement", "requirements"}
LIST_KEYS = {"find-links", "extra-index-url", "trusted-host", "constraint", "constraints"}
LINE = re.compile(r"^(?P<scope>[^.]+|:env:)\.(?P<key>[\w-]+)='(?P<value>.*)'$")


def pip_config() -> dict[str, str]:
    """``pip config list`` as {key: value}, the highest-precedence scope winning; sections other than ``global`` (and
    the environment) are merged in as pip would for ``install``/``wheel``/``download``."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], check=True, capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"pipconf: pip config list failed ({exc}); staging an empty configuration", file=sys.stderr)
        return {}
    found: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        m = LINE.match(line.strip())
        if m is None:
            continue
        scope = m["scope"]
        # `global.cert=...` in a file; `:env:.cert` from PIP_CERT; `install.x` sections rank as their file's global.
        rank = ":env:" if scope == ":env:" else "global"
        found.setdefault(m["key"], {})[rank] = m["value"]
    return {key: by_scope.get(":env:", by_scope.get("global", "")) for key, by_scope in found.items()}


def _local(value: str) -> Path | None:
    if value.startswith("file://"):
        return Path(value.removeprefix("file://"))
    if "://" in value:
        return None
    return Path(value)


def _copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=_link_or_copy, dirs_exist_ok=True)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        _link_or_copy(str(src), str(dst))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def stage(config: dict[str, str], out: Path, builder: str) -> list[str]:
    """Write ``out/pip.conf`` and ``out/files``; return the host paths to mount into podman builds."""
    if out.exists():
        shutil.rmtree(out)
    (out / "files").mkdir(parents=True)
    volumes: list[str] = []
    lines = ["# Staged by deploy/compose/run.sh from this machine's pip configuration (pipconf.py).", "[global]"]
    counter = 0
    for key in sorted(config):
        values = config[key].split() if key in LIST_KEYS else [config[key]]
        kept: list[str] = []
        for value in values:
            local = _local(value)
            if key in FILE_KEYS | {"find-links"} and local is not None:
                if not local.exists():
                    print(f"pipconf: {key} {value} does not exist here; left out", file=sys.stderr)
                    continue
                counter += 1
                name = f"{key}-{counter}-{local.name}"
                _copy(local, out / "files" / name)
                kept.append(f"/pip/files/{name}")
            elif key in ("index-url", "extra-index-url") and value.startswith("file://") and local is not None:
                if builder == "podman" and local.exists():
                    # A PEP 503 index in .../simple links its files relatively (../../files/...): mount its parent.
                    volumes.append(str(local.parent if local.name == "simple" else local))
                    kept.append(value)
                else:
                    print(f"pipconf: {key} {value} is a local mirror; Docker builds mount no host folders, so it is "
                          "left out (serve it over http(s) to use it)", file=sys.stderr)
            else:
                kept.append(value)
        if kept:
            lines.append(f"{key} = {' '.join(kept)}")
    (out / "pip.conf").write_text("\n".join(lines) + "\n")
    return volumes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--builder", choices=("podman", "docker"), default="docker")
    args = parser.parse_args(argv)
    for volume in stage(pip_config(), args.out, args.builder):
        print(f"volume {volume}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
