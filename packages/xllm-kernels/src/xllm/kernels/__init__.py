"""Compute ops of xLLM.

Every op here is a plain function on torch tensors with a stated contract and a
pure-torch reference implementation; faster native paths may replace the body
but never the contract.

- :mod:`xllm.kernels.norm`: RMSNorm, optionally fused with the residual add.
- :mod:`xllm.kernels.rotary`: rotary position embedding tables and application.
- :mod:`xllm.kernels.activation`: SiLU-and-multiply.
- :mod:`xllm.kernels.attention`: prefill (varlen, chunked) and decode attention
  over per-sequence contiguous KV regions addressed by slot and length.
- :mod:`xllm.kernels.sampling`: penalties, logit bias, top-k/top-p/min-p, seeded sampling.
- :mod:`xllm.kernels.linear`: linear layers with a native skinny-GEMM path for decode.
- :mod:`xllm.kernels.gemm`: the native blocked GEMM over packed weights (any row count), and
  :mod:`xllm.kernels.gemm_choice`: the measured per-shape choice between it and oneDNN.
- :mod:`xllm.kernels.native`: the C kernels (``kernels/cpu``) built on first use, with fallbacks.
- :mod:`xllm.kernels.quant`: weight-only quantized linears (GGUF Q8_0/Q4_0/Q4_1 as stored, int8,
  int4 g32/g128): formats, (de)quantization, ``quant_linear`` (native VNNI kernels in
  :mod:`xllm.kernels.quant_native`).
- :mod:`xllm.kernels.moe`: expert routing (softmax/sigmoid, group-limited, bias-corrected)
  and the routed SwiGLU experts.
- :mod:`xllm.kernels.mla`: multi-head latent attention helpers (interleaved RoPE,
  weight-absorbed query/value projections).
- :mod:`xllm.kernels.lora`: the segmented multi-LoRA product of a projection over a step's rows
  (one native call, else a torch loop over the adapters).
"""

from xllm.kernels.activation import silu_and_mul
from xllm.kernels.attention import (
    decode_attention,
    paged_decode_attention,
    paged_prefill_attention,
    paged_write_kv,
    prefill_attention,
)
from xllm.kernels.gemm import PackedWeight, packed_linear
from xllm.kernels.linear import linear
from xllm.kernels.mla import absorb_query, apply_rotary_interleaved, expand_values
from xllm.kernels.moe import RoutingConfig, moe_expert_pairs, moe_experts, select_experts
from xllm.kernels.norm import rms_norm
from xllm.kernels.rotary import RopeBatch, RotaryTable, apply_rotary

__all__ = [
    "PackedWeight",
    "RopeBatch",
    "RotaryTable",
    "RoutingConfig",
    "absorb_query",
    "apply_rotary",
    "apply_rotary_interleaved",
    "decode_attention",
    "expand_values",
    "linear",
    "moe_expert_pairs",
    "moe_experts",
    "packed_linear",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_write_kv",
    "prefill_attention",
    "rms_norm",
    "select_experts",
    "silu_and_mul",
]
