"""Llama-architecture decoder (Llama 2/3, SmolLM, Mistral-style), our own implementation.

Also the base for Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm): the attention block
takes those as options, so those models only change their config reading.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from xllm.core.model_api import AttentionContext, KVCacheSpec
from xllm.core.overlap import MicroBatch
from xllm.core.parallel.comm import PendingReduce, Reduced
from xllm.kernels import RopeBatch, RotaryTable, apply_rotary, silu_and_mul
from xllm.models.config import ModelConfig
from xllm.models.layers import (
    Linear,
    LMHead,
    MergedLinear,
    PackOnDemand,
    QuantTiedHead,
    RMSNorm,
    TiedLMHead,
    build_rotary,
    streamed_tensors,
    tied_lm_head,
)
from xllm.models.llama_native import FusedLlamaForward
from xllm.models.lora import LoraAdapterError, LoraStack
from xllm.models.prefix import layer_prefix_view
from xllm.models.tensor_parallel import TPShard
from xllm.models.tp_layers import local_vocab, parallel_head, vocab_embedding
from xllm.models.weights import StackedName, load_named_weights


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=bool(cfg.get("attention_bias", False)))
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.scale = self.head_dim**-0.5
        self.q_size, self.kv_size = q_size, kv_size

    def forward(self, hidden: torch.Tensor, rope: RopeBatch, ctx: AttentionContext) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.q_norm is None:  # q and k heads lead each row: rotate them in place, in one pass
            rope.rotate_(qkv, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            cos, sin = rope.cos_sin(q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = ctx.attention(self.layer, q, k, v, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU MLP; ``gate_proj`` and ``up_proj`` are loaded into one fused ``gate_up_proj``."""

    # checkpoint names of the two halves of gate_up_proj (every model using this MLP lists them)
    stacked_names = (
        StackedName(".gate_up_proj", ".gate_proj", "gate"),
        StackedName(".gate_up_proj", ".up_proj", "up"),
    )

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate": intermediate, "up": intermediate}, bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block. On a tensor-parallel rank the attention's and the MLP's outputs are the rank's
    partial sums (its heads' ``o_proj`` columns, its channels' ``down_proj`` columns): ``tp.comm``
    all-reduces each before the residual add."""

    def __init__(self, cfg: ModelConfig, layer: int, qkv_bias: bool, qk_norm: bool, mlp: nn.Module,
                 tp: TPShard | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer, qkv_bias, qk_norm)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.comm = tp.comm if tp is not None and tp.parallel else None

    def forward(self, hidden, residual, rope, ctx):
        hidden, residual = self.attend(hidden, residual, rope, ctx)
        if self.comm is not None:
            hidden = self.comm.all_reduce(hidden)
        hidden, residual = self.feed_forward(hidden, residual)
        if self.comm is not None:
            hidden = self.comm.all_reduce(hidden)
        return hidden, residual

    def attend(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RopeBatch,
               ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's first half: the attention output (a rank's partial sum) and the residual."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return self.self_attn(hidden, rope, ctx), residual

    def feed_forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's second half over the (summed) attention output: the MLP's output (a rank's partial
        sum) and the residual."""
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


