"""Image inputs of multimodal models in the engine (issue 47: the encode phase, first part).

A request's images (``GenerateRequest.images``: the model processor's patch rows, grid and content hash) are
checked at admission (:func:`admit_images`): the model must take images (:class:`SupportsImages`), the prompt
must hold each image's run of image tokens in order, and the sequence gets :class:`SequenceImages` (its
images, where their tokens are, the prompt's M-RoPE positions and the offset of the positions after the
prompt). Its KV hash root is chained from the images' content hashes, so the prefix cache, tiers and hand-offs
never give one image's KV to another (and the same image in a later request reuses it).

Per step, :func:`batch_images` gives the forward what the images need: the M-RoPE positions ``[3, T]`` of
every row (a text-only sequence's rows: its positions three times) and the embeddings of the image tokens the
step computes (rows ``image_rows``), from the :class:`EncoderCache` (an image is encoded once while cached,
also when its tokens span several prefill chunks). Such a step runs the eager forward (the fused native steps
have plain RoPE only).

Not with images (refused, naming ``images``): speculative decoding, beam search, prefill/decode hand-offs.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from xllm.engine_api.errors import InvalidRequestError

if TYPE_CHECKING:
    from xllm.core.sequence import Sequence
    from xllm.proto.engine.v1 import engine_pb2


@runtime_checkable
class SupportsImages(Protocol):
    """A model that takes images (``xllm.models.qwen_vl``)."""

    image_token_id: int

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Each image's embeddings ``[tokens_i, hidden]``."""
        ...

    def mrope_positions(self, input_ids: torch.Tensor,
                        image_grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """The prompt's M-RoPE positions ``[3, P]`` and the offset of the positions after it; ``ValueError`` unless
        the prompt holds each image's run of image tokens, in order, and no other image token."""
        ...

    def image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """The image tokens of one image of patch grid ``grid_thw``."""
        ...

    def patch_dim(self) -> int:
        """Floats per patch row of ``pixel_values``."""
        ...


@dataclass
class SequenceImages:
    """A sequence's images: ``pixels[i]`` float32 ``[rows, patch_dim]``, ``grid`` int64 ``[n, 3]``, ``hashes``
    their content hashes, ``spans[i]`` the (first prompt index, tokens) of image ``i``'s image tokens,
    ``positions`` the prompt's M-RoPE positions ``[3, P]``, ``delta``: a later token ``j`` is at ``j + delta``."""

    pixels: list[torch.Tensor]
    grid: torch.Tensor
    hashes: list[bytes]
    spans: list[tuple[int, int]]
    positions: torch.Tensor
    delta: int

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """The M-RoPE positions ``[3, end - start]`` of tokens ``start .. end - 1``."""
        p = self.positions.shape[1]
        head = self.positions[:, start:min(end, p)]
        if end <= p:
            return head
        tail = torch.arange(max(start, p), end, dtype=torch.int64) + self.delta
        return torch.cat([head, tail.expand(3, -1)], dim=1)


def image_hash_root(root: int, hashes: list[bytes]) -> int:
    """The KV hash root of a prompt with these images after ``root`` (its adapter's, 0 for the base model)."""
    h = hashlib.blake2b(root.to_bytes(8, "little"), digest_size=8, person=b"xllm-images")
    for d in hashes:
        h.update(len(d).to_bytes(2, "little"))
        h.update(d)
    return int.from_bytes(h.digest(), "little") >> 1 or 1


def admit_images(model: object, seq: Sequence, req: engine_pb2.GenerateRequest, speculative: bool = False) -> None:
    """Check ``req.images`` against the model and the prompt and give ``seq`` its :class:`SequenceImages` (and
    the hash root they key); a prompt of a multimodal model must not hold image tokens without their images.
    ``speculative``: the engine speculates (images are refused there). :class:`InvalidRequestError` naming
    ``images`` (or ``prompt_token_ids``)."""
    takes = isinstance(model, SupportsImages)
    images = list(req.images)
    if not images:
        if takes and model.image_token_id in seq.prompt_ids:
            raise InvalidRequestError("the prompt holds image tokens but the request has no images",
                                      "prompt_token_ids")
        return
    if not takes:
        raise InvalidRequestError("this model takes no images (a text model)", "images")
    if req.sampling.beam_width or req.disagg_phase or speculative:
        raise InvalidRequestError("images are not served with beam search, prefill/decode hand-offs or speculative "
                                  "decoding yet", "images")
    pixels, grids, hashes = [], [], []
    dim = model.patch_dim()
    for i, image in enumerate(images):
        grid = tuple(int(v) for v in image.grid_thw)
        if len(grid) != 3 or min(grid) < 1:
            raise InvalidRequestError(f"images[{i}].grid_thw must be three positive integers, got {list(grid)}",
                                      "images")
        rows = grid[0] * grid[1] * grid[2]
        if len(image.pixel_values) != rows * dim * 4:
            raise InvalidRequestError(f"images[{i}].pixel_values has {len(image.pixel_values)} bytes, the grid "
                                      f"{list(grid)} needs {rows} rows of {dim} float32", "images")
        if not image.content_hash:
            raise InvalidRequestError(f"images[{i}].content_hash is required", "images")
        pixels.append(torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32).view(rows, dim))
        grids.append(grid)
        hashes.append(bytes(image.content_hash))
    ids = torch.tensor(seq.prompt_ids, dtype=torch.int64)
    grid_t = torch.tensor(grids, dtype=torch.int64)
    try:  # (the model checks that the prompt holds each image's run of image tokens, in order, and no more)
        positions, delta = model.mrope_positions(ids, grid_t)
    except ValueError as exc:
        raise InvalidRequestError(f"the prompt's image tokens do not fit its images: {exc}", "images") from None
    at = (ids == model.image_token_id).nonzero().flatten().tolist()
    spans, k = [], 0
    for grid in grids:
        spans.append((at[k], model.image_tokens(grid)))
        k += spans[-1][1]
    seq.images = SequenceImages(pixels, grid_t, hashes, spans, positions.to(torch.int64), int(delta))
    seq.hash_root = image_hash_root(seq.hash_root, hashes)


