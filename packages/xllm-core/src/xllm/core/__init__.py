"""The xLLM engine runtime.

Public API:

- :class:`EngineConfig` / :class:`ConfigError`: engine settings.
- :class:`LLMEngine`: the synchronous step engine (continuous batching).
- :class:`AsyncEngine` / :class:`RequestStream`: the engine on its own thread,
  streaming ``xllm.engine.v1.GenerateResponse`` chunks to asyncio callers.
- :class:`ComputeThread`: the single thread that loads, builds and steps an engine.
- :mod:`xllm.core.model_api`: the contract models implement.
- Errors: :class:`InvalidRequestError`, :class:`EngineOverloadedError`, :class:`EngineDeadError`.
"""

from xllm.core.async_engine import AsyncEngine, RequestStream
from xllm.core.compute_thread import ComputeThread
from xllm.core.config import ConfigError, EngineConfig, parse_dtype
from xllm.core.engine import LLMEngine
from xllm.core.errors import EngineDeadError, EngineError, EngineOverloadedError, InvalidRequestError
from xllm.core.model_api import AttentionContext, CausalLM, KVCacheSpec
from xllm.core.stats import EngineCounters, FinishedRequest, StatsObserver, StepStats

__all__ = [
    "AsyncEngine",
    "AttentionContext",
    "CausalLM",
    "ComputeThread",
    "ConfigError",
    "EngineConfig",
    "EngineCounters",
    "EngineDeadError",
    "EngineError",
    "EngineOverloadedError",
    "FinishedRequest",
    "InvalidRequestError",
    "KVCacheSpec",
    "LLMEngine",
    "RequestStream",
    "StatsObserver",
    "StepStats",
    "parse_dtype",
]
