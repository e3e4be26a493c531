"""deploy/k8s: each overlay built with kustomize, every object validated against Kubernetes' own schemas
(kubernetes-validate, strict: unknown fields fail), the InferencePool against the Gateway API Inference Extension's
own CRD (vendored, pinned: deploy/k8s/vendor), Istio and Gateway API objects against a small schema of the fields
used here, and every kvloop container's command and KVLOOP_ variables through the real CLI and configs.

kustomize: ``.kvloop/bin/kustomize`` (built by deploy/local/run.sh set-up when nothing else is there), else
``kustomize`` on PATH, else ``kubectl kustomize`` (kubectl embeds kustomize v5)."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from kvloop.engines.config import EngineConfig
from kvloop.router.config import RouterConfig
from kvloop.shared.config import parse_host_port
from tests.deploy.support import (
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

K8S = DEPLOY / "k8s"
GAIE_CRD = K8S / "vendor" / "gateway-api-inference-extension" / "inference.networking.k8s.io_inferencepools.yaml"
GAIE_CRD_SHA256 = "55e0dbf39c50c4bbdd60106493a4573df4bb44479f9ce46762f1af718883e5cd"  # v1.6.0, SOURCE.md
OVERLAYS = ["cpu-dev", "gpu", "istio"]
KUBERNETES_VERSION = "1.32"
# Values the kubelet would put in for the downward API, to check what the configs make of them.
FIELD_VALUES = {"metadata.name": "kvloop-prefill-7d9f8-x2k4q", "status.podIP": "10.244.1.17"}
# Image name (without tag) -> the Dockerfile stage it is built from.
IMAGES = {"kvloop": (DEPLOY / "docker" / "Dockerfile", "kvloop"),
          "kvloop-engine-cpu": (DEPLOY / "docker" / "Dockerfile", "engine-cpu"),
          "kvloop-engine-gpu": (DEPLOY / "docker" / "Dockerfile.gpu", "engine-gpu")}

_ISTIO_TLS = {"type": "object", "properties": {"mode": {"enum": ["DISABLE", "SIMPLE", "MUTUAL", "ISTIO_MUTUAL"]}},
              "required": ["mode"], "additionalProperties": False}
_META = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                                          "namespace": {"type": "string"}, "labels": {"type": "object"}},
         "required": ["name"], "additionalProperties": False}
_PORT = {"type": "object", "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535},
                                          "name": {"type": "string"},
                                          "protocol": {"enum": ["HTTP", "HTTPS", "GRPC", "HTTP2", "TCP", "TLS"]}},
         "required": ["number"], "additionalProperties": False}


def _istio(api: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
            "properties": {"apiVersion": {"const": api}, "kind": {"type": "string"}, "metadata": _META,
                           "spec": spec}}


# A schema of the Istio fields these manifests use (Istio's CRDs are not in Kubernetes' schemas), closed against
# typos: an unknown field fails as it would in Istio's own validation.
ISTIO_SCHEMAS: dict[str, dict[str, Any]] = {
    "PeerAuthentication": _istio("security.istio.io/v1", {
        "type": "object", "additionalProperties": False, "required": ["mtls"],
        "properties": {"selector": {"type": "object"},
                       "mtls": {"type": "object", "additionalProperties": False, "required": ["mode"],
                                "properties": {"mode": {"enum": ["UNSET", "DISABLE", "PERMISSIVE", "STRICT"]}}}}}),
    "DestinationRule": _istio("networking.istio.io/v1", {
        "type": "object", "additionalProperties": False, "required": ["host"],
        "properties": {"host": {"type": "string"},
                       "trafficPolicy": {"type": "object", "additionalProperties": False,
                                         "properties": {"tls": _ISTIO_TLS}}}}),
    "Gateway": _istio("networking.istio.io/v1", {
        "type": "object", "additionalProperties": False, "required": ["selector", "servers"],
        "properties": {"selector": {"type": "object", "additionalProperties": {"type": "string"}},
                       "servers": {"type": "array", "minItems": 1, "items": {
                           "type": "object", "additionalProperties": False, "required": ["port", "hosts"],
                           "properties": {"port": {**_PORT, "required": ["number", "name", "protocol"]},
                                          "hosts": {"type": "array", "minItems": 1,
                                                    "items": {"type": "string"}}}}}}}),
    "VirtualService": _istio("networking.istio.io/v1", {
        "type": "object", "additionalProperties": False, "required": ["hosts", "http"],
        "properties": {"hosts": {"type": "array", "items": {"type": "string"}},
                       "gateways": {"type": "array", "items": {"type": "string"}},
                       "http": {"type": "array", "items": {
                           "type": "object", "additionalProperties": False, "required": ["route"],
                           "properties": {
                               "match": {"type": "array", "items": {
                                   "type": "object", "additionalProperties": False,
                                   "properties": {"uri": {"type": "object", "minProperties": 1, "maxProperties": 1,
                                                          "additionalProperties": False,
                                                          "properties": {k: {"type": "string"} for k in
                                                                         ("exact", "prefix", "regex")}}}}},
                               "route": {"type": "array", "minItems": 1, "items": {
                                   "type": "object", "additionalProperties": False, "required": ["destination"],
                                   "properties": {"destination": {
                                       "type": "object", "additionalProperties": False, "required": ["host"],
                                       "properties": {"host": {"type": "string"},
                                                      "port": {**_PORT, "required": ["number"]}}},
                                       "weight": {"type": "integer"}}}},
                               "timeout": {"type": "string", "pattern": r"^\d+(\.\d+)?(ms|s|m|h)$"},
                               "retries": {"type": "object", "additionalProperties": False,
                                           "properties": {"attempts": {"type": "integer", "minimum": 0}}}}}}}}),
    "AuthorizationPolicy": _istio("security.istio.io/v1", {
        "type": "object", "additionalProperties": False, "required": ["selector", "action", "rules"],
        "properties": {
            "selector": {"type": "object", "additionalProperties": False, "required": ["matchLabels"],
                         "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}},
            "action": {"enum": ["ALLOW", "DENY", "AUDIT", "CUSTOM"]},
            "rules": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False,
                "properties": {
                    "from": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "required": ["source"],
                        "properties": {"source": {"type": "object", "additionalProperties": False, "minProperties": 1,
                                                  "properties": {k: {"type": "array", "items": {"type": "string"}}
                                                                 for k in ("principals", "namespaces")}}}}},
                    "to": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "required": ["operation"],
                        "properties": {"operation": {
                            "type": "object", "additionalProperties": False, "minProperties": 1,
                            "properties": {k: {"type": "array", "items": {"type": "string"}}
                                           for k in ("ports", "paths", "methods")}}}}}}}}}})
}


def _gateway_api(spec: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
            "properties": {"apiVersion": {"const": "gateway.networking.k8s.io/v1"}, "kind": {"type": "string"},
                           "metadata": _META, "spec": spec}}


_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
# The Gateway API fields these manifests use (its CRDs are not in Kubernetes' schemas either), closed the same way.
GATEWAY_API_SCHEMAS: dict[str, dict[str, Any]] = {
    "Gateway": _gateway_api({
        "type": "object", "additionalProperties": False, "required": ["gatewayClassName", "listeners"],
        "properties": {"gatewayClassName": _NAME, "listeners": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "port", "protocol"],
            "properties": {"name": _NAME, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                           "protocol": {"enum": ["HTTP", "HTTPS", "TLS", "TCP", "UDP"]}}}}}}),
    "HTTPRoute": _gateway_api({
        "type": "object", "additionalProperties": False, "required": ["parentRefs", "rules"],
        "properties": {
            "parentRefs": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["name"],
                "properties": {"group": {"const": "gateway.networking.k8s.io"}, "kind": {"const": "Gateway"},
                               "name": _NAME, "sectionName": _NAME}}},
            "rules": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["backendRefs"],
                "properties": {
                    "matches": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False,
                        "properties": {"path": {"type": "object", "additionalProperties": False,
                                                "required": ["type", "value"],
                                                "properties": {"type": {"enum": ["Exact", "PathPrefix"]},
                                                               "value": {"type": "string", "pattern": "^/"}}}}}},
                    "backendRefs": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False, "required": ["group", "kind", "name"],
                        "properties": {"group": {"const": "inference.networking.k8s.io"},
                                       "kind": {"const": "InferencePool"}, "name": _NAME}}},
                    "timeouts": {"type": "object", "additionalProperties": False,
                                 "properties": {"request": {"type": "string",
                                                            "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}}}}}}}}),
}


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD's structural schema with unknown fields refused (as kubectl's strict field validation refuses them),
    Kubernetes' own extensions left out (jsonschema ignores them; the CEL rules are checked by hand)."""
    out = {k: closed(v) if isinstance(v, dict) and k not in ("properties",) else v
           for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if "properties" in schema:
        out["properties"] = {k: closed(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema:
            out["additionalProperties"] = False
    if isinstance(schema.get("items"), dict):
        out["items"] = closed(schema["items"])
    return out


@functools.cache
def inference_pool_schema() -> dict[str, Any]:
    text = GAIE_CRD.read_bytes()
    assert hashlib.sha256(text).hexdigest() == GAIE_CRD_SHA256, f"{GAIE_CRD} does not match its sha256 (SOURCE.md)"
    crd = yaml.safe_load(text)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert crd["spec"]["names"]["kind"] == "InferencePool" and v1["served"]
    schema = closed(v1["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": "inference.networking.k8s.io/v1"}
    schema["properties"]["metadata"] = _META
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return schema


def check_inference_pool(pool: dict[str, Any]) -> None:
    """The vendored CRD's schema, and its CEL rules (jsonschema has no CEL): target ports unique, and a Service
    picker named with its port."""
    where = f"InferencePool {pool['metadata']['name']}"
    errors = list(jsonschema.Draft7Validator(inference_pool_schema()).iter_errors(pool))
    if errors:
        raise DeployError(f"{where}: {[f'{e.message} at {list(e.path)}' for e in errors]}")
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    if len(set(numbers)) != len(numbers):
        raise DeployError(f"{where}: targetPorts repeat a number")
    picker = pool["spec"].get("endpointPickerRef", {})
    if picker.get("kind", "Service") == "Service" and "port" not in picker:
        raise DeployError(f"{where}: endpointPickerRef: port is required when kind is 'Service' or unspecified")


@functools.cache
def kustomize() -> list[str] | None:
    local = ROOT / ".kvloop" / "bin" / "kustomize"
    if local.is_file() and os.access(local, os.X_OK):
        return [str(local), "build"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    kubectl = shutil.which("kubectl")
    if kubectl and subprocess.run([kubectl, "kustomize", "--help"], capture_output=True, timeout=60).returncode == 0:
        return [kubectl, "kustomize"]
    return None


@functools.cache
def build(directory: str) -> tuple[dict[str, Any], ...]:
    cmd = kustomize()
    if cmd is None:
        pytest.skip("no kustomize: neither .kvloop/bin/kustomize (deploy/local/run.sh set-up builds it), "
                    "kustomize nor kubectl on PATH")
    done = subprocess.run([*cmd, directory], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(cmd)} {directory}: {done.stderr}"
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def pod_specs(objects: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects
            if o["kind"] in ("Deployment", "StatefulSet")}


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command, args and env values ($$ escapes)."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  value)


def container_env(container: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
        else:
            ref = item["valueFrom"].get("fieldRef", {}).get("fieldPath")
            assert ref in FIELD_VALUES, f"{container['name']}: {item['name']} comes from {item['valueFrom']}"
            env[item["name"]] = FIELD_VALUES[ref]
    assert not container.get("envFrom"), f"{container['name']}: envFrom hides variables from these checks"
    return env


def container_argv(container: dict[str, Any]) -> list[str] | None:
    image = container["image"].rsplit(":", 1)[0]
    if image not in IMAGES:
        return None
    stage = final_stage(*IMAGES[image])
    env = container_env(container)
    command = container.get("command", stage.exec_form("ENTRYPOINT") or [])
    args = container.get("args", stage.exec_form("CMD") if "command" not in container else [])
    return [expand(str(a), env) for a in [*command, *(args or [])]]


def check_pods(objects: tuple[dict[str, Any], ...], tmp: Path) -> dict[str, dict[str, Checked]]:
    """Every kvloop container of every pod template through the CLI and configs; {workload: {container: ...}}."""
    paths = stand_ins(tmp)
    out: dict[str, dict[str, Checked]] = {}
    for name, spec in pod_specs(objects).items():
        pod: dict[str, Checked] = {}
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            argv = container_argv(container)
            env = container_env(container)
            where = f"{name}/{container['name']}"
            if argv is None:
                assert not any(k.startswith("KVLOOP_") for k in env), f"{where}: KVLOOP_ vars on a non-kvloop image"
                continue
            if argv[1:3] == ["model", "fingerprint"]:
                pod[container["name"]] = check_kvloop(argv, env, where)
                run_fingerprint(pod[container["name"]], paths)
            else:
                pod[container["name"]] = check_kvloop(argv, env, where, paths)
        out[name] = pod
    return out


def check_objects(objects: tuple[dict[str, Any], ...], tmp: Path) -> None:
    for obj in objects:
        kind, group = obj["kind"], obj["apiVersion"].split("/")[0]
        if kind == "InferencePool":
            check_inference_pool(obj)
            continue
        schema = (GATEWAY_API_SCHEMAS.get(kind) if group == "gateway.networking.k8s.io"
                  else ISTIO_SCHEMAS.get(kind) if group.endswith("istio.io") else None)
        if schema is not None:
            errors = list(jsonschema.Draft7Validator(schema).iter_errors(obj))
            assert not errors, f"{kind} {obj['metadata']['name']}: {[e.message for e in errors]}"
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise DeployError(f"{kind} {obj['metadata']['name']}: {exc.message} at "
                              f"{'/'.join(map(str, exc.path))}") from exc
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    workloads = {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
    checked = check_pods(objects, tmp)
    for name, pod in checked.items():
        spec = workloads[name]["spec"]["template"]["spec"]
        containers = {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}
        for cname, c in pod.items():
            container = containers[cname]
            where = f"{name}/{cname}"
            assert container.get("resources", {}).get("requests"), f"{where}: no resource requests"
            if c.command == "model fingerprint":
                continue
            ports = listening_ports(c)
            declared = {p["containerPort"] for p in container.get("ports", [])}
            assert ports <= declared, f"{where}: listens on {ports}, declares {declared}"
            named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            probes = {k: container.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe")}
            assert all(probes.values()), f"{where}: needs startup, readiness and liveness probes"
            for kind, probe in probes.items():
                assert isinstance(probe, dict)
                picker = isinstance(c.config, RouterConfig) and bool(c.config.ext_proc_listen)
                if c.command in ("broker serve", "sidecar") or picker:
                    assert "grpc" in probe, f"{where}: {kind} must be a gRPC health probe"
                    assert probe["grpc"]["port"] in ports, f"{where}: {kind} on {probe['grpc']['port']}"
                else:
                    assert "httpGet" in probe, f"{where}: {kind} must be an HTTP probe"
                    port = probe["httpGet"]["port"]
                    assert named.get(port, port) in ports, f"{where}: {kind} on {port}"
            if c.command == "sidecar":
                assert probes["readinessProbe"]["grpc"]["service"] == "kvloop.v1.EngineLink"
        engines = [n for n, c in pod.items() if c.command == "engine"]
        if engines:
            engine, sidecar = pod[engines[0]], next(c for c in pod.values() if c.command == "sidecar")
            check_engine_sidecar_pair(engine, sidecar, name, engine_host=FIELD_VALUES["status.podIP"])
            volumes = {v["name"]: v for v in spec["volumes"]}
            socket_dir = str(Path(str(getattr(sidecar.config, "socket", ""))).parent)
            for cname in (engines[0], "sidecar", "fingerprint"):
                mounts = {m["mountPath"]: m["name"] for m in containers[cname]["volumeMounts"]}
                assert socket_dir in mounts and "emptyDir" in volumes[mounts[socket_dir]], \
                    f"{name}/{cname}: {socket_dir} is not the pod's shared emptyDir"
            shm = {m["mountPath"]: m["name"] for m in containers[engines[0]]["volumeMounts"]}.get("/dev/shm")
            assert shm and volumes[shm].get("emptyDir", {}).get("medium") == "Memory", f"{name}: /dev/shm"
            assert isinstance(engine.config, EngineConfig)
            assert spec["terminationGracePeriodSeconds"] > engine.config.stop_timeout_s, f"{name}: too short to drain"
            job = pod["fingerprint"].argv
            for flag in ("--block-size", "--model", "--dtype"):
                assert job[job.index(flag) + 1] == engine.argv[engine.argv.index(flag) + 1], \
                    f"{name}: the fingerprint's {flag} differs from the engine's"
    # Addresses handed to the router and sidecars are Services of this build, on ports their pods listen on.
    listen = {name: set().union(*(listening_ports(c) for c in pod.values())) for name, pod in checked.items()}
    for name, pod in checked.items():
        for c in pod.values():
            for address in str(getattr(c.config, "broker", "") or "").split(","):
                if address:
                    host, port = address.rsplit(":", 1)
                    service_name = host.split(".")[1] if host.count(".") else host
                    assert service_name in services, f"{name}: broker {address}: no Service {service_name}"
                    assert int(port) in listen["kvloop-broker"], f"{name}: broker port {port}"
    for service in services.values():
        for port in service["spec"]["ports"]:
            if "grpc" in port["name"]:
                assert port.get("appProtocol") == "grpc", f"Service {service['metadata']['name']}: {port['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_and_validates(overlay: str, tmp_path: Path) -> None:
    objects = build(str(K8S / "overlays" / overlay))
    check_objects(objects, tmp_path)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for expected in [("StatefulSet", "kvloop-etcd"), ("StatefulSet", "kvloop-broker"), ("Deployment", "kvloop-router"),
                     ("Deployment", "kvloop-prefill"), ("Deployment", "kvloop-decode")]:
        assert expected in kinds, expected


def test_engines_bind_their_cores_by_role_where_they_share_a_node(tmp_path: Path) -> None:
    """The development overlay puts every engine on one node without cpusets: each takes its role's share of the
    node's cores, the binding `kvloop up` and compose use. The base (a node or a cpuset per pod) takes them all."""
    for overlay, expected in (("cpu-dev", "role"), (None, "auto")):
        where = str(K8S / "overlays" / overlay) if overlay else str(K8S / "base")
        pods = check_pods(build(where), tmp_path)
        for name in ("kvloop-prefill", "kvloop-decode"):
            config = pods[name]["engine"].config
            assert isinstance(config, EngineConfig) and config.omp_threads_bind == expected, (overlay, name)


def test_gpu_overlay_asks_for_gpus(tmp_path: Path) -> None:
    specs = pod_specs(build(str(K8S / "overlays" / "gpu")))
    for name in ("kvloop-prefill", "kvloop-decode"):
        engine = next(c for c in specs[name]["containers"] if c["name"] == "engine")
        assert engine["image"].startswith("kvloop-engine-gpu:")
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert not any(e["name"] == "KVLOOP_ENGINE_KV_CACHE_GIB" for e in engine["env"])
        model = next(m for m in engine["volumeMounts"] if m["mountPath"] == "/models/model")
        claim = next(v for v in specs[name]["volumes"] if v["name"] == model["name"])["persistentVolumeClaim"]
        assert claim["claimName"] == "kvloop-model"


def test_istio_overlay(tmp_path: Path) -> None:
    objects = build(str(K8S / "overlays" / "istio"))
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for o in objects:
        by_kind.setdefault(o["kind"], []).append(o)
    assert [p["spec"]["mtls"]["mode"] for p in by_kind["PeerAuthentication"]] == ["STRICT"]
    namespace = by_kind["Namespace"][0]
    assert namespace["metadata"]["labels"]["istio-injection"] == "enabled"
    services = {f"{s['metadata']['name']}.{namespace['metadata']['name']}.svc.cluster.local": s
                for s in by_kind["Service"]}
    rules = {r["spec"]["host"]: r for r in by_kind["DestinationRule"]}
    assert set(rules) == set(services), "one DestinationRule per Service"
    assert all(r["spec"]["trafficPolicy"]["tls"]["mode"] == "ISTIO_MUTUAL" for r in rules.values())
    gateways = {g["metadata"]["name"] for g in by_kind["Gateway"]}
    for vs in by_kind["VirtualService"]:
        assert set(vs["spec"]["gateways"]) <= gateways
        for http in vs["spec"]["http"]:
            for route in http["route"]:
                dest = route["destination"]
                assert dest["host"] in services, dest
                assert dest["port"]["number"] in {p["port"] for p in services[dest["host"]]["spec"]["ports"]}


def test_istio_policies_follow_the_brokers_access_tables() -> None:
    """Each broker RPC is open, by the mesh, to the service account of the caller broker/access.py allows it to, and
    to no other; every workload runs as its kind's service account; an engine's HTTP takes the router (and its own
    sidecar) only; NIXL's ports, which the mesh does not see, take only engine pods."""
    from kvloop.broker.access import ENGINE_RPCS, INSPECT_RPCS, LEASE_RPCS, ROUTER_RPCS

    objects = build(str(K8S / "overlays" / "istio"))
    accounts = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"}
    specs = pod_specs(objects)
    assert {n: specs[n].get("serviceAccountName") for n in specs} == {
        "kvloop-broker": "kvloop-broker", "kvloop-router": "kvloop-router", "kvloop-prefill": "kvloop-engine",
        "kvloop-decode": "kvloop-engine", "kvloop-etcd": None, "kvloop-picker": "kvloop-router"}
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "AuthorizationPolicy"}
    principal = "cluster.local/ns/kvloop/sa/{}".format

    def opened(policy: dict[str, Any], port: str) -> dict[str, set[str]]:
        """source principal ('*' = any) -> paths ('*' = any) it may reach on ``port``."""
        out: dict[str, set[str]] = {}
        for rule in policy["rules"]:
            sources = [p for f in rule.get("from", []) for p in
                       f["source"].get("principals", [f"ns:{n}" for n in f["source"].get("namespaces", [])])]
            for to in rule.get("to", [{"operation": {}}]):
                op = to["operation"]
                if port in op.get("ports", [port]):
                    for source in sources or ["*"]:
                        out.setdefault(source, set()).update(op.get("paths", ["*"]))
        return out

    for p in (pp for policy in policies.values() for rule in policy["rules"] for f in rule.get("from", [])
              for pp in f["source"].get("principals", [])):
        assert p.rsplit("/", 1)[1] in accounts | {GATEWAY_ACCOUNT}, p
    broker = opened(policies["kvloop-broker"], "50051")
    rpc = "/kvloop.v1.KVBroker/{}".format
    assert broker[principal("kvloop-engine")] == {rpc(m) for m in (*ENGINE_RPCS, *LEASE_RPCS)}
    assert broker[principal("kvloop-router")] == {rpc(m) for m in (*ROUTER_RPCS, *INSPECT_RPCS)}
    assert broker[principal("kvloop-operator")] == {rpc("*")}
    assert all(p.startswith(("/grpc.health.v1.", "/grpc.reflection.")) for p in broker["*"]), broker["*"]
    assert set(broker) == {principal("kvloop-engine"), principal("kvloop-router"), principal("kvloop-operator"), "*"}
    engines = opened(policies["kvloop-engines"], "8000")
    assert set(engines) == {principal("kvloop-router"), principal("kvloop-engine"), "ns:observability"}
    assert engines["ns:observability"] == {"/metrics"}
    # The inference gateway: the picker's ext_proc and the decode engines' OpenAI paths, nothing else.
    picker = opened(policies["kvloop-picker"], "9002")
    assert picker == {principal(GATEWAY_ACCOUNT): {"/envoy.service.ext_proc.v3.ExternalProcessor/Process"},
                      "*": {"/grpc.health.v1.Health/*"}}
    assert opened(policies["kvloop-decode-from-gateway"], "8000") == {principal(GATEWAY_ACCOUNT): {"/v1/*"}}
    assert policies["kvloop-decode-from-gateway"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "decode"}
    gateway_reaches = {name for name, policy in policies.items()
                       if any(principal(GATEWAY_ACCOUNT) in f["source"].get("principals", [])
                              for rule in policy["rules"] for f in rule.get("from", []))}
    assert gateway_reaches == {"kvloop-picker", "kvloop-decode-from-gateway"}
    (netpol,) = [o["spec"] for o in objects
                 if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "kvloop-engines"]
    assert netpol["podSelector"] == {"matchLabels": {"app.kubernetes.io/component": "engine"}}
    for rule in netpol["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        if not ports:  # every port, NIXL's included: engine pods only
            assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "engine"}}}]
        else:
            assert 5600 not in ports, rule
    for name in ("kvloop-prefill", "kvloop-decode"):
        labels = next(o for o in objects if o["metadata"]["name"] == name and o["kind"] == "Deployment")[
            "spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == "engine"


GATEWAY_ACCOUNT = "kvloop-inference-istio"
"""The service account istiod gives the Gateway API gateway kvloop-inference (its Deployment: NAME-istio)."""


def test_the_inference_pool_sends_the_gateway_to_the_decode_engines_through_the_picker(tmp_path: Path) -> None:
    """The InferencePool selects the decode engines' pods on their vLLM port, its picker is the picker's Service on
    the port its ext_proc listens on, the route leads from the Gateway to the pool, and the picker admits the
    gateway's mesh identity (and needs no token it could not be sent)."""
    objects = build(str(K8S / "overlays" / "istio"))
    named = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    pool = named[("InferencePool", "kvloop-decode")]
    decode = named[("Deployment", "kvloop-decode")]["spec"]["template"]
    labels = decode["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    engine = check_pods(objects, tmp_path)["kvloop-decode"]["engine"].config
    assert isinstance(engine, EngineConfig)
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [engine.port]
    prefill_labels = named[("Deployment", "kvloop-prefill")]["spec"]["template"]["metadata"]["labels"]
    assert not pool["spec"]["selector"]["matchLabels"].items() <= prefill_labels.items(), "prefill pods in the pool"
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == "FailClose"
    service = named[("Service", ref["name"])]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert port["appProtocol"] == "grpc"
    picker_spec = named[("Deployment", "kvloop-picker")]["spec"]["template"]
    assert service["spec"]["selector"].items() <= picker_spec["metadata"]["labels"].items()
    picker = check_pods(objects, tmp_path / "p")["kvloop-picker"]["picker"].config
    assert isinstance(picker, RouterConfig)
    container = picker_spec["spec"]["containers"][0]
    target = {p["name"]: p["containerPort"] for p in container["ports"]}.get(port["targetPort"], port["targetPort"])
    assert parse_host_port(picker.ext_proc_listen, "ext_proc_listen")[1] == target
    assert picker.mesh_callers() == [f"spiffe://cluster.local/ns/kvloop/sa/{GATEWAY_ACCOUNT}"]
    assert picker.ext_proc_token_file is None and not picker.dev_open_ext_proc
    route = named[("HTTPRoute", "kvloop-inference")]
    gateway = named[("Gateway", "kvloop-inference")]
    assert f"{gateway['metadata']['name']}-istio" == GATEWAY_ACCOUNT and gateway["spec"]["gatewayClassName"] == "istio"
    assert [r["name"] for r in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
    assert {b["name"] for rule in route["spec"]["rules"] for b in rule["backendRefs"]} == {pool["metadata"]["name"]}


def test_the_inference_pool_is_held_to_the_vendored_crd() -> None:
    import copy

    pool = next(o for o in build(str(K8S / "overlays" / "istio")) if o["kind"] == "InferencePool")
    check_inference_pool(pool)
    for spoil, message in [
        (lambda p: p["spec"]["endpointPickerRef"].update(failuremode="FailClose"), "failuremode"),
        (lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Closed"), "Closed"),
        (lambda p: p["spec"].update(targetPortNumber=8000), "targetPortNumber"),  # the pre-GA field
        (lambda p: p["spec"].update(targetPorts=[{"number": 8000}, {"number": 8000}]), "repeat"),
        (lambda p: p["spec"]["endpointPickerRef"].pop("port"), "port is required"),
        (lambda p: p["spec"].pop("selector"), "selector"),
    ]:
        bad = copy.deepcopy(pool)
        spoil(bad)
        with pytest.raises(DeployError, match=message):
            check_inference_pool(bad)


def test_the_checks_catch_mistakes(tmp_path: Path) -> None:
    import copy

    def workload(objs: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
        return next(o for o in objs if o["metadata"]["name"] == name and o["kind"] in ("Deployment", "StatefulSet"))

    objects = build(str(K8S / "overlays" / "cpu-dev"))
    bad = copy.deepcopy(objects)
    router = workload(bad, "kvloop-router")
    router["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "KVLOOP_ROUTER_LISTN", "value": "x"})
    with pytest.raises(DeployError, match="not a variable of RouterConfig"):
        check_objects(tuple(bad), tmp_path / "a")
    bad = copy.deepcopy(objects)
    router = workload(bad, "kvloop-router")
    router["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/x"
    with pytest.raises(DeployError, match="readinessProbe"):
        check_objects(tuple(bad), tmp_path / "b")
    bad = copy.deepcopy(objects)
    decode = workload(bad, "kvloop-decode")
    engine = decode["spec"]["template"]["spec"]["containers"][0]
    engine["args"] = ["--broker" if a == "--log-format" else ("kvloop-broker-0.kvloop-broker:50051" if a == "json"
                                                               else a) for a in engine["args"]]
    with pytest.raises(DeployError, match="spawn its own sidecar"):
        check_objects(tuple(bad), tmp_path / "c")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"apiVersion": "security.istio.io/v1", "kind": "PeerAuthentication",
                             "metadata": {"name": "x"}, "spec": {"mtls": {"mode": "STRICTLY"}}},
                            ISTIO_SCHEMAS["PeerAuthentication"])
