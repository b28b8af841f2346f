"""LLaVA (1.5-style): a CLIP vision tower, a two-layer projector and a Llama language model, loaded from HF model
directories (``model.vision_tower.*``, ``model.multi_modal_projector.*``, ``model.language_model.*``,
``lm_head`` as transformers 5 names them; ``vision_tower.vision_model.*``, ``multi_modal_projector.*``,
``language_model.model.*``, ``language_model.lm_head`` as it saves them).

The engine's image contract (:class:`xllm.core.images.SupportsImages`), as for Qwen2-VL:

- ``pixel_values``: the image's 14x14 (``patch_size``) patches as rows, in raster order, each row the patch's
  ``channels x patch x patch`` values as the patch convolution reads them (:func:`patch_rows` turns the CLIP
  image processor's ``[images, 3, H, W]`` into them); ``grid_thw`` ``(1, H / patch, W / patch)``, which must be
  the tower's fixed ``image_size / patch`` square (CLIP's learned positions are for that grid alone).
- :meth:`LlavaForConditionalGeneration.encode_images` runs the tower to ``vision_feature_layer`` (HF's
  ``hidden_states[layer]``), drops the class token (``vision_feature_select_strategy`` ``default``) and
  projects: one ``[h * w, hidden]`` tensor per image.
- Positions are plain: :meth:`mrope_positions` returns the 1-D positions three times and ``delta`` 0, and
  :meth:`forward` rotates by ``positions`` (the M-RoPE rows the engine passes are those positions again).
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from xllm.core.model_api import AttentionContext
from xllm.kernels import RopeBatch
from xllm.models.config import ModelConfig, ModelConfigError
from xllm.models.llama import LlamaForCausalLM
from xllm.models.tensor_parallel import TPShard

_ACTS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class ClipConfig:
    """The ``vision_config`` fields the CLIP tower reads (HF's names)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    image_size: int
    patch: int
    channels: int
    eps: float
    act: str

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ClipConfig:
        act = raw.get("hidden_act", "quick_gelu")
        if act not in _ACTS:
            raise ModelConfigError(f"vision_config.hidden_act {act!r} is not supported")
        return cls(int(raw.get("hidden_size", 1024)), int(raw.get("intermediate_size", 4096)),
                   int(raw.get("num_hidden_layers", 24)), int(raw.get("num_attention_heads", 16)),
                   int(raw.get("image_size", 336)), int(raw.get("patch_size", 14)), int(raw.get("num_channels", 3)),
                   float(raw.get("layer_norm_eps", 1e-5)), act)

    @property
    def side(self) -> int:
        return self.image_size // self.patch


class ClipLayer(nn.Module):
    def __init__(self, c: ClipConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.layer_norm1 = nn.LayerNorm(c.hidden, eps=c.eps)
        self.layer_norm2 = nn.LayerNorm(c.hidden, eps=c.eps)
        # (not HF's q_proj/k_proj/v_proj names: the Llama loader stacks those into its qkv_proj)
        self.query, self.key, self.value, self.out = (nn.Linear(c.hidden, c.hidden) for _ in range(4))
        self.fc1 = nn.Linear(c.hidden, c.intermediate)
        self.fc2 = nn.Linear(c.intermediate, c.hidden)
        self.act = _ACTS[c.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[images, tokens, hidden]``; every token attends to every token of its image."""
        b, t, d = x.shape
        h = self.layer_norm1(x)
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.query, self.key, self.value))
        x = x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class ClipTower(nn.Module):
    """CLIP's vision transformer up to (not including) ``keep`` layers' output, no post-norm."""

    def __init__(self, c: ClipConfig, keep: int) -> None:
        super().__init__()
        self.c = c
        self.patch_embedding = nn.Linear(c.channels * c.patch * c.patch, c.hidden, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(c.hidden))
        self.position_embedding = nn.Parameter(torch.empty(c.side * c.side + 1, c.hidden))
        self.pre_layrnorm = nn.LayerNorm(c.hidden, eps=c.eps)
        self.layers = nn.ModuleList(ClipLayer(c) for _ in range(keep))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` ``[images, side * side, patch_dim]`` -> ``[images, 1 + side * side, hidden]``."""
        x = self.patch_embedding(rows)
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        x = self.pre_layrnorm(torch.cat([cls, x], dim=1) + self.position_embedding)
        for layer in self.layers:
            x = layer(x)
        return x


class LlavaProjector(nn.Module):
    def __init__(self, vision: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision, hidden, bias=bias)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)
        self.act = _ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def text_config(raw: dict[str, Any]) -> ModelConfig:
    """The language model's :class:`ModelConfig` (``text_config`` over the top level)."""
    merged = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    merged.update(raw.get("text_config") or {})
    merged["architectures"] = raw.get("architectures") or merged.get("architectures")
    return ModelConfig.from_dict(merged)


def patch_rows(pixel_values: torch.Tensor, patch: int) -> torch.Tensor:
    """The CLIP image processor's ``[images, C, H, W]`` as the engine's patch rows ``[images * (H/p) * (W/p),
    C * p * p]`` (raster order of patches; each row in the patch convolution's ``(C, p, p)`` order)."""
    n, c, h, w = pixel_values.shape
    x = pixel_values.reshape(n, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n * (h // patch) * (w // patch), c * patch * patch)


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """LLaVA: CLIP tower + projector + Llama (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, tp: TPShard | None = None) -> None:
        if tp is not None and tp.parallel:
            raise ModelConfigError(f"{type(self).__name__} is not served with tensor parallelism yet")
        raw = cfg.raw
        super().__init__(text_config(raw))
        vision_raw = raw.get("vision_config")
        if not vision_raw:
            raise ModelConfigError("config.json has no vision_config")
        if raw.get("vision_feature_select_strategy", "default") != "default":
            raise ModelConfigError("only vision_feature_select_strategy 'default' (drop the class token) is served")
        self.clip = ClipConfig.from_dict(vision_raw)
        layer = int(raw.get("vision_feature_layer", -2))
        keep = layer if layer >= 0 else self.clip.layers + 1 + layer  # hidden_states[layer]: after `keep` layers
        if not 0 <= keep <= self.clip.layers:
            raise ModelConfigError(f"vision_feature_layer {layer} is outside the tower's {self.clip.layers} layers")
        self.vision_tower = ClipTower(self.clip, keep)
        self.multi_modal_projector = LlavaProjector(self.clip.hidden, self.cfg.hidden_size,
                                                    raw.get("projector_hidden_act", "gelu"),
                                                    bool(raw.get("multimodal_projector_bias", True)))
        token = raw.get("image_token_id", raw.get("image_token_index"))
        if token is None:
            raise ModelConfigError("config.json lacks required field 'image_token_index'")
        self.image_token_id = int(token)

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Each image's embeddings ``[side * side, hidden]`` (patch rows in, see the module docstring)."""
        side = self.clip.side
        for t, h, w in image_grid_thw.tolist():
            if (t, h, w) != (1, side, side):
                raise ValueError(f"image grid {[t, h, w]}: this tower takes {side}x{side} patches only")
        dtype = self.vision_tower.patch_embedding.weight.dtype
        rows = pixel_values.to(dtype).view(len(image_grid_thw), side * side, -1)
        feats = self.vision_tower(rows)[:, 1:]
        return list(self.multi_modal_projector(feats).to(self.dtype).unbind(0))

    def image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w

    def patch_dim(self) -> int:
        return self.clip.channels * self.clip.patch * self.clip.patch

    def image_embed_dim(self) -> int:
        """An image token's embedding width: the language model's hidden size."""
        return self.cfg.hidden_size

    def reference_grid(self) -> tuple[int, int, int]:
        return (1, self.clip.side, self.clip.side)

    def mrope_positions(self, input_ids: torch.Tensor,
                        image_grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """Plain positions (three times) and delta 0, after checking that the prompt holds each image's run of
        image tokens, in order, and no other image token."""
        at = (input_ids == self.image_token_id).nonzero().flatten().tolist()
        counts = [self.image_tokens(tuple(g)) for g in image_grid_thw.tolist()] if image_grid_thw is not None else []
        if len(at) != sum(counts):
            raise ValueError(f"{len(at)} image tokens for images of {sum(counts)}")
        k = 0
        for n in counts:
            if at[k + n - 1] - at[k] != n - 1:
                raise ValueError("an image's tokens are not one run")
            k += n
        return torch.arange(len(input_ids), dtype=torch.int64).expand(3, -1), 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext, *,
                mrope_positions: torch.Tensor | None = None,
                image_embeds: torch.Tensor | None = None, image_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden rows ``[T, hidden]``: the image rows' embeddings replaced by ``image_embeds`` (rows ``image_rows``,
        by default every image token), rotated by ``positions`` (``mrope_positions`` hold the same)."""
        hidden = self.embed_with_images(input_ids, self.image_token_id, image_embeds, image_rows)
        return self.decode_layers(hidden, RopeBatch(self.rotary, positions), ctx)

    def overlap_supported(self) -> bool:
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names (either layout, see the module docstring) into the parameters; the tower's layers past the
        feature layer and its post-norm are not used; every parameter must be set."""
        own: list[tuple[str, torch.Tensor]] = []
        for name, t in weights:
            mapped = _our_name(name, len(self.vision_tower.layers))
            if mapped is None:
                continue
            if mapped.endswith("patch_embedding.weight") and t.dim() == 4:  # the convolution, as a linear on rows
                t = t.reshape(t.shape[0], math.prod(t.shape[1:]))
            own.append((mapped, t))
        super().load_weights(own)


def _our_name(name: str, keep: int) -> str | None:
    for prefix, ours in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."),
                         ("model.multi_modal_projector.", "multi_modal_projector."),
                         ("multi_modal_projector.", "multi_modal_projector."),
                         ("model.vision_tower.", "vision_tower."), ("vision_tower.vision_model.", "vision_tower.")):
        if name.startswith(prefix):
            name = ours + name[len(prefix):]
            break
    if not name.startswith("vision_tower."):
        return name
    rest = name[len("vision_tower."):]
    if rest.startswith("post_layernorm."):
        return None
    if rest.startswith("embeddings."):
        rest = rest[len("embeddings."):]
        if rest == "position_embedding.weight":
            rest = "position_embedding"
        return "vision_tower." + rest
    if rest.startswith("encoder.layers."):
        index, _, tail = rest[len("encoder.layers."):].partition(".")
        if int(index) >= keep:
            return None
        for theirs, ours in (("self_attn.q_proj.", "query."), ("self_attn.k_proj.", "key."),
                             ("self_attn.v_proj.", "value."), ("self_attn.out_proj.", "out."), ("mlp.", "")):
            tail = tail.replace(theirs, ours)
        return f"vision_tower.layers.{index}." + tail
    return "vision_tower." + rest


def load_llava(model_dir: str | pathlib.Path, dtype: torch.dtype = torch.float32) -> LlavaForConditionalGeneration:
    """A LLaVA model directory's model, in eval mode (its ``config.json`` nests the text fields)."""
    from xllm.models.loader import iter_safetensors, shard_files

    model_dir = pathlib.Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    cfg = text_config(raw)
    cfg.raw = raw
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(cfg)
    model.to_empty(device="cpu")
    model.to(dtype)
    model.load_weights(iter_safetensors(shard_files(model_dir), progress=False))
    model.post_load()
    return model.eval().requires_grad_(False)

