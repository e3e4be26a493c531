"""The router's one typed config: every field a flag (``--broker``) with an env twin (``KVLOOP_ROUTER_BROKER``)
and a YAML key (``broker``); see :mod:`kvloop.shared.config`."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

from kvloop.shared.auth import check_token_file, read_shared_token
from kvloop.shared.config import ServiceConfig, parse_host_port, setting
from kvloop.shared.errors import ConfigError
from kvloop.shared.telemetry import DEFAULT_LOG_FORMAT, DEFAULT_LOG_LEVEL, LOG_FORMATS, LOG_LEVELS
from kvloop.shared.tls import check_files


@dataclass(frozen=True)
class RouterConfig(ServiceConfig):
    ENV_PREFIX = "KVLOOP_ROUTER_"

    listen: str = setting("127.0.0.1:8080", "HTTP address of the OpenAI-compatible API, host:port (0 = a free port)")
    broker: str = setting("", "broker address(es) host:port, comma-separated (required, unless pools)")
    pools: str = setting("", "one broker group per model, for a router in front of several model pools: "
                             "MODEL=HOST:PORT[,HOST:PORT...] entries separated by ';' (each pool's replicas); "
                             "requests go to their model's pool, each placed by its own broker group. With pools, "
                             "broker, model, tokenizer and the fallback URLs stay unset (each pool's engines "
                             "tokenize); the broker TLS and token settings serve every pool (one trust root)")
    prefill_urls: str = setting("", "fallback prefill engine base URLs, comma-separated, used when the broker "
                                    "is unreachable and knows none (engines are normally learned from it)")
    decode_urls: str = setting("", "fallback decode engine base URLs, comma-separated")
    model: str = setting("", "served model name clients must ask for (default: what the engines serve)")
    max_request_bytes: int = setting(8 * 1024 * 1024, "largest request body accepted, in bytes")
    max_prompt_tokens: int = setting(131072, "longest prompt accepted, in tokens")
    request_timeout_s: float = setting(600.0, "deadline of one non-streamed engine call (the prefill, a JSON "
                                              "answer): past it the client gets 504 naming it; a stream has none "
                                              "while its bytes flow")
    engine_stall_s: float = setting(60.0, "an engine is taken as frozen (a stopped process accepts connections but "
                                          "never answers) when a stream sends no byte for this long, or when a "
                                          "non-streamed call's engine shows no progress in its step counters for "
                                          "this long: the call goes to another engine, a broken stream resumes "
                                          "there; a busy engine is never cut")
    broker_timeout_s: float = setting(2.0, "deadline of one broker call; past it the turn recomputes")
    publication_wait_s: float = setting(0.5, "for this long after a turn's answer, a next turn that extends it "
                                             "re-places until the decode's lease of that answer is published "
                                             "(agent loops with no think time); 0 = never wait")
    decode_local: bool = setting(True, "let the broker plan DECODE_LOCAL (a decode engine holding the prefix "
                                       "computes a short tail itself); off: strict P/D for this router's turns")
    tokenizer: str = setting("", "the served model's directory or hub name: tokenize in the router with its own "
                                 "tokenizer and chat template (one engine round trip less per turn); empty = "
                                 "ask an engine's /tokenize")
    tokenizer_sessions: int = setting(4096, "sessions whose last rendered prompt the router's tokenizer remembers, "
                                            "to encode only what a session's next turn adds (router/tokenizer.py); "
                                            "0 = encode every prompt whole")
    chat_as_tokens: bool = setting(True, "send a plain chat turn the router rendered to the engine as its token ids "
                                         "(a completions request; answered in the chat shape), so the engine does "
                                         "not render and tokenize it again; tools, logprobs, n > 1 and the like stay "
                                         "chats (router/chat_tokens.py). Off for engines that run a reasoning "
                                         "parser: it splits chat answers the token path would not")
    records_path: Path | None = setting(None, "append one JSON line per finished turn here, for kvloop analyze "
                                              "(lengths, block-key digests, path, tokens, TTFT; no text or token "
                                              "ids); unset = no records")
    residual_window_s: float = setting(30.0, "measure the broker's estimates on this router's turns (per kind of "
                                             "path, seconds to first token beyond the plan's estimate) and send "
                                             "with each placement the median of the last turns within this many "
                                             "seconds (router/residuals.py); 0 = measure and send none")
    residual_samples: int = setting(16, "most recent turns of each kind of path in the measured residual's median")
    drift_log_s: float = setting(0.5, "log router.model_drift when a kind of path's measured residual (how far the "
                                      "broker's cost model is off on this router's turns) goes past this many "
                                      "seconds either way, and router.model_drift_back when it returns within")
    refresh_s: float = setting(2.0, "how often the engine list is refreshed from the broker")
    unlisted_grace_s: float = setting(60.0, "an engine the broker stops listing stays a last resort this long: used "
                                            "when no engine of its role is listed, or after every listed one failed "
                                            "(its sidecar may be down while the engine serves); 0 = never")
    ext_proc_listen: str = setting("", "also serve as the Gateway API Inference Extension's endpoint picker: Envoy's "
                                       "ext_proc gRPC service on this host:port (docs/gateway.md); empty = off")
    ext_proc_token_file: Path | None = setting(None, "file holding the token the gateway sends as 'authorization: "
                                                     "Bearer TOKEN' on ext_proc streams (Envoy: grpc_service's "
                                                     "initial_metadata); required with ext_proc_listen")
    ext_proc_mesh_callers: str = setting("", "comma-separated SPIFFE ids of gateways let in by the mesh: an "
                                             "ext_proc stream whose x-forwarded-client-cert (set by this pod's mesh "
                                             "sidecar after mutual TLS) names one of them needs no token; only "
                                             "where every connection to ext_proc_listen passes such a sidecar "
                                             "(Istio, STRICT mTLS)")
    dev_open_ext_proc: bool = setting(False, "development only: take ext_proc streams from any caller (logged at "
                                             "start)")
    port_file: str = setting("", "write the bound HTTP port here once serving (for launchers)")
    console_spans: bool = setting(False, "print OpenTelemetry spans to stderr (OTLP uses OTEL_* variables)")
    log_format: str = setting(DEFAULT_LOG_FORMAT, "log format: json, console, or auto", choices=LOG_FORMATS)
    log_level: str = setting(DEFAULT_LOG_LEVEL, "log level", choices=LOG_LEVELS)
    tls_cert: Path | None = setting(None, "PEM certificate (chain) of the HTTP port; with tls_key: HTTPS")
    tls_key: Path | None = setting(None, "PEM private key of tls_cert (unencrypted)")
    tls_ca: Path | None = setting(None, "PEM CA bundle: HTTPS clients must present a certificate it signed")
    api_key: str = setting("", "API key clients send as 'Authorization: Bearer KEY' (prefer the env twin or "
                               "api_key_file: a flag shows in ps); empty and no api_key_file = no key",
                           secret=True)
    api_key_file: Path | None = setting(None, "file of accepted API keys, one a line ('#' comments); with "
                                              "api_key both are accepted (rotation)")
    open_paths: str = setting("/health,/metrics", "comma-separated paths served without the API key "
                                                  "(empty: every path needs it)")
    broker_tls_ca: Path | None = setting(None, "PEM CA that signed the broker's certificate: TLS to the broker")
    broker_tls_cert: Path | None = setting(None, "PEM certificate the router presents to a broker with mTLS")
    broker_tls_key: Path | None = setting(None, "PEM private key of broker_tls_cert")
    broker_tls_server_name: str = setting("", "name the broker's certificate must carry, when not the dialled host")
    broker_token_file: Path | None = setting(None, "file holding this router's bearer token for the broker "
                                                   "(role router; kvloop auth token mints one); never the "
                                                   "token in argv")

    def validate(self) -> None:
        parse_host_port(self.listen, "listen")
        if self.pools.strip():
            for name in ("broker", "model", "tokenizer", "prefill_urls", "decode_urls"):
                self._require(not str(getattr(self, name)).strip(), name, "must be unset with pools (each pool "
                                                                            "names its model and broker group)")
            self.pool_brokers()
        else:
            self._require(bool(self.broker.strip()) or bool(self.prefill_urls and self.decode_urls), "broker",
                          "is required (or both prefill_urls and decode_urls, or pools)")
        for address in self.broker.split(","):
            if address.strip():
                parse_host_port(address.strip(), "broker")
        for name in ("prefill_urls", "decode_urls"):
            for url in self.urls(name):
                self._require(url.startswith(("http://", "https://")), name, "must list http(s) URLs")
        for name in ("max_request_bytes", "max_prompt_tokens"):
            self._require(getattr(self, name) > 0, name, "must be positive")
        self._require(self.publication_wait_s >= 0, "publication_wait_s", "must be 0 or more")
        self._require(0 <= self.tokenizer_sessions <= 1_000_000, "tokenizer_sessions", "must be within 0..1000000")
        for name in ("request_timeout_s", "broker_timeout_s", "refresh_s", "engine_stall_s"):
            self._require(getattr(self, name) > 0, name, "must be positive")
        self._require(self.unlisted_grace_s >= 0, "unlisted_grace_s", "must be 0 or more")
        self._require(self.residual_window_s >= 0, "residual_window_s", "must be 0 or more")
        self._require(4 <= self.residual_samples <= 1024, "residual_samples", "must be within 4..1024")
        self._require(self.drift_log_s > 0, "drift_log_s", "must be positive")
        check_files(self, "tls_", server=True)
        check_files(self, "broker_tls_", server=False)
        check_token_file(self, "broker_token_file")
        if self.api_key_file is not None:
            self.api_keys()
        if self.ext_proc_listen:
            parse_host_port(self.ext_proc_listen, "ext_proc_listen")
            self._require(self.ext_proc_token_file is not None or bool(self.mesh_callers())
                          or self.dev_open_ext_proc, "ext_proc_token_file",
                          "the picker checks its caller: set ext_proc_token_file or ext_proc_mesh_callers "
                          "(dev_open_ext_proc opens it for development only)")
            self._require(all(c.startswith("spiffe://") for c in self.mesh_callers()), "ext_proc_mesh_callers",
                          "must list SPIFFE ids such as spiffe://cluster.local/ns/NS/sa/ACCOUNT")
            if self.ext_proc_token_file is not None:
                self.ext_proc_token()
        self._require(all(p.startswith("/") for p in self.open_path_set()), "open_paths",
                      "must list absolute paths such as /health")

    def mesh_callers(self) -> list[str]:
        """The SPIFFE ids of ``ext_proc_mesh_callers``."""
        return [c.strip() for c in self.ext_proc_mesh_callers.split(",") if c.strip()]

    def ext_proc_token(self) -> bytes | None:
        """The token ext_proc callers may send (None: none set)."""
        if self.ext_proc_token_file is None:
            return None
        return read_shared_token(Path(self.ext_proc_token_file), "ext_proc_token_file").encode()

    def api_keys(self) -> list[bytes]:
        """Every accepted API key (``api_key`` and the lines of ``api_key_file``); empty = no key required."""
        return [key for key, _ in self.api_key_tenants()]

    def api_key_tenants(self) -> list[tuple[bytes, str]]:
        """Every accepted API key with its tenant, whose sessions it owns (``kvloop.router.sessions``): a key file's
        line ``KEY TENANT`` names it (two keys of one tenant: rotation keeps its sessions); otherwise the key's own
        fingerprint, ``key-`` and 12 hex digits of its SHA-256."""
        key = self.api_key.strip()
        out = [(key.encode(), key_tenant(key))] if key else []
        if self.api_key_file is not None:
            try:
                lines = Path(self.api_key_file).read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"api_key_file: cannot read {self.api_key_file}: {exc.strerror}",
                                  field="api_key_file") from None
            found = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
            if not found:
                raise ConfigError(f"api_key_file: {self.api_key_file} holds no key", field="api_key_file")
            for line in found:
                key, *named = line.split(None, 1)
                tenant = named[0].strip() if named else key_tenant(key)
                self._require(len(tenant.split()) == 1 and len(tenant) <= 48, "api_key_file",
                              "a line is KEY or KEY TENANT (a tenant is one word of at most 48 characters)")
                out.append((key.encode(), tenant))
        return out

    def pool_brokers(self) -> dict[str, str]:
        """``pools`` as model name -> its broker group's addresses (comma-separated); {} without pools. Raises
        ConfigError naming ``pools`` for an entry that is not MODEL=HOST:PORT[,...] or a model named twice."""
        out: dict[str, str] = {}
        for entry in (e.strip() for e in self.pools.split(";")):
            if not entry:
                continue
            model, eq, addresses = (part.strip() for part in entry.partition("="))
            listed = [a.strip() for a in addresses.split(",") if a.strip()]
            self._require(bool(eq and model and listed), "pools", f"entry {entry!r} is not MODEL=HOST:PORT[,...]")
            self._require(model not in out, "pools", f"model {model!r} is named twice")
            for address in listed:
                parse_host_port(address, "pools")
            out[model] = ",".join(listed)
        return out

    def for_pool(self, model: str, brokers: str) -> RouterConfig:
        """This router's settings for one pool: its model and broker group, everything else shared."""
        return replace(self, pools="", model=model, broker=brokers)

    def open_path_set(self) -> frozenset[str]:
        return frozenset(p.strip() for p in self.open_paths.split(",") if p.strip())

    def urls(self, name: str) -> list[str]:
        return [u.strip().rstrip("/") for u in str(getattr(self, name)).split(",") if u.strip()]


def key_tenant(key: str) -> str:
    """The tenant of an API key the key file names none for: its fingerprint (never the key itself, which would
    show in logs and traces)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
