"""The router's HTTP shell: OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` (SSE streaming
and not), ``/v1/models``, ``/health``, ``/metrics``; graceful shutdown.

Bad input is refused before any engine is touched, in OpenAI's error shape: a body that is not JSON or not
an object, too large (413), a missing or mistyped field, an unknown model (404). An engine's own refusal
(a prompt too long for it, say) is passed on with its status; only when no engine can serve does the
client see a 503, and then also in OpenAI's shape.

Security (all optional, off by default): HTTPS from ``tls_cert``/``tls_key`` (with ``tls_ca``, client
certificates required), an API key as ``Authorization: Bearer KEY`` on every path but ``open_paths`` (a
missing or wrong key gets OpenAI's 401 ``invalid_api_key``), TLS or mTLS to the broker (``broker_tls_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvloop.router.config import RouterConfig
from kvloop.router.metrics import RouterMetrics
from kvloop.router.session_calls import session_json
from kvloop.router.sessions import (
    SessionCall,
    SessionError,
    SessionHints,
    check_session_id,
    rest_hints,
    scoped,
    session_call,
)
from kvloop.router.turn import Turn, TurnError, TurnRunner
from kvloop.shared import headers as hdr
from kvloop.shared.config import parse_host_port
from kvloop.shared.grpc_server import GrpcShell, start_grpc_server
from kvloop.shared.http import MEASURED_PREFIX, engine_client_connector
from kvloop.shared.serving import freeze_started_heap, wait_for_stop, write_port_file
from kvloop.shared.tls import TlsFiles
from kvloop.shared.vocabulary import Role

log = structlog.get_logger("kvloop.router")


def error_response(error: TurnError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


def decision_headers(turn: Turn) -> dict[str, str]:
    """What the turn did, for clients and demos (the trace has the same and more): the path actually taken (from
    the engines' measurements; :mod:`kvloop.router.truth`), the plan beside it, and the tokens found in the
    serving engine's own cache, pulled and computed. A DECODE_LOCAL stream's engine account arrives with its last
    chunk: its headers carry the plan's figures with ``x-kvloop-measured: false``, and :func:`measured_comment`
    gives the measured ones before ``[DONE]``. Names: :mod:`kvloop.shared.headers`."""
    return {hdr.DECISION: turn.path, hdr.PLANNED: turn.plan.path,
            hdr.REASON: turn.plan.reason, hdr.DECODE_LOCAL_VETO: turn.plan.veto,
            hdr.PLAN_OUTCOME: turn.plan_vs_actual,
            hdr.MEASURED: str(turn.measured).lower(),
            hdr.PREFILL_ENGINE: turn.outcome.prefill_engine, hdr.DECODE_ENGINE: turn.decode.engine_id,
            hdr.ENGINE_REQUEST: "tokens" if turn.as_tokens is not None else turn.plan.kind, **figures(turn),
            hdr.TIMING: ",".join(f"{k}={v}" for k, v in timing_ms(turn).items())}


def figures(turn: Turn) -> dict[str, str]:
    report = turn.done
    return {hdr.PROMPT_TOKENS: str(turn.plan.prompt_tokens),
            hdr.AVAILABLE_TOKENS: str(turn.plan.available_tokens),
            hdr.MATCHED_TOKENS: str(turn.plan.matched_tokens),
            hdr.PULLED_TOKENS: str(report.pulled_tokens),
            hdr.LOCAL_TOKENS: str(report.local_tokens),
            hdr.COMPUTED_TOKENS: str(report.computed_tokens),
            hdr.PULL_MS: str(report.pull_ms if turn.measured else 0)}


def measured_comment(turn: Turn) -> bytes:
    """An SSE comment (clients ignore it) with a stream's measured figures, sent before ``[DONE]``."""
    body = {hdr.field(hdr.DECISION): turn.path, hdr.field(hdr.PLANNED): turn.plan.path,
            hdr.field(hdr.PLAN_OUTCOME): turn.plan_vs_actual, hdr.field(hdr.MEASURED): turn.measured,
            **{hdr.field(k): int(float(v)) for k, v in figures(turn).items()}}
    return f"{MEASURED_PREFIX}{json.dumps(body, separators=(',', ':'))}\n\n".encode()


def timing_ms(turn: Turn) -> dict[str, float]:
    """The router's steps (``TurnOutcome.timings_ms``) and the prefill engine's own account of its part."""
    out = dict(turn.outcome.timings_ms)
    report = turn.outcome.report
    if report is not None:
        out.update(prefill_queue=report.queue_ms, pull=report.pull_ms, prefill_compute=report.compute_ms)
    return out


def session_of(headers: Mapping[str, str], body: dict[str, Any], tenant: str) -> SessionCall:
    """The turn's session and hints (:mod:`kvloop.router.sessions`), scoped by the caller's tenant; a 400 naming
    the field the router cannot take."""
    try:
        return session_call(headers, body, tenant)
    except SessionError as exc:
        raise exc.turn_error() from None


def validate(kind: str, body: Any, model: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise TurnError(400, "request body must be a JSON object", "invalid_request_error")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise TurnError(400, "model: a model name is required", "invalid_request_error", "model")
    if model and body["model"] != model:
        raise TurnError(404, f"model: the model '{body['model']}' does not exist (this router serves '{model}')",
                        "invalid_request_error", "model")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise TurnError(400, "messages: a non-empty list of {role, content} objects is required",
                            "invalid_request_error", "messages")
    else:
        prompt = body.get("prompt")
        ok = (isinstance(prompt, str) and prompt) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt))
        if not ok:
            raise TurnError(400, "prompt: a non-empty string or list of token ids is required",
                            "invalid_request_error", "prompt")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise TurnError(400, f"{name}: must be a positive integer", "invalid_request_error", name)
    if body.get("n", 1) != 1:
        raise TurnError(400, "n: only n=1 is supported", "invalid_request_error", "n")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise TurnError(400, "stream: must be a boolean", "invalid_request_error", "stream")
    return body


