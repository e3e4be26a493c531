"""The router as the Gateway API Inference Extension's endpoint picker (protocol v1, docs/gateway.md): Envoy's
ext_proc service in the router's process, placing each request through the broker exactly as the router's own
endpoint does (the same runner: tokenize, place, pin, prefill) and sending Envoy to the decode engine.

One ext_proc stream per HTTP request, the body in ``FULL_DUPLEX_STREAMED`` mode (the placement needs the prompt):
the picker holds the headers until the body's end, runs the turn up to its decode, then answers the headers with
the destination (``x-gateway-destination-endpoint``, the same in the ``envoy.lb`` dynamic metadata) and the body
with the decode request, which carries the plan's transfer parameters (any the client sent are replaced). The
answer then streams from the decode engine through Envoy; the picker adds the turn's ``x-kvloop-*`` headers to it
and closes the turn's books when its headers pass. A P/D turn's prefill runs from the picker, not from a proxy
beside the decode engine (llm-d's way): the plan never leaves the picker, so no header can forge one.

Refusals are Envoy immediate responses in OpenAI's error shape: 401 (API key), 400/404 (the request), 503 (no
engine of the gateway's subset, ``envoy.lb.subset_hint``, can serve it), and the router's own statuses (504...).
The stream's caller must send the ext_proc token (``ext_proc_token_file``) or come through the mesh as one of
``ext_proc_mesh_callers`` (:mod:`.picker_callers`), unless ``dev_open_ext_proc``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlparse

import grpc
import structlog
from google.protobuf import struct_pb2

from kvloop.router.errors import TurnError
from kvloop.router.outcome import Turn
from kvloop.router.picker_callers import CallerCheck
from kvloop.router.plan import decode_request
from kvloop.router.server import decision_headers, tenant_of
from kvloop.router.turn import TurnRunner
from kvloop.v1 import ext_proc_pb2 as ep
from kvloop.v1 import ext_proc_pb2_grpc as ep_grpc

log = structlog.get_logger("kvloop.router.picker")

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("liveness", "readiness", SERVICE)
"""The gRPC health names GAIE asks of a picker."""
DESTINATION = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE, SUBSET = "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset"
BODY_CHUNK = 62_000
"""Bytes per streamed body chunk: under Envoy's 64 KiB gRPC frame budget with the message's own overhead."""
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


def endpoint_of(url: str) -> str:
    """An engine's base URL as the gateway's ``host:port``."""
    parsed = urlparse(url)
    host = f"[{parsed.hostname}]" if parsed.hostname and ":" in parsed.hostname else parsed.hostname
    return f"{host}:{parsed.port or (443 if parsed.scheme == 'https' else 80)}"


def header_map(headers: ep.HeaderMap) -> dict[str, str]:
    return {h.key.lower(): (h.raw_value.decode(errors="replace") if h.raw_value else h.value)
            for h in headers.headers}


def set_headers(values: dict[str, str]) -> ep.HeaderMutation:
    return ep.HeaderMutation(set_headers=[
        ep.HeaderValueOption(header=ep.HeaderValue(key=k, raw_value=v.encode()),
                             append_action=ep.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
        for k, v in values.items()])


def immediate(error: TurnError) -> ep.ProcessingResponse:
    """A refusal Envoy answers itself, in OpenAI's error shape."""
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=ep.HttpStatus(code=error.status), body=json.dumps(error.body()).encode(),
        headers=set_headers({"content-type": "application/json"}), details="kvloop_picker"))


def subset_of(request: ep.ProcessingRequest) -> set[str] | None:
    """The gateway's subset of endpoints (None: no subset named)."""
    metadata = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in metadata or SUBSET not in metadata[SUBSET_NAMESPACE].fields:
        return None
    return {v.string_value for v in metadata[SUBSET_NAMESPACE].fields[SUBSET].list_value.values}


def served_of(request: ep.ProcessingRequest) -> str:
    metadata = request.metadata_context.filter_metadata
    if LB_NAMESPACE in metadata and SERVED in metadata[LB_NAMESPACE].fields:
        return metadata[LB_NAMESPACE].fields[SERVED].string_value
    return ""


def pick_responses(endpoint: str, body: dict[str, Any]) -> list[ep.ProcessingResponse]:
    """The headers' answer (the destination, in the header and the metadata) and the new body, chunked."""
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: endpoint}})
    headers = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=ep.CommonResponse(
        clear_route_cache=True, header_mutation=set_headers({DESTINATION: endpoint,
                                                             "content-type": "application/json"}))),
        dynamic_metadata=metadata)
    raw = json.dumps(body, separators=(",", ":")).encode()
    chunks = [raw[i:i + BODY_CHUNK] for i in range(0, len(raw), BODY_CHUNK)] or [b""]
    return [headers, *(ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
        body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
            body=chunk, end_of_stream=i == len(chunks) - 1))))) for i, chunk in enumerate(chunks))]


