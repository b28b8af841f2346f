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

Multi-token-prediction (MTP) layers of V3 checkpoints (``num_nextn_predict_layers``; tensors
``model.layers.<num_hidden_layers + i>.*``) are skipped at load, unless the model is built with
``mtp=True`` (``--speculative mtp``): then the first one is loaded as :class:`DeepseekMTPModule`
and lent to the ``mtp`` proposer through :meth:`DeepseekV2ForCausalLM.mtp_layers` (see
:class:`DeepseekMTP` for its semantics). A model can also lend a view of its first layers
(``--speculative self``: :meth:`DeepseekV2ForCausalLM.layer_prefix`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from xllm.core.model_api import AttentionContext, KVCacheSpec
from xllm.kernels import RotaryTable, RoutingConfig
from xllm.models.config import ModelConfig, ModelConfigError
from xllm.models.expert_parallel import ExpertParallelHost
from xllm.models.layers import Linear, LMHead, RMSNorm, TiedLMHead
from xllm.models.llama import LlamaMLP, LlamaModel
from xllm.models.mla import MLADims, MLAttention, build_mla_rotary
from xllm.models.moe import SparseMoeBlock
from xllm.models.prefix import layer_prefix_view
from xllm.models.tensor_parallel import SHARED_INTERMEDIATE_KEY, TPShard
from xllm.models.tp_layers import local_vocab, parallel_head
from xllm.models.weights import StackedName, load_named_weights

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_OWN = ("enorm", "hnorm", "eh_proj", "shared_head")  # an MTP layer's tensors outside its decoder block


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm block: MLA attention then a dense or MoE MLP, residual carried fused with the norms.
    On a tensor-parallel rank each part's output (its heads' ``o_proj`` columns; its channels of the
    dense MLP, or of every routed and shared expert) is all-reduced over ``tp.comm`` before the
    residual add."""

    def __init__(self, cfg: ModelConfig, layer: int, attn: MLAttention, mlp: nn.Module,
                 tp: TPShard | None = None) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.comm = tp.comm if tp is not None and tp.parallel else None

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, ctx)
        if self.comm is not None:
            hidden = self.comm.all_reduce(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.comm is not None:
            hidden = self.comm.all_reduce(hidden)
        return hidden, residual


class SharedHead(nn.Module):
    """An MTP module's output head: ``head(norm(h))`` (checkpoint ``shared_head.norm`` / ``.head``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class DeepseekMTPModule(nn.Module):
    """The parameters of one DeepSeek-V3 next-token-prediction layer (checkpoint names under
    ``model.layers.<num_hidden_layers + i>``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head`` and
    a full decoder block, here ``block``). Its ``embed_tokens`` is the main model's (DeepSeek-V3's
    README_WEIGHTS: shared), so the checkpoint's copy is not loaded. The block's attention is KV
    layer 0 of the MTP's own cache."""

    def __init__(self, cfg: ModelConfig, dims: MLADims, interleaved: bool, mlp: nn.Module,
                 tp: TPShard | None = None) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)  # (replicated on tensor-parallel ranks)
        self.block = DeepseekDecoderLayer(cfg, 0, MLAttention(cfg, 0, dims, interleaved), mlp, tp)