@dataclass
class RunningRouter:
    config: RouterConfig
    runners: dict[str, TurnRunner]
    """Model name -> its pool's turn runner; one entry (keyed by ``config.model``, maybe "") without pools."""
    web_runner: web.AppRunner
    port: int
    _refresher: asyncio.Future[Any]
    _http: aiohttp.ClientSession
    picker: GrpcShell | None = None
    """The endpoint picker's gRPC server (``ext_proc_listen``); None when off."""

    @property
    def runner(self) -> TurnRunner:
        """The one pool's turn runner (with ``pools``: the first pool's)."""
        return next(iter(self.runners.values()))

    @property
    def url(self) -> str:
        host = parse_host_port(self.config.listen, "listen")[0]
        scheme = "https" if self.config.tls_cert is not None else "http"
        return f"{scheme}://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}"

    async def stop(self) -> None:
        log.info("router.stopping")
        self._refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # retrieved, so asyncio logs no "never retrieved"
            await self._refresher
        if self.picker is not None:
            await self.picker.stop(5.0)
        await self.web_runner.cleanup()  # stops accepting, lets in-flight requests finish (shutdown_timeout)
        for runner in self.runners.values():
            await runner.close()
        await self._http.close()
        log.info("router.stopped")


class RouterApp:
    def __init__(self, config: RouterConfig, runners: dict[str, TurnRunner], metrics: RouterMetrics) -> None:
        self.config, self.runners, self.metrics = config, runners, metrics
        self.pooled = bool(config.pools.strip())

    def runner_for(self, body: dict[str, Any]) -> TurnRunner:
        """The turn runner of the request's model: its pool's with ``pools`` (an unknown model is a 404 naming
        the served ones), else the one runner (``validate`` checked the model)."""
        if not self.pooled:
            return next(iter(self.runners.values()))
        runner = self.runners.get(body["model"])
        if runner is None:
            raise TurnError(404, f"model: the model '{body['model']}' does not exist (this router serves "
                                 f"{', '.join(repr(m) for m in sorted(self.runners))})", "invalid_request_error",
                            "model")
        return runner

    async def read_body(self, request: web.Request) -> Any:
        if request.content_length is not None and request.content_length > self.config.max_request_bytes:
            raise self.too_large()
        return self.parse_body(await request.content.read(self.config.max_request_bytes + 1))

    def too_large(self) -> TurnError:
        return TurnError(413, f"request body is larger than {self.config.max_request_bytes} bytes",
                         "invalid_request_error")

    def parse_body(self, raw: bytes) -> Any:
        """A request's body as JSON: 413 past ``max_request_bytes``, 400 when it is not JSON (the router's own
        endpoints and the endpoint picker alike)."""
        if len(raw) > self.config.max_request_bytes:
            raise self.too_large()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise TurnError(400, f"request body is not valid JSON: {exc}", "invalid_request_error") from None

    async def prepare_turn(self, kind: str, raw: Any, headers: Mapping[str, str], tenant: str
                           ) -> tuple[TurnRunner, Turn]:
        """A chat or completions request, checked, with its session, up to its decode (``TurnRunner.prepare``):
        what the router's own endpoints and the endpoint picker both do first."""
        body = validate(kind, raw, self.served_model())
        session = session_of(headers, body, tenant)
        runner = self.runner_for(body)
        turn = await runner.prepare(kind, body, session.scoped_id)
        turn.session = session
        return runner, turn

    def served_model(self) -> str:
        return self.config.model

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.turn(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.turn(request, "completion")

    async def turn(self, request: web.Request, kind: str) -> web.StreamResponse:
        endpoint = "chat" if kind == "chat" else "completions"
        try:
            runner, turn = await self.prepare_turn(kind, await self.read_body(request), request.headers,
                                                   request.get(TENANT, ""))
        except TurnError as exc:
            self.metrics.requests.labels(endpoint, str(exc.status)).inc()
            return error_response(exc)
        if not turn.body.get("stream"):
            try:
                reply = await runner.decode_json(turn)
            except TurnError as exc:
                runner.finish(turn, output_tokens=0, ttft_s=time.perf_counter() - turn.started, error=exc.message)
                self.metrics.requests.labels(endpoint, str(exc.status)).inc()
                return error_response(exc)
            usage = reply.get("usage") or {}
            runner.finish(turn, output_tokens=int(usage.get("completion_tokens", 0)),
                          ttft_s=time.perf_counter() - turn.started)
            self.metrics.requests.labels(endpoint, "200").inc()
            return web.json_response(reply, headers=decision_headers(turn))
        return await self.stream(request, runner, turn, endpoint)

    async def stream(self, request: web.Request, runner: TurnRunner, turn: Turn, endpoint: str
                     ) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        ttft = 0.0
        chunks = 0
        # One write per SSE event (its lines and the blank line that ends it), as the engine sends it: a write per
        # line doubled the router's socket writes and the client's wake-ups on every token.
        event = bytearray()
        try:
            async for line in runner.decode_stream(turn):
                if response is None:
                    runner.first_line(turn)
                    response = web.StreamResponse(headers={"content-type": "text/event-stream",
                                                           "cache-control": "no-cache", **decision_headers(turn)})
                    await response.prepare(request)
                if not line.strip():
                    if event:
                        event += line
                        await response.write(bytes(event))
                        event.clear()
                    continue  # a blank line ending an event already written (or one the router dropped)
                if turn.observe(line):
                    continue  # the usage chunk the router asked for, not the client
                if line.startswith(b"data: {"):
                    chunks += 1
                    ttft = ttft or time.perf_counter() - turn.started
                if line.startswith(b"data: [DONE]") and turn.plan.decode_local:
                    event += measured_comment(turn)
                event += line
        except TurnError as exc:
            runner.finish(turn, output_tokens=0, ttft_s=time.perf_counter() - turn.started, error=exc.message)
            self.metrics.requests.labels(endpoint, str(exc.status)).inc()
            if response is None:
                return error_response(exc)
            cut = bytes(event) + b"\n" if event else b""  # an event cut short, ended before the error's own
            await response.write(cut + f"data: {json.dumps(exc.body())}\n\n".encode())
            return response
        except (ConnectionResetError, aiohttp.ClientError) as exc:
            runner.finish(turn, output_tokens=chunks, ttft_s=ttft, error=f"stream broke: {exc}")
            raise
        runner.finish(turn, output_tokens=chunks, ttft_s=ttft or time.perf_counter() - turn.started)
        self.metrics.requests.labels(endpoint, "200").inc()
        assert response is not None
        await response.write_eof(bytes(event))  # an event the engine did not end with a blank line, as it came
        return response

    # ----------------------------------------------------------------- /v1/sessions/{id}
    def session_path(self, request: web.Request) -> SessionCall:
        tenant = request.get(TENANT, "")
        try:
            session_id = check_session_id(request.match_info["session_id"], "session_id")
        except SessionError as exc:
            raise exc.turn_error() from None
        return SessionCall(session_id, scoped(tenant, session_id), tenant, None)

    async def session_call(self, request: web.Request, action: str) -> web.Response:
        """GET reads the caller's session, POST hints it (a JSON object of hints), DELETE ends it; with pools, at
        every pool's broker."""
        try:
            call = self.session_path(request)
            desks = [r.sessions for r in self.runners.values()]
            if action in ("get", "end"):  # ending what the caller does not hold is a 404, as reading it is
                states = [await desk.get(call) for desk in desks]
                if not any(state.known for state in states):
                    raise TurnError(404, f"session_id: no session {call.session_id!r} of this caller",
                                    "invalid_request_error", "session_id")
            if action != "get":
                hints = SessionHints(end=True) if action == "end" else rest_hints(await self.read_body(request))
                states = [await desk.hint(call, hints, "rest") for desk in desks]
        except SessionError as exc:
            self.metrics.requests.labels("sessions", "400").inc()
            return error_response(exc.turn_error())
        except TurnError as exc:
            self.metrics.requests.labels("sessions", str(exc.status)).inc()
            return error_response(exc)
        self.metrics.requests.labels("sessions", "200").inc()
        known = [state for state in states if state.known] or states
        reply = session_json(call, known[0])
        for key in ("leases", "blocks", "host_blocks"):
            reply[key] = sum(getattr(state, key) for state in states)
        if action == "end":
            reply.update(object="session.deleted", deleted=True,
                         released_leases=sum(state.released_leases for state in states))
        elif action == "hint":
            reply.update(pause_granted_s=min(state.pause_granted_s for state in states),
                         refused=sorted({r for state in states for r in state.refused}))
        return web.json_response(reply)

    async def get_session(self, request: web.Request) -> web.Response:
        return await self.session_call(request, "get")

    async def hint_session(self, request: web.Request) -> web.Response:
        return await self.session_call(request, "hint")

    async def end_session(self, request: web.Request) -> web.Response:
        return await self.session_call(request, "end")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(await self.model_list())

    async def model_list(self) -> dict[str, Any]:
        """``/v1/models``: the served models (also through the endpoint picker)."""
        if self.pooled:
            names = set(self.runners)
        else:
            runner = next(iter(self.runners.values()))
            names = {self.config.model} if self.config.model else runner.directory.models()
            if not names:
                for engine in runner.directory.of_role(Role.DECODE):
                    with contextlib.suppress(Exception):
                        async with runner.http.get(f"{engine.http}/v1/models",
                                                   timeout=aiohttp.ClientTimeout(total=5)) as reply:
                            names |= {m["id"] for m in (await reply.json()).get("data", [])}
                        break
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvloop"} for name in sorted(names)]}

    async def health(self, request: web.Request) -> web.Response:
        """200 when every pool has a prefill and a decode engine; the counts (per pool with ``pools``)."""
        counts = {model: {str(role): len(r.directory.of_role(role)) for role in (Role.PREFILL, Role.DECODE)}
                  for model, r in self.runners.items()}
        ok = all(c[Role.PREFILL] and c[Role.DECODE] for c in counts.values())
        body: dict[str, Any] = {"status": "ok" if ok else "no engines"}
        if self.pooled:
            body["pools"] = counts
        else:
            body.update(next(iter(counts.values())))
        return web.json_response(body, status=200 if ok else 503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"content-type": CONTENT_TYPE_LATEST})

    async def not_found(self, request: web.Request) -> web.Response:
        return error_response(TurnError(404, f"{request.method} {request.path} is not an endpoint of this router",
                                        "invalid_request_error"))


