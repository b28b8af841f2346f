"""SmoothQuant scales for ``--quantization w8a8``: move activation outliers into the weights before both
are rounded to int8.

A product ``x . W^T`` equals ``(x / s) . (W * s)^T`` for any per-input-channel ``s > 0``. W8A8 rounds each
row of ``x`` to int8 with one scale (its largest value), so a few outlier channels (large in every token)
leave the other channels a handful of int8 steps; dividing those channels by ``s`` and multiplying the
weight's columns by it evens the two out. SmoothQuant's choice (Xiao et al., 2023),
``s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha)`` with ``alpha = 0.5``, from the largest value of each
input channel over a short calibration text (:data:`CALIBRATION_TEXT`, public domain, kept apart from the
benchmarks' held-out text).

The division by ``s`` is folded into what produces ``x``, so a smoothed model computes the same function
in exact arithmetic and costs nothing at run time, per decoder layer of a Llama-family model:

- ``qkv_proj`` and ``gate_up_proj`` read an RMSNorm's output: its weight is divided by ``s``;
- ``o_proj`` reads the attention output, a mix of the value rows: the ``v`` rows of ``qkv_proj`` (and their
  bias) are divided by ``s``, one scale per (KV head, channel) shared by the query heads of its group;
- ``down_proj`` reads ``silu(gate) * up``: the ``up`` rows of ``gate_up_proj`` are divided by ``s``.

Other architectures (and MoE MLPs) are quantized without smoothing.
"""

from __future__ import annotations

import logging
import pathlib

import torch
import torch.nn.functional as F
from torch import nn

from xllm.models.layers import Linear, MergedLinear

log = logging.getLogger(__name__)

CALIBRATION_TEXT = pathlib.Path(__file__).resolve().parent / "data" / "calibration.txt"
ALPHA = 0.5
_MIN_SCALE = 1e-5


class _CausalAttention:
    """The calibration forward's attention: one sequence, plain causal, no KV cache."""

    def attention(self, layer, q, k, v, scale, v_dim=None):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True, scale=scale)
        return o.transpose(0, 1)


def calibration_ids(model_dir: str | pathlib.Path, vocab_size: int, max_tokens: int = 512) -> list[int]:
    """:data:`CALIBRATION_TEXT` in ``model_dir``'s tokenizer (at most ``max_tokens``); a directory without a
    tokenizer (a random test model) gets ``max_tokens`` pseudo-random ids of its vocabulary instead."""
    model_dir = pathlib.Path(model_dir)
    if (model_dir / "tokenizer.json").exists() or (model_dir / "tokenizer_config.json").exists():
        from xllm.models.tokenizer import Tokenizer

        return Tokenizer(model_dir).encode(CALIBRATION_TEXT.read_text())[:max_tokens]
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (max_tokens,), generator=gen).tolist()


