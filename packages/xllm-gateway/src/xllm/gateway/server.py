"""Composition root for single-machine serving: model + engine + gateway in one process."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

from xllm.core import AsyncEngine, ComputeThread, EngineConfig, LLMEngine
from xllm.gateway.app import GatewayState, create_app
from xllm.gateway.engine_client import InProcessEngineClient
from xllm.gateway.metrics import EngineMetrics
from xllm.gateway.registry import EmbeddedRegistry
from xllm.models import DEFAULT_MODEL, Tokenizer, load_model, resolve_model
from xllm.proto.registry.v1 import instance_pb2

log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    model: str | None = None
    served_model_name: str | None = None
    engine: EngineConfig | None = None
    progress: bool = True
    routing: str = "kv_aware"


def build_embedded(opts: ServeOptions):
    """Load the model, start one in-process engine and return the FastAPI app."""
    model_dir = resolve_model(opts.model, progress=opts.progress)
    cfg = opts.engine or EngineConfig()
    tokenizer = Tokenizer(model_dir)
    compute = ComputeThread()  # loads, builds and steps the engine: one OpenMP pool (see compute_thread)
    model = compute.call(load_model, model_dir, cfg.dtype, progress=opts.progress)
    name = opts.served_model_name or (DEFAULT_MODEL if opts.model is None else opts.model.rstrip("/"))
    metrics = EngineMetrics()
    instance_id = "engine-0"
    engine = compute.call(LLMEngine, model, tokenizer, cfg, observers=[metrics.observer(name, instance_id)],
                          instance_id=instance_id, forward_executor=compute)
    async_engine = AsyncEngine(engine, compute=compute)
    async_engine.start()
    info = instance_pb2.InstanceInfo(
        instance_id=instance_id, role=instance_pb2.INSTANCE_ROLE_MIXED, start_time=time.time(),
        model=instance_pb2.ModelInfo(served_name=name, max_model_len=engine.max_model_len,
                                     dtype=str(cfg.dtype).removeprefix("torch."),
                                     block_size=engine.layout.block_size))
    stop_compute = functools.partial(compute.shutdown, wait=False)
    registry = EmbeddedRegistry()
    registry.register(InProcessEngineClient(async_engine, info))
    state = GatewayState(registry=registry, tokenizer=tokenizer, metrics=metrics, default_model=name,
                         max_model_len=engine.max_model_len, on_shutdown=[async_engine.shutdown, stop_compute],
                         routing=opts.routing)
    return create_app(state)
