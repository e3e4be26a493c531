"""Logging and tracing set-up shared by every kvloop service.

Logs: structlog, JSON lines in production (``json``), coloured key=value on a terminal (``console``);
``auto`` picks console when stderr is a TTY. Traces: OpenTelemetry; the OTLP exporter is configured
by the standard ``OTEL_EXPORTER_OTLP_*`` variables when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the traces
variant) is set, and ``console_spans`` prints spans to stderr for local use.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanProcessor

LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_FORMAT = "auto"
"""Every service's ``log_format`` unless configured: console on a TTY, else JSON."""
DEFAULT_LOG_LEVEL = "info"
"""Every service's ``log_level`` unless configured."""


def configure_logging(fmt: str = DEFAULT_LOG_FORMAT, level: str = DEFAULT_LOG_LEVEL) -> None:
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: Any = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def configure_tracing(
    service_name: str, *, console_spans: bool = False, extra: SpanProcessor | None = None
) -> TracerProvider | None:
    """Install a global TracerProvider for this process and return it (shut it down on exit).

    With no exporter configured nothing is installed: spans stay OpenTelemetry's non-recording
    no-ops, which cost a fraction of a recorded span on the broker's hot path. Sampling follows the
    standard ``OTEL_TRACES_SAMPLER`` variables."""
    processors: list[SpanProcessor] = []
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        processors.append(BatchSpanProcessor(OTLPSpanExporter()))
    if console_spans:
        processors.append(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    if extra is not None:
        processors.append(extra)
    if not processors:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    for processor in processors:
        provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    return provider
