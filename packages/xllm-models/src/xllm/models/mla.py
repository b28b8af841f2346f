"""Multi-head latent attention (DeepSeek-V2/V3) over a compressed-latent KV cache.

Per token the cache holds one vector: the normalized KV latent ``c`` (``r =
kv_lora_rank`` channels) followed by the shared, roped key part ``k_pe``
(``qk_rope_head_dim``). With ``kv_b_proj`` split per head into ``W_UK`` (``[d_nope,
r]``) and ``W_UV`` (``[d_v, r]``), head ``h``'s attention

    softmax(scale * (q_nope . W_UK c + q_pe . k_pe)) . W_UV c

is computed without expanding keys or values ("weight absorption"): the query
becomes ``[q_nope W_UK ‖ q_pe]`` (``r + rope`` wide), the key is the cached
vector, the values are its first ``r`` channels, and ``W_UV`` is applied to the
attention output. Only ``r + rope`` numbers per token and layer are cached.

The softmax scale is ``qk_head_dim ** -0.5``, times ``mscale(factor,
mscale_all_dim) ** 2`` under YaRN scaling; RoPE is the interleaved-pair form
(DeepSeek-V2, and V3 unless ``rope_interleave`` is false: then rotate-half).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from xllm.core.model_api import AttentionContext
from xllm.kernels import RotaryTable, absorb_query, apply_rotary, apply_rotary_interleaved, expand_values
from xllm.models.config import ModelConfig, ModelConfigError, rope_parameters
from xllm.models.layers import Linear, MergedLinear, RMSNorm

LATENT_NORM_EPS = 1e-6  # HF and the reference use the RMSNorm default here, not rms_norm_eps


@dataclass(frozen=True)
class MLADims:
    """Head geometry of an MLA model, read from its config."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> MLADims:
        try:
            q_lora = cfg.get("q_lora_rank")
            return cls(cfg.num_heads, int(q_lora) if q_lora else None, int(cfg.raw["kv_lora_rank"]),
                       int(cfg.raw["qk_nope_head_dim"]), int(cfg.raw["qk_rope_head_dim"]), int(cfg.raw["v_head_dim"]))
        except KeyError as exc:
            raise ModelConfigError(f"config.json lacks MLA field {exc}") from exc

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Channels cached per token and layer: latent then roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: ModelConfig, dims: MLADims) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` when a scaled
    RoPE sets ``mscale_all_dim`` (DeepSeek's YaRN configs)."""
    scale = dims.qk_head_dim ** -0.5
    params = rope_parameters(cfg.raw)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale


def _yarn(dim: int, base: float, params: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies and cos/sin magnitude (``attention_factor``) for ``dim`` rotary channels."""
    orig = float(params.get("original_max_position_embeddings") or max_positions)
    factor = float(params["factor"]) if params.get("factor") is not None else max_positions / orig
    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the original (extrapolated) frequency per channel pair
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def build_mla_rotary(cfg: ModelConfig, dims: MLADims) -> RotaryTable:
    """The RoPE table of the ``qk_rope_head_dim`` channels (default, linear or YaRN)."""
    params = rope_parameters(cfg.raw)
    kind = params.get("rope_type", "default")
    base = float(params.get("rope_theta", cfg.rope_theta))
    dim = dims.qk_rope_head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = 1.0
    if kind == "yarn":
        inv_freq, scaling = _yarn(dim, base, params, cfg.max_position_embeddings)
    elif kind == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif kind != "default":
        raise ModelConfigError(f"rope_type {kind!r} is not supported for MLA (supported: default, linear, yarn)")
    return RotaryTable.build(dim, cfg.max_position_embeddings, base, inv_freq=inv_freq, attention_scaling=scaling)


class MLAttention(nn.Module):
    """DeepSeek attention with HF weight names; ``q_a_proj`` (or ``q_proj``) and
    ``kv_a_proj_with_mqa`` are fused into ``qkv_a_proj`` at load (same input)."""

    def __init__(self, cfg: ModelConfig, layer: int, dims: MLADims, interleaved_rope: bool) -> None:
        super().__init__()
        self.layer, self.dims = layer, dims
        bias = bool(cfg.get("attention_bias", False))
        h = dims.num_heads
        q_out = h * dims.qk_head_dim
        if dims.q_lora_rank is None:
            if bias:
                raise ModelConfigError("attention_bias without q_lora_rank is not supported")
            self.qkv_a_proj = MergedLinear(cfg.hidden_size, {"q": q_out, "kv_a": dims.cache_dim}, False)
            self.q_a_layernorm = self.q_b_proj = None
            self.q_a_size = q_out
        else:
            self.qkv_a_proj = MergedLinear(cfg.hidden_size, {"q": dims.q_lora_rank, "kv_a": dims.cache_dim}, bias)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(dims.q_lora_rank, q_out, bias=False)
            self.q_a_size = dims.q_lora_rank
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS)
        # never called: its per-head halves are used through views (see post_load)
        self.kv_b_proj = nn.Linear(dims.kv_lora_rank, h * (dims.qk_nope_head_dim + dims.v_head_dim), bias=False)
        self.o_proj = Linear(h * dims.v_head_dim, cfg.hidden_size, bias=bias)
        self.scale = softmax_scale(cfg, dims)
        self.rotate = apply_rotary_interleaved if interleaved_rope else apply_rotary
        self.w_uk: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None

    def post_load(self) -> None:
        """Per-head views of ``kv_b_proj``: ``w_uk`` ``[H, d_nope, r]``, ``w_uv`` ``[H, d_v, r]`` (no copy)."""
        d = self.dims
        per_head = self.kv_b_proj.weight.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        self.w_uk, self.w_uv = per_head[:, :d.qk_nope_head_dim], per_head[:, d.qk_nope_head_dim:]

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        d, t = self.dims, hidden.shape[0]
        q, kv_a = self.qkv_a_proj(hidden).split([self.q_a_size, d.cache_dim], dim=-1)
        if self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_pe = q.view(t, d.num_heads, d.qk_head_dim).split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(kv_a[:, :d.kv_lora_rank])
        k_pe = self.rotate(kv_a[:, None, d.kv_lora_rank:], cos, sin)
        query = torch.cat([absorb_query(q_nope, self.w_uk), self.rotate(q_pe, cos, sin)], dim=-1)
        key = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)
        out = ctx.attention(self.layer, query, key, None, self.scale, v_dim=d.kv_lora_rank)
        return self.o_proj(expand_values(out, self.w_uv).reshape(t, d.num_heads * d.v_head_dim))
