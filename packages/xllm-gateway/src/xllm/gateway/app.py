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

from xllm.engine_api.tracing import Tracing
from xllm.gateway.access import AccessPolicy, Caller
from xllm.gateway.dashboard import EventHub, add_dashboard_routes
from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.encode import EncodeMetrics, EncodeStage, EPDOptions
from xllm.gateway.fronts import ModelFront, ModelFronts
from xllm.gateway.guard import REQUEST_ID_HEADER, ApiGuard, caller_of, request_id_of
from xllm.gateway.media.intake import MediaIntake
from xllm.gateway.metrics import EngineMetrics, MoveMetrics, PDMetrics, PDRoleMetrics, RouterMetrics
from xllm.gateway.moves import MoveOptions, Mover
from xllm.gateway.openai.errors import RETRY_AFTER_SECONDS, APIError, internal_error, model_not_found, new_request_id
from xllm.gateway.openai.limits import ApiLimits
from xllm.gateway.openai.preprocess import Preprocessor
from xllm.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from xllm.gateway.openai.protocol_embeddings import EmbeddingRequest
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
    Detokenized,
    EmbeddingList,
    Health,
    ModelList,
    Recommendation,
    ResponseDeleted,
    ResponseObject,
    ResponseStreamEvent,
    Tokenized,
)
from xllm.gateway.openai.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from xllm.gateway.openai.request_body import validation_error
from xllm.gateway.openai.responses_api import ResponsesRequest
from xllm.gateway.openai.serving_chat import ChatServing
from xllm.gateway.openai.serving_completion import CompletionServing
from xllm.gateway.openai.serving_embeddings import EmbeddingsServing
from xllm.gateway.openai.serving_lora import LoadLoraAdapterRequest, LoraAdmin, UnloadLoraAdapterRequest
from xllm.gateway.openai.serving_recommend import RecommendServing
from xllm.gateway.openai.serving_responses import ResponsesServing
from xllm.gateway.openai.serving_resume import ResumeServing
from xllm.gateway.openai.serving_tokenize import TokenizeServing
from xllm.gateway.openai.serving_weights import WeightsAdmin, add_weights_routes
from xllm.gateway.openai.stream_ids import StreamSeal
from xllm.gateway.openai.tool_parsers import DEFAULT_TOOL_PARSER
from xllm.gateway.progress import StallLimits
from xllm.gateway.registry import InstanceState, Registry
from xllm.gateway.roles import PDRoleOptions, RoleController
from xllm.gateway.router import Router
from xllm.gateway.tracing import RecentTraces, TraceMiddleware, spans_of
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
    routing_fallback_ratio: float = 2.0  # --routing-fallback-ratio (kv_aware's load fallback)
    started: float = field(default_factory=time.time)
    limits: ApiLimits = field(default_factory=ApiLimits)
    access: AccessPolicy = field(default_factory=AccessPolicy)
    moves: MoveOptions = field(default_factory=MoveOptions)  # requests on draining instances
    pd_roles: PDRoleOptions = field(default_factory=PDRoleOptions)  # static or dynamic PD roles
    tool_parser: str = DEFAULT_TOOL_PARSER  # the tool-call format (--tool-call-parser)
    media: MediaIntake = field(default_factory=MediaIntake)  # image inputs (--allowed-media-domains, limits)
    stall: StallLimits = field(default_factory=StallLimits)  # streams of stopped instances (--stream-stall-timeout)
    epd: EPDOptions = field(default_factory=EPDOptions)  # where images are encoded (--epd-strategy, --encode-timeout)
    stream_key: bytes | None = None  # resumable stream ids' key (the cluster's; None: random, this gateway only)
    # the other models this gateway serves, each with its own tokenizer and context (xllm.gateway.fronts)
    extra_models: tuple[ModelFront, ...] = ()
    tracing: Tracing = field(default_factory=Tracing)  # request traces (--otlp-traces-endpoint; off: a null object)
    recent_traces: RecentTraces | None = None  # the gateway's spans of its last requests (the cluster page)
    # why this gateway can no longer serve (set by fail(): an in-process engine taken for hung); the HTTP
    # server then stops and the process exits with status 1 (xllm.gateway.http_guard.serve)
    failure: str | None = None

    def fail(self, reason: str) -> None:
        """This gateway cannot serve any more (the first reason is kept): see ``failure``."""
        if self.failure is None:
            self.failure = reason


    def fronts(self) -> ModelFronts:
        """Every served model's front, the default model's first."""
        return ModelFronts([ModelFront(self.default_model, self.tokenizer, self.max_model_len), *self.extra_models])