def smoothing_scales(act_max: torch.Tensor, w_max: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """SmoothQuant's per-input-channel ``s`` (fp32) for activations whose channels reach ``act_max`` and
    weight columns whose largest magnitude is ``w_max``; 1 where a channel never fired or its column is zero."""
    s = act_max.float().clamp(min=_MIN_SCALE).pow(alpha) / w_max.clamp(min=_MIN_SCALE).pow(1 - alpha)
    return torch.where((act_max > 0) & (w_max > 0), s.clamp(min=_MIN_SCALE), torch.ones_like(s))


@torch.inference_mode()
def smooth_for_w8a8(model: nn.Module, ids: list[int], alpha: float = ALPHA) -> int:
    """Fold SmoothQuant scales into a float Llama-family ``model`` (loaded, ``post_load`` done) from one
    forward over ``ids`` (see the module docstring); returns the number of layers smoothed (0 for other
    architectures). Call before quantizing to w8a8 (and build a fused forward again: ``post_load``)."""
    from xllm.models.llama import LlamaForCausalLM, LlamaMLP

    if not isinstance(model, LlamaForCausalLM) or not ids:
        return 0
    act_max: dict[nn.Module, torch.Tensor] = {}

    def record(module, args):
        x = args[0].detach().float().reshape(-1, args[0].shape[-1]).abs().amax(dim=0)
        act_max[module] = x if module not in act_max else torch.maximum(act_max[module], x)

    watched = []
    for layer in model.model.layers:
        watched += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
        if isinstance(layer.mlp, LlamaMLP):
            watched += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
    hooks = [m.register_forward_pre_hook(record) for m in watched]
    try:
        model.forward(torch.tensor(ids), torch.arange(len(ids)), _CausalAttention())
    finally:
        for h in hooks:
            h.remove()
    for layer in model.model.layers:
        attn = layer.self_attn
        _fold_into_norm(layer.input_layernorm.weight, attn.qkv_proj, act_max[attn.qkv_proj], alpha)
        _fold_into_values(attn, act_max[attn.o_proj], alpha)
        if isinstance(layer.mlp, LlamaMLP):
            mlp = layer.mlp
            _fold_into_norm(layer.post_attention_layernorm.weight, mlp.gate_up_proj, act_max[mlp.gate_up_proj],
                            alpha)
            _fold_into_up(mlp, act_max[mlp.down_proj], alpha)
    log.info("w8a8: SmoothQuant scales (alpha %.2f) folded into %d layers from %d calibration tokens", alpha,
             len(model.model.layers), len(ids))
    return len(model.model.layers)


def _column_max(linear: nn.Module) -> torch.Tensor:
    return linear.weight.detach().float().abs().amax(dim=0)


def _scale_columns(linear: Linear | MergedLinear, s: torch.Tensor) -> None:
    w = linear.weight
    w.copy_((w.float() * s[None, :]).to(w.dtype))
    linear.drop_packed()  # (the calibration forward may have packed the old weight)


def _scale_rows(linear: Linear | MergedLinear, rows: slice, inv: torch.Tensor) -> None:
    w = linear.weight
    w[rows] = (w[rows].float() * inv[:, None]).to(w.dtype)
    if linear.bias is not None:
        linear.bias[rows] = (linear.bias[rows].float() * inv).to(linear.bias.dtype)
    linear.drop_packed()


def _fold_into_norm(norm_weight: torch.Tensor, linear: nn.Module, act: torch.Tensor, alpha: float) -> None:
    s = smoothing_scales(act, _column_max(linear), alpha)
    norm_weight.copy_((norm_weight.float() / s).to(norm_weight.dtype))
    _scale_columns(linear, s)


def _fold_into_values(attn: nn.Module, act: torch.Tensor, alpha: float) -> None:
    """o_proj's scales into the v rows of qkv_proj, per (KV head, channel): the largest activation and weight
    column over the query heads that read that KV head."""
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    rep = nh // nkv
    w_max = _column_max(attn.o_proj).reshape(nkv, rep, hd).amax(dim=1)  # (query head h reads KV head h // rep)
    a_max = act.reshape(nkv, rep, hd).amax(dim=1)
    s = smoothing_scales(a_max.reshape(-1), w_max.reshape(-1), alpha)  # [nkv * hd]
    v0 = attn.q_size + attn.kv_size
    _scale_rows(attn.qkv_proj, slice(v0, v0 + attn.kv_size), 1 / s)
    _scale_columns(attn.o_proj, s.reshape(nkv, 1, hd).expand(nkv, rep, hd).reshape(-1))


def _fold_into_up(mlp: nn.Module, act: torch.Tensor, alpha: float) -> None:
    inter = mlp.down_proj.weight.shape[1]
    s = smoothing_scales(act, _column_max(mlp.down_proj), alpha)
    _scale_rows(mlp.gate_up_proj, slice(inter, 2 * inter), 1 / s)
    _scale_columns(mlp.down_proj, s)
