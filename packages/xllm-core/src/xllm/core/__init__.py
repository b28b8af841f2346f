"""The xLLM engine runtime.

Public API (imported on first use, so the torch-free parts — :mod:`xllm.core.errors`,
:mod:`xllm.core.stats`, :mod:`xllm.core.sampling_params`, :mod:`xllm.core.dtypes`,
:data:`xllm.core.kv.KV_BACKENDS` — can be used without loading torch):

- :class:`EngineConfig` / :class:`ConfigError`: engine settings; :data:`DTYPES`.
- :class:`LLMEngine`: the synchronous step loop (continuous batching) over a
  :class:`~xllm.core.scheduler.Scheduler` and a :class:`~xllm.core.model_runner.ModelRunner`.
- :class:`AsyncEngine` / :class:`RequestStream`: the engine on its own thread,
  streaming ``xllm.engine.v1.GenerateResponse`` chunks to asyncio callers.
- :class:`ComputeThread`: the single thread that loads, builds and steps an engine.
- :mod:`xllm.core.model_api`: the contract models implement.
- Errors: :class:`InvalidRequestError`, :class:`EngineOverloadedError`, :class:`EngineDeadError`.
"""

from typing import TYPE_CHECKING

from xllm.common.lazy import lazy_exports

if TYPE_CHECKING:
    from xllm.core.async_engine import AsyncEngine, RequestStream
    from xllm.core.compute_thread import ComputeThread
    from xllm.core.config import EngineConfig, parse_dtype
    from xllm.core.dtypes import DTYPES
    from xllm.core.engine import LLMEngine
    from xllm.core.errors import ConfigError, EngineDeadError, EngineError, EngineOverloadedError, InvalidRequestError
    from xllm.core.model_api import AttentionContext, CausalLM, KVCacheSpec
    from xllm.core.stats import EngineCounters, FinishedRequest, StatsObserver, StepStats

_EXPORTS = {
    "AsyncEngine": "async_engine", "RequestStream": "async_engine",
    "ComputeThread": "compute_thread",
    "EngineConfig": "config", "parse_dtype": "config",
    "DTYPES": "dtypes",
    "LLMEngine": "engine",
    "ConfigError": "errors", "EngineDeadError": "errors", "EngineError": "errors", "EngineOverloadedError": "errors",
    "InvalidRequestError": "errors",
    "AttentionContext": "model_api", "CausalLM": "model_api", "KVCacheSpec": "model_api",
    "EngineCounters": "stats", "FinishedRequest": "stats", "StatsObserver": "stats", "StepStats": "stats",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
