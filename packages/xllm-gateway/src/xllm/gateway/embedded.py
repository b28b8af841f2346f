"""Composition root for single-machine serving: gateway and one engine in one process.

The only gateway module that loads the engine runtime (torch, the model) and the engine service's
server half (loader, in-process client, the engine's settings from its flags); a cluster gateway
(:mod:`xllm.gateway.cluster`) never imports it. The import-linter contract of the gateway names it.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from dataclasses import dataclass, field, replace

from xllm.core import AsyncEngine, ComputeThread, EngineConfig, LLMEngine
from xllm.core.watchdog import StepWatchdog
from xllm.engine.config import engine_config
from xllm.engine.inprocess import InProcessEngineClient
from xllm.engine.loader import load_engine
from xllm.engine.tracing import EngineTracer
from xllm.engine_api.flags import served_models
from xllm.engine_api.tracing import Tracing, TracingOptions, tracing_options
from xllm.gateway.access import AccessPolicy
from xllm.gateway.app import GatewayState, create_app
from xllm.gateway.fronts import ModelFront
from xllm.gateway.kv_tier_metrics import KVTierCollector
from xllm.gateway.media.intake import MediaIntake
from xllm.gateway.metrics import EngineMetrics
from xllm.gateway.openai.limits import ApiLimits
from xllm.gateway.openai.tool_parsers import DEFAULT_TOOL_PARSER
from xllm.gateway.registry import EmbeddedRegistry
from xllm.gateway.tracing import gateway_tracing
from xllm.models import served_name

log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    model: str | None = None
    served_model_name: str | None = None
    engine: EngineConfig | None = None
    progress: bool = True
    routing: str = "kv_aware"
    routing_fallback_ratio: float = 2.0  # --routing-fallback-ratio
    limits: ApiLimits = field(default_factory=ApiLimits)  # of the OpenAI API
    access: AccessPolicy = field(default_factory=AccessPolicy)  # API keys, priority permission
    tool_parser: str = DEFAULT_TOOL_PARSER  # the tool-call format (xllm.gateway.openai.tools)
    media: MediaIntake = field(default_factory=MediaIntake)  # image inputs (xllm.gateway.media.intake)
    tracing: TracingOptions = field(default_factory=TracingOptions)  # request traces (gateway and engine spans)
    step_timeout: float = 60.0  # --step-timeout: each engine's step watchdog (0: none; xllm.core.watchdog)
    # more models, each with its own engine here: (model, served name) (xllm serve --model A --model B)
    more_models: list[tuple[str | None, str | None]] = field(default_factory=list)


def serve_options(args: argparse.Namespace, **api) -> ServeOptions:
    """The :class:`ServeOptions` of ``xllm serve``'s flags, with the API's ``limits``, ``access`` and
    ``tool_parser`` in ``api`` (raises ``ConfigError`` or ``ValueError`` naming a flag)."""
    models = served_models(args)
    return ServeOptions(*models[0], engine_config(args), not args.no_progress, routing=args.routing,
                        routing_fallback_ratio=args.routing_fallback_ratio,
                        tracing=tracing_options(args, "xllm-gateway"), more_models=models[1:],
                        step_timeout=args.step_timeout, **api)


def build_embedded(opts: ServeOptions):
    """Load the model(s), start one in-process engine per model and return the FastAPI app."""
    models = [(opts.model, opts.served_model_name), *opts.more_models]
    cfg = opts.engine
    if cfg is not None and len(models) > 1 and cfg.num_threads is None:  # the engines share this process's cores
        cfg = replace(cfg, num_threads=max(1, (os.cpu_count() or 1) // len(models)))
    metrics = EngineMetrics()
    registry = EmbeddedRegistry()
    traced = gateway_tracing(opts.tracing)  # the gateway's tracer and the page's recent requests
    recent = traced.get("recent_traces")  # (the engines' spans join them: one process)
    engines: list[_Engine] = []
    try:
        for i, (model, served) in enumerate(models):
            iid = f"engine-{i}"
            tracing = Tracing(replace(opts.tracing, service_name="xllm-engine"), {"xllm.instance_id": iid},
                              processors=[recent.processor()] if recent is not None else (), roots=False)
            engines.append(_start_engine(model, served_name(model, served), cfg, iid, opts.progress, metrics,
                                         registry, tracing, opts.step_timeout))
    except BaseException:
        for e in engines:
            e.stop()
        raise

    def stop_engines() -> None:
        for e in engines:
            e.stop()

    first = engines[0]
    state = GatewayState(registry=registry, tokenizer=first.front.tokenizer, metrics=metrics,
                         default_model=first.front.name, max_model_len=first.front.max_model_len,
                         extra_models=tuple(e.front for e in engines[1:]), on_shutdown=[stop_engines],
                         routing=opts.routing, routing_fallback_ratio=opts.routing_fallback_ratio,
                         limits=opts.limits, access=opts.access, tool_parser=opts.tool_parser, media=opts.media,
                         **traced)
    for e in engines:  # a hung step fails its streams, then the server stops (exit status 1)
        state.on_startup.append(functools.partial(e.watchdog.start, state.fail))
        state.on_shutdown.insert(0, e.watchdog.stop)
    return create_app(state)


@dataclass
class _Engine:
    """One in-process engine: its front (tokenizer, context) and how it stops."""

    front: ModelFront
    engine: LLMEngine
    async_engine: AsyncEngine
    compute: ComputeThread
    tracing: Tracing
    watchdog: StepWatchdog

    def stop(self) -> None:
        """Stop the loop, then release the engine (a tensor-parallel one's worker ranks get their SHUTDOWN, as in
        ``xllm engine``); a hung step may still use it: then the process exits without closing it."""
        self.async_engine.shutdown(0.1 if self.async_engine.hung else 10.0)
        if not self.async_engine.hung:
            self.engine.close()
        self.compute.shutdown(wait=False)
        self.tracing.shutdown()


def _start_engine(model: str | None, name: str, cfg: EngineConfig | None, instance_id: str, progress: bool,
                  metrics: EngineMetrics, registry: EmbeddedRegistry, tracing: Tracing, step_timeout: float
                  ) -> _Engine:
    """Load ``model`` served as ``name``, start its engine and register it (its spans through ``tracing``; its
    step watchdog's floor ``step_timeout``, started with the app)."""
    loaded = load_engine(model, name, cfg, instance_id, progress, observers=[metrics.observer(name, instance_id)])
    async_engine = AsyncEngine(loaded.engine, compute=loaded.compute)
    if async_engine.lower_tiers is not None:  # xllm:kv_tier_* series, read at scrape time
        metrics.registry.register(KVTierCollector(lambda: [(name, instance_id, async_engine.tier_stats())]))
    async_engine.start()
    watchdog = StepWatchdog(async_engine, step_timeout)
    registry.register(InProcessEngineClient(async_engine, loaded.info, EngineTracer(tracing, instance_id), watchdog))
    return _Engine(ModelFront(name, loaded.tokenizer, loaded.engine.max_model_len), loaded.engine, async_engine,
                   loaded.compute, tracing, watchdog)
