"""Shared checks for the deployment files: a kvloop container's command through the real CLI parser, its
``KVLOOP_*`` variables through the matching service config (unknown variable = failure, values through the
config's own loading and ``validate()``), and the Dockerfiles' stages (entrypoint, command, user, health check)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvloop.app.cli import build_parser
from kvloop.broker.config import BrokerConfig
from kvloop.engines.config import EngineConfig
from kvloop.engines.sidecar import SidecarConfig
from kvloop.router.config import RouterConfig
from kvloop.shared.config import ServiceConfig, parse_host_port
from kvloop.shared.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# Paths that exist only inside the images or at run time, and the stand-ins the checks put in their place
# (see stand_ins()): the model directory an engine serves and the sidecar's fingerprint file.
MODEL_PATHS = ("/opt/kvloop/models/tiny", "/models/model")
LAYOUT_FILE = "/run/kvloop/layout.yaml"


class DeployError(AssertionError):
    """A deployment file names a command, flag or variable the real CLI or config refuses."""


@dataclass
class Checked:
    """One kvloop container, parsed and loaded."""

    where: str
    argv: list[str]
    command: str                      # "broker serve", "router", "engine", "sidecar", "model fingerprint"
    args: argparse.Namespace
    config: ServiceConfig | None = None
    env: dict[str, str] = field(default_factory=dict)


def config_class(command: str) -> type[ServiceConfig] | None:
    return {"broker serve": BrokerConfig, "router": RouterConfig, "engine": EngineConfig,
            "sidecar": SidecarConfig}.get(command)


def parse_kvloop(argv: Sequence[str], where: str) -> tuple[str, argparse.Namespace]:
    """``argv`` (``kvloop ...``) through ``kvloop.app.cli.build_parser()``; the subcommand path and the namespace."""
    argv = [str(a) for a in argv]
    if not argv or argv[0] != "kvloop":
        raise DeployError(f"{where}: command must start with kvloop (got {argv!r})")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(argv[1:])
    except SystemExit as exc:
        raise DeployError(f"{where}: `{shlex.join(argv)}` refused by the kvloop CLI: {err.getvalue().strip()}") from exc
    words = [argv[1]]
    for sub in ("broker_command", "model_command", "bench_command", "auth_command"):
        value = getattr(args, sub, None)
        if value:
            words.append(value)
    return " ".join(words), args


def check_env(cls: type[ServiceConfig] | None, env: Mapping[str, Any], where: str) -> dict[str, str]:
    """The ``KVLOOP_*`` variables of ``env``; each must name a field (or ``CONFIG``) of ``cls``."""
    out: dict[str, str] = {}
    for name, value in env.items():
        if not name.startswith("KVLOOP_"):
            continue
        if cls is None:
            raise DeployError(f"{where}: {name}: this command reads no KVLOOP_ variables")
        known = {cls.env_name(f.name) for f in cls.fields()} | {cls.ENV_PREFIX + "CONFIG"}
        if name not in known:
            raise DeployError(f"{where}: {name}: not a variable of {cls.__name__} (known: {sorted(known)})")
        if value is None:
            raise DeployError(f"{where}: {name}: no value")
        out[name] = str(value)
    return out


def replace_paths(values: Sequence[str], mapping: Mapping[str, str]) -> list[str]:
    return [mapping.get(v, v) for v in values]


def check_kvloop(argv: Sequence[str], env: Mapping[str, Any], where: str,
                 paths: Mapping[str, str] | None = None) -> Checked:
    """Parse ``argv`` with the real CLI, check the ``KVLOOP_*`` variables, and load the service config from both
    (flags over env, as at start) with its own validation. ``paths`` maps in-image paths to local stand-ins."""
    paths = paths or {}
    command, args = parse_kvloop(argv, where)
    cls = config_class(command)
    kv_env = check_env(cls, env, where)
    checked = Checked(where=where, argv=list(argv), command=command, args=args, env=kv_env)
    if cls is None:
        return checked
    _, local_args = parse_kvloop(replace_paths(list(argv), paths), where)
    local_env = {k: paths.get(v, v) for k, v in kv_env.items()}
    try:
        checked.config = cls.load(local_args, env=local_env)
    except ConfigError as exc:
        raise DeployError(f"{where}: {cls.__name__} refuses it: {exc}") from exc
    return checked


def listening_ports(checked: Checked) -> set[int]:
    """The TCP ports a checked kvloop container listens on, from its config."""
    c = checked.config
    ports: set[int] = set()
    if isinstance(c, BrokerConfig | SidecarConfig):
        ports.add(parse_host_port(c.listen, "listen")[1])
        if c.metrics_listen:
            ports.add(parse_host_port(c.metrics_listen, "metrics_listen")[1])
    elif isinstance(c, RouterConfig):
        ports.add(parse_host_port(c.listen, "listen")[1])
        if c.ext_proc_listen:
            ports.add(parse_host_port(c.ext_proc_listen, "ext_proc_listen")[1])
    elif isinstance(c, EngineConfig):
        ports |= {c.port, c.nixl_port}
    return ports - {0}


def check_engine_sidecar_pair(engine: Checked, sidecar: Checked, where: str, *,
                              engine_host: str | None = None) -> None:
    """An engine and its own-container sidecar agree: the socket, the engine id, the role, the addresses; and the
    engine has no broker (with one, the launcher would start a second sidecar of its own)."""
    e, s = engine.config, sidecar.config
    assert isinstance(e, EngineConfig) and isinstance(s, SidecarConfig), where
    if e.broker:
        raise DeployError(f"{where}: the engine has broker={e.broker!r}: it would spawn its own sidecar")
    if e.connector != "kvloop":
        raise DeployError(f"{where}: the engine's connector is {e.connector!r}, not kvloop")
    socket = e.extra_config().get("kvloop_sidecar_socket")
    if socket != str(s.socket):
        raise DeployError(f"{where}: engine kvloop_sidecar_socket {socket!r} != sidecar socket {str(s.socket)!r}")
    if e.engine_id != s.engine_id or not e.engine_id:
        raise DeployError(f"{where}: engine_id {e.engine_id!r} != sidecar engine_id {s.engine_id!r}")
    if e.role != s.role:
        raise DeployError(f"{where}: engine role {e.role!r} != sidecar role {s.role!r}")
    url_host, url_port = parse_host_port(s.engine_url.split("://", 1)[1].split("/", 1)[0], "engine_url")
    if url_port != e.port:
        raise DeployError(f"{where}: sidecar engine_url port {url_port} != engine port {e.port}")
    if engine_host is not None and url_host not in (engine_host, "127.0.0.1", "localhost"):
        raise DeployError(f"{where}: sidecar engine_url host {url_host!r} is not the engine ({engine_host!r})")
    nixl_host, nixl_port = parse_host_port(s.nixl_address, "nixl_address")
    if nixl_port != e.nixl_port:
        raise DeployError(f"{where}: sidecar nixl_address port {nixl_port} != engine nixl_port {e.nixl_port}")
    if nixl_host != e.resolved_nixl_host():
        raise DeployError(f"{where}: sidecar nixl_address host {nixl_host!r} != engine nixl_host "
                          f"{e.resolved_nixl_host()!r} (what the engine binds and hands to decode engines)")


def fake_model(directory: Path) -> Path:
    """A stand-in model directory: what the engine config's validation and the layout fingerprint read."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    (directory / "model.safetensors").write_bytes(b"\0" * 64)
    return directory


