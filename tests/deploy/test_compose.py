"""deploy/docker-compose.yaml (and the GPU override): valid against the Compose specification's JSON schema, and
every kvloop container's command, variables and ports accepted by the real CLI and configs.

The schema is the one check-jsonschema vendors (``check_jsonschema/builtin_schemas/vendor/compose-spec.json``, with
its sha256 beside it), so the check needs no network: only the dev extra from PyPI."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.resources
import io
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from kvloop.broker.config import BrokerConfig
from kvloop.engines.config import EngineConfig
from kvloop.router.config import RouterConfig
from tests.deploy.support import (
    AUTH_SECRET,
    AUTH_TOKEN,
    DEPLOY,
    ROOT,
    Checked,
    DeployError,
    check_engine_sidecar_pair,
    check_kvloop,
    final_stage,
    listening_ports,
    run_fingerprint,
    stand_ins,
)

BASE = DEPLOY / "docker-compose.yaml"
GPU = DEPLOY / "docker-compose.gpu.yaml"
# What `docker compose` would take from the shell for ${...} in the files.
SHELL_ENV = {"MODEL_DIR": "/srv/models/llama"}


def compose_schema() -> dict[str, Any]:
    vendor = importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor"
    text = (vendor / "compose-spec.json").read_bytes()
    expected = (vendor / "sha256" / "compose-spec.sha256").read_text().strip()
    assert hashlib.sha256(text).hexdigest() == expected, "vendored compose schema does not match its sha256"
    schema: dict[str, Any] = json.loads(text)
    assert "compose" in schema.get("$id", "") + schema.get("title", "").lower() + json.dumps(schema.get("properties"))
    return schema


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} on every string."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in env and env[name] != "":
            return env[name]
        if op == ":?":
            raise DeployError(f"${{{name}}} is required: {arg}")
        return arg if op == ":-" else ""

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", one, value)


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Compose's merge of an override file, for the keys these files use: mappings merge, command, entrypoint and
    healthcheck.test replace, volumes merge by target path."""
    out = copy.deepcopy(base)
    for name, svc in override.get("services", {}).items():
        target = out.setdefault("services", {}).setdefault(name, {})
        for key, value in svc.items():
            if key == "volumes":
                by_target = {str(v).split(":")[1]: v for v in target.get("volumes", [])}
                by_target.update({str(v).split(":")[1]: v for v in value})
                target["volumes"] = list(by_target.values())
            elif isinstance(value, dict) and isinstance(target.get(key), dict):
                target[key] = {**target[key], **value}
            else:
                target[key] = copy.deepcopy(value)
    for key in ("volumes", "networks"):  # top-level definitions merge by name
        if key in override:
            out[key] = {**out.get(key, {}), **copy.deepcopy(override[key])}
    return out


def environment(svc: Mapping[str, Any]) -> dict[str, Any]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return dict(env)


def kvloop_argv(name: str, svc: Mapping[str, Any]) -> list[str] | None:
    """entrypoint + command as the container runs them (the image's own from its Dockerfile stage when the service
    does not set them); None for a service not built from deploy/docker."""
    build = svc.get("build")
    if not isinstance(build, dict) or not str(build.get("dockerfile", "")).startswith("deploy/docker/"):
        return None
    stage = final_stage(ROOT / build["dockerfile"], build.get("target"))
    entrypoint = svc.get("entrypoint", stage.exec_form("ENTRYPOINT"))
    command = svc.get("command", stage.exec_form("CMD") if "entrypoint" not in svc else None)
    return [str(a) for a in [*(entrypoint or []), *(command or [])]]


def check_compose(doc: dict[str, Any], tmp: Path) -> dict[str, Checked]:
    paths = stand_ins(tmp)
    services = doc["services"]
    argvs: dict[str, list[str]] = {}
    for name, svc in services.items():
        argv = kvloop_argv(name, svc)
        if argv is None:
            assert not any(k.startswith("KVLOOP_") for k in environment(svc)), f"{name}: KVLOOP_ variables on a " \
                                                                               "non-kvloop image"
        else:
            argvs[name] = argv
    # The fingerprint job first: the sidecars' --config is the file it writes.
    jobs = [n for n, argv in argvs.items() if argv[1:3] == ["model", "fingerprint"]]
    assert len(jobs) == 1, f"one fingerprint job (got {jobs})"
    checked = {jobs[0]: check_kvloop(argvs[jobs[0]], environment(services[jobs[0]]), f"compose service {jobs[0]}")}
    run_fingerprint(checked[jobs[0]], paths)
    for name, argv in argvs.items():
        if name not in checked:
            checked[name] = check_kvloop(argv, environment(services[name]), f"compose service {name}", paths)
    return checked


