"""Image inputs of multimodal models in the engine, and their encode phase (xLLM §3.3).

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

**The encode phase** (:mod:`xllm.sched.encode`): a sequence with images starts with ``encode_pending`` = its
image count. With the phase on (:func:`max_encode_images` > 0) the batch policy admits it to prefill only once
a step has encoded its images (:func:`encode_phase`: one batched call of the vision tower for the images of
the step's encode batch that the cache lacks), and encodes only while no prompt is mid-prefill, a bounded
batch per step. The bound: ``--max-encode-images``, else a start-up profile with a TPOT target
(:func:`profile_encode_images`: the largest batch of reference images the tower encodes within
:data:`~xllm.sched.encode.ENCODE_SLO_SHARE` of the target), else
:data:`~xllm.sched.encode.DEFAULT_MAX_ENCODE_IMAGES`. An image dropped from the cache before its prefill is
encoded again in its chunk (never a wrong embedding).

Not with images (refused, naming ``images``): speculative decoding. Beam search takes them: the prompt as above,
the beams' rows at their M-RoPE text positions (:class:`xllm.core.beam.BeamRows`). So do prefill/decode hand-offs:
both sides get the request with its images (the same hash root, so the decode side's prefix cache matches only
the same images; its decode rows at the M-RoPE text positions; a hand-off that fails is recomputed there, the
images encoded in that prefill).
"""

from __future__ import annotations

import hashlib
import logging
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from xllm.engine_api.errors import InvalidRequestError
from xllm.proto.engine.v1 import engine_pb2
from xllm.sched.encode import DEFAULT_MAX_ENCODE_IMAGES, ENCODE_SLO_SHARE, largest_within

if TYPE_CHECKING:
    from xllm.core.config import EngineConfig
    from xllm.core.sequence import Sequence


log = logging.getLogger(__name__)


@runtime_checkable
class SupportsImages(Protocol):
    """A model that takes images (``xllm.models.qwen_vl``)."""

    image_token_id: int
    dtype: torch.dtype  # the embeddings' dtype

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

    def reference_grid(self) -> tuple[int, int, int]:
        """The patch grid of a typical image (448 x 448 pixels as the model's processor resizes it): what the
        encode-phase profile encodes."""
        ...

    def image_embed_dim(self) -> int:
        """The width of one image token's embedding (the language model's hidden size)."""
        ...