AUTH_SECRET = "/auth/secret"
AUTH_TOKEN = "/auth/token"
"""Where each kvloop container finds its credentials (the cluster secret on brokers, its own token on the others)."""


def stand_ins(tmp: Path) -> dict[str, str]:
    """In-image paths -> local stand-ins (the layout file is written by running the fingerprint command; the
    credentials by ``kvloop auth init``, any token standing in for each caller's own)."""
    model = str(fake_model(tmp / "model"))
    from kvloop.app.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["auth", "init", "--dir", str(tmp / "auth"), "--router", "router"]) == 0
    return {**dict.fromkeys(MODEL_PATHS, model), LAYOUT_FILE: str(tmp / "layout.yaml"),
            AUTH_SECRET: str(tmp / "auth" / "broker" / "secret"), AUTH_TOKEN: str(tmp / "auth" / "router" / "token")}


def run_fingerprint(checked: Checked, paths: Mapping[str, str]) -> Path:
    """Run a checked ``kvloop model fingerprint`` with the stand-in paths; the file it wrote."""
    from kvloop.app.cli import main

    local = replace_paths(checked.argv, paths)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(local[1:])
    if code != 0:
        raise DeployError(f"{checked.where}: `{shlex.join(checked.argv)}` exited {code}")
    written = Path(local[local.index("--out") + 1])
    if not re.fullmatch(r'layout_fingerprint: "[0-9a-f]+"\nserved_model: "[^"]+"\n', written.read_text()):
        raise DeployError(f"{checked.where}: unexpected fingerprint file {written.read_text()!r}")
    return written


# Dockerfiles.

@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def last(self, op: str) -> str | None:
        values = [v for o, v in self.instructions if o == op]
        return values[-1] if values else None

    def exec_form(self, op: str) -> list[str] | None:
        value = self.last(op)
        if value is None:
            return None
        parsed = json.loads(value)
        if not (isinstance(parsed, list) and all(isinstance(p, str) for p in parsed)):
            raise DeployError(f"{op} of stage {self.name} must be in exec (JSON) form: {value}")
        return parsed


def dockerfile_stages(path: Path) -> dict[str, Stage]:
    """The stages of a Dockerfile (comments and line continuations handled; ARG defaults substituted in FROM)."""
    lines: list[str] = []
    current = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for line in lines:
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "ARG" and stage is None and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value
        elif op == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), words[0])
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages))
            stage = Stage(name=name, base=base)
            stages[name] = stage
        elif stage is not None:
            stage.instructions.append((op, rest))
    return stages


def root_base(path: Path, target: str) -> str:
    """The image a stage is built on, following ``FROM <earlier stage>`` back to the first image named."""
    stages = dockerfile_stages(path)
    base = stages[target].base
    while base in stages:
        base = stages[base].base
    return base


def final_stage(path: Path, target: str | None) -> Stage:
    stages = dockerfile_stages(path)
    if target is None:
        return list(stages.values())[-1]
    if target not in stages:
        raise DeployError(f"{path}: no stage {target!r} (stages: {sorted(stages)})")
    return stages[target]