def check_credentials(doc: dict[str, Any], checked: dict[str, Checked]) -> None:
    """The auth job writes the secret and one token per caller, each into a volume of its own; the brokers mount the
    secret's, the router and each sidecar only their own token's (minted for their name or engine id)."""
    services = doc["services"]
    jobs = [n for n, c in checked.items() if c.command == "auth init"]
    assert len(jobs) == 1, jobs
    job = checked[jobs[0]].args
    made = {Path(str(v).split(":")[1]).name: str(v).split(":")[0] for v in services[jobs[0]]["volumes"]}
    assert set(made) == {"broker", *job.engine, *job.router, *job.operator}, made
    users: dict[str, set[str]] = {}
    for name, c in checked.items():
        mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in services[name].get("volumes", [])}
        for volume in mounts.values():
            users.setdefault(volume, set()).add(name)
        if c.command == "broker serve":
            assert c.env.get("KVLOOP_BROKER_AUTH_SECRET_FILE") == AUTH_SECRET, name
            assert mounts.get(str(Path(AUTH_SECRET).parent)) == made["broker"], name
        elif c.command in ("router", "sidecar"):
            subject = getattr(c.config, "engine_id", "") if c.command == "sidecar" else "router"
            prefix = "KVLOOP_SIDECAR_" if c.command == "sidecar" else "KVLOOP_ROUTER_"
            assert c.env.get(prefix + "BROKER_TOKEN_FILE") == AUTH_TOKEN, name
            assert mounts.get(str(Path(AUTH_TOKEN).parent)) == made[subject], f"{name}: not its own token"
    for subject, volume in made.items():
        if subject not in ("broker", "operator"):
            assert len(users[volume] - set(jobs)) == 1, f"{volume} is mounted by {sorted(users[volume])}"


def check_topology(doc: dict[str, Any], checked: dict[str, Checked]) -> None:
    services = doc["services"]
    by_command: dict[str, list[str]] = {}
    for name, c in checked.items():
        by_command.setdefault(c.command, []).append(name)
    brokers = by_command.get("broker serve", [])
    assert len(brokers) == 2, brokers
    for name in brokers:
        config = checked[name].config
        assert isinstance(config, BrokerConfig) and config.store == "etcd"
        host, port = config.etcd_endpoint.rsplit(":", 1)
        assert host in services, f"{name}: etcd endpoint {config.etcd_endpoint} is no service"
    replicas = {c.replica for c in (checked[n].config for n in brokers) if isinstance(c, BrokerConfig)}
    assert len(replicas) == 2, "two distinct replica ids"
    engines = {n: c for n, c in checked.items() if c.command == "engine"}
    roles = sorted(c.config.role for c in engines.values() if isinstance(c.config, EngineConfig))
    assert roles == ["decode", "prefill", "prefill"], roles
    # The engines share the host: each binds its role's share of the cores, as `kvloop up` binds them.
    binds = {n: getattr(c.config, "omp_threads_bind", None) for n, c in engines.items()}
    assert set(binds.values()) == {"role"}, binds
    sidecars = {n: c for n, c in checked.items() if c.command == "sidecar"}
    assert len(sidecars) == len(engines)
    for engine_name, engine in engines.items():
        pair = [s for s in sidecars.values() if getattr(s.config, "engine_id", None) ==
                getattr(engine.config, "engine_id", "")]
        assert len(pair) == 1, f"{engine_name}: exactly one sidecar"
        sidecar_name = next(n for n, s in sidecars.items() if s is pair[0])
        ipv4 = services[engine_name]["networks"]["kvloop"]["ipv4_address"]
        check_engine_sidecar_pair(engine, pair[0], f"{engine_name} + {sidecar_name}", engine_host=ipv4)
        socket_dir = str(Path(str(getattr(pair[0].config, "socket", ""))).parent.parent)
        for svc_name in (engine_name, sidecar_name):
            mounts = [str(v).split(":")[1] for v in services[svc_name].get("volumes", [])]
            assert socket_dir in mounts, f"{svc_name}: the socket's volume {socket_dir} is not mounted"
        assert isinstance(engine.config, EngineConfig) and engine.config.resolved_nixl_host() == ipv4, \
            f"{engine_name}: nixl_host must be the engine's own static address {ipv4}"
    # Addresses a kvloop service is told to reach: services of this file, on ports they listen on.
    listen = {n: listening_ports(c) for n, c in checked.items()}
    static = {svc["networks"]["kvloop"]["ipv4_address"]: n for n, svc in services.items()
              if isinstance(svc.get("networks"), dict) and "ipv4_address" in svc["networks"].get("kvloop", {})}
    for name, c in checked.items():
        cfg = c.config
        targets: list[str] = []
        if c.command in ("router", "sidecar"):
            targets += [a.strip() for a in str(getattr(cfg, "broker", "")).split(",") if a.strip()]
        if c.command == "sidecar":
            targets.append(str(getattr(cfg, "engine_url", "")).split("://", 1)[1].split("/")[0])
        for t in targets:
            host, port = t.rsplit(":", 1)
            host = static.get(host, host)
            assert host in listen, f"{name}: {t} names no kvloop service"
            assert int(port) in listen[host], f"{name}: {t}: {host} listens on {sorted(listen[host])}"
    # Published and health-checked ports are ones the service listens on.
    for name in checked:
        svc = services[name]
        for mapping in svc.get("ports", []):
            container_port = int(str(mapping).rsplit(":", 1)[1].split("/")[0])
            assert container_port in listen[name], f"{name}: publishes {container_port}, listens on {listen[name]}"
        test = (svc.get("healthcheck") or {}).get("test") or []
        for word in test:
            m = re.match(r"^(?:grpc|https?)://[^:/]+:(\d+)", str(word))
            if m:
                assert int(m.group(1)) in listen[name], f"{name}: health check on {word}, listens on {listen[name]}"
    # Prometheus scrapes every kvloop service and every engine, on ports they listen on.
    prom = yaml.safe_load((DEPLOY / "observability" / "prometheus.yml").read_text())
    scraped = {t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]}
    for t in scraped:
        host, port = t.rsplit(":", 1)
        if host in listen:
            assert int(port) in listen[host], f"prometheus: {t}: {host} listens on {sorted(listen[host])}"
        else:
            assert host in services, f"prometheus: {t} is no service"
    for name, c in checked.items():
        if c.command not in ("model fingerprint", "auth init", "gateway config"):  # one-shot jobs
            assert any(t.split(":")[0] == name for t in scraped), f"prometheus does not scrape {name}"


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return compose_schema()