@dataclass(frozen=True)
class _Servings:
    """The routes' handlers of one served model (its tokenizer and context length)."""

    chat: ChatServing
    completions: CompletionServing
    recommend: RecommendServing
    tokenize: TokenizeServing
    embeddings: EmbeddingsServing


class _ByModel:
    """Each request's model → its :class:`_Servings` (404 for a model this gateway has no front for)."""

    def __init__(self, dispatcher: Dispatcher, fronts: ModelFronts, preprocessor: Preprocessor, tool_parser: str,
                 seal: StreamSeal, media: MediaIntake) -> None:
        self.dispatcher = dispatcher
        self._servings: dict[str, _Servings] = {}
        for f in fronts:
            chat = ChatServing(dispatcher, f.tokenizer, f.max_model_len, preprocessor, tool_parser, seal, media)
            self._servings[f.name] = _Servings(
                chat, CompletionServing(dispatcher, f.tokenizer, f.max_model_len, preprocessor, seal),
                RecommendServing(dispatcher, f.tokenizer, f.max_model_len, preprocessor),
                TokenizeServing(dispatcher, chat, f.tokenizer, f.max_model_len, preprocessor),
                EmbeddingsServing(dispatcher, f.tokenizer, f.max_model_len, preprocessor))

    def __call__(self, requested: str | None) -> _Servings:
        name, _ = self.dispatcher.base_of(self.dispatcher.resolve_model(requested))  # (an adapter: its model's)
        servings = self._servings.get(name)
        if servings is None:  # registered by an instance, but this gateway has no tokenizer for it
            raise model_not_found(name)
        return servings


async def _call(fn: Callable[[], object]) -> None:
    result = fn()
    if inspect.isawaitable(result):
        await result


