"""The model's own image processor at the front: decoded images → ``pixel_values``, ``image_grid_thw``
and the number of image tokens each image becomes in the prompt.

The processor is HF transformers' ``AutoImageProcessor.from_pretrained(model_dir)`` (for Qwen2-VL and
Qwen2.5-VL without torchvision: the PIL-backed ``Qwen2VLImageProcessorPil``), loaded once per model
directory by an :class:`ImageProcessors` cache the caller owns. Arrays come back as numpy arrays
(``return_tensors="np"``): the gateway imports no torch or numpy itself.

Only grid processors (Qwen2-VL style: an ``image_grid_thw`` output and a ``merge_size``) are supported:
an image of grid ``(t, h, w)`` is ``t * h * w / merge_size**2`` image tokens. ``detail`` does not
change the resolution yet: the processor's ``min_pixels`` / ``max_pixels`` decide it.
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
    """The image processor of each model directory, loaded on first use and kept (thread-safe)."""

    _loaded: dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, model_dir: str | os.PathLike) -> Any:
        """The processor of ``model_dir`` (its ``preprocessor_config.json``); ``ValueError`` when it
        is not a grid (Qwen2-VL style) processor."""
        key = os.path.realpath(model_dir)
        with self._lock:
            processor = self._loaded.get(key)
            if processor is None:
                from transformers import AutoImageProcessor

                processor = AutoImageProcessor.from_pretrained(key)
                if not isinstance(getattr(processor, "merge_size", None), int):
                    raise ValueError(f"{key}: {type(processor).__name__} is not a grid image processor "
                                     "(Qwen2-VL style, with merge_size); it is not supported yet")
                self._loaded[key] = processor
            return processor

    def preprocess(self, images: Sequence[ImageInput], model_dir: str | os.PathLike) -> PreprocessedImages:
        return preprocess(images, model_dir, self)


def preprocess(images: Sequence[ImageInput], model_dir: str | os.PathLike,
               processors: ImageProcessors) -> PreprocessedImages:
    """``images`` through ``model_dir``'s image processor (CPU work: run it off the event loop). An image
    the processor refuses (``ValueError``) is a 400 naming its part."""
    if not images:
        return PreprocessedImages(pixel_values=None, grid_thw=[], tokens=[], hashes=[])
    processor = processors.get(model_dir)
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
    grids = [(int(t), int(h), int(w)) for t, h, w in out["image_grid_thw"].tolist()]
    merge = processor.merge_size ** 2
    return PreprocessedImages(pixel_values=out["pixel_values"], grid_thw=grids,
                              tokens=[t * h * w // merge for t, h, w in grids], hashes=[im.hash for im in images])
