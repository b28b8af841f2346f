"""Qwen3-MoE: the Qwen3 attention block (q/k RMSNorm per head) with sparse MoE MLPs.

Layer ``i`` is sparse when ``num_experts > 0``, ``i`` is not in
``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; otherwise it has
a dense SwiGLU MLP of ``intermediate_size``. Routing: softmax over the experts,
top ``num_experts_per_tok``, renormalized when ``norm_topk_prob``; router logits
in the model dtype (as HF computes them).
"""

from __future__ import annotations

from torch import nn

from xllm.kernels import RoutingConfig
from xllm.models.config import ModelConfig, ModelConfigError
from xllm.models.expert_parallel import ExpertParallelHost
from xllm.models.llama import LlamaForCausalLM, LlamaMLP
from xllm.models.moe import SparseMoeBlock
from xllm.models.tensor_parallel import TPShard


def _sparse_layer(cfg: ModelConfig, layer: int) -> bool:
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    return experts > 0 and layer not in (cfg.get("mlp_only_layers") or []) and (layer + 1) % step == 0


class Qwen3MoeForCausalLM(ExpertParallelHost, LlamaForCausalLM):
    """Qwen3-MoE decoder with HF weight names (experts stacked, qkv / gate_up fused at load)."""

    qk_norm = True

    def __init__(self, cfg: ModelConfig, tp: TPShard | None = None) -> None:
        if cfg.get("use_sliding_window"):
            raise ModelConfigError("Qwen3-MoE with use_sliding_window=true is not supported")
        super().__init__(cfg, tp)

    def build_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        if not _sparse_layer(cfg, layer):
            return LlamaMLP(cfg.hidden_size, int(cfg.raw["intermediate_size"]), False)
        routing = RoutingConfig(top_k=int(cfg.raw["num_experts_per_tok"]), scoring="softmax",
                                renormalize=bool(cfg.get("norm_topk_prob", False)))
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts"))
        return SparseMoeBlock(cfg.hidden_size, experts, int(cfg.raw["moe_intermediate_size"]), routing,
                              slots=self.tp.expert_slots(experts))
