"""Qwen2/Qwen2.5 (bias on q, k, v) and Qwen3 (RMSNorm on q and k per head): the
Llama block with those two switches."""

from __future__ import annotations

from xllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
