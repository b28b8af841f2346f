"""Composition root for single-machine serving: gateway and one engine in one process.

The only gateway module that loads the engine runtime (torch, the model) and the engine service's
server half (loader, in-process client, the engine's settings from its flags); a cluster gateway
(:mod:`xllm.gateway.cluster`) never imports it. The import-linter contract of the gateway names it.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

from xllm.core import AsyncEngine, EngineConfig
from xllm.engine.config import engine_config
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


def serve_options(args: argparse.Namespace, **api) -> ServeOptions:
    """The :class:`ServeOptions` of ``xllm serve``'s flags, with the API's ``limits``, ``access`` and
    ``tool_parser`` in ``api`` (raises ``ConfigError`` or ``ValueError`` naming a flag)."""
    return ServeOptions(args.model, args.served_model_name, engine_config(args), not args.no_progress,
                        routing=args.routing, **api)


def build_embedded(opts: ServeOptions):
    """Load the model, start one in-process engine and return the FastAPI app."""
    name = served_name(opts.model, opts.served_model_name)
    metrics = EngineMetrics()
    instance_id = "engine-0"
    loaded = load_engine(opts.model, name, opts.engine, instance_id, opts.progress,
                         observers=[metrics.observer(name, instance_id)])
    engine, compute = loaded.engine, loaded.compute
    async_engine = AsyncEngine(engine, compute=compute)
    if async_engine.lower_tiers is not None:  # xllm:kv_tier_* series, read at scrape time
        metrics.registry.register(KVTierCollector(lambda: [(name, instance_id, async_engine.tier_stats())]))
    async_engine.start()

    def stop_engine() -> None:
        """Stop the loop, then release the engine (a tensor-parallel one's worker ranks get their SHUTDOWN, as in
        ``xllm engine``); a hung step may still use it: then the process exits without closing it."""
        async_engine.shutdown(0.1 if async_engine.hung else 10.0)
        if not async_engine.hung:
            engine.close()
        compute.shutdown(wait=False)

    registry = EmbeddedRegistry()
    registry.register(InProcessEngineClient(async_engine, loaded.info))
    state = GatewayState(registry=registry, tokenizer=loaded.tokenizer, metrics=metrics, default_model=name,
                         max_model_len=engine.max_model_len, on_shutdown=[stop_engine],
                         routing=opts.routing, limits=opts.limits, access=opts.access,
                         tool_parser=opts.tool_parser)
    return create_app(state)
