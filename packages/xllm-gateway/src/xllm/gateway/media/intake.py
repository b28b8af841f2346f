"""A chat request's images, from its ``image_url`` parts to the engine's ``GenerateRequest.images``.

:class:`MediaIntake` (one per gateway: the flags' limits and allow-list, the image processors) loads a request's
images (:func:`xllm.gateway.media.images.load_images`: fetched and decoded within the limits), runs the model's
image processor on them (:mod:`xllm.gateway.media.preprocess`) and, once the chat template has rendered one
image token per image, :func:`expand_image_tokens` gives each image its run of image tokens and
:func:`engine_images` the engine's inputs (patch rows, grid, content hash). A model that takes no images gets a
400 naming the first image part; so does a template that did not place every image.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from xllm.gateway.media.limits import AllowedMediaDomains, MediaLimits
from xllm.gateway.media.parts import image_parts
from xllm.gateway.openai.errors import bad_request
from xllm.proto.engine.v1 import engine_pb2

if TYPE_CHECKING:  # (Pillow and the processors load with the first image, not with the gateway)
    from xllm.gateway.media.preprocess import ImageProcessors, PreprocessedImages


class ImageModel(Protocol):
    """What the intake needs of a served model's tokenizer (:class:`xllm.models.tokenizer.Tokenizer`)."""

    image_dir: str | None
    image_token_id: int | None


Runner = Callable[..., Awaitable[Any]]


@dataclass
class MediaIntake:
    """The gateway's image intake: ``limits`` and ``allow`` from the ``xllm serve`` flags."""

    limits: MediaLimits = field(default_factory=MediaLimits)
    allow: AllowedMediaDomains = field(default_factory=AllowedMediaDomains)
    processors: ImageProcessors | None = None  # built with the first image

    async def load(self, messages: Sequence[Any], model: ImageModel, run: Runner) -> PreprocessedImages | None:
        """The images of chat ``messages`` (their ``content`` lists) preprocessed for ``model`` (None: no image
        part); CPU work on ``run``'s threads. 400s name the part's field."""
        parts = image_parts([{"content": m} for m in messages])
        if not parts:
            return None
        if model.image_dir is None or model.image_token_id is None:
            raise bad_request(f"Invalid '{parts[0].field('.image_url')}': this model takes no images (text only)",
                              parts[0].field(".image_url"), "invalid_image")
        from xllm.gateway.media.images import load_images
        from xllm.gateway.media.preprocess import ImageProcessors, preprocess

        if self.processors is None:
            self.processors = ImageProcessors()
        images = await load_images(parts, self.limits, self.allow, run)
        return await run(preprocess, images, model.image_dir, self.processors)


def expand_image_tokens(prompt: list[int], image_token_id: int, images: PreprocessedImages) -> list[int]:
    """``prompt`` (rendered: one image token per image) with image ``i``'s token repeated ``images.tokens[i]``
    times; a 400 naming ``messages`` when the prompt's image tokens are not one per image."""
    at = [k for k, t in enumerate(prompt) if t == image_token_id]
    if len(at) != len(images.tokens):
        raise bad_request(f"the chat template placed {len(at)} image token(s) for {len(images.tokens)} image(s) "
                          "(is it the model's own multimodal template? image tokens in the text are not allowed)",
                          "messages")
    out: list[int] = []
    last = 0
    for k, n in zip(at, images.tokens, strict=True):
        out.extend(prompt[last:k])
        out.extend([image_token_id] * n)
        last = k + 1
    out.extend(prompt[last:])
    return out


def engine_images(images: PreprocessedImages) -> list[engine_pb2.ImageInput]:
    """The engine's ``GenerateRequest.images`` of ``images`` (float32 patch rows per image, grid, hash)."""
    rows = [t * h * w for t, h, w in images.grid_thw]
    out, start = [], 0
    pixels = images.pixel_values.astype("<f4", copy=False)
    for grid, n, digest in zip(images.grid_thw, rows, images.hashes, strict=True):
        out.append(engine_pb2.ImageInput(pixel_values=pixels[start:start + n].tobytes(), grid_thw=list(grid),
                                         content_hash=bytes.fromhex(digest)))
        start += n
    return out
