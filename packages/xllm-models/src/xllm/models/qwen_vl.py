"""Qwen2-VL and Qwen2.5-VL: the vision tower (:mod:`xllm.models.vision`) and the Qwen2 language model with
M-RoPE, loaded from HF model directories (``model.visual.*``, ``model.language_model.*``, ``lm_head`` as
transformers 5 saves them; ``visual.*``, ``model.*`` as older checkpoints name them).

The contract the engine uses (the model is a :class:`xllm.core.model_api.CausalLM`; text-only requests need
nothing else):

- :meth:`Qwen2VLForConditionalGeneration.encode_images` ``(pixel_values, image_grid_thw)`` -> one float tensor
  ``[tokens_i, hidden]`` per image (``tokens_i = t*h*w / spatial_merge_size**2``), from the image processor's
  outputs (``preprocessor_config.json``; the images of one call never attend to each other, so a batch of
  several requests' images encodes each exactly as alone).
- :func:`mrope_positions` ``(input_ids, image_grid_thw, image_token_id, spatial_merge_size)`` -> ``([3, T]
  positions, delta)``: HF's ``get_rope_index`` for one whole prompt. Every run of ``<|image_pad|>`` tokens is
  one image's ``tokens_i`` tokens (t, h, w grid positions from the running text position); text continues
  from the image's start + max(h, w) / merge. ``delta = max + 1 - T``: a token at index ``i >= T`` (decode)
  has all three positions ``i + delta``, i.e. plain 1-D RoPE at ``i + delta``.
- :meth:`Qwen2VLForConditionalGeneration.forward` ``(input_ids, positions, ctx, *, mrope_positions=None,
  image_embeds=None)``: ``positions`` ``[T]`` stays the 1-D token index of the KV layout; ``mrope_positions``
  ``[3, T]`` (a chunk's columns of :func:`mrope_positions`' result, or ``index + delta`` repeated thrice past
  the prompt) rotates q and k instead when given; ``image_embeds`` ``[n, hidden]`` replaces the embedding
  rows ``image_rows`` (default: the ``n`` ``<|image_pad|>`` tokens of ``input_ids``), in order (a chunk's share
  of its images' rows). Without both, a row at 1-D position ``p`` rotates as M-RoPE with ``t = h = w = p`` (equal to 1-D
  RoPE), so text-only requests, and decode steps given ``positions + delta``, run the plain Qwen2 path,
  native fused steps included.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from xllm.core.model_api import AttentionContext
from xllm.kernels import RopeBatch, apply_rotary
from xllm.models.config import ModelConfig, ModelConfigError, rope_parameters
from xllm.models.qwen import Qwen2ForCausalLM
from xllm.models.tensor_parallel import TPShard
from xllm.models.vision import VisionConfig, VisionTransformer


def text_config(raw: dict[str, Any]) -> ModelConfig:
    """The language model's :class:`ModelConfig` of a Qwen2-VL / Qwen2.5-VL ``config.json`` (its
    ``text_config`` over the top level: transformers 5 nests the text fields, older checkpoints keep
    them at the top), with M-RoPE's ``rope_type`` ("mrope") read as the default frequencies it uses."""
    merged = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    merged.update(raw.get("text_config") or {})
    merged["architectures"] = raw.get("architectures") or merged.get("architectures")
    params = rope_parameters(merged)
    if params.get("rope_type") == "mrope":
        params["rope_type"] = "default"
    params.pop("type", None)
    merged["rope_parameters"] = params
    merged.pop("rope_scaling", None)
    merged.pop("layer_types", None)
    return ModelConfig.from_dict(merged)


def mrope_section(cfg: ModelConfig) -> tuple[int, ...]:
    """How many of the rotary half-dims rotate with t, h and w (``rope_parameters.mrope_section``)."""
    section = tuple(int(s) for s in rope_parameters(cfg.raw).get("mrope_section") or ())
    if len(section) != 3 or sum(section) * 2 != cfg.head_dim:
        raise ModelConfigError(f"mrope_section {list(section)} must have 3 parts summing to head_dim / 2 "
                               f"= {cfg.head_dim // 2}")
    return section