@pytest.mark.parametrize("path", [BASE, GPU], ids=["base", "gpu-override"])
def test_compose_file_matches_the_compose_schema(path: Path, schema: dict[str, Any]) -> None:
    doc = interpolate(load(path), SHELL_ENV)
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_merged_gpu_compose_matches_the_schema(schema: dict[str, Any]) -> None:
    doc = merge(interpolate(load(BASE), SHELL_ENV), interpolate(load(GPU), SHELL_ENV))
    errors = list(jsonschema.validators.validator_for(schema)(schema).iter_errors(doc))
    assert not errors, [e.message for e in errors]


def test_compose_kvloop_services_through_the_real_cli(tmp_path: Path) -> None:
    doc = interpolate(load(BASE), SHELL_ENV)
    checked = check_compose(doc, tmp_path)
    assert {c.command for c in checked.values()} == {"broker serve", "router", "engine", "sidecar",
                                                      "model fingerprint", "auth init"}
    check_topology(doc, checked)
    check_credentials(doc, checked)
    for name in ("etcd", "otel-collector", "jaeger", "prometheus", "grafana"):
        assert name in doc["services"], name


def test_gpu_override_through_the_real_cli(tmp_path: Path) -> None:
    doc = merge(interpolate(load(BASE), SHELL_ENV), interpolate(load(GPU), SHELL_ENV))
    checked = check_compose(doc, tmp_path)
    check_topology(doc, checked)
    for name, c in checked.items():
        if c.command == "engine":
            svc = doc["services"][name]
            assert svc["build"]["dockerfile"] == "deploy/docker/Dockerfile.gpu"
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            assert devices and devices[0]["capabilities"] == ["gpu"]
            assert isinstance(c.config, EngineConfig) and c.config.block_size == 16
    fingerprint = next(c for c in checked.values() if c.command == "model fingerprint")
    assert fingerprint.argv[fingerprint.argv.index("--block-size") + 1] == "16"


def test_gpu_override_needs_a_model_dir() -> None:
    with pytest.raises(DeployError, match="MODEL_DIR"):
        interpolate(load(GPU), {})


