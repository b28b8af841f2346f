"""Composition root for single-machine serving: gateway and one engine in one process.

The only gateway module that loads the engine runtime (torch, the model); a cluster gateway
(:mod:`xllm.gateway.cluster`) never imports it.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

from xllm.core import AsyncEngine, EngineConfig
from xllm.engine.inprocess import InProcessEngineClient
from xllm.engine.loader import load_engine
from xllm.gateway.access import AccessPolicy
from xllm.gateway.app import GatewayState, create_app
from xllm.gateway.kv_tier_metrics import KVTierCollector
from xllm.gateway.metrics import EngineMetrics
from xllm.gateway.openai.limits import ApiLimits
from xllm.gateway.openai.tool_parsers import DEFAULT_TOOL_PARSER
from xllm.gateway.registry import EmbeddedRegistry
from xllm.models import served_name

log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    model: str | None = None
    served_model_name: str | None = None
    engine: EngineConfig | None = None
    progress: bool = True
    routing: str = "kv_aware"
    limits: ApiLimits = field(default_factory=ApiLimits)  # of the OpenAI API
    access: AccessPolicy = field(default_factory=AccessPolicy)  # API keys, priority permission
    tool_parser: str = DEFAULT_TOOL_PARSER  # the tool-call format (xllm.gateway.openai.tools)


def build_embedded(opts: ServeOptions):
    """Load the model, start one in-process engine and return the FastAPI app."""
    name = served_name(opts.model, opts.served_model_name)
    metrics = EngineMetrics()
    instance_id = "engine-0"
    loaded = load_engine(opts.model, name, opts.engine, instance_id, opts.progress,
                         observers=[metrics.observer(name, instance_id)])
    engine, compute = loaded.engine, loaded.compute
    if engine.kv.has_tiers:  # xllm:kv_tier_* series, read at scrape time
        metrics.registry.register(KVTierCollector(lambda: [(name, instance_id, engine.kv.tier_stats())]))
    async_engine = AsyncEngine(engine, compute=compute)
    async_engine.start()
    stop_compute = functools.partial(compute.shutdown, wait=False)
    registry = EmbeddedRegistry()
    registry.register(InProcessEngineClient(async_engine, loaded.info))
    state = GatewayState(registry=registry, tokenizer=loaded.tokenizer, metrics=metrics, default_model=name,
                         max_model_len=engine.max_model_len, on_shutdown=[async_engine.shutdown, stop_compute],
                         routing=opts.routing, limits=opts.limits, access=opts.access,
                         tool_parser=opts.tool_parser)
    return create_app(state)
