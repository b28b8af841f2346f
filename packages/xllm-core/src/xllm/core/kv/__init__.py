"""KV cache memory backends.

Every backend implements :class:`xllm.core.kv.base.KVCacheBackend`: block
accounting for the batch policy (``allocate``/``free``) plus the per-layer
tensors attention reads. Backends are chosen by name through
:func:`create_kv_cache` and imported lazily.
"""

from xllm.core.kv.base import KVCacheBackend, KVCacheLayout, build_kv_cache, create_kv_cache

__all__ = ["KVCacheBackend", "KVCacheLayout", "build_kv_cache", "create_kv_cache"]
