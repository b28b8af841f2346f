"""DeepSeek-V2 and DeepSeek-V3 style decoders: MLA attention over a compressed-latent
KV cache and DeepSeek MoE (routed + shared experts); the first
``first_k_dense_replace`` layers have a dense SwiGLU MLP.

Routing (see :class:`xllm.kernels.RoutingConfig`):

- V2: softmax scores; ``topk_method`` ``greedy`` or ``group_limited_greedy``
  (``n_group`` groups ranked by their best score, ``topk_group`` kept); weights
  times ``routed_scaling_factor``. With ``norm_topk_prob`` the weights are
  renormalized instead of scaled (the DeepSeek-V2 reference rule; transformers
  5.23 ignores ``norm_topk_prob`` for V2 -- every released V2 checkpoint has it
  false, where both agree).
- V3: sigmoid scores; experts chosen on scores + ``e_score_correction_bias``
  inside the ``topk_group`` best of ``n_group`` groups (ranked by the sum of
  their two best biased scores); weights from the unbiased scores,
  renormalized when ``norm_topk_prob``, then times ``routed_scaling_factor``.

Multi-token-prediction layers of V3 checkpoints (``model.layers.<num_hidden_layers>...``)
are not used and skipped at load.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from xllm.core.model_api import AttentionContext, KVCacheSpec
from xllm.kernels import RotaryTable, RoutingConfig, linear
from xllm.models.config import ModelConfig, ModelConfigError
from xllm.models.layers import Linear, RMSNorm
from xllm.models.llama import LlamaMLP, LlamaModel
from xllm.models.mla import MLADims, MLAttention, build_mla_rotary
from xllm.models.moe import SparseMoeBlock
from xllm.models.weights import StackedName, load_named_weights

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm block: MLA attention then a dense or MoE MLP, residual carried fused with the norms."""

    def __init__(self, cfg: ModelConfig, layer: int, attn: MLAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekV2ForCausalLM(nn.Module):
    """DeepSeek-V2 (incl. V2-Lite: no ``q_lora_rank``) with HF weight names.

    KV cache: one shared head of ``kv_lora_rank + qk_rope_head_dim`` channels per
    token and layer, no separate values (see :mod:`xllm.models.mla`).
    """

    version = 2
    stacked_names = (
        StackedName(".qkv_a_proj", ".q_a_proj", "q"),
        StackedName(".qkv_a_proj", ".q_proj", "q"),
        StackedName(".qkv_a_proj", ".kv_a_proj_with_mqa", "kv_a"),
        *LlamaMLP.stacked_names,
    )

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.require_silu(type(self).__name__)
        self.cfg = cfg
        self.dims = MLADims.from_config(cfg)
        self.max_context_len = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        interleaved = self.version == 2 or bool(cfg.get("rope_interleave", True))
        layers = [DeepseekDecoderLayer(cfg, i, MLAttention(cfg, i, self.dims, interleaved), self.build_mlp(cfg, i))
                  for i in range(cfg.num_layers)]
        self.model = LlamaModel(cfg, layers)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryTable | None = None

    # ---- construction ---------------------------------------------------------------------
    def routing(self, cfg: ModelConfig) -> RoutingConfig:
        method = cfg.get("topk_method") or "greedy"
        groups = (int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1))
        if method == "greedy":
            groups = (1, 1)
        elif method != "group_limited_greedy":
            raise ModelConfigError(f"topk_method {method!r} is not supported for DeepSeek-V2 "
                                   "(supported: greedy, group_limited_greedy)")
        return RoutingConfig(top_k=int(cfg.raw["num_experts_per_tok"]), scoring="softmax",
                             renormalize=bool(cfg.get("norm_topk_prob", False)), num_groups=groups[0],
                             topk_groups=groups[1], group_score="max",
                             scaling=float(cfg.get("routed_scaling_factor", 1.0)), scale_after_renormalize=False)

    def build_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        bias = bool(cfg.get("mlp_bias", False)) if self.version == 2 else False
        experts = int(cfg.get("n_routed_experts") or 0)
        if layer < int(cfg.get("first_k_dense_replace") or 0) or experts == 0:
            return LlamaMLP(cfg.hidden_size, int(cfg.raw["intermediate_size"]), bias)
        inter = int(cfg.raw["moe_intermediate_size"])
        n_shared = int(cfg.get("n_shared_experts") or 0)
        shared = LlamaMLP(cfg.hidden_size, inter * n_shared, bias) if n_shared else None
        return SparseMoeBlock(cfg.hidden_size, experts, inter, self.routing(cfg), fp32_router=True,
                              correction_bias=self.version == 3, shared=shared)

    def post_load(self) -> None:
        """Build the RoPE table and the per-head absorbed-weight views once parameters are loaded."""
        self.rotary = build_mla_rotary(self.cfg, self.dims)
        for layer in self.model.layers:
            layer.self_attn.post_load()

    # ---- the CausalLM contract ------------------------------------------------------------
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.cfg.num_layers, 1, self.dims.cache_dim, 0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions, hidden.dtype)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, cos, sin, ctx)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return linear(hidden, self.model.embed_tokens.weight).float()

    def load_weights(self, weights) -> None:
        """Copy ``(hf_name, tensor)`` pairs into the parameters; every parameter must be set.
        Tensors of layers past ``num_hidden_layers`` (V3's MTP module) are skipped."""
        skip = ("rotary_emb.inv_freq",)
        if self.lm_head is None:
            skip += ("lm_head.weight",)
        num_layers = self.cfg.num_layers

        def used(pairs):
            for name, tensor in pairs:
                m = _LAYER_RE.match(name)
                if m is None or int(m.group(1)) < num_layers:
                    yield name, tensor

        load_named_weights(self, used(weights), self.stacked_names, skip_suffixes=skip)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 style: sigmoid routing with correction bias (``noaux_tc``), LoRA queries."""

    version = 3

    def routing(self, cfg: ModelConfig) -> RoutingConfig:
        return RoutingConfig(top_k=int(cfg.raw["num_experts_per_tok"]), scoring="sigmoid",
                             renormalize=bool(cfg.get("norm_topk_prob", True)),
                             num_groups=int(cfg.get("n_group") or 1), topk_groups=int(cfg.get("topk_group") or 1),
                             group_score="top2_sum", scaling=float(cfg.get("routed_scaling_factor", 1.0)))
