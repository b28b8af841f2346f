"""The dtypes an engine runs in, by name (torch is imported only when one is resolved)."""

from __future__ import annotations

from xllm.common import NameRegistry

DTYPES: NameRegistry = NameRegistry("dtype", {  # name -> torch.dtype
    "bfloat16": "torch:bfloat16",
    "float32": "torch:float32",
    "float16": "torch:float16",
}, aliases={"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}, normalize=str.lower)

# Weight quantization of an engine's linear layers (``--quantization``), name -> the format of
# xllm.kernels.quant it stores weights in (None: no format of its own). "auto": a GGUF file's linears keep
# the format they are stored in (Q8_0/Q4_0/Q4_1), other checkpoints stay float; "none": float weights (a
# GGUF dequantized) in the engine's dtype; the others quantize a float checkpoint's linears at load:
# "int8" per output channel (symmetric), "int4" / "int4_g128" group-wise (asymmetric, a scale and a zero
# point per group of 32 / 128 input columns); "w8a8" the weights as "int8" and the activations rounded to
# int8 per row in every product (VNNI int8 GEMM: twice the bf16 multiply rate; changes outputs).
WEIGHT_QUANTIZATIONS: dict[str, str | None] = {
    "auto": None, "none": None, "int8": "int8", "int4": "int4_g32", "int4_g128": "int4_g128", "w8a8": "w8a8"}
_QUANTIZATION_ALIASES = {"int4_g32": "int4"}


def quantization_choices() -> list[str]:
    """Every accepted ``--quantization`` spelling (canonical names first)."""
    return [*WEIGHT_QUANTIZATIONS, *_QUANTIZATION_ALIASES]


def canonical_quantization(name: str) -> str:
    """The canonical ``--quantization`` name of ``name``; ``ValueError`` lists the known ones."""
    key = _QUANTIZATION_ALIASES.get(name.lower(), name.lower())
    if key not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; known: {', '.join(quantization_choices())}")
    return key