def mrope_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, image_token_id: int,
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """``([3, T] int64 positions, delta)`` of one prompt ``input_ids`` ``[T]`` (see the module docstring;
    HF's ``get_rope_index`` for images). ``ValueError`` when the ``<|image_pad|>`` runs do not hold exactly
    the tokens of ``image_grid_thw``'s images."""
    ids = input_ids.tolist()
    grid = [] if image_grid_thw is None else [tuple(int(v) for v in r) for r in image_grid_thw.tolist()]
    m = spatial_merge_size
    cols: list[torch.Tensor] = []
    pos, i, image = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            j = i
            while j < len(ids) and ids[j] != image_token_id:
                j += 1
            cols.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        if image >= len(grid):
            raise ValueError(f"input_ids has more images than image_grid_thw's {len(grid)}")
        t, h, w = grid[image]
        gh, gw = h // m, w // m
        n = t * gh * gw
        if ids[i:i + n] != [image_token_id] * n:
            raise ValueError(f"image {image} needs {n} image tokens in input_ids")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        cols.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(h, w) // m
        i += n
        image += 1
    if image != len(grid):
        raise ValueError(f"image_grid_thw has {len(grid)} images, input_ids {image}")
    positions = torch.cat(cols, dim=1) if cols else torch.zeros(3, 0, dtype=torch.int64)
    delta = (int(positions.max()) + 1 - len(ids)) if len(ids) else 0
    return positions, delta


