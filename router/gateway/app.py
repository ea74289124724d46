"""The OpenAI-compatible HTTP app over one `Backend` (DESIGN §8). All state lives in the app it builds.

    POST /v1/completions, /v1/chat/completions   generation (JSON or SSE); `session_id`: a session's turn
    POST /v1/sessions, DELETE /v1/sessions/{id}  streaming sessions (sessions.py; API key as /v1)
    GET  /v1/models                              the served model
    GET  /health                                 200 while a decode or colocated worker is alive (readiness.py)
    GET  /health/ready                           a real one-token generation, cached (readiness.py)
    GET  /metrics                                Prometheus text exposition of this app's registry (API key as /v1)
    GET  /debug/workers                          each worker's last reported state (API key as /v1)
    POST /admin/restart                          a rolling restart of the workers (admin.py; API key as /v1)
    GET  /openapi.json                           the OpenAPI document of all of these (openapi.py)

Every request first passes the Host/Origin check (403, hosts.py). A generation request then passes,
in order: API key (401) -> draining (503) -> a JSON Content-Type (415) -> body within
`body_timeout_s` (408) and `max_body_bytes` (413) -> JSON and schema (400/404) -> in-flight limit
(429) -> backend start (its error's status) -> response. The in-flight slot is taken only once the
body is read and valid, so slow or broken uploads never hold what served requests need.
A turn of a streaming session also passes, after its JSON: the session exists (404) -> its prompt
within the session's capacity (400) -> in-flight limit (429) -> no other turn of it running (409).
Set `app.state.draining = True` to refuse new /v1 requests with 503 + Retry-After while the ones in
flight finish; `app.state.gateway.num_in_flight` says how many are left.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import ClientDisconnect

from common.config import SamplingDefaults, SamplingParams
from kernels.model.tokenizer import encode_prompt
from router.gateway import openapi
from router.gateway.admin import RestartWorkers, add_admin_routes
from router.gateway.config import GatewayConfig
from router.gateway.errors import CLIENT_DISCONNECT, APIError, install_handlers, internal
from router.gateway.hosts import HostGuard, HostPolicy
from router.gateway.json_body import check_json_content_type, parse_json_object
from router.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from router.gateway.openapi import errors, generation_responses, openapi_document, request_models, session_request_model
from router.gateway.readiness import ReadinessProbe, serving_workers_alive
from router.gateway.responses import SHAPES
from router.gateway.schema import Endpoint, GenerateRequest, ModelLimits, parse_chat, parse_completion, parse_session
from router.gateway.sessions import GatewaySession, GatewaySessions, SessionTurn, parse_turn
from router.gateway.siblings import Siblings
from router.gateway.streaming import GenerationRun, SSEResponse, choice_of, sse_frames, unless_disconnected
from router.gateway.structured import check_grammar
from router.gateway.tokenize import DetokenizeResponse, TokenizeResponse, detokenize, tokenize, tokenize_request_models
from router.gateway.tool_parsers import parser_for

log = logging.getLogger(__name__)

DRAINING_RETRY_AFTER_S = 5.0
CLIENT_CLOSED_STATUS = 499  # nobody reads it: the client is gone; it only shows in access logs
_PARSERS: dict[Endpoint, Callable[..., GenerateRequest]] = {Endpoint.COMPLETION: parse_completion,
                                                              Endpoint.CHAT: parse_chat}


class Gateway:
    """The request handling of one app: admission, parsing, and runs through the backend."""

    def __init__(self, backend: Any, config: GatewayConfig, state: Any, sampling: SamplingDefaults):
        self.backend, self.config, self._state = backend, config, state
        self.served_name = config.served_model_name or backend.model_name
        self.limits = ModelLimits(self.served_name, backend.max_model_len, len(backend.tokenizer),
                                  config.default_max_tokens, config.max_prompt_tokens, sampling,
                                  parser_for(config.tool_call_parser,
                                             getattr(backend.tokenizer, "chat_template", None)))
        self.metrics = GatewayMetrics(backend, getattr(backend, "extra_collectors", ()), config.slow_request_log_s)
        self._probe_metrics = GatewayMetrics(backend)  # readiness probes are not traffic: never scraped
        self.created = int(time.time())
        self.num_in_flight = 0
        self.readiness = ReadinessProbe(self._one_token, config.ready_interval_s, config.ready_timeout_s)
        self.sessions = GatewaySessions(backend)

    # ---- admission -----------------------------------------------------------------------------
    def check_api_key(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.config.api_key.encode()):
            raise APIError(401, "a valid API key is required: `Authorization: Bearer <key>`",
                           code="invalid_api_key")

    def check_not_draining(self) -> None:
        if self._state.draining:
            raise APIError(503, "the server is shutting down", code="draining", retry_after_s=DRAINING_RETRY_AFTER_S)

    def admit(self) -> Callable[[], None]:
        """Take an in-flight slot; returns its release (call exactly once). Raises 503/429."""
        self.check_not_draining()
        if self.num_in_flight >= self.config.max_pending_requests:
            raise APIError(429, f"more than {self.config.max_pending_requests} requests in flight; retry later",
                           code="too_many_pending_requests", retry_after_s=1.0)
        self.num_in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            assert not released, "in-flight slot released twice"
            released = True
            self.num_in_flight -= 1
        return release

    async def read_body(self, request: Request) -> bytes:
        """The body; 413 as soon as it is known to exceed `max_body_bytes` (declared or actually read),
        408 when it is not complete within `body_timeout_s`. `ClientDisconnect` when the client left."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise _too_large(limit)
        parts, size = [], 0
        with anyio.move_on_after(self.config.body_timeout_s) as deadline:
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise _too_large(limit)
                parts.append(part)
        if deadline.cancelled_caught:
            raise APIError(408, f"the request body did not arrive within {self.config.body_timeout_s} s",
                           code="request_timeout", close_connection=True)
        return b"".join(parts)

    # ---- generation ----------------------------------------------------------------------------
    async def generate(self, request: Request, endpoint: Endpoint) -> Response:
        """Serve one generation request. Failures before the run starts are counted here; after that,
        by the run. The in-flight slot and the run pass to a streaming response when one is returned."""
        release: Callable[[], None] | None = None
        run: GenerationRun | Siblings | None = None
        turn: SessionTurn | None = None
        try:
            self.check_api_key(request)
            self.check_not_draining()
            check_json_content_type(request)
            body = await self.read_body(request)
            arrival_s = time.monotonic()  # latency is the server's: from the whole request, not its upload
            payload = parse_json_object(body)
            session = await self.sessions.for_turn(payload)
            parsed = self._parse(endpoint, payload, session)
            if parsed.params.grammar is not None:
                await check_grammar(parsed.params.grammar, parsed.grammar_param)
            release = self.admit()
            shape = SHAPES[endpoint](self.served_name, self.backend.tokenizer)
            if session is not None:  # no await since for_turn: no other turn of it can start meanwhile
                turn = self.sessions.begin_turn(session, shape.id, parsed)
            if parsed.n > 1 or parsed.more_prompts:  # never a session turn: it continues one conversation
                run = Siblings(self.backend, shape.id, parsed, self.metrics, arrival_s)
            else:
                run = GenerationRun(self.backend, shape.id, parsed, self.metrics, arrival_s,
                                    on_end=turn.end if turn is not None else None)
            started, _ = await unless_disconnected(request.receive, run.start)
            if not started:
                return Response(status_code=CLIENT_CLOSED_STATUS)
            if parsed.stream:
                response = self._stream(run, shape, parsed, release, turn)
                release, run, turn = None, None, None  # owned by the response now
                return response
            return await self._complete(request, run, shape, parsed)
        except APIError as err:
            return self._count(run, err).response()
        except ClientDisconnect:  # gone mid-upload: nobody to answer, and nothing went wrong here
            log.info("client disconnected before its request body was complete")
            self.metrics.failure.labels(kind=CLIENT_DISCONNECT).inc()
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except Exception as exc:  # noqa: BLE001 - a bug: a 500 in the error shape (logged with its id); keep serving
            return self._count(run, internal(exc)).response()
        finally:
            await self._finish(run, release, turn)

    def _parse(self, endpoint: Endpoint, payload: dict, session: GatewaySession | None) -> GenerateRequest:
        if session is None:
            return _PARSERS[endpoint](payload, self.backend.tokenizer, self.limits)
        return parse_turn(_PARSERS[endpoint], payload, self.backend.tokenizer, self.limits, session, endpoint)

    def _stream(self, run: GenerationRun | Siblings, shape: Any, parsed: GenerateRequest,
                release: Callable[[], None], turn: SessionTurn | None):
        async def cleanup() -> None:
            await self._finish(run, release, turn)
        if isinstance(run, Siblings):
            return SSEResponse(run.frames(shape, parsed.include_usage), cleanup)
        return SSEResponse(sse_frames(run, shape, parsed.include_usage), cleanup)

    async def _complete(self, request: Request, run: GenerationRun | Siblings, shape: Any,
                        parsed: GenerateRequest) -> Response:
        if isinstance(run, Siblings):
            finished, body = await unless_disconnected(request.receive, lambda: run.body(shape))
            if not finished:
                return Response(status_code=CLIENT_CLOSED_STATUS)
            return body.response() if isinstance(body, APIError) else JSONResponse(body)
        finished, result = await unless_disconnected(request.receive, run.collect)
        if not finished:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        assert result is not None, "unless_disconnected gives the result of work that finished"
        text, outcome = result
        if isinstance(outcome, APIError):
            return outcome.response()
        return JSONResponse(shape.full_choices([choice_of(text, outcome, parsed, parsed.prompt_token_ids)],
                                               outcome.usage))

    def _count(self, run: GenerationRun | Siblings | None, err: APIError) -> APIError:
        """Count a request's failure once: through its run when it has one."""
        if run is not None:
            return run.fail(err)
        self.metrics.failure.labels(kind=err.failure_kind).inc()
        return err

    @staticmethod
    async def _finish(run: GenerationRun | Siblings | None, release: Callable[[], None] | None,
                      turn: SessionTurn | None = None) -> None:
        with anyio.CancelScope(shield=True):
            if run is not None:
                await run.close()  # a session turn ends there (after its abort), unless it ended before
            if turn is not None:
                turn.end(None)  # no-op once the run told it how it ended
            if release is not None:
                release()

    # ---- sessions ------------------------------------------------------------------------------
    async def open_session(self, request: Request) -> Response:
        """POST /v1/sessions: API key (401) -> draining (503) -> JSON body (415/408/413/400) -> the
        backend opens it (429 when its session KV budget is full)."""
        try:
            self.check_api_key(request)
            self.check_not_draining()
            check_json_content_type(request)
            spec = parse_session(parse_json_object(await self.read_body(request)), self.limits)
            session = await self.sessions.open(spec)
            return JSONResponse(session.body())
        except APIError as err:
            return err.response()
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED_STATUS)

    async def delete_session(self, request: Request, session_id: str) -> Response:
        """DELETE /v1/sessions/{id}: API key (401) -> 404 unless open -> closed."""
        try:
            self.check_api_key(request)
            await self.sessions.delete(session_id)
            return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True})
        except APIError as err:
            return err.response()

    # ---- health --------------------------------------------------------------------------------
    def health(self) -> Response:
        if not serving_workers_alive(self.backend.worker_gauges()):
            return APIError(503, "no decode or colocated worker is alive", code="unavailable").response()
        return JSONResponse({"status": "ok"})

    async def ready(self) -> Response:
        """200 when the (cached) one-token probe succeeded; 503 while draining, unhealthy or not ready."""
        if self._state.draining:
            return APIError(503, "the server is shutting down", code="draining").response()
        if not serving_workers_alive(self.backend.worker_gauges()):
            return APIError(503, "not ready: no decode or colocated worker is alive", code="unavailable").response()
        readiness = await self.readiness.check()
        if not readiness.ready:
            return APIError(503, f"not ready: {readiness.reason}", code="unavailable").response()
        return JSONResponse({"status": "ready"})

    async def _one_token(self) -> None:
        request_id = f"ready-{uuid.uuid4().hex}"
        prompt = encode_prompt(self.backend.tokenizer, "ready") or [0]
        params = SamplingParams(max_tokens=1, temperature=0.0)
        request = GenerateRequest(Endpoint.COMPLETION, prompt, params, stream=False, include_usage=False)
        run = GenerationRun(self.backend, request_id, request, self._probe_metrics, time.monotonic())
        try:
            await run.start()
            _, outcome = await run.collect()
            if isinstance(outcome, APIError):
                raise outcome
        finally:
            await run.close()


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large",
                    close_connection=True)  # the rest of the body is never read


