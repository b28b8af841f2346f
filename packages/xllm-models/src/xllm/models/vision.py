"""The Qwen2-VL and Qwen2.5-VL vision transformers (our implementation of HF's ``model.visual``).

Contract of :meth:`VisionTransformer.forward` (what :meth:`xllm.models.qwen_vl.Qwen2VLForConditionalGeneration.
encode_images` calls): ``pixel_values`` ``[patches, in_channels * temporal_patch_size * patch_size**2]`` as the
model's image processor emits them (each image's patches in a row, every ``spatial_merge_size**2`` consecutive
patches one merge block), ``grid_thw`` int ``[images, 3]`` (temporal, height, width patches per image); returns
``[sum(t * h * w) / merge**2, out_hidden]``: each image's merged tokens in the processor's order, images in
order. Images never attend to each other (each frame is one attention segment, HF's ``cu_seqlens``).

- patch embed: HF's ``Conv3d`` with stride = kernel is a linear over the flattened patch (its weight
  ``[embed, C, tp, p, p]`` viewed as ``[embed, C*tp*p*p]``);
- 2-D rotary: a quarter of the head's channels rotate with the patch row, a quarter with its column
  (``cat([h, w, h, w])`` frequencies over ``theta ** (-4i/head_dim)``), the whole head rotated in float32;
- Qwen2-VL blocks: LayerNorm, quick-GELU ``fc1``/``fc2`` MLP; merger LayerNorm + MLP over 2x2 merged patches;
- Qwen2.5-VL blocks: RMSNorm, SwiGLU MLP with biases (:class:`xllm.models.llama.LlamaMLP`); window attention
  (windows of ``window_size`` pixels of merged tokens) except in ``fullatt_block_indexes``: the merge
  blocks are reordered window by window before the blocks and the merged rows put back after the merger.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from xllm.models.config import ModelConfigError
from xllm.models.layers import RMSNorm
from xllm.models.llama import LlamaMLP

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


@dataclass(frozen=True)
class VisionConfig:
    """The ``vision_config`` fields both towers read (HF's names; ``qwen25``: the Qwen2.5-VL layout)."""

    qwen25: bool
    depth: int
    dim: int  # the blocks' width (Qwen2-VL ``embed_dim``, Qwen2.5-VL ``hidden_size``)
    out_hidden: int  # the merger's output width (the LM's hidden size)
    num_heads: int
    mlp_hidden: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    rope_theta: float
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any], qwen25: bool, text_hidden: int) -> VisionConfig:
        """From a ``config.json``'s ``vision_config`` (``text_hidden``: the LM's width, Qwen2-VL's merger output)."""
        try:
            rope = raw.get("rope_parameters") or {}
            common = dict(
                depth=int(raw["depth"]), num_heads=int(raw["num_heads"]),
                in_channels=int(raw.get("in_channels", raw.get("in_chans", 3))),  # (older checkpoints: in_chans)
                patch_size=int(raw.get("patch_size", 14)), temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
                spatial_merge_size=int(raw.get("spatial_merge_size", 2)),
                rope_theta=float(rope.get("rope_theta", 10000.0)),
            )
            if qwen25:
                return cls(qwen25=True, dim=int(raw["hidden_size"]), out_hidden=int(raw["out_hidden_size"]),
                           mlp_hidden=int(raw["intermediate_size"]), hidden_act=str(raw.get("hidden_act", "silu")),
                           window_size=int(raw.get("window_size", 112)),
                           fullatt_block_indexes=tuple(int(i) for i in raw.get("fullatt_block_indexes", ())),
                           **common)
            dim = int(raw["embed_dim"])
            return cls(qwen25=False, dim=dim, out_hidden=int(raw.get("hidden_size", text_hidden)),
                       mlp_hidden=int(dim * float(raw.get("mlp_ratio", 4))),
                       hidden_act=str(raw.get("hidden_act", "quick_gelu")), **common)
        except KeyError as exc:
            raise ModelConfigError(f"config.json vision_config lacks required field {exc}") from exc

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2


class VisionAttention(nn.Module):
    """Non-causal multi-head attention within each ``cu_seqlens`` segment, 2-D rotary on q and k."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        for start, end in itertools.pairwise(cu_seqlens):
            seg = [t[start:end].transpose(0, 1) for t in (q, k, v)]
            out[start:end] = F.scaled_dot_product_attention(*seg, scale=self.head_dim**-0.5).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb_vision``: ``x`` ``[N, heads, d]`` rotated in float32, back in its dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


class VisionMLP(nn.Module):
    """Qwen2-VL's ``fc2(act(fc1(x)))``."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``+ mlp(norm2(x))``."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        if cfg.qwen25:
            self.norm1, self.norm2 = RMSNorm(cfg.dim, 1e-6), RMSNorm(cfg.dim, 1e-6)
            self.mlp: nn.Module = LlamaMLP(cfg.dim, cfg.mlp_hidden, bias=True)
        else:
            self.norm1, self.norm2 = nn.LayerNorm(cfg.dim, eps=1e-6), nn.LayerNorm(cfg.dim, eps=1e-6)
            self.mlp = VisionMLP(cfg.dim, cfg.mlp_hidden, cfg.hidden_act)
        self.attn = VisionAttention(cfg.dim, cfg.num_heads)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """HF's stride-equals-kernel ``Conv3d`` as a linear over each flattened patch (same weight layout)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(cfg.dim, cfg.in_channels, cfg.temporal_patch_size,
                                                    cfg.patch_size, cfg.patch_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype).reshape(-1, w[0].numel()), w.reshape(w.shape[0], -1))


class PatchMerger(nn.Module):
    """Norm each patch, concatenate each merge block's patches, then ``Linear -> GELU -> Linear``."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        width = cfg.dim * cfg.merge_unit
        self.ln_q = RMSNorm(cfg.dim, 1e-6) if cfg.qwen25 else nn.LayerNorm(cfg.dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, cfg.out_hidden))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


