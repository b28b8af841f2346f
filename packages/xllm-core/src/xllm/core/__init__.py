"""The xLLM engine runtime.

Public API (imported on first use, so the torch-free parts, e.g. :mod:`xllm.core.sampling_params`,
can be used without loading torch). The engine's errors, stats types and name tables are
torch-free and live in :mod:`xllm.engine_api` (``errors``, ``stats``, ``names``).

- :class:`EngineConfig`: engine settings.
- :class:`LLMEngine`: the synchronous step loop (continuous batching) over a
  :class:`~xllm.core.scheduler.Scheduler` and a :class:`~xllm.core.model_runner.ModelRunner`.
- :class:`AsyncEngine` / :class:`RequestStream`: the engine on its own thread,
  streaming ``xllm.engine.v1.GenerateResponse`` chunks to asyncio callers.
- :class:`ComputeThread`: the single thread that loads, builds and steps an engine.
- :mod:`xllm.core.model_api`: the contract models implement.
"""

from typing import TYPE_CHECKING

from xllm.common.lazy import lazy_exports

if TYPE_CHECKING:
    from xllm.core.async_engine import AsyncEngine, RequestStream
    from xllm.core.compute_thread import ComputeThread
    from xllm.core.config import EngineConfig, parse_dtype
    from xllm.core.engine import LLMEngine
    from xllm.core.model_api import AttentionContext, CausalLM, KVCacheSpec

_EXPORTS = {
    "AsyncEngine": "async_engine", "RequestStream": "async_engine",
    "ComputeThread": "compute_thread",
    "EngineConfig": "config", "parse_dtype": "config",
    "LLMEngine": "engine",
    "AttentionContext": "model_api", "CausalLM": "model_api", "KVCacheSpec": "model_api",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
