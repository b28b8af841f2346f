"""The KV cache backends by name (torch is imported only when one is built)."""

from __future__ import annotations

from xllm.common import NameRegistry

KV_BACKENDS: NameRegistry = NameRegistry("KV cache backend", {
    "xtensor": "xllm.core.kv.xtensor:XTensorKVCache",
    "paged": "xllm.core.kv.paged:PagedKVCache",
    "contiguous": "xllm.core.kv.contiguous:ContiguousKVCache",
})
