"""The dtypes an engine runs in, by name (torch is imported only when one is resolved)."""

from __future__ import annotations

from xllm.common import NameRegistry

DTYPES: NameRegistry = NameRegistry("dtype", {  # name -> torch.dtype
    "bfloat16": "torch:bfloat16",
    "float32": "torch:float32",
    "float16": "torch:float16",
}, aliases={"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}, normalize=str.lower)