@dataclass
class MRopeBatch(RopeBatch):
    """A :class:`RopeBatch` over 3-D positions ``[3, T]``: each rotary frequency of the table takes its
    angle from the t, h or w row as ``section`` assigns it (HF's ``mrope_section``; both halves alike)."""

    section: tuple[int, ...] = ()

    def cos_sin(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._cached:
            rd = self.table.cos.shape[-1]
            axis = torch.repeat_interleave(torch.arange(3), torch.tensor(self.section)).repeat(2)
            pos = self.positions.to(torch.int64)
            if pos.numel() and int(pos.max()) >= self.table.cos.shape[0]:
                raise ValueError(f"position {int(pos.max())} beyond rotary table of {self.table.cos.shape[0]}")
            # row t, h or w of each channel: gather the three lookups' rows, channel by channel
            pick = axis.expand(pos.shape[1], rd).unsqueeze(0)
            cos = self.table.cos[pos].gather(0, pick).squeeze(0)
            sin = self.table.sin[pos].gather(0, pick).squeeze(0)
            self._cached[dtype] = (cos.to(dtype), sin.to(dtype))
        return self._cached[dtype]

    def rotate_(self, rows: torch.Tensor, heads: int, head_dim: int) -> None:
        view = rows[:, : heads * head_dim].view(rows.shape[0], heads, head_dim)
        cos, sin = self.cos_sin(rows.dtype)
        view.copy_(apply_rotary(view, cos, sin))


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2-VL: a Qwen2 decoder (q/k/v bias) with M-RoPE, and the vision tower as ``visual``.
    ``cfg``: the whole model's config (any layout :func:`text_config` reads). One process only (no
    tensor parallelism yet)."""

    qwen25 = False

    def __init__(self, cfg: ModelConfig, tp: TPShard | None = None) -> None:
        if tp is not None and tp.parallel:
            raise ModelConfigError(f"{type(self).__name__} is not served with tensor parallelism yet")
        text = text_config(cfg.raw)
        super().__init__(text)
        self.section = mrope_section(text)
        vision_raw = cfg.raw.get("vision_config")
        if not vision_raw:
            raise ModelConfigError("config.json has no vision_config")
        self.vision_cfg = VisionConfig.from_dict(vision_raw, self.qwen25, text.hidden_size)
        if self.vision_cfg.out_hidden != text.hidden_size:
            raise ModelConfigError(f"vision out hidden size {self.vision_cfg.out_hidden} != hidden_size "
                                   f"{text.hidden_size}")
        self.visual = VisionTransformer(self.vision_cfg)
        try:
            self.image_token_id = int(cfg.raw["image_token_id"])
        except KeyError:
            raise ModelConfigError("config.json lacks required field 'image_token_id'") from None

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Each image's embeddings ``[tokens_i, hidden]`` (the merger's output, in the LM's dtype; see the
        module docstring)."""
        dtype = self.visual.patch_embed.proj.weight.dtype
        merged = self.visual(pixel_values.to(dtype), image_grid_thw)
        m2 = self.vision_cfg.merge_unit
        sizes = [int(t * h * w) // m2 for t, h, w in image_grid_thw.tolist()]
        return list(merged.to(self.dtype).split(sizes))

    def image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """The image tokens of one image of patch grid ``grid_thw`` (``t * h * w / merge_size**2``)."""
        t, h, w = grid_thw
        return t * h * w // self.vision_cfg.merge_unit

    def patch_dim(self) -> int:
        """Floats per row of ``pixel_values`` (channels x temporal patch x patch x patch)."""
        c = self.vision_cfg
        return c.in_channels * c.temporal_patch_size * c.patch_size * c.patch_size

    def image_embed_dim(self) -> int:
        """An image token's embedding width: the language model's hidden size."""
        return self.cfg.hidden_size

    def reference_grid(self) -> tuple[int, int, int]:
        """The patch grid of a 448 x 448 image (the encode-phase profile's reference; whole merge blocks)."""
        c = self.vision_cfg
        side = max(c.spatial_merge_size, 448 // c.patch_size // c.spatial_merge_size * c.spatial_merge_size)
        return (1, side, side)

    def mrope_positions(self, input_ids: torch.Tensor,
                        image_grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """:func:`mrope_positions` with this model's image token and merge size."""
        return mrope_positions(input_ids, image_grid_thw, self.image_token_id, self.vision_cfg.spatial_merge_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext, *,
                mrope_positions: torch.Tensor | None = None,
                image_embeds: torch.Tensor | None = None, image_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden rows ``[T, hidden]``; the keyword arguments as the module docstring states (``image_rows``: the
        rows ``image_embeds`` replace, in order; by default every row whose token is the image token)."""
        hidden = self.embed_with_images(input_ids, self.image_token_id, image_embeds, image_rows)
        if mrope_positions is None:
            rope: RopeBatch = RopeBatch(self.rotary, positions)
        else:
            if tuple(mrope_positions.shape) != (3, input_ids.shape[0]):
                raise ValueError(f"mrope_positions must be [3, {input_ids.shape[0]}], got "
                                 f"{list(mrope_positions.shape)}")
            rope = MRopeBatch(self.rotary, mrope_positions, section=self.section)
        return self.decode_layers(hidden, rope, ctx)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names (transformers 5's ``model.language_model.*`` / ``model.visual.*``, or the older
        ``model.*`` / ``visual.*``) into the parameters; every parameter must be set."""
        super().load_weights((_our_name(name), t) for name, t in weights)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: Qwen2-VL with the RMSNorm / SwiGLU / window-attention vision tower."""

    qwen25 = True


def _our_name(name: str) -> str:
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return name[len("model."):]
    return name


def load_qwen_vl(model_dir: str | pathlib.Path, dtype: torch.dtype = torch.float32) -> Qwen2VLForConditionalGeneration:
    """A Qwen2-VL / Qwen2.5-VL model directory's model, in eval mode, whatever its ``config.json`` layout
    (:func:`xllm.models.loader.load_model` reads only configs with the text fields at the top level)."""
    from xllm.models.loader import iter_safetensors, shard_files

    model_dir = pathlib.Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    classes = {c.__name__: c for c in (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration)}
    arch = (raw.get("architectures") or [""])[0]
    if arch not in classes:
        raise ModelConfigError(f"architecture {arch!r} is not a Qwen2-VL / Qwen2.5-VL model")
    cfg = text_config(raw)
    cfg.raw = raw
    with torch.device("meta"):
        model = classes[arch](cfg)
    model.to_empty(device="cpu")
    model.to(dtype)
    model.load_weights(iter_safetensors(shard_files(model_dir), progress=False))
    model.post_load()
    return model.eval().requires_grad_(False)
