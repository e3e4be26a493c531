"""The router's one typed config: every field a flag (``--broker``) with an env twin (``KVLOOP_ROUTER_BROKER``)
and a YAML key (``broker``); see :mod:`kvloop.config`."""

from __future__ import annotations

from dataclasses import dataclass

from kvloop.config import ServiceConfig, parse_host_port, setting
from kvloop.telemetry import LOG_FORMATS, LOG_LEVELS


@dataclass(frozen=True)
class RouterConfig(ServiceConfig):
    ENV_PREFIX = "KVLOOP_ROUTER_"

    listen: str = setting("127.0.0.1:8080", "HTTP address of the OpenAI-compatible API, host:port (0 = a free port)")
    broker: str = setting("", "broker address(es) host:port, comma-separated (required)")
    prefill_urls: str = setting("", "fallback prefill engine base URLs, comma-separated, used when the broker "
                                    "is unreachable and knows none (engines are normally learned from it)")
    decode_urls: str = setting("", "fallback decode engine base URLs, comma-separated")
    model: str = setting("", "served model name clients must ask for (default: what the engines serve)")
    max_request_bytes: int = setting(8 * 1024 * 1024, "largest request body accepted, in bytes")
    max_prompt_tokens: int = setting(131072, "longest prompt accepted, in tokens")
    request_timeout_s: float = setting(600.0, "deadline of one engine call")
    broker_timeout_s: float = setting(2.0, "deadline of one broker call; past it the turn recomputes")
    publication_wait_s: float = setting(0.5, "for this long after a turn's answer, a next turn that extends it "
                                             "re-places until the decode's lease of that answer is published "
                                             "(agent loops with no think time); 0 = never wait")
    refresh_s: float = setting(2.0, "how often the engine list is refreshed from the broker")
    port_file: str = setting("", "write the bound HTTP port here once serving (for launchers)")
    console_spans: bool = setting(False, "print OpenTelemetry spans to stderr (OTLP uses OTEL_* variables)")
    log_format: str = setting("auto", "log format: json, console, or auto", choices=LOG_FORMATS)
    log_level: str = setting("info", "log level", choices=LOG_LEVELS)

    def validate(self) -> None:
        parse_host_port(self.listen, "listen")
        self._require(bool(self.broker.strip()) or bool(self.prefill_urls and self.decode_urls), "broker",
                      "is required (or both prefill_urls and decode_urls)")
        for address in self.broker.split(","):
            if address.strip():
                parse_host_port(address.strip(), "broker")
        for name in ("prefill_urls", "decode_urls"):
            for url in self.urls(name):
                self._require(url.startswith(("http://", "https://")), name, "must list http(s) URLs")
        for name in ("max_request_bytes", "max_prompt_tokens"):
            self._require(getattr(self, name) > 0, name, "must be positive")
        self._require(self.publication_wait_s >= 0, "publication_wait_s", "must be 0 or more")
        for name in ("request_timeout_s", "broker_timeout_s", "refresh_s"):
            self._require(getattr(self, name) > 0, name, "must be positive")

    def urls(self, name: str) -> list[str]:
        return [u.strip().rstrip("/") for u in str(getattr(self, name)).split(",") if u.strip()]
