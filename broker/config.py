"""The broker's one typed config. Every field is a flag (``--default-ttl-s``) with an env twin
(``KVLOOP_BROKER_DEFAULT_TTL_S``) and a YAML key (``default_ttl_s``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvloop.broker.core import POLICIES, CostAwarePolicy, Limits, PlacementPolicy
from kvloop.shared.auth import read_secrets
from kvloop.shared.config import ServiceConfig, field_default, parse_host_port, process_name, setting
from kvloop.shared.telemetry import DEFAULT_LOG_FORMAT, DEFAULT_LOG_LEVEL, LOG_FORMATS, LOG_LEVELS
from kvloop.shared.tls import check_files

SOFT_INDEX_MAX_BLOCKS = 1 << 24


# The defaults the broker's core declares: each limit and policy figure has one source, the core's dataclass.
def _limit(name: str) -> Any:
    return field_default(Limits, name)


def _policy(name: str) -> Any:
    return field_default(PlacementPolicy, name)


@dataclass(frozen=True)
class BrokerConfig(ServiceConfig):
    ENV_PREFIX = "KVLOOP_BROKER_"

    listen: str = setting("127.0.0.1:50051", "gRPC listen address host:port (port 0 picks a free one)")
    advertise: str = setting("", "address other services use to reach this replica (default: listen)")
    metrics_listen: str = setting("127.0.0.1:9460", "Prometheus /metrics address host:port ('' = off)")
    port_file: Path | None = setting(None, "write the bound gRPC port here once serving (for tests, port 0)")
    store: str = setting("memory", "where state survives: memory (embedded) or etcd", choices=("memory", "etcd"))
    etcd_endpoint: str = setting("127.0.0.1:2379", "etcd client endpoint host:port (store=etcd)")
    etcd_prefix: str = setting("/kvloop/", "etcd key prefix; one per broker cluster")
    replica_id: str = setting("", "this replica's id in leader election (default: host-pid)")
    leader_ttl_s: int = setting(5, "leader lease TTL in seconds; failover takes up to this long")
    default_ttl_s: float = setting(_limit("default_ttl_s"),
        "retention TTL of a lease published without one (upstream's 480 s)")
    min_ttl_s: float = setting(_limit("min_ttl_s"), "smallest retention TTL accepted")
    max_ttl_s: float = setting(_limit("max_ttl_s"), "largest retention TTL accepted")
    default_pin_timeout_s: float = setting(_limit("default_pin_timeout_s"), "pin timeout when a reader gives none")
    max_pin_timeout_s: float = setting(_limit("max_pin_timeout_s"), "largest pin timeout accepted")
    engine_ttl_s: float = setting(_limit("engine_ttl_s"), "an engine silent this long is dropped with its leases")
    keepalive_interval_s: float = setting(3.0, "keep-alive period the broker asks engines for")
    max_block_keys: int = setting(_limit("max_block_keys"),
        "most block keys in one request (8192 x 128 tokens = 1M tokens)")
    max_message_bytes: int = setting(4 * 1024 * 1024, "largest gRPC message accepted, in bytes")
    max_id_len: int = setting(_limit("max_id_len"), "longest engine, session, lease or pin id accepted")
    eviction_log_size: int = setting(_limit("eviction_log_size"),
        "eviction commands kept per engine for replay on reconnect")
    soft_index_max_blocks: int = setting(_limit("soft_index_max_blocks"),
        "soft index: most block keys kept per engine from its prefix-cache events (the oldest-stored go "
        "first); memory only")
    max_cache_event_keys: int = setting(_limit("max_cache_event_keys"),
        "most stored (and most removed) keys in one ReportCacheEvents batch")
    host_ttl_s: float = setting(_limit("host_ttl_s"),
        "retention TTL of a lease once demoted to its engine's host tier (0 = the lease's own TTL)")
    demotion_timeout_s: float = setting(_limit("demotion_timeout_s"),
        "a demotion the engine has not reported done in this long is dropped, its host slots freed")
    max_sessions: int = setting(_limit("max_sessions"), "sessions: most hinted sessions the broker keeps (memory "
        "only; a hint past it is refused RESOURCE_EXHAUSTED)")
    max_sessions_per_owner: int = setting(_limit("max_sessions_per_owner"),
        "sessions: most hinted sessions one owner (a router's tenant) holds")
    max_high_sessions_per_owner: int = setting(_limit("max_high_sessions_per_owner"),
        "sessions: most high-priority sessions one owner holds (a hint past it is granted normal)")
    max_session_pause_s: float = setting(_limit("max_session_pause_s"),
        "sessions: longest pause granted (a longer one is granted this long, and the reply says so)")
    session_resume_margin_s: float = setting(_limit("session_resume_margin_s"),
        "sessions: a pause keeps the session's leases this long past the stated resume")
    session_idle_s: float = setting(_limit("session_idle_s"),
        "sessions: a session not hinted this long (after its pause) is forgotten")
    session_end_memory_s: float = setting(_limit("session_end_memory_s"),
        "sessions: an ended session is remembered this long, so its last turn's lease is freed as it arrives")
    session_prefetch_lead_s: float = setting(_limit("session_prefetch_lead_s"),
        "sessions: this long before a paused session's stated resume, its host-tier lease is promoted back into "
        "the pool where the retention budget has room or leases lower in the eviction order hold it (0 = never)")
    eviction_policy: str = setting("cost", "victim choice: cost (cheapest to recompute per block) or lru",
                                   choices=POLICIES)
    recency_half_life_s: float = setting(CostAwarePolicy.recency_half_life_s,
        "cost policy: a lease's value halves every this many idle seconds")
    threshold_tokens: int = setting(_policy("threshold_tokens"),
        "recompute below this many matched tokens (upstream's default)")
    default_bandwidth_bytes_per_s: float = setting(_policy("default_bandwidth_bytes_per_s"),
        "NIXL bandwidth assumed until engines report one")
    default_prefill_tokens_per_s: float = setting(_policy("default_prefill_tokens_per_s"),
        "prefill throughput assumed until engines report one")
    default_bytes_per_block: int = setting(_policy("default_bytes_per_block"),
        "KV bytes per block assumed until engines report it")
    transfer_overhead_s: float = setting(_policy("transfer_overhead_s"),
        "fixed cost of one pull (handshake, notifications, extra step)")
    sticky_load_gap: float = setting(_policy("sticky_load_gap"),
        "keep a session on the decode engine holding its own history unless it has this many more requests")
    shared_prefix_load_gap: float = setting(_policy("shared_prefix_load_gap"),
        "keep a new session on a decode engine holding only a shared prefix (a system prompt) unless it has "
        "this many more requests than the least loaded")
    pd_hop_s: float = setting(_policy("pd_hop_s"),
        "cost model: fixed seconds of the P/D hop (prefill round trip, the decode's read of the new blocks, "
        "its first step), measured on the benchmark")
    queue_penalty_s: float = setting(_policy("queue_penalty_s"),
        "cost model: estimated wait per request running or queued on an engine")
    decode_local: bool = setting(_policy("decode_local"),
        "allow DECODE_LOCAL: a decode engine holding the prefix computes a short tail itself (off: strict "
        "disaggregation)")
    decode_local_max_tokens: int = setting(_policy("decode_local_max_tokens"),
        "DECODE_LOCAL only for an uncached tail of at most this many tokens")
    decode_local_max_share: float = setting(_policy("decode_local_max_share"),
        "DECODE_LOCAL only when the tail is at most this share of the prompt")
    decode_local_stall_budget_s: float = setting(_policy("decode_local_stall_budget_s"),
        "DECODE_LOCAL only while the tail's compute time times the decode engine's streams is at most this many "
        "stream-seconds, none queued (the busy veto: a tail never holds up the streams for more)")
    relief_stall_budget_s: float = setting(_policy("relief_stall_budget_s"),
        "the busy veto's budget, in stream-seconds, for a prompt only prefill relief puts on the decode engine")
    prefill_relief: bool = setting(_policy("prefill_relief"),
        "let a decode engine compute a prompt of any length (or one it holds nothing of) when every other prefill "
        "engine's counted queue alone outlasts its compute there; the stall and step vetoes still apply")
    decode_stall_weight: float = setting(_policy("decode_stall_weight"),
        "cost model: DECODE_LOCAL's price per stream-second its tail holds up the decode engine's streams")
    least_loaded_candidates: int = setting(_policy("least_loaded_candidates"),
        "placement prices the engines holding a prompt's prefix plus this many of the least loaded of each role")
    placed_s: float = setting(_policy("placed_s"), "a placement counts on its engines for this long, until the "
                              "router's own counts hold it (each Place of a burst sees the ones before it)")
    measured_residuals: bool = setting(_policy("measured_residuals"),
        "cost model: add each router's measured residuals (how much longer than estimated its recent P/D and "
        "DECODE_LOCAL turns took to the first token) to the paths of their kind; off: the idle estimates alone")
    residual_bound_s: float = setting(_policy("residual_bound_s"), "cost model: the most a router's residual moves "
                                      "a path's price, either way (beyond it the broker counts the residual clipped)")
    in_flight_ttl_s: float = setting(_policy("in_flight_ttl_s"), "a router's counts of its requests in flight "
                                     "stand for this long after its last placement (they price load and veto)")
    tick_interval_s: float = setting(0.25, "how often leases, pins and engines are checked for expiry")
    shutdown_grace_s: float = setting(5.0, "on SIGTERM, how long in-flight RPCs may finish")
    tls_cert: Path | None = setting(None, "PEM certificate (chain) of the gRPC port; with tls_key: TLS on")
    tls_key: Path | None = setting(None, "PEM private key of tls_cert (unencrypted)")
    tls_ca: Path | None = setting(None, "PEM CA bundle: every client must present a certificate it signed "
                                        "(mutual TLS), and engine calls are checked against the caller's identity")
    auth_secret_file: Path | None = setting(None, "file of the cluster secret (one per line: the first signs, any "
                                                  "verifies) that callers' bearer tokens are checked with "
                                                  "(kvloop.shared.auth); never the secret itself in argv")
    dev_no_auth: bool = setting(False, "DEVELOPMENT ONLY: accept every caller unchecked when neither tokens "
                                       "(auth_secret_file) nor mutual TLS (tls_ca) is set; logged at start")
    engine_identity: str = setting("{engine_id}", "mTLS: the certificate name (CN or SAN) that may act for an "
                                                  "engine, {engine_id} replaced by the engine's id")
    allowed_engines: str = setting("", "mTLS: comma-separated engine ids that may register and act "
                                       "('' = any id whose certificate names it)")
    client_identities: str = setting("", "mTLS: comma-separated certificate names allowed Place, PlaceStream, "
                                         "PinBlocks, CompleteTransfer and Inspect ('' = any certificate signed "
                                         "by tls_ca)")
    admin_identities: str = setting("", "mTLS: comma-separated certificate names allowed every call for any "
                                        "engine (operators, benchmarks)")
    log_format: str = setting(DEFAULT_LOG_FORMAT, "log format: json, console, or auto (console on a TTY)",
                              choices=LOG_FORMATS)
    log_level: str = setting(DEFAULT_LOG_LEVEL, "log level", choices=LOG_LEVELS)
    console_spans: bool = setting(False, "print OpenTelemetry spans to stderr (OTLP uses OTEL_* variables)")

    def validate(self) -> None:
        parse_host_port(self.listen, "listen")
        if self.advertise:
            parse_host_port(self.advertise, "advertise")
        if self.metrics_listen:
            parse_host_port(self.metrics_listen, "metrics_listen")
        if self.store == "etcd":
            parse_host_port(self.etcd_endpoint, "etcd_endpoint")
        self._require(self.etcd_prefix.startswith("/") and self.etcd_prefix.endswith("/"), "etcd_prefix",
                      "must start and end with '/'")
        self._require(self.leader_ttl_s >= 2, "leader_ttl_s", "must be at least 2 seconds")
        for name in ("default_ttl_s", "min_ttl_s", "max_ttl_s", "default_pin_timeout_s", "max_pin_timeout_s",
                     "engine_ttl_s", "keepalive_interval_s", "recency_half_life_s", "tick_interval_s",
                     "default_bandwidth_bytes_per_s", "default_prefill_tokens_per_s"):
            self._require(getattr(self, name) > 0, name, "must be positive")
        self._require(self.min_ttl_s <= self.max_ttl_s, "max_ttl_s", "must be at least min_ttl_s")
        self._require(self.min_ttl_s <= self.default_ttl_s <= self.max_ttl_s, "default_ttl_s",
                      "must lie within min_ttl_s..max_ttl_s")
        self._require(self.default_pin_timeout_s <= self.max_pin_timeout_s, "default_pin_timeout_s",
                      "must not exceed max_pin_timeout_s")
        self._require(self.keepalive_interval_s < self.engine_ttl_s, "keepalive_interval_s",
                      "must be shorter than engine_ttl_s")
        for name in ("max_block_keys", "max_message_bytes", "max_id_len", "eviction_log_size",
                     "default_bytes_per_block"):
            self._require(getattr(self, name) > 0, name, "must be positive")
        self._require(self.max_message_bytes >= 64 * 1024, "max_message_bytes", "must be at least 65536")
        # ~100 bytes a key in memory: the top of the range is ~1.6 GiB for one engine.
        self._require(1 <= self.soft_index_max_blocks <= SOFT_INDEX_MAX_BLOCKS, "soft_index_max_blocks",
                      f"must be within 1..{SOFT_INDEX_MAX_BLOCKS}")
        # 34 bytes a key on the wire: a batch over max_message_bytes is refused by gRPC itself.
        self._require(1 <= self.max_cache_event_keys <= 65536, "max_cache_event_keys", "must be within 1..65536")
        for name in ("threshold_tokens", "transfer_overhead_s", "sticky_load_gap", "shared_prefix_load_gap",
                     "shutdown_grace_s", "pd_hop_s",
                     "queue_penalty_s", "decode_local_max_tokens", "decode_local_stall_budget_s",
                     "relief_stall_budget_s",
                     "decode_stall_weight", "placed_s"):
            self._require(getattr(self, name) >= 0, name, "must not be negative")
        self._require(self.host_ttl_s == 0 or self.min_ttl_s <= self.host_ttl_s <= self.max_ttl_s, "host_ttl_s",
                      "must be 0 or lie within min_ttl_s..max_ttl_s")
        self._require(self.demotion_timeout_s > 0, "demotion_timeout_s", "must be positive")
        for name in ("max_sessions", "max_sessions_per_owner", "session_idle_s", "session_end_memory_s"):
            self._require(getattr(self, name) > 0, name, "must be positive")
        self._require(self.max_sessions_per_owner <= self.max_sessions, "max_sessions_per_owner",
                      "must not exceed max_sessions")
        self._require(0 <= self.max_high_sessions_per_owner <= self.max_sessions_per_owner,
                      "max_high_sessions_per_owner", "must lie within 0..max_sessions_per_owner")
        for name in ("max_session_pause_s", "session_resume_margin_s", "session_prefetch_lead_s"):
            self._require(getattr(self, name) >= 0, name, "must not be negative")
        self._require(0 < self.decode_local_max_share <= 1, "decode_local_max_share", "must be in (0, 1]")
        # The wire refuses residuals past 60 s (kvloop.shared.protocol.MAX_RESIDUAL_S): a bound beyond it binds nothing.
        self._require(0 <= self.residual_bound_s <= 60, "residual_bound_s", "must lie within 0..60 seconds")
        self._require(1 <= self.least_loaded_candidates <= 64, "least_loaded_candidates", "must be within 1..64")
        check_files(self, "tls_", server=True)
        if self.auth_secret_file is not None:
            self._require(Path(self.auth_secret_file).is_file(), "auth_secret_file", "must be an existing file")
            try:
                read_secrets(Path(self.auth_secret_file))
            except ValueError as exc:
                self._require(False, "auth_secret_file", str(exc))
        self._require("{engine_id}" in self.engine_identity, "engine_identity", "must contain {engine_id}")

    def require_auth(self) -> None:
        """Refuse to serve with no check of callers unless ``dev_no_auth`` says so (called at start, not by
        :meth:`validate`: a config is also a value that tests and tools build)."""
        self._require(self.auth_secret_file is not None or self.mutual_tls or self.dev_no_auth, "auth_secret_file",
                      "the broker authenticates its callers: set auth_secret_file (tokens) or tls_cert, tls_key and "
                      "tls_ca (mutual TLS); dev_no_auth (--dev-no-auth) opens it for development only")

    @property
    def mutual_tls(self) -> bool:
        """TLS with client certificates required: callers are authorized by identity (broker.access)."""
        return self.tls_cert is not None and self.tls_key is not None and self.tls_ca is not None

    @property
    def advertised(self) -> str:
        return self.advertise or self.listen

    @property
    def replica(self) -> str:
        return self.replica_id or process_name()

    def limits(self) -> Limits:
        """The core's limits, from the fields of the same names."""
        return Limits(**self._core_fields(Limits))

    def placement(self) -> PlacementPolicy:
        """The core's placement policy, from the fields of the same names."""
        return PlacementPolicy(**self._core_fields(PlacementPolicy))

    def _core_fields(self, cls: type) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(cls) if hasattr(self, f.name)}
