"""KV cache memory backends.

Every backend implements :class:`xllm.core.kv.base.KVCacheBackend`: block accounting for the
scheduler (``admit``/``allocate``/``free``), the per-layer tensors attention reads and the
:class:`~xllm.core.kv.addressing.KVAddressing` that tells the model runner how to reach them.
Backends are chosen by name from :data:`~xllm.core.kv.registry.KV_BACKENDS` (torch-free) and
imported on first use.
"""

from typing import TYPE_CHECKING

from xllm.common.lazy import lazy_exports

if TYPE_CHECKING:
    from xllm.core.kv.base import KVCacheBackend, KVCacheLayout, PrefixStats, build_kv_cache
    from xllm.core.kv.registry import KV_BACKENDS

_EXPORTS = {
    "KV_BACKENDS": "registry",
    "KVCacheBackend": "base", "KVCacheLayout": "base", "PrefixStats": "base", "build_kv_cache": "base",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
