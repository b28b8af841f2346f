"""KV cache memory backends.

Every backend implements :class:`xllm.core.kv.base.KVCacheBackend`, which is the three contracts
of :mod:`xllm.core.kv.contracts`, each held by who uses it: :class:`KVAllocator` (the scheduler:
``admit``/``allocate``/``free``, prefix registration, lower-tier loads), :class:`KVTensors` (the
model runner: the per-layer tensors attention reads and the
:class:`~xllm.core.kv.addressing.KVAddressing` that tells it how to reach them) and
:class:`KVTransfer` (moves, hand-offs and the engine service: pages as bytes, block hashes, tiers,
events). Backends are chosen by name from :data:`xllm.engine_api.names.KV_BACKENDS` (torch-free)
and imported on first use; each sizes itself (block size, row padding, a fallback where it cannot run).
"""

from typing import TYPE_CHECKING

from xllm.common.lazy import lazy_exports

if TYPE_CHECKING:
    from xllm.core.kv.base import KVCacheBackend, build_kv_cache
    from xllm.core.kv.contracts import KVAllocator, KVTensors, KVTransfer
    from xllm.core.kv.layout import KVCacheLayout, PrefixStats

_EXPORTS = {
    "KVCacheBackend": "base", "build_kv_cache": "base",
    "KVAllocator": "contracts", "KVTensors": "contracts", "KVTransfer": "contracts",
    "KVCacheLayout": "layout", "PrefixStats": "layout",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
