"""The KV cache backends by name (torch is imported only when one is built)."""

from __future__ import annotations

from xllm.common import NameRegistry

KV_BACKENDS: NameRegistry = NameRegistry("KV cache backend", {
    "xtensor": "xllm.core.kv.xtensor:XTensorKVCache",
    "paged": "xllm.core.kv.paged:PagedKVCache",
    "contiguous": "xllm.core.kv.contiguous:ContiguousKVCache",
})

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "int8", "fp8_e4m3")
"""``--kv-cache-dtype`` values: ``auto`` stores K/V in the model dtype; ``int8`` and ``fp8_e4m3`` store
one-byte codes with an fp32 scale per token and KV head (:mod:`xllm.kernels.kv_quant`)."""