@dataclass
class VisionLayout:
    """One batch of images' token bookkeeping: the rotary angles of every patch, the per-frame
    attention segments, and (Qwen2.5-VL) the window order of the merge blocks and the windows' segments."""

    cos: torch.Tensor
    sin: torch.Tensor
    cu_seqlens: list[int]
    window_index: torch.Tensor | None = None
    cu_window_seqlens: list[int] | None = None


class VisionTransformer(nn.Module):
    """``model.visual`` of Qwen2-VL / Qwen2.5-VL (module and parameter names as HF's, so checkpoint
    names map one to one). See the module docstring for the forward's contract."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        if cfg.qwen25 and cfg.hidden_act != "silu":
            raise ModelConfigError(f"vision hidden_act {cfg.hidden_act!r} is not supported (Qwen2.5-VL: only silu)")
        if not cfg.qwen25 and cfg.hidden_act not in _ACTIVATIONS:
            raise ModelConfigError(f"vision hidden_act {cfg.hidden_act!r} is not supported "
                                   f"(supported: {', '.join(sorted(_ACTIVATIONS))})")
        if (cfg.dim // cfg.num_heads) % 4:
            raise ModelConfigError(f"vision head dim {cfg.dim // cfg.num_heads} is not a multiple of 4")
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        m = self.cfg.spatial_merge_size
        if any(h % m or w % m for _, h, w in grid):
            raise ValueError(f"image_grid_thw: heights and widths must be multiples of {m}, got {grid}")
        if pixel_values.shape[0] != sum(t * h * w for t, h, w in grid):
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, image_grid_thw says "
                             f"{sum(t * h * w for t, h, w in grid)}")
        layout = self.layout(grid)
        x = self.patch_embed(pixel_values)
        cos, sin = layout.cos, layout.sin
        if layout.window_index is not None:
            x, cos, sin = (self._by_block(t, layout.window_index) for t in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            windowed = layout.cu_window_seqlens is not None and i not in self.cfg.fullatt_block_indexes
            x = block(x, layout.cu_window_seqlens if windowed else layout.cu_seqlens, cos, sin)
        merged = self.merger(x)
        if layout.window_index is not None:
            merged = merged[torch.argsort(layout.window_index)]
        return merged

    def _by_block(self, t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """The rows of ``t`` with its merge blocks (``merge_unit`` consecutive rows) in ``order``."""
        u = self.cfg.merge_unit
        return t.reshape(-1, u, t.shape[-1])[order].reshape(t.shape)

    def layout(self, grid: list[tuple[int, int, int]]) -> VisionLayout:
        """Rotary angles, attention segments and (Qwen2.5-VL) window order of images of ``grid``'s sizes."""
        cfg = self.cfg
        m = cfg.spatial_merge_size
        head_dim = cfg.dim // cfg.num_heads
        spatial = head_dim // 2
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        pos, cu = [], [0]
        for t, h, w in grid:
            hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            shape = (h // m, m, w // m, m)  # block-major: each merge block's patches in a row
            hw = torch.stack([hh.reshape(shape).transpose(1, 2).flatten(), ww.reshape(shape).transpose(1, 2).flatten()],
                             dim=-1)
            pos.append(hw.repeat(t, 1))
            cu.extend(cu[-1] + h * w * (f + 1) for f in range(t))
        freqs = torch.cat(pos)[..., None].float() * inv_freq  # [N, 2, head_dim / 4]
        hw_freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([hw_freqs, hw_freqs], dim=-1)
        layout = VisionLayout(emb.cos(), emb.sin(), cu)
        if cfg.qwen25:
            layout.window_index, layout.cu_window_seqlens = self._windows(grid)
        return layout

    def _windows(self, grid: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """HF's ``get_vision_window_index``: merge blocks in window order, and the windows' patch segments
        (empty windows dropped)."""
        cfg = self.cfg
        m, size = cfg.spatial_merge_size, cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        if size < 1:
            raise ModelConfigError(f"vision window_size {cfg.window_size} is under one merged patch")
        order, cu, offset = [], [0], 0
        for t, h, w in grid:
            gh, gw = h // m, w // m
            index = torch.arange(t * gh * gw).reshape(t, gh, gw)
            pad_h, pad_w = size - gh % size, size - gw % size
            nh, nw = (gh + pad_h) // size, (gw + pad_w) // size
            padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
            padded = padded.reshape(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, size, size)
            counts = (padded != -100).sum([2, 3]).reshape(-1)
            flat = padded.reshape(-1)
            order.append(flat[flat != -100] + offset)
            for c in counts.tolist():
                if c:
                    cu.append(cu[-1] + c * cfg.merge_unit)
            offset += t * gh * gw
        return torch.cat(order), cu