def create_app(state: GatewayState) -> FastAPI:
    """The gateway app: the OpenAI routes over a dispatcher and router, and the service routes."""
    router = Router(state.registry, state.routing, metrics=RouterMetrics(state.metrics.registry),
                    fallback_ratio=state.routing_fallback_ratio,
                    pd_slo_ttft_s=state.pd_roles.overflow_slo_ttft_s, pd_predictor=state.pd_roles.predictor)

    def on_instance(event: str, st: InstanceState) -> None:
        if event == "removed":
            state.metrics.forget(st.model, st.instance_id)
        else:
            state.metrics.set_role(st.model, st.instance_id, st.role)

    state.registry.add_listener(on_instance)
    for st in state.registry.states():  # registered before the app (the embedded engine)
        on_instance("added", st)
    hub = EventHub()  # flips and moves as they happen, for the cluster page (xllm.gateway.events)
    encoder = EncodeStage(router, state.epd, EncodeMetrics(state.metrics.registry),  # (EPD: --epd-strategy)
                          state.metrics.registry)
    dispatcher = Dispatcher(state.registry, state.default_model, router, pd_metrics=PDMetrics(state.metrics.registry),
                            mover=Mover(router, state.moves, MoveMetrics(state.metrics.registry), events=hub),
                            stall=state.stall, encoder=encoder)
    preprocessor = Preprocessor(state.limits)
    roles = RoleController(state.registry, router, state.pd_roles, PDRoleMetrics(state.metrics.registry),
                           on_role=lambda st: state.metrics.set_role(st.model, st.instance_id, st.role), events=hub)

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
        state.tracing.shutdown()  # the spans still queued are sent

    app = FastAPI(title="xLLM", version="0.1.0", lifespan=lifespan)
    app.state.gateway = state
    app.state.roles = roles
    app.add_middleware(ApiGuard, access=state.access, max_inflight=state.limits.max_inflight_requests)
    if state.tracing.enabled:  # outside the guard: a request's trace covers its admission too
        app.add_middleware(TraceMiddleware, tracing=state.tracing)
    _add_error_handlers(app)
    bodies = RequestBodies()
    seal = StreamSeal(state.stream_key)
    fronts = state.fronts()
    by_model = _ByModel(dispatcher, fronts, preprocessor, state.tool_parser, seal, state.media)
    _add_openai_routes(app, bodies, preprocessor, state.access, by_model)
    _add_responses_routes(app, bodies, state.access, ResponsesServing(preprocessor, state.limits), by_model)
    _add_tokenizer_routes(app, bodies, preprocessor, by_model)
    _add_resume_route(app, ResumeServing(state.registry, fronts.tokenizers(), seal))
    _add_lora_routes(app, bodies, preprocessor, state.access, LoraAdmin(state.registry, dispatcher))
    add_weights_routes(app, bodies, preprocessor, state.access,  # /sleep, /wake_up, /update_weights
                       WeightsAdmin(state.registry, dispatcher))
    _add_service_routes(app, state, roles, fronts)
    add_dashboard_routes(app, state, router, roles, dispatcher.mover,  # the live cluster page, /dashboard
                         timelines=state.recent_traces, hub=hub)
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
                       by_model: _ByModel) -> None:
    """The generation routes. Each reads its own body (:meth:`Preprocessor.parse`); its declared
    schema (``openapi_extra``, ``responses``) only describes it in ``/openapi.json``."""
    anonymous = Caller(False, access.allow_client_priority)

    async def parse(raw: Request, model: type[OpenAIRequest]) -> OpenAIRequest:
        with spans_of(raw.scope).phase("validate"):  # admission: the body read, parsed and checked
            req = await preprocessor.parse(raw, model)
            access.check_priority(caller_of(raw.scope) or anonymous, req)
        return req

    @app.post("/v1/chat/completions", operation_id="createChatCompletion",
              openapi_extra=bodies.json(ChatCompletionRequest),
              responses=answers(ChatCompletion, *GENERATION_ERRORS, stream=ChatCompletionChunk))
    async def chat_completions(raw: Request):
        req = await parse(raw, ChatCompletionRequest)
        return await by_model(req.model).chat.create(req, raw, access.scheduling(req))

    @app.post("/v1/completions", operation_id="createCompletion", openapi_extra=bodies.json(CompletionRequest),
              responses=answers(Completion, *GENERATION_ERRORS, stream=CompletionChunk))
    async def create_completions(raw: Request):
        req = await parse(raw, CompletionRequest)
        return await by_model(req.model).completions.create(req, raw, access.scheduling(req))

    @app.post("/v1/embeddings", operation_id="createEmbedding", openapi_extra=bodies.json(EmbeddingRequest),
              responses=answers(EmbeddingList, 400, 404, 413, 500, 503))
    async def create_embeddings(raw: Request):
        req = await preprocessor.parse(raw, EmbeddingRequest)
        return await by_model(req.model).embeddings.create(req)

    @app.post("/v1/recommend", operation_id="createRecommendation", openapi_extra=bodies.json(RecommendRequest),
              responses=answers(Recommendation, 400, 404, 413, 500, 503))  # (no priority asked: no 403)
    async def create_recommendation(raw: Request):  # generative recommendation over the item catalogue
        req = await preprocessor.parse(raw, RecommendRequest)
        return await by_model(req.model).recommend.create(req, raw)


def _add_responses_routes(app: FastAPI, bodies: RequestBodies, access: AccessPolicy, responses: ResponsesServing,
                          by_model: _ByModel) -> None:
    """``/v1/responses`` (:mod:`xllm.gateway.openai.serving_responses`): create, read back, delete."""
    anonymous = Caller(False, access.allow_client_priority)

    @app.post("/v1/responses", operation_id="createResponse", openapi_extra=bodies.json(ResponsesRequest),
              responses=answers(ResponseObject, *GENERATION_ERRORS, stream=ResponseStreamEvent, named_events=True))
    async def create_response(raw: Request):
        with spans_of(raw.scope).phase("validate"):  # admission: the body read, parsed and checked
            parsed = await responses.parse(raw)
            access.check_priority(caller_of(raw.scope) or anonymous, parsed.chat)
        chat = by_model(parsed.chat.model).chat
        return await responses.create(parsed, chat, raw, access.scheduling(parsed.chat))

    @app.get("/v1/responses/{response_id}", operation_id="getResponse", responses=answers(ResponseObject, 404, 500))
    async def get_response(response_id: str):
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}", operation_id="deleteResponse",
                responses=answers(ResponseDeleted, 404, 500))
    async def delete_response(response_id: str):
        return responses.delete(response_id)