class DeepseekMTP:
    """One MTP layer as the ``mtp`` proposer runs it (:class:`xllm.core.spec.base.MTPLayer`).

    Row ``t`` at position ``i`` takes the token one past ``i`` and a hidden state ``h_i`` of
    position ``i`` (the main model's final, normed hidden state, or this module's own output when
    chained, as vLLM chains it) and computes

        h' = block(eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i))))    (block output + residual)
        logits = shared_head.head(shared_head.norm(h'))                      (predicting t_{i+2})

    with the embedding rows of position 0 zeroed (as vLLM does). RoPE is the main model's table.
    """

    def __init__(self, model: DeepseekV2ForCausalLM, module: DeepseekMTPModule) -> None:
        self.model, self.module = model, module
        self.max_context_len = model.max_context_len
        self.vocab_size = model.vocab_size

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(1, 1, self.model.dims.cache_dim, 0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        m = self.module
        embeds = self.model.model.embed_tokens(input_ids).masked_fill((positions == 0).unsqueeze(-1), 0)
        hidden = m.eh_proj(torch.cat([m.enorm(embeds), m.hnorm(previous.to(embeds.dtype))], dim=-1))
        cos, sin = self.model.rotary.lookup(positions, hidden.dtype)
        hidden, residual = m.block(hidden, None, cos, sin, ctx)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.module.shared_head
        return head.head(head.norm(hidden)).float()


class DeepseekV2ForCausalLM(ExpertParallelHost, nn.Module):
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

    def __init__(self, cfg: ModelConfig, mtp: bool = False, tp: TPShard | None = None) -> None:
        """``mtp``: also build (and load) the first next-token-prediction layer (V3 checkpoints with
        ``num_nextn_predict_layers`` > 0; :class:`ModelConfigError` otherwise). ``tp``: this process's
        tensor-parallel shard (``cfg`` its local config), as :class:`~xllm.models.llama.LlamaForCausalLM`
        takes it: heads split, the latent KV whole on every rank."""
        super().__init__()
        cfg.require_silu(type(self).__name__)
        self.cfg = cfg
        self.tp = tp or TPShard()
        self.dims = MLADims.from_config(cfg)
        self.max_context_len = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        interleaved = self.version == 2 or bool(cfg.get("rope_interleave", True))
        layers = [DeepseekDecoderLayer(cfg, i, MLAttention(cfg, i, self.dims, interleaved), self.build_mlp(cfg, i),
                                       self.tp) for i in range(cfg.num_layers)]
        self.model = LlamaModel(cfg, layers, self.tp)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, local_vocab(cfg, self.tp),
                                                                   bias=False)
        self._tied_head: TiedLMHead | None = None
        self.rotary: RotaryTable | None = None
        self.mtp = nn.ModuleList()  # the loaded MTP layer (only with mtp=True)
        if mtp:
            if self.version != 3 or int(cfg.get("num_nextn_predict_layers") or 0) < 1:
                raise ModelConfigError(f"{cfg.architecture} has no multi-token-prediction layers "
                                       "(num_nextn_predict_layers is 0): --speculative mtp needs them")
            self.mtp.append(DeepseekMTPModule(cfg, self.dims, interleaved, self.build_mlp(cfg, cfg.num_layers),
                                              self.tp))
        self._mtp_layers: list[DeepseekMTP] = []

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
        shared_inter = int(cfg.get(SHARED_INTERMEDIATE_KEY) or inter * n_shared)  # (a rank's: its channels)
        shared = LlamaMLP(cfg.hidden_size, shared_inter, bias) if n_shared else None
        return SparseMoeBlock(cfg.hidden_size, experts, inter, self.routing(cfg), fp32_router=True,
                              correction_bias=self.version == 3, shared=shared, slots=self.tp.expert_slots(experts))

    def post_load(self) -> None:
        """Build the RoPE table and the per-head absorbed-weight views once parameters are loaded."""
        self.rotary = build_mla_rotary(self.cfg, self.dims)
        for layer in self.model.layers:
            layer.self_attn.post_load()
        for module in self.mtp:
            module.block.self_attn.post_load()
        self._mtp_layers = [DeepseekMTP(self, module) for module in self.mtp]

    # ---- what speculative decoding borrows (xllm.core.spec) --------------------------------
    def mtp_layers(self) -> list[DeepseekMTP]:
        """The loaded MTP layers (:class:`xllm.core.spec.base.SupportsMTP`; empty unless built with
        ``mtp=True``)."""
        return self._mtp_layers

    def layer_prefix(self, num_layers: int) -> DeepseekV2ForCausalLM:
        """A view of the first ``num_layers`` layers with the final norm and LM head, over the same
        weight tensors (:class:`xllm.core.spec.base.SupportsLayerPrefix`; see
        :func:`xllm.models.prefix.layer_prefix_view`)."""
        view = layer_prefix_view(self, num_layers)
        view.mtp = nn.ModuleList()
        view._mtp_layers = []
        return view

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
        return self._head().logits(hidden)

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """``compute_logits(hidden).argmax(-1)`` exactly, without the logits where the kernels allow."""
        return self._head().greedy(hidden)

    def _head(self) -> LMHead:
        """The LM head (over the full vocabulary on every tensor-parallel rank)."""
        head = self.lm_head
        if head is None:
            if self._tied_head is None:
                self._tied_head = TiedLMHead(self.model.embed_tokens.weight)
            head = self._tied_head
        return parallel_head(head, self.tp)

    def load_weights(self, weights) -> None:
        """Copy ``(hf_name, tensor)`` pairs into the parameters; every parameter must be set.
        Tensors of layers past ``num_hidden_layers`` (V3's MTP layers) are skipped, except the first
        MTP layer's when it was built (``mtp=True``; its ``embed_tokens`` copy is skipped: shared)."""
        skip = ("rotary_emb.inv_freq",)
        if self.lm_head is None:
            skip += ("lm_head.weight",)
        num_layers = self.cfg.num_layers
        num_mtp = len(self.mtp)

        def used(pairs):
            for name, tensor in pairs:
                m = _LAYER_RE.match(name)
                if m is None or int(m.group(1)) < num_layers:
                    yield name, tensor
                elif int(m.group(1)) < num_layers + num_mtp:
                    rest = name[m.end():]
                    head = rest.split(".", 1)[0]
                    if head == "embed_tokens":
                        continue
                    inner = rest if head in _MTP_OWN else f"block.{rest}"
                    yield f"mtp.{int(m.group(1)) - num_layers}.{inner}", tensor

        load_named_weights(self, used(weights), self.stacked_names, skip_suffixes=skip)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 style: sigmoid routing with correction bias (``noaux_tc``), LoRA queries."""

    version = 3

    def routing(self, cfg: ModelConfig) -> RoutingConfig:
        return RoutingConfig(top_k=int(cfg.raw["num_experts_per_tok"]), scoring="sigmoid",
                             renormalize=bool(cfg.get("norm_topk_prob", True)),
                             num_groups=int(cfg.get("n_group") or 1), topk_groups=int(cfg.get("topk_group") or 1),
                             group_score="top2_sum", scaling=float(cfg.get("routed_scaling_factor", 1.0)))
