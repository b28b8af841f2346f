"""Building blocks shared by the decoder models: norms, fused projections, RoPE."""

from __future__ import annotations

import torch
from torch import nn

from xllm.kernels import RotaryTable, linear, rms_norm
from xllm.kernels.linear import pack_weight
from xllm.models.config import ModelConfig, ModelConfigError, rope_parameters


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, res = rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, res)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward takes the native skinny-GEMM path for decode-sized
    inputs and a prepacked oneDNN weight (after :func:`prepack_linears`) for larger ones."""

    packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, packed=self.packed)

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)


def prepack_linears(model: nn.Module) -> int:
    """Give every :class:`Linear`/:class:`MergedLinear` of ``model`` a prepacked weight
    for large-batch GEMMs (a second copy of the weights); returns how many were packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, (Linear, MergedLinear)):
            module.pack()
            count += module.packed is not None
    return count


class MergedLinear(nn.Module):
    """A linear layer whose output rows are several checkpoint weights stacked.

    ``shards`` maps a checkpoint shard name (e.g. ``"q"``) to its output size;
    :meth:`load_shard` copies one checkpoint tensor into its row range, so fused
    weights (qkv, gate_up) are assembled at load time.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__()
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (start, size)
            start += size
        self.weight = nn.Parameter(torch.empty(start, in_features))
        self.bias = nn.Parameter(torch.empty(start)) if bias else None

    packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, packed=self.packed)

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)

    def load_shard(self, shard: str, kind: str, tensor: torch.Tensor) -> None:
        start, size = self.shard_offsets[shard]
        target = self.weight if kind == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {kind} for shard {shard!r} but the layer has none")
        dest = target.data[start:start + size]
        if dest.shape != tensor.shape:
            raise ValueError(f"shard {shard!r} {kind}: checkpoint shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
        dest.copy_(tensor)


def build_rotary(cfg: ModelConfig, rotary_dim: int) -> RotaryTable:
    """The RoPE table for ``cfg`` (default and llama3-style scaled frequencies)."""
    params = rope_parameters(cfg.raw)
    kind = params.get("rope_type", "default")
    base = float(params.get("rope_theta", cfg.rope_theta))
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base**exponent)
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    elif kind == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif kind != "default":
        raise ModelConfigError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3)")
    return RotaryTable.build(rotary_dim, cfg.max_position_embeddings, base, inv_freq=inv_freq)


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