class PickerStream:
    """One HTTP request's ext_proc stream."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.headers: dict[str, str] = {}
        self.subset: set[str] | None = None
        self.body = bytearray()
        self.turn: Turn | None = None
        self.runner: TurnRunner | None = None
        self.picked = ""

    async def on(self, request: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            self.headers = header_map(request.request_headers.headers)
            self.subset = subset_of(request)
            if request.request_headers.end_of_stream:  # no body: not a turn
                return [await self.without_body()]
            return []
        if kind == "request_body":
            # At most one byte past the router's limit is kept: enough for parse_body's 413.
            room = self.picker.app.config.max_request_bytes + 1 - len(self.body)
            self.body += request.request_body.body[:max(room, 0)]
            return await self.pick() if request.request_body.end_of_stream else []
        if kind == "request_trailers":
            return [*await self.pick(), ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_headers":
            return [self.answered(header_map(request.response_headers.headers), served_of(request))]
        return []

    async def without_body(self) -> ep.ProcessingResponse:
        """A request with no body: ``GET /v1/models`` is answered by the picker as the router answers it (behind
        the API key); anything else is not served through the picker."""
        method, path = self.headers.get(":method", "?"), self.headers.get(":path", "").split("?")[0]
        try:
            self.picker.tenant(self.headers.get("authorization", ""))
            if (method, path) != ("GET", "/v1/models"):
                raise TurnError(404, f"{method} {path} is not served through the picker", "invalid_request_error")
        except TurnError as exc:
            return immediate(exc)
        return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
            status=ep.HttpStatus(code=200), body=json.dumps(await self.picker.app.model_list()).encode(),
            headers=set_headers({"content-type": "application/json"}), details="kvloop_picker"))

    async def pick(self) -> list[ep.ProcessingResponse]:
        try:
            endpoint, body = await self.plan()
        except TurnError as exc:
            self.picker.app.metrics.requests.labels("picker", str(exc.status)).inc()
            return [immediate(exc)]
        self.picked = endpoint
        return pick_responses(endpoint, body)

    async def plan(self) -> tuple[str, dict[str, Any]]:
        """The turn, up to its decode: the decode engine's endpoint and the decode request."""
        app = self.picker.app
        tenant = self.picker.tenant(self.headers.get("authorization", ""))
        kind = ENDPOINTS.get(self.headers.get(":path", "").split("?")[0])
        if kind is None:
            raise TurnError(404, f"{self.headers.get(':path')} is not served through the picker",
                            "invalid_request_error")
        self.runner, self.turn = runner, turn = await app.prepare_turn(kind, app.parse_body(bytes(self.body)),
                                                                       self.headers, tenant)
        engines = [e for e in turn.plan.decodes if self.subset is None or endpoint_of(e.http) in self.subset]
        if turn.plan.decode_local:
            engines = engines[:1] if engines and engines[0].engine_id == turn.plan.decode.engine_id else []
        if not engines:
            error = TurnError(503, "no decode engine of the gateway's subset can serve the request "
                                   f"(subset {sorted(self.subset or ())})")
            runner.finish(turn, output_tokens=0, ttft_s=time.perf_counter() - turn.started, error=error.message)
            self.turn = None
            raise error
        request, turn.outcome.client_usage = decode_request(turn.plan, turn.engine_body, turn.outcome.decode_params,
                                                                    keep_generated=turn.keeps_generated)
        turn.outcome.decode, turn.outcome.decode_started_ns = engines[0], time.time_ns()
        return endpoint_of(engines[0].http), request

    def answered(self, headers: dict[str, str], served: str) -> ep.ProcessingResponse:
        """The decode engine's answer is on its way: the turn's headers to the client, the turn's books closed."""
        turn, runner = self.turn, self.runner
        if turn is None or runner is None:
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        status = headers.get(":status", "")
        if served and served != self.picked:
            log.info("picker.served_elsewhere", picked=self.picked, served=served)
        runner.finish(turn, output_tokens=0, ttft_s=time.perf_counter() - turn.started,
                      error="" if status == "200" else f"the decode engine answered {status}")
        self.picker.app.metrics.requests.labels("picker", status or "?").inc()
        self.turn = None
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=ep.CommonResponse(
            header_mutation=set_headers(decision_headers(turn)))))

    def close(self) -> None:
        """The stream ended before the answer's headers (the client or the gateway gave up)."""
        if self.turn is not None and self.runner is not None:
            self.runner.finish(self.turn, output_tokens=0, ttft_s=time.perf_counter() - self.turn.started,
                               error="the gateway closed the stream before the decode engine answered")
            self.turn = None


class Picker(ep_grpc.ExternalProcessorServicer):
    def __init__(self, app: Any, callers: CallerCheck, keys: list[tuple[bytes, str]]) -> None:
        self.app, self.callers, self.keys = app, callers, keys
        """``app``: the router's ``RouterApp`` (its runners, metrics and model)."""

    def tenant(self, authorization: str) -> str:
        """The client's tenant from its API key, as the router's own endpoint takes it; 401 without a valid one."""
        if not self.keys:
            return ""
        found = tenant_of(self.keys, authorization)
        if found is None:
            raise TurnError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer KEY'.",
                            "invalid_request_error")
        return found

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ep.ProcessingResponse]:
        metadata = {k: str(v) for k, v in context.invocation_metadata() or ()}
        if refusal := self.callers.refusal(metadata):
            log.info("picker.refused_caller", peer=context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
        stream = PickerStream(self)
        try:
            async for request in request_iterator:
                for response in await stream.on(request):
                    yield response
        finally:
            stream.close()