def unauthorized(message: str) -> web.Response:
    """OpenAI's answer to a missing or wrong key: 401, ``invalid_request_error``, code ``invalid_api_key``."""
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    return web.json_response(body, status=401, headers={"WWW-Authenticate": 'Bearer realm="kvloop"'})


TENANT = web.RequestKey("kvloop_tenant", str)
"""The request's key: the caller's tenant (``RouterConfig.api_key_tenants``); absent without API keys."""


def tenant_of(keys: list[tuple[bytes, str]], authorization: str) -> str | None:
    """The tenant of the API key an ``Authorization: Bearer KEY`` value carries; None without one of ``keys``. Each
    key is compared in constant time (``hmac.compare_digest``), all of them every time."""
    scheme, _, token = authorization.partition(" ")
    given = token.strip().encode()
    tenant = None
    for key, name in keys:
        if hmac.compare_digest(given, key) and tenant is None:
            tenant = name
    return tenant if scheme.lower() == "bearer" and given else None


def api_key_middleware(keys: list[tuple[bytes, str]], open_paths: frozenset[str], metrics: RouterMetrics) -> Any:
    """Require ``Authorization: Bearer KEY`` (one of ``keys``, each with its tenant, :func:`tenant_of`) on every path
    but ``open_paths``. The matching key's tenant goes on the request (:data:`TENANT`)."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        authorization = request.headers.get("Authorization", "")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            metrics.requests.labels("auth", "401").inc()
            return unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.")
        tenant = tenant_of(keys, authorization)
        if tenant is None:
            metrics.requests.labels("auth", "401").inc()
            log.info("router.bad_api_key", path=request.path, peer=request.remote)
            return unauthorized("Incorrect API key provided.")
        request[TENANT] = tenant
        return await handler(request)

    return check


async def start_router(config: RouterConfig) -> RunningRouter:
    """Start the router. With ``tls_cert``/``tls_key`` it serves HTTPS (``tls_ca``: client certificates signed by
    it are required); with an API key (``api_key``, ``api_key_file``) every path but ``open_paths`` needs
    ``Authorization: Bearer KEY``; with ``broker_tls_*`` its broker link is TLS. Calls to the engines' HTTP stay
    as their URLs say (plain ``http://`` from the broker; on Kubernetes the mesh's mTLS covers them)."""
    config.validate()
    if config.ext_proc_listen:
        # Through the gateway the decode engine answers the client directly, in the shape it was asked in: no chat
        # turn goes to the engines as token ids (the router would have to turn the answer back into a chat).
        config = replace(config, chat_as_tokens=False)
    metrics = RouterMetrics()
    http = aiohttp.ClientSession(connector=engine_client_connector(256))
    pools = config.pool_brokers()
    runners = ({model: TurnRunner(config.for_pool(model, brokers), http, metrics) for model, brokers in pools.items()}
               if pools else {config.model: TurnRunner(config, http, metrics)})
    await asyncio.gather(*(r.refresh() for r in runners.values()))
    app = RouterApp(config, runners, metrics)
    keys = config.api_key_tenants()
    middlewares = [api_key_middleware(keys, config.open_path_set(), metrics)] if keys else []
    web_app = web.Application(client_max_size=config.max_request_bytes + 1024, middlewares=middlewares)
    web_app.add_routes([web.post("/v1/chat/completions", app.chat), web.post("/v1/completions", app.completions),
                        web.get("/v1/models", app.models), web.get("/v1/sessions/{session_id}", app.get_session),
                        web.post("/v1/sessions/{session_id}", app.hint_session),
                        web.delete("/v1/sessions/{session_id}", app.end_session), web.get("/health", app.health),
                        web.get("/metrics", app.metrics_endpoint), web.route("*", "/{tail:.*}", app.not_found)])
    web_runner = web.AppRunner(web_app, access_log=None, shutdown_timeout=10.0)
    await web_runner.setup()
    host, port = parse_host_port(config.listen, "listen")
    server_tls = TlsFiles.of(config, "tls_")
    ssl_context = server_tls.server_ssl_context() if server_tls.enabled else None
    site = web.TCPSite(web_runner, host, port, ssl_context=ssl_context)
    await site.start()
    bound = web_runner.addresses[0][1]
    refresher: asyncio.Future[Any] = asyncio.gather(*(r.refresh_forever() for r in runners.values()))
    if config.port_file:
        write_port_file(config.port_file, bound)
    log.info("router.listening", address=f"{host}:{bound}", broker=config.broker or None,
             pools={m: r.config.broker for m, r in runners.items()} if pools else None,
             engines=sum(len(r.directory.engines) for r in runners.values()), api_key=bool(keys),
             tls="mutual" if server_tls.mutual else "server" if server_tls.enabled else "off",
             broker_tls=TlsFiles.of(config, "broker_tls_").enabled)
    picker = await start_picker(config, app, keys) if config.ext_proc_listen else None
    freeze_started_heap()
    return RunningRouter(config, runners, web_runner, bound, refresher, http, picker)


async def start_picker(config: RouterConfig, app: RouterApp, keys: list[tuple[bytes, str]]) -> GrpcShell:
    """The endpoint picker's gRPC port (:mod:`kvloop.router.picker`): ext_proc, health and reflection."""
    from kvloop.router import picker
    from kvloop.router.picker_callers import CallerCheck
    from kvloop.v1 import ext_proc_pb2_grpc

    callers = CallerCheck(config.ext_proc_token(), config.mesh_callers())
    servicer = picker.Picker(app, callers, keys)
    shell = await start_grpc_server(
        listen=config.ext_proc_listen, services=[picker.SERVICE],
        add_servicers=lambda server, _port: ext_proc_pb2_grpc.add_ExternalProcessorServicer_to_server(servicer,
                                                                                                      server))
    for name in picker.HEALTH_SERVICES:
        await shell.set_serving(name, True)
    if callers.mesh_callers:
        log.info("router.picker_mesh_callers", callers=sorted(callers.mesh_callers),
                 detail="ext_proc streams whose x-forwarded-client-cert names one of these need no token: the "
                        "port must be reachable only through this pod's mesh sidecar")
    if callers.open:
        log.warning("router.picker_open", detail="dev_open_ext_proc: ext_proc streams are taken from any caller "
                    "(development only)")
    log.info("router.picker_listening", address=f"{config.ext_proc_listen.rsplit(':', 1)[0]}:{shell.port}")
    return shell


async def serve(config: RouterConfig) -> None:
    running = await start_router(config)
    try:
        await wait_for_stop()
    finally:
        await running.stop()