@dataclass
class _InFlight:
    """One micro-batch of :meth:`LlamaForCausalLM.forward_overlapped`: its last half-layer's output,
    being summed (``pending``), its residual, RoPE rows and attention."""

    pending: PendingReduce
    residual: torch.Tensor | None
    rope: RopeBatch
    ctx: AttentionContext


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], tp: TPShard | None = None) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg, tp or TPShard())
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM with the HF Llama weight names (fused at load time).

    ``tp``: this process's tensor-parallel shard (default: the whole model in one process). A rank's
    ``cfg`` is its local config (:meth:`TPShard.local_config`: its heads and MLP channels); its
    embedding and LM head hold its vocabulary rows (:mod:`xllm.models.tp_layers`); ``tp.comm`` joins
    the partial results, so every rank's ``forward`` / ``compute_logits`` / ``compute_greedy`` return
    the full model's. ``model.tp`` is public (fused forwards read it).
    """

    qkv_bias = False
    qk_norm = False
    stacked_names = (
        StackedName(".qkv_proj", ".q_proj", "q"),
        StackedName(".qkv_proj", ".k_proj", "k"),
        StackedName(".qkv_proj", ".v_proj", "v"),
        *LlamaMLP.stacked_names,
    )

    def __init__(self, cfg: ModelConfig, tp: TPShard | None = None) -> None:
        super().__init__()
        cfg.require_silu(type(self).__name__)
        self.cfg = cfg
        self.tp = tp or TPShard()
        self.max_context_len = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        # HF Llama/Mistral put a bias on q, k, v and o alike when ``attention_bias`` is set.
        qkv_bias = self.qkv_bias or bool(cfg.get("attention_bias", False))
        layers = [
            LlamaDecoderLayer(cfg, i, qkv_bias, self.qk_norm, self.build_mlp(cfg, i), self.tp)
            for i in range(cfg.num_layers)
        ]
        self.model = LlamaModel(cfg, layers, self.tp)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, local_vocab(cfg, self.tp),
                                                                   bias=False)
        self.rotary: RotaryTable | None = None
        self._fused: FusedLlamaForward | None = None
        self._tied_head: TiedLMHead | QuantTiedHead | None = None  # the LM head reading the embedding (tied)
        self._lora: LoraStack | None = None  # LoRA adapter slots (lora_stack), built on first use

    def post_load(self) -> None:
        """Build non-parameter state (RoPE table, native decoder) once parameters are materialized."""
        self.rotary = build_rotary(self.cfg, self.cfg.head_dim)
        self._fused = FusedLlamaForward(self) if FusedLlamaForward.model_supported(self) else None
        if self._fused is not None and getattr(self, "_lora", None) is not None:  # (rebuilt after a weight update)
            self._fused.attach_lora(self._lora)

    def fused_forward(self) -> FusedLlamaForward | None:
        """The native whole-step forward (:class:`xllm.core.model_api.SupportsFusedForward`), or None
        when the native kernels are unavailable or the layout is one they do not implement."""
        return self._fused

    def lora_stack(self, max_loras: int, max_rank: int) -> LoraStack:
        """The model's LoRA adapter slots (:class:`xllm.core.model_api.SupportsLora`), built on the first call;
        a later call with the same sizes returns them, with other sizes replaces them (the engine that asked
        before must be gone). Not on a tensor-parallel shard."""
        if self.tp.parallel:
            raise LoraAdapterError("LoRA adapters are not served with tensor parallelism yet")
        if self._lora is None or (self._lora.max_loras, self._lora.max_rank) != (max_loras, max_rank):
            self._lora = LoraStack(list(self.model.layers), max_loras, max_rank)
            if self._fused is not None:  # the fused steps add the adapters too
                self._fused.attach_lora(self._lora)
        return self._lora

    def layer_prefix(self, num_layers: int) -> LlamaForCausalLM:
        """A view of the first ``num_layers`` layers with the final norm and LM head, over the same
        weight tensors (:class:`xllm.core.spec.base.SupportsLayerPrefix`, ``--speculative self``; see
        :func:`xllm.models.prefix.layer_prefix_view`), with its own fused native forward over those
        layers where the kernels take them."""
        if self.lm_head is None and self._tied_head is None:  # one tied head (and its packed copies)
            self._tied_head = tied_lm_head(self.model.embed_tokens)
        view = layer_prefix_view(self, num_layers)
        view._fused = FusedLlamaForward(view) if self._fused is not None else None
        return view

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the final norm's: float even when the linears are quantized)."""
        return self.model.norm.weight.dtype

    def build_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return LlamaMLP(cfg.hidden_size, int(cfg.raw["intermediate_size"]), bool(cfg.get("mlp_bias", False)))

    def kv_cache_spec(self) -> KVCacheSpec:
        c = self.cfg
        return KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        return self.decode_layers(self.model.embed_tokens(input_ids), RopeBatch(self.rotary, positions), ctx)

    def decode_layers(self, hidden: torch.Tensor, rope: RopeBatch, ctx: AttentionContext) -> torch.Tensor:
        """Every decoder layer and the final norm over embedded rows ``hidden`` (what :meth:`forward` runs after
        the embedding; multimodal subclasses embed their own rows first)."""
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, rope, ctx)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def embed_with_images(self, input_ids: torch.Tensor, image_token_id: int, image_embeds: torch.Tensor | None,
                          image_rows: torch.Tensor | None) -> torch.Tensor:
        """The token embeddings of ``input_ids`` with rows ``image_rows`` (default: every ``image_token_id``
        token) replaced by ``image_embeds``, in order (multimodal subclasses); ``ValueError`` when the counts
        differ."""
        hidden = self.model.embed_tokens(input_ids)
        if image_embeds is None:
            return hidden
        rows = (input_ids == image_token_id).nonzero().flatten() if image_rows is None else image_rows
        if rows.shape[0] != image_embeds.shape[0]:
            raise ValueError(f"image_embeds has {image_embeds.shape[0]} rows for {rows.shape[0]} image tokens")
        hidden = hidden.clone()
        hidden[rows] = image_embeds.to(hidden.dtype)
        return hidden

    def overlap_supported(self) -> bool:
        """Whether :meth:`forward_overlapped` runs here: a tensor-parallel shard (all-reduces to hide) of this
        class's forward over Llama decoder layers (a subclass that changes ``forward`` must say for itself)."""
        return (self.tp.parallel and type(self).forward is LlamaForCausalLM.forward
                and all(isinstance(layer, LlamaDecoderLayer) for layer in self.model.layers))

    def forward_overlapped(self, parts: Sequence[MicroBatch]) -> torch.Tensor:
        """``forward`` of each part (its own rows, positions and attention), concatenated in part order, with
        the parts' half-layers interleaved: a part's all-reduce (``comm.all_reduce_start``) is waited on
        only when that part needs the sum, after the other parts computed their half-layer
        (:mod:`xllm.core.overlap`). Every rank must call it with the same parts' row counts."""
        comm = self.tp.comm
        embedded = self.model.embed_tokens(torch.cat([p.input_ids for p in parts]))
        flights = [_InFlight(Reduced(h), None, RopeBatch(self.rotary, p.positions), p.ctx)
                   for p, h in zip(parts, embedded.split([len(p.input_ids) for p in parts]), strict=True)]
        for layer in self.model.layers:
            for f in flights:
                out, f.residual = layer.attend(f.pending.wait(), f.residual, f.rope, f.ctx)
                f.pending = comm.all_reduce_start(out)
            for f in flights:
                out, f.residual = layer.feed_forward(f.pending.wait(), f.residual)
                f.pending = comm.all_reduce_start(out)
        return torch.cat([self.model.norm(f.pending.wait(), f.residual)[0] for f in flights])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head().logits(hidden)

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """``compute_logits(hidden).argmax(-1)`` exactly, without the logits where the kernels allow."""
        return self._head().greedy(hidden)

    def drop_packed(self) -> None:
        """Forget every packed weight copy and the fused forward bound over them: call after writing
        weights in place (loading made the copies; they are rebuilt from the new weights on demand)."""
        for m in self.modules():
            if isinstance(m, PackOnDemand):
                m.drop_packed()
        self._tied_head = None
        self.post_load()

    def streamed_tensors(self) -> list[torch.Tensor]:
        """What the kernels stream every step, in module order (the embedding, each layer's projections:
        packed copies made here, then the plain weights) and the LM head last
        (:class:`xllm.models.placement.StreamsWeights`)."""
        return [t for part in [*self.modules(), self._local_head()] for t in streamed_tensors(part)]

    def _local_head(self) -> LMHead:
        """The LM head over this rank's vocabulary rows (all of them in one process)."""
        if self.lm_head is not None:
            return self.lm_head
        if self._tied_head is None:
            self._tied_head = tied_lm_head(self.model.embed_tokens)
        return self._tied_head

    def _head(self) -> LMHead:
        return parallel_head(self._local_head(), self.tp)

    def load_weights(self, weights) -> None:
        """Copy ``(hf_name, tensor)`` pairs into the parameters; every parameter must be set."""
        skip = ("rotary_emb.inv_freq",)
        if self.lm_head is None:
            skip += ("lm_head.weight",)
        load_named_weights(self, weights, self.stacked_names, skip_suffixes=skip)