def test_the_checks_catch_mistakes(tmp_path: Path) -> None:
    """The checks above fail on what they are meant to catch."""
    doc = interpolate(load(BASE), SHELL_ENV)
    bad = copy.deepcopy(doc)
    bad["services"]["router"]["command"] = [*bad["services"]["router"]["command"], "--no-such-flag"]
    with pytest.raises(DeployError, match="refused by the kvloop CLI"):
        check_compose(bad, tmp_path / "a")
    bad = copy.deepcopy(doc)
    bad["services"]["router"]["environment"]["KVLOOP_ROUTER_NO_SUCH_FIELD"] = "1"
    with pytest.raises(DeployError, match="not a variable of RouterConfig"):
        check_compose(bad, tmp_path / "b")
    bad = copy.deepcopy(doc)
    bad["services"]["broker-0"]["environment"]["KVLOOP_BROKER_ENGINE_TTL_S"] = "-1"
    with pytest.raises(DeployError, match="engine_ttl_s"):
        check_compose(bad, tmp_path / "c")
    bad = copy.deepcopy(doc)
    bad["services"]["broker-0"]["environment"]["KVLOOP_ROUTER_BROKER"] = "x:1"
    with pytest.raises(DeployError, match="not a variable of BrokerConfig"):
        check_compose(bad, tmp_path / "d")
    bad = copy.deepcopy(doc)
    bad["services"]["sidecar-decode-0"]["command"] = [
        "/run/kvloop/prefill-0/sidecar.sock" if a == "/run/kvloop/decode-0/sidecar.sock" else a
        for a in bad["services"]["sidecar-decode-0"]["command"]]
    with pytest.raises(DeployError, match="kvloop_sidecar_socket"):
        check_topology(bad, check_compose(bad, tmp_path / "e"))


def test_dashboard_uses_real_metric_names() -> None:
    """Every kvloop_* series the Grafana dashboard queries is one the broker, router or sidecar exports."""
    from kvloop.broker.metrics import BrokerMetrics
    from kvloop.engines.sidecar import SidecarMetrics
    from kvloop.router.metrics import RouterMetrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    exported = {family.name + suffix
                for metrics in (BrokerMetrics(), RouterMetrics(), SidecarMetrics())
                for family in metrics.registry.collect() for suffix in suffixes[family.type]}
    dashboard = json.loads((DEPLOY / "observability" / "grafana" / "dashboards" / "kvloop.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\bkvloop_[a-z_]+", e)}
    assert used and used <= exported, f"not exported: {sorted(used - exported)}"
    for wanted in ("kvloop_router_ttft_seconds_bucket", "kvloop_router_prompt_tokens_total",
                   "kvloop_router_pull_bytes_total", "kvloop_broker_evictions_total", "kvloop_broker_retained_blocks"):
        assert wanted in used, wanted
    assert any("vllm:" in e for e in exprs)


GATEWAY = DEPLOY / "compose" / "gateway.yaml"