def _add_tokenizer_routes(app: FastAPI, bodies: RequestBodies, preprocessor: Preprocessor, by_model: _ByModel) -> None:
    """``POST /tokenize`` and ``POST /detokenize`` (vLLM's; behind the API keys as ``/v1/*`` are)."""

    @app.post("/tokenize", operation_id="tokenize", openapi_extra=bodies.json(TokenizeRequest),
              responses=answers(Tokenized, 400, 404, 413, 500))
    async def tokenize(raw: Request):
        req = await preprocessor.parse(raw, TokenizeRequest)
        return await by_model(req.model).tokenize.tokenize(req)

    @app.post("/detokenize", operation_id="detokenize", openapi_extra=bodies.json(DetokenizeRequest),
              responses=answers(Detokenized, 400, 404, 413, 500))
    async def detokenize(raw: Request):
        req = await preprocessor.parse(raw, DetokenizeRequest)
        return await by_model(req.model).tokenize.detokenize(req)


def _add_lora_routes(app: FastAPI, bodies: RequestBodies, preprocessor: Preprocessor, access: AccessPolicy,
                     lora: LoraAdmin) -> None:
    """vLLM's run-time LoRA routes (:mod:`xllm.gateway.openai.serving_lora`): an admin key's, when keys are set."""
    anyone = Caller(False, access.allow_client_priority, admin=not access.requires_key)

    refusals = answers(None, 400, 403, 404, 413, 500, 503)

    @app.post("/v1/load_lora_adapter", operation_id="loadLoraAdapter",
              openapi_extra=bodies.json(LoadLoraAdapterRequest), responses=refusals)
    async def load_lora_adapter(raw: Request):
        req = await preprocessor.parse(raw, LoadLoraAdapterRequest)
        access.check_admin(caller_of(raw.scope) or anyone, "loading a LoRA adapter")
        return await lora.load(req)

    @app.post("/v1/unload_lora_adapter", operation_id="unloadLoraAdapter",
              openapi_extra=bodies.json(UnloadLoraAdapterRequest), responses=refusals)
    async def unload_lora_adapter(raw: Request):
        req = await preprocessor.parse(raw, UnloadLoraAdapterRequest)
        access.check_admin(caller_of(raw.scope) or anyone, "unloading a LoRA adapter")
        return await lora.unload(req)


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


def _add_service_routes(app: FastAPI, state: GatewayState, roles: RoleController, fronts: ModelFronts) -> None:
    """``/v1/models``, ``/health`` and ``/metrics`` over the registry's live instances."""

    @app.get("/v1/models", operation_id="listModels", responses=answers(ModelList, 500))
    async def models():
        """The served models, then their LoRA adapters (``parent``: the model an adapter runs on, as vLLM lists
        them)."""
        served = [name for name in state.registry.served_models() if name in fronts]  # (those it can serve)
        data = [{"id": name, "object": "model", "created": int(state.started), "owned_by": "xllm",
                 "max_model_len": _max_model_len(state, fronts, name)} for name in served]
        data += [{"id": name, "object": "model", "created": int(state.started), "owned_by": "xllm",
                  "max_model_len": _max_model_len(state, fronts, base), "parent": base}
                 for name, base in sorted(state.registry.adapters().items()) if base in served and name not in served]
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


def _max_model_len(state: GatewayState, fronts: ModelFronts, name: str) -> int:
    lens = [s.info.model.max_model_len for s in state.registry.states(name) if s.info.model.max_model_len]
    front = fronts.get(name)
    return min(lens) if lens else (front.max_model_len if front is not None else state.max_model_len)


async def _load(st: InstanceState) -> instance_pb2.LoadReport | None:
    """An instance's load: its last heartbeat (remote), or asked now (in-process); None if unreachable."""
    if st.load is not None:
        return st.load
    try:
        return await st.client.load()
    except Exception:  # an unreachable instance keeps its last reported values
        log.warning("load report of %s failed", st.instance_id, exc_info=True)
        return None