def build_app(backend: Any, config: GatewayConfig, *, sampling: SamplingDefaults = SamplingDefaults(),
              on_shutdown: Callable[[], Awaitable[None]] | None = None,
              restart_workers: RestartWorkers | None = None) -> FastAPI:
    """A new app serving `backend` (a `router.backend.Backend`) as configured by `config`, filling
    requests' unset sampling fields from `sampling` (`config.generation_config` resolved for the
    model: `kernels.model.generation_config.sampling_defaults`).

    Nothing is shared between apps: each has its own Prometheus registry (plus the backend's
    `extra_collectors`, when it has that attribute). `on_shutdown` is awaited at lifespan shutdown,
    after the server stopped taking requests. `app.state.draining = True` refuses new /v1 requests.
    """
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        app.state.draining = True
        if on_shutdown is not None:
            await on_shutdown()

    app = FastAPI(title="tandem", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    gateway = app.state.gateway = Gateway(backend, config, app.state, sampling)
    app.add_middleware(HostGuard, policy=HostPolicy.for_bind(config.host, config.allowed_hosts))
    install_handlers(app)
    _add_routes(app, gateway)
    add_admin_routes(app, gateway, restart_workers)
    _add_openapi(app, gateway)
    return app


def _add_routes(app: FastAPI, gateway: Gateway) -> None:
    """The routes, each documented by `openapi` (responses here, request bodies in `_add_openapi`)."""
    @app.post("/v1/completions", responses=generation_responses(openapi.CompletionResponse, openapi.CompletionChunk))
    async def completions(request: Request) -> Response:
        return await gateway.generate(request, Endpoint.COMPLETION)

    @app.post("/v1/chat/completions",
              responses=generation_responses(openapi.ChatCompletionResponse, openapi.ChatCompletionChunk))
    async def chat_completions(request: Request) -> Response:
        return await gateway.generate(request, Endpoint.CHAT)

    @app.post("/v1/sessions", responses={200: {"model": openapi.SessionObject},
                                         **errors(400, 401, 403, 408, 413, 415, 429, 500, 503)})
    async def open_session(request: Request) -> Response:
        return await gateway.open_session(request)

    @app.delete("/v1/sessions/{session_id}",
                responses={200: {"model": openapi.SessionDeleted}, **errors(401, 403, 404)})
    async def delete_session(request: Request, session_id: str) -> Response:
        return await gateway.delete_session(request, session_id)

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}, **errors(400, 401, 403, 408, 413, 415)})
    async def tokenize_route(request: Request) -> Response:
        return await tokenize(gateway, request)

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **errors(400, 401, 403, 408, 413, 415)})
    async def detokenize_route(request: Request) -> Response:
        return await detokenize(gateway, request)

    @app.get("/v1/models", responses={200: {"model": openapi.ModelList}, **errors(401, 403)})
    async def models(request: Request) -> Response:
        gateway.check_api_key(request)
        defaults = gateway.limits.sampling
        card = {"id": gateway.served_name, "object": "model", "created": gateway.created, "owned_by": "tandem",
                "max_model_len": gateway.limits.max_model_len,
                "generation_defaults": {"temperature": defaults.temperature, "top_p": defaults.top_p,
                                        "top_k": defaults.top_k, "source": defaults.source}}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health", responses={200: {"model": openapi.HealthStatus}, **errors(403, 503)})
    async def health() -> Response:
        return gateway.health()

    @app.get("/health/ready", responses={200: {"model": openapi.ReadyStatus}, **errors(403, 503)})
    async def ready() -> Response:
        return await gateway.ready()

    @app.get("/debug/workers", responses={200: {"model": openapi.WorkerList}, **errors(401, 403)})
    async def workers(request: Request) -> Response:
        gateway.check_api_key(request)
        details = getattr(gateway.backend, "worker_details", None)
        return JSONResponse({"workers": details() if details is not None else []})

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text exposition.", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **errors(401, 403)})
    async def metrics(request: Request) -> Response:
        gateway.check_api_key(request)  # load, worker names and traffic are the operator's business
        return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE)


def _add_openapi(app: FastAPI, gateway: Gateway) -> None:
    """`GET /openapi.json`. Open like /health when no API key is set (clients and fuzzers read it, as
    vLLM's); with a key it needs the key like /v1/models: it names the served model and its limits."""
    completion, chat = request_models(gateway.limits)
    bodies = {"/v1/completions": completion, "/v1/chat/completions": chat,
              "/v1/sessions": session_request_model(gateway.limits), **tokenize_request_models(gateway.limits)}

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, gateway.limits, gateway.config.api_key is not None, bodies)
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]  # FastAPI's documented hook: its own tooling calls it

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        gateway.check_api_key(request)
        return JSONResponse(document())