def test_the_gateway_option_puts_envoy_before_the_router_as_its_picker(schema: dict[str, Any], tmp_path: Path
                                                                       ) -> None:
    """compose/gateway.yaml over the base: valid Compose; its job, run for real, writes the token the router's picker
    reads and a bootstrap that the real Envoy accepts (--mode validate), pointing at the router's ext_proc port and
    listening where the gateway publishes; the engines are named by address (Envoy's ORIGINAL_DST takes no name)."""
    import subprocess

    from kvloop.app.cli import main
    from kvloop.app.gateway import ensure_envoy
    from kvloop.engines.config import default_work_dir

    doc = merge(interpolate(load(BASE), SHELL_ENV), interpolate(load(GATEWAY), SHELL_ENV))
    errors = list(jsonschema.validators.validator_for(schema)(schema).iter_errors(doc))
    assert not errors, [e.message for e in errors]
    services = doc["services"]
    job_argv = kvloop_argv("gateway-config", services["gateway-config"])
    assert job_argv is not None
    local = tmp_path / "gateway"
    argv = [a.replace("/gateway/", f"{local}/") for a in job_argv]
    owner = argv.index("--owner")
    del argv[owner:owner + 2]  # the job's hand-over to uid 10001, which needs root
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv[1:]) == 0
    token = (local / "token").read_text().strip()
    assert len(token) >= 16 and (local / "token").stat().st_mode & 0o077 == 0
    env = {k: str(v).replace("/gateway/", f"{local}/") for k, v in environment(services["router"]).items()}
    router = check_kvloop(kvloop_argv("router", services["router"]) or [], env, "compose service router",
                          stand_ins(tmp_path / "s"))
    assert isinstance(router.config, RouterConfig) and router.config.ext_proc_token() == token.encode()
    mounts = {svc: {str(v).split(":")[1]: str(v).split(":")[0] for v in services[svc].get("volumes", [])}
              for svc in ("gateway-config", "router", "gateway")}
    assert mounts["router"]["/gateway"] == mounts["gateway"]["/gateway"] == mounts["gateway-config"]["/gateway"]
    bootstrap = yaml.safe_load((local / "envoy.yaml").read_text())
    (picker,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "kvloop_picker"]
    address = picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert picker["type"] == "STRICT_DNS" and address["address"] == "router"
    assert address["port_value"] == int(router.config.ext_proc_listen.rsplit(":", 1)[1])
    listener = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    assert [str(p).rsplit(":", 1)[1] for p in services["gateway"]["ports"]] == [str(listener)]
    command = services["gateway"]["command"]
    assert command[command.index("-c") + 1] == "/gateway/envoy.yaml"
    envoy = ensure_envoy(default_work_dir())
    done = subprocess.run([str(envoy), "--mode", "validate", "-c", str(local / "envoy.yaml")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("sidecar-prefill-0", "sidecar-prefill-1", "sidecar-decode-0"):
        argv = services[name]["command"]
        url = argv[argv.index("--engine-url") + 1]
        assert re.fullmatch(r"http://\d+\.\d+\.\d+\.\d+:\d+", url), f"{name}: {url}"


STANDINS = DEPLOY / "compose" / "standins.yaml"
PODMAN = DEPLOY / "compose" / "podman.yaml"
STANDINS_DOCKERFILE = DEPLOY / "compose" / "Dockerfile.standins"


def test_local_overrides_match_the_schema(schema: dict[str, Any]) -> None:
    """deploy/compose/run.sh's files on a machine without a registry: the stand-ins and podman's ulimits."""
    env = {"KVLOOP_NOFILE": "1024", "KVLOOP_NPROC": "1024"}
    validator = jsonschema.validators.validator_for(schema)(schema)
    for path in (STANDINS, PODMAN):
        errors = list(validator.iter_errors(interpolate(load(path), env)))
        assert not errors, f"{path.name}: {[e.message for e in errors]}"
    doc = merge(merge(interpolate(load(BASE), env), interpolate(load(STANDINS), env)), interpolate(load(PODMAN), env))
    errors = list(validator.iter_errors(doc))
    assert not errors, [e.message for e in errors]


def test_local_overrides_stand_in_for_every_third_party_image(tmp_path: Path) -> None:
    base, standins, podman = load(BASE), load(STANDINS), load(PODMAN)
    from tests.deploy.support import dockerfile_stages

    stages = dockerfile_stages(STANDINS_DOCKERFILE)
    pinned = re.compile(r"^[\w.\-/]+:(v?\d+(\.\d+)+[\w.\-]*)$")
    third_party = {name for name, svc in base["services"].items() if "build" not in svc}
    assert third_party == {"etcd", "otel-collector", "jaeger", "prometheus", "grafana"}
    for name in third_party:
        svc = standins["services"][name]
        if "profiles" in svc:                 # no package on the machine: left out, never faked
            assert svc["profiles"] == ["upstream-images"], name
            continue
        assert pinned.match(svc["image"]), svc["image"]
        assert svc["build"]["dockerfile"] == "deploy/compose/Dockerfile.standins"
        assert svc["build"]["target"] in stages, name
    assert set(standins["services"]) == third_party
    # The trace backend takes the collector's name too, so the kvloop services' OTLP endpoint reaches it unchanged.
    endpoints = {svc.get("environment", {}).get("OTEL_EXPORTER_OTLP_ENDPOINT") for svc in base["services"].values()}
    assert endpoints - {None} == {"http://otel-collector:4317"}
    assert "otel-collector" in standins["services"]["jaeger"]["networks"]["kvloop"]["aliases"]
    assert "4317" in " ".join(v for op, v in stages["phoenix"].instructions if op in ("ENV", "EXPOSE"))
    # Phoenix's UI and span API on Jaeger's published port.
    assert standins["services"]["jaeger"]["environment"]["PHOENIX_PORT"] == "16686"
    assert "127.0.0.1:16686:16686" in base["services"]["jaeger"]["ports"]
    # Every service of the base file gets podman's explicit ulimits.
    assert set(podman["services"]) == set(base["services"])
    assert all(set(svc["ulimits"]) == {"nofile", "nproc"} for svc in podman["services"].values())
    # The stand-ins run unprivileged, like the kvloop images.
    for target in ("etcd", "prometheus", "phoenix"):
        user = stages[target].last("USER")
        assert user is not None and user.split(":")[0] not in ("root", "0"), target
