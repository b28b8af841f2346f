"""The client of an engine living in the caller's process (``xllm serve`` on one machine)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from xllm.core import AsyncEngine
from xllm.core.watchdog import StepWatchdog
from xllm.engine.tracing import EngineTracer, traced_stream
from xllm.engine_api.errors import EngineError
from xllm.engine_api.tracing import TraceCarrier
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.kvstore.v1 import kv_events_pb2
from xllm.proto.registry.v1 import instance_pb2


class InProcessEngineClient:
    """:class:`xllm.engine_api.client.EngineClient` over an :class:`~xllm.core.AsyncEngine` in this process."""

    def __init__(self, engine: AsyncEngine, info: instance_pb2.InstanceInfo,
                 tracer: EngineTracer | None = None, watchdog: StepWatchdog | None = None) -> None:
        """``tracer``: the engine's spans of the requests its caller traces (the gateway's tracing);
        ``watchdog``: the engine's step watchdog, whose view of a stuck step the health answer reports (none
        given: one that is off, which reports a dead engine only)."""
        self.engine = engine
        self.info = info
        self.tracer = tracer
        self.watchdog = watchdog or StepWatchdog(engine, stall_timeout=0.0)

    async def submit(self, req: engine_pb2.GenerateRequest,
                     trace: TraceCarrier | None = None) -> AsyncIterator[engine_pb2.GenerateResponse]:
        traced = self.tracer.begin(trace, req) if self.tracer is not None and trace else None
        if traced is None:
            return await self.engine.submit_async(req)  # a constraint compiles off the loop
        try:
            stream = await self.engine.submit_async(req, traced.record)
        except Exception as exc:
            traced.end(str(exc))
            raise
        return traced_stream(traced, stream)

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def migrate(self, request_id: str, target: engine_pb2.KVTarget,
                      num_tokens: int) -> engine_pb2.MigrateResponse:
        """An in-process engine serves no KV hand-offs (it never drains with requests to move)."""
        return engine_pb2.MigrateResponse(accepted=False, error="an in-process engine does not migrate requests")

    async def health(self) -> engine_pb2.HealthResponse:
        problem = self.watchdog.problem()
        return engine_pb2.HealthResponse(healthy=not problem, status=problem or "ok")

    async def load_lora(self, name: str, path: str) -> engine_pb2.LoadLoraResponse:
        return await load_lora_answer(self.engine, engine_pb2.LoadLoraRequest(lora_name=name, lora_path=path))

    async def embed(self, req: engine_pb2.EmbedRequest) -> engine_pb2.EmbedResponse:
        return await embed_answer(self.engine, req)

    async def encode(self, req: engine_pb2.EncodeRequest, timeout: float) -> engine_pb2.EncodeResponse:
        return await encode_answer(self.engine, req)

    async def control(self, req: engine_pb2.ControlRequest) -> engine_pb2.ControlResponse:
        return await control_answer(self.engine, req)

    async def load(self) -> instance_pb2.LoadReport:
        return self.engine.load_report()

    async def kv_events(self, since_version: int, epoch: int, snapshot: bool = False) -> kv_events_pb2.KVCacheEvents:
        """An in-process engine publishes no KV events (epoch 0: nothing to apply): it is the only
        instance of its gateway, so nothing routes on them, and its engine keeps none."""
        return kv_events_pb2.KVCacheEvents(instance_id=self.info.instance_id)

    async def close(self) -> None:
        """Nothing to release: the engine's owner shuts it down."""


async def load_lora_answer(engine: AsyncEngine, req: engine_pb2.LoadLoraRequest) -> engine_pb2.LoadLoraResponse:
    """``EngineService.LoadLora`` on ``engine`` (the gRPC service's and the in-process client's): load, or with an
    empty path unload, between steps; a refusal is an answer (``error``, the field at fault in ``param``)."""
    try:
        root = await engine.load_lora(req.lora_name, req.lora_path or None)
    except (EngineError, ValueError) as exc:  # (an engine that cannot take adapters: a ConfigError)
        return engine_pb2.LoadLoraResponse(ok=False, error=str(exc), param=getattr(exc, "param", None) or "")
    return engine_pb2.LoadLoraResponse(ok=True, hash_root=root)


async def control_answer(engine: AsyncEngine, req: engine_pb2.ControlRequest) -> engine_pb2.ControlResponse:
    """``EngineService.Control`` on ``engine`` (the gRPC service's and the in-process client's): sleep, wake, update
    the weights (each after the engine drained: :mod:`xllm.core.engine_weights`) or report whether it sleeps; a
    refusal is an answer (``error``, the field at fault in ``param``)."""
    answer = engine_pb2.ControlResponse(ok=True)
    try:
        if req.action == engine_pb2.CONTROL_ACTION_SLEEP:
            await engine.sleep(req.level or 1)
        elif req.action == engine_pb2.CONTROL_ACTION_WAKE_UP:
            answer.woke_from = await engine.wake_up()
        elif req.action == engine_pb2.CONTROL_ACTION_UPDATE_WEIGHTS:
            answer.weights_identity = await engine.update_weights(req.model_path)
        elif req.action != engine_pb2.CONTROL_ACTION_IS_SLEEPING:
            return engine_pb2.ControlResponse(ok=False, error=f"unknown control action {req.action}", param="action")
    except (EngineError, ValueError) as exc:
        answer = engine_pb2.ControlResponse(ok=False, error=str(exc), param=getattr(exc, "param", None) or "")
    answer.sleeping_level = engine.is_sleeping()
    return answer


async def embed_answer(engine: AsyncEngine, req: engine_pb2.EmbedRequest) -> engine_pb2.EmbedResponse:
    """``EngineService.Embed`` on ``engine``: the prompt's pooled hidden state, computed between steps (raises the
    engine's ``InvalidRequestError`` naming the field)."""
    values = await engine.embed(list(req.prompt_token_ids), req.pooling or "last", req.normalize)
    return engine_pb2.EmbedResponse(embedding=values)


async def encode_answer(engine: AsyncEngine, req: engine_pb2.EncodeRequest) -> engine_pb2.EncodeResponse:
    """``EngineService.Encode`` on ``engine``: each image's embeddings, computed between steps (raises the engine's
    ``InvalidRequestError`` naming ``images``)."""
    return engine_pb2.EncodeResponse(embeddings=await engine.encode_images(list(req.images)))
