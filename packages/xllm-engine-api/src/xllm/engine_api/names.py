"""The name tables of the engine's flags: dtypes, weight quantizations, KV cache backends and
their storage, speculative proposers, KV transports. Each :class:`~xllm.common.NameRegistry` maps
a name to a ``"module:attribute"`` of the engine (``xllm.core``, ``xllm.engine``), imported only when
one is resolved: the flags (:mod:`xllm.engine_api.flags`) list the choices without torch, the
engine builds from the same tables."""

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

KV_BACKENDS: NameRegistry = NameRegistry("KV cache backend", {  # --kv-cache-backend
    "xtensor": "xllm.core.kv.xtensor:XTensorKVCache",
    "paged": "xllm.core.kv.paged:PagedKVCache",
    "contiguous": "xllm.core.kv.contiguous:ContiguousKVCache",
})

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "int8", "fp8_e4m3")
"""``--kv-cache-dtype`` values: ``auto`` stores K/V in the model dtype; ``int8`` and ``fp8_e4m3`` store
one-byte codes with an fp32 scale per token and KV head (:mod:`xllm.kernels.kv_quant`)."""

PROPOSERS: NameRegistry = NameRegistry("speculative proposer", {  # --speculative (xllm.core.spec)
    "ngram": "xllm.core.spec.ngram:NgramProposer",
    "self": "xllm.core.spec.selfspec:SelfProposer",
    "draft": "xllm.core.spec.draft:DraftProposer",
    "mtp": "xllm.core.spec.mtp:MTPProposer",
})

KV_TRANSPORTS: NameRegistry = NameRegistry("KV transport", {  # --kv-transfer (xllm.engine.handoff)
    "fd": "xllm.engine.handoff.fd:TRANSPORT",
    "grpc": "xllm.engine.handoff.grpc:TRANSPORT",
    "mooncake": "xllm.engine.handoff.mooncake:TRANSPORT",
})

TP_COMMS: tuple[str, ...] = ("auto", "shm", "gloo")
"""``--tp-comm`` values, the tensor-parallel ranks' all-reduce (:mod:`xllm.engine.ranks`): ``shm`` the native
shared-memory one (ranks of one host), ``gloo`` ``torch.distributed`` over TCP, ``auto`` shm where it is built."""
