"""A real OTLP/gRPC trace receiver on loopback for tests: the collector's ``TraceService/Export``, keeping every
span it is sent (no fake: the exporters under test speak the real protocol to it)."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    scope: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else str(v)


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request: Any, context: Any) -> Any:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next((_value(a.value) for a in resource_spans.resource.attributes
                                if a.key == "service.name"), "")
                for scope_spans in resource_spans.scope_spans:
                    for s in scope_spans.spans:
                        self.spans.append(ReceivedSpan(
                            service, scope_spans.scope.name, s.name, s.trace_id.hex(), s.span_id.hex(),
                            s.parent_span_id.hex(), {a.key: _value(a.value) for a in s.attributes}))
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)
