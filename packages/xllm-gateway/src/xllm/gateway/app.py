"""The FastAPI application: OpenAI routes, health, metrics, error mapping.

Every route sits behind :class:`~xllm.gateway.guard.ApiGuard` (request ids, API keys on
``/v1/*``, the in-flight bound). The OpenAI routes read their body themselves, bounded by
:class:`~xllm.gateway.openai.limits.ApiLimits`, and parse, validate, template and tokenize it on
the :class:`~xllm.gateway.openai.preprocess.Preprocessor`'s threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from xllm.gateway.access import AccessPolicy, Caller
from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.guard import REQUEST_ID_HEADER, ApiGuard, caller_of, request_id_of
from xllm.gateway.metrics import EngineMetrics, MoveMetrics, PDMetrics, PDRoleMetrics, RouterMetrics
from xllm.gateway.moves import MoveOptions, Mover
from xllm.gateway.openai.errors import RETRY_AFTER_SECONDS, APIError, internal_error, new_request_id
from xllm.gateway.openai.limits import ApiLimits
from xllm.gateway.openai.preprocess import Preprocessor
from xllm.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from xllm.gateway.openai.protocol_openapi import (
    GENERATION_ERRORS,
    RETRY_AFTER,
    RequestBodies,
    answers,
    install_openapi,
    sse_event,
)
from xllm.gateway.openai.protocol_recommend import RecommendRequest
from xllm.gateway.openai.protocol_responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    Health,
    ModelList,
    Recommendation,
)
from xllm.gateway.openai.request_body import validation_error
from xllm.gateway.openai.serving_chat import ChatServing
from xllm.gateway.openai.serving_completion import CompletionServing
from xllm.gateway.openai.serving_recommend import RecommendServing
from xllm.gateway.openai.serving_resume import ResumeServing
from xllm.gateway.openai.stream_ids import StreamSeal
from xllm.gateway.openai.tool_parsers import DEFAULT_TOOL_PARSER
from xllm.gateway.progress import StallLimits
from xllm.gateway.registry import InstanceState, Registry
from xllm.gateway.roles import PDRoleOptions, RoleController
from xllm.gateway.router import Router
from xllm.models.tokenizer import Tokenizer
from xllm.proto.registry.v1 import instance_pb2

log = logging.getLogger(__name__)


@dataclass
class GatewayState:
    """Everything the routes need; built by :mod:`xllm.gateway.embedded` / :mod:`xllm.gateway.cluster`.

    ``on_startup`` / ``on_shutdown`` callables may be coroutine functions (run on the app's loop).
    ``limits`` bound the OpenAI requests; ``access`` holds the API keys and who may set priorities.
    """

    registry: Registry
    tokenizer: Tokenizer
    metrics: EngineMetrics
    default_model: str
    max_model_len: int
    on_shutdown: list[Callable[[], object]] = field(default_factory=list)
    on_startup: list[Callable[[], object]] = field(default_factory=list)
    routing: str = "kv_aware"
    started: float = field(default_factory=time.time)
    limits: ApiLimits = field(default_factory=ApiLimits)
    access: AccessPolicy = field(default_factory=AccessPolicy)
    moves: MoveOptions = field(default_factory=MoveOptions)  # requests on draining instances
    pd_roles: PDRoleOptions = field(default_factory=PDRoleOptions)  # static or dynamic PD roles
    tool_parser: str = DEFAULT_TOOL_PARSER  # the tool-call format (--tool-call-parser)
    stall: StallLimits = field(default_factory=StallLimits)  # streams of stopped instances (--stream-stall-timeout)
    stream_key: bytes | None = None  # resumable stream ids' key (the cluster's; None: random, this gateway only)


async def _call(fn: Callable[[], object]) -> None:
    result = fn()
    if inspect.isawaitable(result):
        await result


def create_app(state: GatewayState) -> FastAPI:
    """The gateway app: the OpenAI routes over a dispatcher and router, and the service routes."""
    router = Router(state.registry, state.routing, metrics=RouterMetrics(state.metrics.registry),
                    pd_slo_ttft_s=state.pd_roles.overflow_slo_ttft_s, pd_predictor=state.pd_roles.predictor)

    def on_instance(event: str, st: InstanceState) -> None:
        if event == "removed":
            state.metrics.forget(st.model, st.instance_id)
        else:
            state.metrics.set_role(st.model, st.instance_id, st.role)

    state.registry.add_listener(on_instance)
    for st in state.registry.states():  # registered before the app (the embedded engine)
        on_instance("added", st)
    dispatcher = Dispatcher(state.registry, state.default_model, router, pd_metrics=PDMetrics(state.metrics.registry),
                            mover=Mover(router, state.moves, MoveMetrics(state.metrics.registry)), stall=state.stall)
    preprocessor = Preprocessor(state.limits)
    roles = RoleController(state.registry, router, state.pd_roles, PDRoleMetrics(state.metrics.registry),
                           on_role=lambda st: state.metrics.set_role(st.model, st.instance_id, st.role))

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await state.registry.start()
        for fn in state.on_startup:
            await _call(fn)
        await roles.start()
        yield
        await roles.stop()
        for fn in state.on_shutdown:
            try:
                await _call(fn)
            except Exception:
                log.exception("shutdown hook failed")
        await state.registry.close()
        preprocessor.close()

    app = FastAPI(title="xLLM", version="0.1.0", lifespan=lifespan)
    app.state.gateway = state
    app.state.roles = roles
    app.add_middleware(ApiGuard, access=state.access, max_inflight=state.limits.max_inflight_requests)
    _add_error_handlers(app)
    bodies = RequestBodies()
    seal = StreamSeal(state.stream_key)
    _add_openai_routes(app, bodies, preprocessor, state.access,
                       ChatServing(dispatcher, state.tokenizer, state.max_model_len, preprocessor,
                                   state.tool_parser, seal),
                       CompletionServing(dispatcher, state.tokenizer, state.max_model_len, preprocessor, seal),
                       RecommendServing(dispatcher, state.tokenizer, state.max_model_len, preprocessor))
    _add_resume_route(app, ResumeServing(state.registry, state.tokenizer, seal))
    _add_service_routes(app, state, roles)
    install_openapi(app, bodies, state.access.requires_key, state.limits)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body with its status."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_req: Request, exc: RequestValidationError):
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(APIError)
    async def _on_api_error(_req: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(_req: Request, exc: StarletteHTTPException):
        """404, 405 (its ``Allow`` header kept), ...: OpenAI-style."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _on_error(req: Request, exc: Exception):
        """Logged with the request id; the client gets a generic message naming that id."""
        request_id = request_id_of(req.scope) or new_request_id()
        response = internal_error(exc, request_id).response()
        response.headers[REQUEST_ID_HEADER] = request_id
        return response


def _add_openai_routes(app: FastAPI, bodies: RequestBodies, preprocessor: Preprocessor, access: AccessPolicy,
                       chat: ChatServing, completions: CompletionServing, recommend: RecommendServing) -> None:
    """The generation routes. Each reads its own body (:meth:`Preprocessor.parse`); its declared
    schema (``openapi_extra``, ``responses``) only describes it in ``/openapi.json``."""
    anonymous = Caller(False, access.allow_client_priority)

    async def parse(raw: Request, model: type[OpenAIRequest]) -> OpenAIRequest:
        req = await preprocessor.parse(raw, model)
        access.check_priority(caller_of(raw.scope) or anonymous, req)
        return req

    @app.post("/v1/chat/completions", operation_id="createChatCompletion",
              openapi_extra=bodies.json(ChatCompletionRequest),
              responses=answers(ChatCompletion, *GENERATION_ERRORS, stream=ChatCompletionChunk))
    async def chat_completions(raw: Request):
        req = await parse(raw, ChatCompletionRequest)
        return await chat.create(req, raw, access.scheduling(req))

    @app.post("/v1/completions", operation_id="createCompletion", openapi_extra=bodies.json(CompletionRequest),
              responses=answers(Completion, *GENERATION_ERRORS, stream=CompletionChunk))
    async def create_completions(raw: Request):
        req = await parse(raw, CompletionRequest)
        return await completions.create(req, raw, access.scheduling(req))

    @app.post("/v1/recommend", operation_id="createRecommendation", openapi_extra=bodies.json(RecommendRequest),
              responses=answers(Recommendation, 400, 404, 413, 500, 503))  # (no priority asked: no 403)
    async def create_recommendation(raw: Request):  # generative recommendation over the item catalogue
        return await recommend.create(await preprocessor.parse(raw, RecommendRequest), raw)


def _add_resume_route(app: FastAPI, resume: ResumeServing) -> None:
    """``GET /v1/streams/{stream_id}`` (:mod:`xllm.gateway.openai.serving_resume`): the rest of a broken
    stream after the ``Last-Event-ID`` its client received, through any gateway of the cluster."""
    stream = {"anyOf": [sse_event(ChatCompletionChunk), sse_event(CompletionChunk)]}

    @app.get("/v1/streams/{stream_id}", operation_id="resumeStream",
             responses={200: {"description": "The rest of the stream",
                              "content": {"text/event-stream": {"schema": stream}}},
                        **answers(None, 400, 404, 500, 503)})
    async def resume_stream(stream_id: str, last_event_id: str | None = Header(None, max_length=8192)):
        return await resume.resume(stream_id, last_event_id)


def _add_service_routes(app: FastAPI, state: GatewayState, roles: RoleController) -> None:
    """``/v1/models``, ``/health`` and ``/metrics`` over the registry's live instances."""

    @app.get("/v1/models", operation_id="listModels", responses=answers(ModelList, 500))
    async def models():
        data = [{"id": name, "object": "model", "created": int(state.started), "owned_by": "xllm",
                 "max_model_len": _max_model_len(state, name)} for name in state.registry.served_models()]
        return {"object": "list", "data": data}

    unhealthy = {"model": Health, "description": "No healthy instance", "headers": RETRY_AFTER}

    @app.get("/health", operation_id="health", responses=answers(Health, 500) | {503: unhealthy})
    async def health():
        """200 while at least one instance is healthy; the body lists every instance (with its role
        and a role flip under way)."""
        states = state.registry.states()
        reports = await asyncio.gather(*(s.client.health() for s in states))
        ok = any(r.healthy for r in reports)
        body = {"status": "ok" if ok else "unhealthy",
                "instances": {s.instance_id: {"healthy": r.healthy, "status": r.status, **roles.status(s)}
                              for s, r in zip(states, reports)}}
        if ok:
            return JSONResponse(body)
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.get("/metrics", operation_id="metrics", response_class=PlainTextResponse, responses=answers(None, 500))
    async def metrics():
        states = state.registry.states()
        loads = await asyncio.gather(*(_load(s) for s in states))
        by_model: dict[str, list] = {}
        for st, report in zip(states, loads):
            if report is None:
                continue
            state.metrics.set_load(st.model, st.instance_id, report)
            if st.counters is not None:
                state.metrics.set_counters(st.model, st.instance_id, st.counters)
            by_model.setdefault(st.model, []).append(report)
        for name in state.registry.served_models():
            state.metrics.set_cluster(name, by_model.get(name, []), state.registry.kv_index.num_blocks())
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _max_model_len(state: GatewayState, name: str) -> int:
    lens = [s.info.model.max_model_len for s in state.registry.states(name) if s.info.model.max_model_len]
    return min(lens) if lens else state.max_model_len


async def _load(st: InstanceState) -> instance_pb2.LoadReport | None:
    """An instance's load: its last heartbeat (remote), or asked now (in-process); None if unreachable."""
    if st.load is not None:
        return st.load
    try:
        return await st.client.load()
    except Exception:  # an unreachable instance keeps its last reported values
        log.warning("load report of %s failed", st.instance_id, exc_info=True)
        return None