@dataclass
class EncoderCache:
    """Image embeddings by content hash, least recently used dropped beyond ``max_bytes``; ``hits`` / ``misses``
    count lookups (an image is encoded once while cached, however many chunks or requests use it)."""

    max_bytes: int = 256 << 20
    hits: int = 0
    misses: int = 0
    _entries: OrderedDict[bytes, torch.Tensor] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def embeddings(self, model: SupportsImages, images: SequenceImages, i: int) -> torch.Tensor:
        key = images.hashes[i]
        got = self._entries.get(key)
        if got is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return got
        self.misses += 1
        (got,) = model.encode_images(images.pixels[i], images.grid[i:i + 1])
        self._entries[key] = got
        self._bytes += got.numel() * got.element_size()
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
        return got


@dataclass(frozen=True)
class BatchImages:
    """A step's image inputs for the forward: ``mrope_positions`` ``[3, T]``, the image tokens' embeddings and
    their rows (None when no row is an image token)."""

    mrope_positions: torch.Tensor
    image_embeds: torch.Tensor | None
    image_rows: torch.Tensor | None

    def forward_kwargs(self) -> dict[str, torch.Tensor | None]:
        return {"mrope_positions": self.mrope_positions, "image_embeds": self.image_embeds,
                "image_rows": self.image_rows}


def batch_images(chunks: list[tuple[Sequence, int]], model: object, cache: EncoderCache,
                 device: torch.device) -> BatchImages | None:
    """The step's :class:`BatchImages` for ``chunks`` (in row order; None when no sequence has images)."""
    if not any(seq.images is not None for seq, _ in chunks):
        return None
    assert isinstance(model, SupportsImages)
    pos, embeds, rows = [], [], []
    row = 0
    for seq, n in chunks:
        start = seq.num_computed_tokens
        end = start + n
        images = seq.images
        if images is None:
            pos.append(torch.arange(start, end, dtype=torch.int64).expand(3, -1))
        else:
            pos.append(images.rope_positions(start, end))
            for i, (first, count) in enumerate(images.spans):
                lo, hi = max(start, first), min(end, first + count)
                if lo < hi:
                    embeds.append(cache.embeddings(model, images, i)[lo - first:hi - first])
                    rows.extend(range(row + lo - start, row + hi - start))
        row += n
    return BatchImages(torch.cat(pos, dim=1).to(device),
                       torch.cat(embeds).to(device) if embeds else None,
                       torch.tensor(rows, dtype=torch.int64, device=device) if rows else None)
