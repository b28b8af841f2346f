"""The model's own image processor at the front: decoded images → ``pixel_values``, ``image_grid_thw``
and the number of image tokens each image becomes in the prompt.

The processor is HF transformers' ``AutoImageProcessor.from_pretrained(model_dir)`` (for Qwen2-VL and
Qwen2.5-VL without torchvision: the PIL-backed ``Qwen2VLImageProcessorPil``), loaded once per model
directory by an :class:`ImageProcessors` cache the caller owns. Arrays come back as numpy arrays
(``return_tensors="np"``): the gateway imports no torch or numpy itself.

Two kinds of processor: grid processors (Qwen2-VL style: an ``image_grid_thw`` output and a ``merge_size``),
where an image of grid ``(t, h, w)`` is ``t * h * w / merge_size**2`` image tokens; and fixed-size ones (CLIP
style, LLaVA: ``pixel_values`` ``[images, C, H, W]``), whose images the gateway cuts into the model's
``vision_config.patch_size`` patches as rows (grid ``(1, H/p, W/p)``, one image token per patch).
``detail`` does not change the resolution yet: the processor decides it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from xllm.gateway.media.images import ImageInput
from xllm.gateway.openai.errors import bad_request


@dataclass(frozen=True)
class PreprocessedImages:
    """The processor's output for a request's images, in order: ``pixel_values`` (a numpy array, the
    patches of all images concatenated), ``grid_thw`` (per image), ``tokens`` (image tokens per image)
    and ``hashes`` (the images' content hashes, for caches keyed by image)."""

    pixel_values: Any
    grid_thw: list[tuple[int, int, int]]
    tokens: list[int]
    hashes: list[str]


@dataclass
class ImageProcessors:
    """The image processor of each model directory, loaded on first use and kept (thread-safe), with the patch
    size a fixed-size processor's images are cut into (None for a grid processor)."""

    _loaded: dict[str, tuple[Any, int | None]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, model_dir: str | os.PathLike) -> tuple[Any, int | None]:
        """The processor of ``model_dir`` (its ``preprocessor_config.json``) and, for a fixed-size one, the
        model's ``vision_config.patch_size``; ``ValueError`` when it is neither kind."""
        key = os.path.realpath(model_dir)
        with self._lock:
            got = self._loaded.get(key)
            if got is None:
                from transformers import AutoImageProcessor

                processor = AutoImageProcessor.from_pretrained(key)
                patch = None
                if not isinstance(getattr(processor, "merge_size", None), int):
                    patch = _patch_size(key)
                    if patch is None or not getattr(processor, "crop_size", None):
                        raise ValueError(f"{key}: {type(processor).__name__} is neither a grid image processor "
                                         "(Qwen2-VL style, with merge_size) nor a fixed-size one with a patch size "
                                         "(CLIP style); it is not supported yet")
                got = self._loaded[key] = (processor, patch)
            return got

    def preprocess(self, images: Sequence[ImageInput], model_dir: str | os.PathLike) -> PreprocessedImages:
        return preprocess(images, model_dir, self)


def preprocess(images: Sequence[ImageInput], model_dir: str | os.PathLike,
               processors: ImageProcessors) -> PreprocessedImages:
    """``images`` through ``model_dir``'s image processor (CPU work: run it off the event loop). An image
    the processor refuses (``ValueError``) is a 400 naming its part."""
    if not images:
        return PreprocessedImages(pixel_values=None, grid_thw=[], tokens=[], hashes=[])
    processor, patch = processors.get(model_dir)
    try:
        out = processor(images=[im.image for im in images], return_tensors="np")
    except ValueError:  # an image the processor cannot take (Qwen2-VL: an aspect ratio past 200): name it
        for im in images:
            try:
                processor(images=[im.image], return_tensors="np")
            except ValueError:
                param = f"{im.where}.image_url.url"
                raise bad_request(f"Invalid '{param}': the model's image processor cannot take this image "
                                  f"({im.size[0]}x{im.size[1]} pixels; an extreme aspect ratio?)", param,
                                  "invalid_image") from None
        raise
    hashes = [im.hash for im in images]
    if patch is not None:  # [n, C, H, W] -> each image's patches as rows, raster order, (C, p, p) each
        pixels = out["pixel_values"]
        n, c, h, w = pixels.shape
        rows = pixels.reshape(n, c, h // patch, patch, w // patch, patch).transpose(0, 2, 4, 1, 3, 5)
        side = (h // patch, w // patch)
        return PreprocessedImages(pixel_values=rows.reshape(n * side[0] * side[1], c * patch * patch),
                                  grid_thw=[(1, *side)] * n, tokens=[side[0] * side[1]] * n, hashes=hashes)
    grids = [(int(t), int(h), int(w)) for t, h, w in out["image_grid_thw"].tolist()]
    merge = processor.merge_size ** 2
    return PreprocessedImages(pixel_values=out["pixel_values"], grid_thw=grids,
                              tokens=[t * h * w // merge for t, h, w in grids], hashes=hashes)


def _patch_size(model_dir: str) -> int | None:
    """``vision_config.patch_size`` of ``model_dir``'s ``config.json`` (None: none)."""
    import json

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            patch = json.load(f).get("vision_config", {}).get("patch_size")
    except (OSError, ValueError, AttributeError):
        return None
    return patch if isinstance(patch, int) and patch > 0 else None
