"""The sidecar's one typed config: flags, ``KVLOOP_SIDECAR_*`` env twins, YAML; validated at start."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvloop.shared.auth import check_token_file
from kvloop.shared.config import ServiceConfig, parse_host_port, setting
from kvloop.shared.protocol import DEFAULT_HOLD_S
from kvloop.shared.telemetry import DEFAULT_LOG_FORMAT, DEFAULT_LOG_LEVEL, LOG_FORMATS, LOG_LEVELS
from kvloop.shared.tls import check_files
from kvloop.shared.vocabulary import Role

ROLES = tuple(role.value for role in Role)
"""The words of an engine's P/D role: the choices of its ``role`` setting, here and in the launcher's config."""
ZMQ_SCHEMES = ("ipc://", "tcp://")
"""The schemes a KV events endpoint may have (here and in the launcher's config)."""


@dataclass(frozen=True)
class SidecarConfig(ServiceConfig):
    """The home of the defaults the engine launcher's config repeats for the sidecar it runs (``role``,
    ``retention_fraction``, ``lease_ttl_s``): :class:`kvloop.engines.config.EngineConfig` names these."""

    ENV_PREFIX = "KVLOOP_SIDECAR_"

    engine_id: str = setting("", "the engine's NIXL engine id (required)")
    role: Role = setting(Role.BOTH, "the engine's P/D role", choices=ROLES)
    broker: str = setting("", "broker address(es) host:port, comma-separated (required)")
    socket: Path | None = setting(None, "Unix socket the connector attaches to (required)")
    listen: str = setting("127.0.0.1:0", "gRPC health and reflection address, host:port (0 = a free port)")
    advertise: str = setting("", "gRPC address other services reach this sidecar at (default: listen)")
    metrics_listen: str = setting("127.0.0.1:0", "Prometheus metrics address host:port; empty = off")
    engine_url: str = setting("", "the engine's OpenAI server base URL, e.g. http://127.0.0.1:8000 (required)")
    nixl_address: str = setting("", "the engine's NIXL side channel host:port, advertised to readers")
    layout_fingerprint: str = setting("", "layout fingerprint (kvloop model fingerprint; required)")
    served_model: str = setting("", "the model name the engine serves (its --served-model-name): the router sends a "
                                    "request only to engines serving the model it names; empty = any model")
    retention_fraction: float = setting(0.5, "share of the engine's KV blocks the broker may keep retained")
    lease_ttl_s: float = setting(0.0, "TTL asked for each published lease; 0 = the broker's default")
    hold_s: float = setting(DEFAULT_HOLD_S, "safety hold renewed on the engine for live leases; must exceed the "
                                   "broker's engine TTL so the broker drops a silent engine's leases first")
    engine_unresponsive_s: float = setting(30.0, "the engine's /health unanswered this long (a frozen or hung "
                                                 "process): no keep-alives, so the broker lets the engine expire and "
                                                 "places nothing on it; they resume when it answers again")
    pressure_kv_usage: float = setting(0.9, "KV usage (0..1) at which, with requests waiting, the sidecar "
                                            "reports memory pressure")
    kv_events_endpoint: str = setting("", "the engine's KV cache events (vLLM's --kv-events-config endpoint, "
                                          "ipc:// or tcp://): reported to the broker's soft index; empty = off")
    kv_events_replay_endpoint: str = setting("", "the engine's KV events replay endpoint, asked for missed "
                                                 "batches; empty = a gap resets the broker's index instead")
    kv_events_batch_keys: int = setting(512, "most keys in one ReportCacheEvents batch (at most the broker's "
                                             "max_cache_event_keys)")
    kv_events_batch_s: float = setting(0.05, "KV events gathered this long into one ReportCacheEvents batch")
    kv_events_max_blocks: int = setting(262144, "most blocks the prefix-cache mirror tracks; past it the events "
                                                "are taken as inconsistent and the mirror starts over")
    port_file: Path | None = setting(None, "write the bound gRPC port here once serving (for launchers)")
    log_format: str = setting(DEFAULT_LOG_FORMAT, "log format: json, console, or auto", choices=LOG_FORMATS)
    log_level: str = setting(DEFAULT_LOG_LEVEL, "log level", choices=LOG_LEVELS)
    tls_cert: Path | None = setting(None, "PEM certificate (chain) of the gRPC port (listen); with tls_key: TLS on "
                                          "(the connector's Unix socket stays plaintext, private to the pod)")
    tls_key: Path | None = setting(None, "PEM private key of tls_cert (unencrypted)")
    tls_ca: Path | None = setting(None, "PEM CA bundle: gRPC clients of listen must present a certificate it signed")
    broker_tls_ca: Path | None = setting(None, "PEM CA that signed the broker's certificate: TLS to the broker")
    broker_tls_cert: Path | None = setting(None, "PEM certificate presented to the broker; with its mTLS, its CN or "
                                                 "a SAN must name engine_id (the broker's engine_identity)")
    broker_tls_key: Path | None = setting(None, "PEM private key of broker_tls_cert")
    broker_tls_server_name: str = setting("", "name the broker's certificate must carry, when not the dialled host")
    broker_token_file: Path | None = setting(None, "file holding this sidecar's bearer token for the broker "
                                                   "(role engine, subject engine_id; kvloop auth token mints "
                                                   "one); never the token in argv")

    def validate(self) -> None:
        for name in ("engine_id", "broker", "engine_url", "layout_fingerprint"):
            self._require(bool(getattr(self, name)), name, "is required")
        self._require(self.socket is not None and len(str(self.socket)) < 100, "socket",
                      "is required and must be shorter than 100 characters (Unix socket path limit)")
        for address in self.broker.split(","):
            if address.strip():
                parse_host_port(address.strip(), "broker")
        parse_host_port(self.listen, "listen")
        if self.metrics_listen:
            parse_host_port(self.metrics_listen, "metrics_listen")
        if self.nixl_address:
            parse_host_port(self.nixl_address, "nixl_address")
        self._require(self.engine_url.startswith(("http://", "https://")), "engine_url", "must be an http(s) URL")
        self._require(0 < self.retention_fraction <= 1, "retention_fraction", "must be in (0, 1]")
        self._require(self.lease_ttl_s >= 0, "lease_ttl_s", "must be >= 0")
        self._require(self.hold_s > 0, "hold_s", "must be positive")
        self._require(self.engine_unresponsive_s > 0, "engine_unresponsive_s", "must be positive")
        self._require(0 < self.pressure_kv_usage <= 1, "pressure_kv_usage", "must be in (0, 1]")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            self._require(value == "" or value.startswith(ZMQ_SCHEMES), name, "must be an ipc:// or tcp:// address")
        self._require(not self.kv_events_replay_endpoint or bool(self.kv_events_endpoint),
                      "kv_events_replay_endpoint", "needs kv_events_endpoint")
        self._require(1 <= self.kv_events_batch_keys <= 4096, "kv_events_batch_keys", "must be within 1..4096")
        self._require(0 < self.kv_events_batch_s <= 5, "kv_events_batch_s", "must be within (0, 5] seconds")
        self._require(self.kv_events_max_blocks >= 1, "kv_events_max_blocks", "must be positive")
        check_files(self, "tls_", server=True)
        check_files(self, "broker_tls_", server=False)
        check_token_file(self, "broker_token_file")