@dataclass
class SequenceImages:
    """A sequence's images: ``pixels[i]`` float32 ``[rows, patch_dim]``, ``grid`` int64 ``[n, 3]``, ``hashes``
    their content hashes, ``spans[i]`` the (first prompt index, tokens) of image ``i``'s image tokens,
    ``positions`` the prompt's M-RoPE positions ``[3, P]``, ``delta``: a later token ``j`` is at ``j + delta``;
    ``given[i]``: image ``i``'s embeddings as an encode instance sent them (checked; None: encoded here)."""

    pixels: list[torch.Tensor]
    grid: torch.Tensor
    hashes: list[bytes]
    spans: list[tuple[int, int]]
    positions: torch.Tensor
    delta: int
    given: list[torch.Tensor | None] = field(default_factory=list)

    def wanted(self, i: int) -> tuple[bytes, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Image ``i`` as :meth:`EncoderCache.encode_all` takes it: (hash, patch rows, grid ``[1, 3]``, given)."""
        return self.hashes[i], self.pixels[i], self.grid[i:i + 1], self.given[i] if self.given else None

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


def admit_images(model: object, seq: Sequence, req: engine_pb2.GenerateRequest, speculative: bool = False,
                 weights_identity: str = "") -> None:
    """Check ``req.images`` against the model and the prompt and give ``seq`` its :class:`SequenceImages` (and
    the hash root they key); a prompt of a multimodal model must not hold image tokens without their images.
    ``speculative``: the engine speculates (images are refused there). An image's embedding from an encode
    instance (:func:`given_embedding`) is used when it passes its checks (this engine's ``weights_identity``),
    else the image is encoded here. :class:`InvalidRequestError` naming ``images`` (or ``prompt_token_ids``)."""
    takes = isinstance(model, SupportsImages)
    images = list(req.images)
    if not images:
        if takes and model.image_token_id in seq.prompt_ids:
            raise InvalidRequestError("the prompt holds image tokens but the request has no images",
                                      "prompt_token_ids")
        return
    if not takes:
        raise InvalidRequestError("this model takes no images (a text model)", "images")
    if speculative:
        raise InvalidRequestError("images are not served with speculative decoding yet", "images")
    parsed = [parse_image(model, i, image) for i, image in enumerate(images)]
    pixels = [p for p, _, _ in parsed]
    grids = [g for _, g, _ in parsed]
    hashes = [h for _, _, h in parsed]
    given = [given_embedding(model, image, grid, weights_identity, seq.request_id)
             for image, grid in zip(images, grids, strict=True)]
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
    seq.images = SequenceImages(pixels, grid_t, hashes, spans, positions.to(torch.int64), int(delta), given)
    seq.hash_root = image_hash_root(seq.hash_root, hashes)
    seq.encode_pending = sum(g is None for g in given)  # (an image encoded elsewhere needs no encode phase here)


def parse_image(model: SupportsImages, i: int, image: engine_pb2.ImageInput
                ) -> tuple[torch.Tensor, tuple[int, int, int], bytes]:
    """``images[i]``'s patch rows ``[rows, patch_dim]``, grid and content hash, checked against ``model``
    (:class:`InvalidRequestError` naming ``images``)."""
    grid = tuple(int(v) for v in image.grid_thw)
    if len(grid) != 3 or min(grid) < 1:
        raise InvalidRequestError(f"images[{i}].grid_thw must be three positive integers, got {list(grid)}",
                                  "images")
    rows, dim = grid[0] * grid[1] * grid[2], model.patch_dim()
    if len(image.pixel_values) != rows * dim * 4:
        raise InvalidRequestError(f"images[{i}].pixel_values has {len(image.pixel_values)} bytes, the grid "
                                  f"{list(grid)} needs {rows} rows of {dim} float32", "images")
    if not image.content_hash:
        raise InvalidRequestError(f"images[{i}].content_hash is required", "images")
    pixels = torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32).view(rows, dim)
    return pixels, grid, bytes(image.content_hash)  # type: ignore[return-value]


def given_embedding(model: SupportsImages, image: engine_pb2.ImageInput, grid: tuple[int, int, int],
                    weights_identity: str, request_id: str = "") -> torch.Tensor | None:
    """The embeddings ``[tokens, hidden]`` an encode instance attached to ``image``, when they are whole (the
    grid's tokens in the model's width), intact (CRC-32) and made by the same weights; None when there are none
    or they fail a check (logged: the image is then encoded here, never a wrong embedding used)."""
    if not image.HasField("embedding"):
        return None
    got = image.embedding
    tokens, hidden = model.image_tokens(grid), model.image_embed_dim()
    problem = ""
    if len(got.values) != tokens * hidden * 4:
        problem = f"{len(got.values)} bytes where {tokens} x {hidden} float32 are due"
    elif zlib.crc32(got.values) & 0xFFFFFFFF != got.crc32:
        problem = "CRC mismatch (corrupted)"
    elif got.weights_identity != weights_identity:
        problem = f"made by weights {got.weights_identity!r}, these are {weights_identity!r}"
    if problem:
        log.warning("request %s: an image's embedding from the encode instance is not used (%s): encoding it here",
                    request_id, problem)
        return None
    return torch.frombuffer(bytearray(got.values), dtype=torch.float32).view(tokens, hidden).to(model.dtype)


def encode_requests(model: object, cache: EncoderCache, requests: list[list[engine_pb2.ImageInput]],
                    weights_identity: str = "") -> list[list[engine_pb2.ImageEmbedding] | InvalidRequestError]:
    """``EngineService.Encode`` for several calls at once: each call's images' embeddings (float32 with their
    CRC-32 and ``weights_identity``), or the :class:`InvalidRequestError` naming ``images`` that refuses that
    call alone (a text model, a malformed image). The images ``cache`` lacks, of every valid call, go through
    the vision tower in one batch (each content hash once)."""
    if not isinstance(model, SupportsImages):
        return [InvalidRequestError("this model takes no images (a text model)", "images") for _ in requests]
    parsed: list[list | InvalidRequestError] = []
    for images in requests:
        try:
            if not images:
                raise InvalidRequestError("images: at least one image to encode", "images")
            parsed.append([(key, pixels, torch.tensor([grid], dtype=torch.int64), None)
                           for pixels, grid, key in (parse_image(model, i, im) for i, im in enumerate(images))])
        except InvalidRequestError as exc:
            parsed.append(exc)
    cache.encode_all(model, [w for p in parsed if not isinstance(p, InvalidRequestError) for w in p], phase=False)
    return [p if isinstance(p, InvalidRequestError) else
            [_embedding_message(cache.embeddings_of(key).float().contiguous().numpy().tobytes(), weights_identity)
             for key, *_ in p] for p in parsed]


def _embedding_message(values: bytes, weights_identity: str) -> engine_pb2.ImageEmbedding:
    return engine_pb2.ImageEmbedding(values=values, crc32=zlib.crc32(values) & 0xFFFFFFFF,
                                     weights_identity=weights_identity)


@dataclass
class EncoderCache:
    """Image embeddings by content hash, least recently used dropped beyond ``max_bytes``; ``hits`` / ``misses``
    count lookups (an image is encoded once while cached, however many chunks or requests use it; a miss is an
    image encoded). Of the misses, ``phase_images`` were encoded in the encode phase (:meth:`encode_all`), in
    ``phase_batches`` calls of the vision tower, the largest of ``largest_batch`` images; the others in a prefill
    chunk. ``encode_seconds``: the vision tower's time, both ways. :meth:`take_report`: the step stats since
    the last report. ``received``: images whose embeddings came with the request from an encode instance (put in
    the cache as they are, not encoded here; neither a hit nor a miss)."""

    max_bytes: int = 256 << 20
    hits: int = 0
    misses: int = 0
    received: int = 0
    phase_images: int = 0
    phase_batches: int = 0
    largest_batch: int = 0
    encode_seconds: float = 0.0
    _reported: tuple[int, int, float] = (0, 0, 0.0)
    _entries: OrderedDict[bytes, torch.Tensor] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def _lookup(self, key: bytes) -> torch.Tensor | None:
        got = self._entries.get(key)
        if got is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return got

    def _put(self, key: bytes, got: torch.Tensor, encoded: bool = True) -> None:
        if encoded:
            self.misses += 1
        else:
            self.received += 1
        self._entries[key] = got
        self._bytes += got.numel() * got.element_size()
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()

    def embeddings(self, model: SupportsImages, images: SequenceImages, i: int) -> torch.Tensor:
        """Image ``i`` of ``images``: from the cache, else as an encode instance sent it, else encoded now (alone)."""
        got = self._lookup(images.hashes[i])
        given = images.given[i] if images.given else None
        if got is None and given is not None:
            self._put(images.hashes[i], got := given, encoded=False)
        elif got is None:
            t0 = time.perf_counter()
            (got,) = model.encode_images(images.pixels[i], images.grid[i:i + 1])
            self.encode_seconds += time.perf_counter() - t0
            self._put(images.hashes[i], got)
        return got

    def take_report(self) -> dict[str, int | float]:
        """The images encoded, the cache hits and the encode seconds since the last call, as the ``StepStats``
        fields (none when nothing happened)."""
        now = (self.misses, self.hits, self.encode_seconds)
        before, self._reported = self._reported, now
        if now == before:
            return {}
        return {"images_encoded": now[0] - before[0], "image_cache_hits": now[1] - before[1],
                "image_encode_seconds": now[2] - before[2]}

    def clear(self) -> None:
        """Forget every embedding (the weights that made them are gone); the counters stay."""
        self._entries.clear()
        self._bytes = 0

    def embeddings_of(self, key: bytes) -> torch.Tensor:
        """The cached embeddings of the image hashed ``key`` (``KeyError`` when not cached)."""
        return self._entries[key]

    def encode_all(self, model: SupportsImages,
                   wanted: Iterable[tuple[bytes, torch.Tensor, torch.Tensor, torch.Tensor | None]],
                   phase: bool = True) -> int:
        """Put the embeddings of every image ``(hash, patch rows, grid [1, 3], given)`` of ``wanted`` in the cache:
        those it lacks (each content hash once) as ``given`` (an encode instance's) or, without, encoded in one
        call of the vision tower; ``phase``: that call is the engine's encode phase (counted as such; not for an
        encode instance's ``Encode``). Returns how many images were encoded."""
        todo: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, pixels, grid, given in wanted:
            if key in todo or self._lookup(key) is not None:
                continue
            if given is not None:
                self._put(key, given, encoded=False)
            else:
                todo[key] = (pixels, grid)
        if not todo:
            return 0
        pixels = torch.cat([p for p, _ in todo.values()])
        grid = torch.cat([g for _, g in todo.values()])
        t0 = time.perf_counter()
        encoded = model.encode_images(pixels, grid)
        self.encode_seconds += time.perf_counter() - t0
        for key, got in zip(todo, encoded, strict=True):
            self._put(key, got)
        if phase:
            self.phase_images += len(todo)
            self.phase_batches += 1
            self.largest_batch = max(self.largest_batch, len(todo))
        return len(todo)


def encode_phase(seqs: Iterable[Sequence], model: object, cache: EncoderCache) -> int:
    """The encode phase of ``seqs`` (a step's ``StepPlan.encodes``): their images into ``cache`` in one batch;
    each sequence is then ready for prefill (``encode_pending`` 0). Returns the images encoded."""
    seqs = list(seqs)
    wanted = [seq.images.wanted(i) for seq in seqs if seq.images is not None for i in range(len(seq.images.hashes))]
    n = cache.encode_all(model, wanted) if wanted else 0  # type: ignore[arg-type]
    for seq in seqs:
        seq.encode_pending = 0
    return n


def image_token_bytes(model: object) -> int:
    """The ``pixel_values`` and ``embedding`` bytes behind one image token of ``model`` (float32 patch rows and
    embedding; 0 for a text model):
    what bounds a request's images on the engine service (:func:`xllm.engine_api.bounds.generate_allowance`)."""
    if not isinstance(model, SupportsImages):
        return 0
    grid = model.reference_grid()
    rows = grid[0] * grid[1] * grid[2]  # (plus an encode instance's float32 embedding of each token)
    return -(-rows * model.patch_dim() * 4 // model.image_tokens(grid)) + 4 * model.image_embed_dim()


def max_encode_images(config: EngineConfig, model: object) -> int:
    """Images encoded per step in the encode phase (0: no encode phase): none for a text model, else
    ``config.max_encode_images`` when set, else the profile's bound with a TPOT target, else the default."""
    if not isinstance(model, SupportsImages):
        return 0
    if config.max_encode_images is not None:
        return config.max_encode_images
    if config.slo_tpot_ms is None:
        return DEFAULT_MAX_ENCODE_IMAGES
    return profile_encode_images(model, config.slo_tpot_ms / 1000 * ENCODE_SLO_SHARE, config.max_num_seqs)


def profile_encode_images(model: SupportsImages, limit_s: float, max_k: int, repeats: int = 2) -> int:
    """The largest batch of reference images (:meth:`SupportsImages.reference_grid`, random pixels) the model's
    vision tower encodes within ``limit_s`` (binary search, :func:`~xllm.sched.encode.largest_within`; each size
    timed ``repeats`` times after one warm-up call, the fastest kept), at most ``max_k``, at least 1."""
    grid = model.reference_grid()
    rows = grid[0] * grid[1] * grid[2]
    pixels = torch.randn(rows, model.patch_dim(), generator=torch.Generator().manual_seed(0))
    model.encode_images(pixels, torch.tensor([grid]))  # (first call: allocations, kernel choices)
    timed: dict[int, float] = {}

    def measure(k: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.encode_images(pixels.repeat(k, 1), torch.tensor([grid] * k))
            best = min(best, time.perf_counter() - t0)
        timed[k] = best
        return best

    k = largest_within(measure, limit_s, max(1, min(max_k, 64)))
    log.info("encode phase: %d image(s) of grid %s per step (profiled: %s; limit %.1f ms)", k, list(grid),
             ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in sorted(timed.items())), limit_s * 1e3)
    return k


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
