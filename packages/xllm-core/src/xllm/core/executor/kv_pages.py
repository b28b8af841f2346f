"""A tensor-parallel instance's KV pages as one page store in the canonical layout (every KV head of the model,
what a one-rank instance of it holds), for KV hand-offs between instances of any tensor-parallel size.

Each rank holds the KV heads ``[start, end)`` of :class:`KVHeads` (consecutive ranks may hold the same head when
there are fewer KV heads than ranks). A page of one (layer, K|V) range is ``block_size`` token rows of
``[heads, head_bytes]``: the canonical page has every head, rank ``r``'s page its own.

Rank 0 (the engine process) holds a :class:`ShardedPageStore`, the transports' page store
(:class:`~xllm.core.kv.page_store.PageAccess`). A read publishes ``KV_READ`` (range, pages) on the plan
channel and every rank contributes its pages' bytes to one ``all_gather`` (padded to the largest rank's);
rank 0 interleaves the heads into canonical rows (:func:`gather_heads`). A write publishes ``KV_WRITE``
(range, pages) and rank 0 contributes the canonical pages to one ``all_gather`` (the workers contribute
zeros); each rank writes its own heads (:func:`split_heads`). Each sequence runs under the runner's lock,
so every rank sees steps, reads and writes in one order. A worker answers with :func:`serve_kv_message`.

A message's range word may be :data:`ALL_RANGES`: every range of the pages (whole blocks: one exchange for a
block's every layer, :meth:`ShardedPageStore.read_blocks` / :meth:`~ShardedPageStore.write_blocks`, what the
KV tiers move).

Quantized KV rows (per-head codes and scales packed per token) are not resharded: such an instance has no
transfer store (``--kv-cache-dtype`` with ``--role`` and ``--tensor-parallel-size`` is refused at start-up).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from xllm.core.executor.channel import RankFailed
from xllm.core.executor.group import RankGroup
from xllm.core.kv.page_store import PageAccess
from xllm.core.model_api import CausalLM
from xllm.core.parallel.comm import CollectiveError, Communicator

# plan-channel message kinds of the page exchange (after channel.py's step kinds, apart from them)
KV_READ = 16   # int64 [range, n, page...]: every rank all-gathers its pages of the range
KV_WRITE = 17  # int64 [range, n, page...]: rank 0 all-gathers canonical pages, every rank writes its heads
ALL_RANGES = -1  # a message's range word: every range of the pages, in block order (whole blocks)
_BLOCK_EXCHANGE_BYTES = 64 << 20  # whole blocks per exchange: at most this many canonical bytes (at least one)
_WORDS = 2


@dataclass(frozen=True)
class KVHeads:
    """The canonical KV heads each rank holds: ``spans[r] = (start, end)``, half-open."""

    spans: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        held = {h for s, e in self.spans for h in range(s, e)}
        if held != set(range(self.total)) or any(e <= s for s, e in self.spans):
            raise ValueError(f"KV head spans {self.spans} do not cover heads 0..{self.total - 1}, each rank some")

    @property
    def total(self) -> int:
        return max(e for _, e in self.spans)

    def count(self, rank: int) -> int:
        s, e = self.spans[rank]
        return e - s

    def sources(self) -> list[tuple[int, int]]:
        """Per canonical head, the first rank holding it and its index among that rank's heads."""
        out = []
        for h in range(self.total):
            rank = next(r for r, (s, e) in enumerate(self.spans) if s <= h < e)
            out.append((rank, h - self.spans[rank][0]))
        return out


def gather_heads(parts: Sequence[np.ndarray], heads: KVHeads, rows: int, head_bytes: int) -> np.ndarray:
    """Canonical rows ``[rows, heads.total, head_bytes]`` (flat uint8) from each rank's rows
    ``parts[r]`` (flat uint8 ``[rows, heads.count(r), head_bytes]``, padding after them ignored)."""
    views = [np.asarray(p, dtype=np.uint8)[:rows * heads.count(r) * head_bytes].reshape(rows, heads.count(r),
                                                                                         head_bytes)
             for r, p in enumerate(parts)]
    out = np.empty((rows, heads.total, head_bytes), dtype=np.uint8)
    for h, (rank, i) in enumerate(heads.sources()):
        out[:, h] = views[rank][:, i]
    return out.reshape(-1)


def split_heads(canonical: np.ndarray, heads: KVHeads, rank: int, rows: int, head_bytes: int) -> np.ndarray:
    """Rank ``rank``'s rows (flat uint8 ``[rows, heads.count(rank), head_bytes]``) of canonical rows."""
    s, e = heads.spans[rank]
    whole = np.asarray(canonical, dtype=np.uint8)[:rows * heads.total * head_bytes]
    return np.ascontiguousarray(whole.reshape(rows, heads.total, head_bytes)[:, s:e]).reshape(-1)


def local_kv_heads(model: CausalLM) -> tuple[int, int]:
    """The canonical KV heads this rank's shard holds. A model shard that names its KV cut (``model.tp.cuts
    ["kv"]``: rows of ``head_dim``, as :mod:`xllm.models.tensor_parallel` does) holds those; otherwise every
    KV head its cache spec has (a whole latent, MLA)."""
    spec = model.kv_cache_spec()
    cuts = getattr(getattr(model, "tp", None), "cuts", None) or {}
    cut = cuts.get("kv")
    if cut is None or not spec.head_dim:
        return 0, int(spec.num_kv_heads)
    span = cut.spans[0]
    return int(span.start) // spec.head_dim, int(span.end) // spec.head_dim


def agree_kv_heads(model: CausalLM, comm: Communicator) -> KVHeads:
    """Every rank calls this once at start-up (one ``all_gather``): every rank's KV heads."""
    s, e = local_kv_heads(model)
    rows = comm.all_gather(torch.tensor([s, e], dtype=torch.int64))
    return KVHeads(tuple((int(r[0]), int(r[1])) for r in rows))


def head_bytes_of(local: PageAccess, heads: KVHeads, rank: int, block_size: int) -> tuple[int, ...]:
    """Per range, one head's bytes of one token row, from rank ``rank``'s page sizes (``ValueError`` for pages
    that are not whole rows of whole heads: quantized rows)."""
    out = []
    for pb in local.page_bytes:
        hb, rest = divmod(pb, block_size * heads.count(rank))
        if rest or not hb:
            raise ValueError(f"a {pb}-byte KV page is not {block_size} rows of {heads.count(rank)} heads")
        out.append(hb)
    return tuple(out)


def _padded(data: bytes | np.ndarray, size: int) -> torch.Tensor:
    out = np.zeros(size, dtype=np.uint8)
    src = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes | bytearray | memoryview) else data
    out[:len(src)] = src
    return torch.from_numpy(out)


def _ranges(local: PageAccess, r: int) -> list[int]:
    """The ranges a message's range word names: one, or every range in block order (:data:`ALL_RANGES`)."""
    return list(range(len(local.page_bytes))) if r == ALL_RANGES else [r]


def _exchange_size(heads: KVHeads, rows: int, head_bytes: Sequence[int]) -> int:
    """Bytes each rank contributes to a read's ``all_gather``: the largest rank's rows of the ranges."""
    return max(heads.count(r) for r in range(len(heads.spans))) * rows * sum(head_bytes)


def _split(data: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    out, at = [], 0
    for n in sizes:
        out.append(data[at:at + n])
        at += n
    return out


def serve_kv_message(kind: int, words: np.ndarray, local: PageAccess, heads: KVHeads, comm: Communicator,
                     block_size: int) -> None:
    """A worker's side of ``KV_READ`` / ``KV_WRITE`` (see the module docstring) over its pages ``local``."""
    r, n = int(words[0]), int(words[1])
    pages = [int(p) for p in words[_WORDS:_WORDS + n]]
    rank = comm.rank
    rs = _ranges(local, r)
    hbs = head_bytes_of(local, heads, rank, block_size)
    hb = [hbs[x] for x in rs]
    rows = n * block_size
    if kind == KV_READ:
        mine = np.concatenate([np.frombuffer(local.read_pages(x, pages), dtype=np.uint8) for x in rs])
        comm.all_gather(_padded(mine, _exchange_size(heads, rows, hb)))
        return
    if kind != KV_WRITE:
        raise RankFailed(f"rank {rank}: unknown KV page message kind {kind}")
    parts = comm.all_gather(torch.zeros(rows * heads.total * sum(hb), dtype=torch.uint8))
    canonical = _split(parts[0].numpy(), [rows * heads.total * b for b in hb])
    for x, data, b in zip(rs, canonical, hb, strict=True):
        _write_local(local, x, pages, split_heads(data, heads, rank, rows, b))


def _write_local(local: PageAccess, r: int, pages: Sequence[int], data: np.ndarray) -> None:
    pb = local.page_bytes[r]
    view = memoryview(data)
    for i, page in enumerate(pages):
        local.write_page(r, page, view[i * pb:(i + 1) * pb])


class ShardedPageStore:
    """Rank 0's page store over every rank's KV heads, in the canonical layout (see the module docstring).
    ``layout``: the canonical fingerprint. No memfd (the ``fd`` transport needs one: it refuses)."""

    memfd = None
    memfd_offsets: tuple[int, ...] = ()
    memfd_map = None

    def __init__(self, group: RankGroup, lock: threading.Lock, local: PageAccess, heads: KVHeads, block_size: int,
                 layout: str) -> None:
        self.group = group
        self.lock = lock
        self.local = local
        self.heads = heads
        self.block_size = block_size
        self.layout = layout
        self.head_bytes = head_bytes_of(local, heads, 0, block_size)
        self.page_bytes = tuple(block_size * heads.total * hb for hb in self.head_bytes)
        self.range_layers = tuple(local.range_layers)
        # pages per message: the page list must fit one plan-channel message
        self._per = max(1, group.channel.spec.slot_bytes // 8 - _WORDS)
        self._per_block = max(1, min(self._per, _BLOCK_EXCHANGE_BYTES // max(1, self.block_bytes)))

    def ranges_of_layer(self, layer: int) -> list[int]:
        return [r for r, lay in enumerate(self.range_layers) if lay == layer]

    @property
    def block_bytes(self) -> int:
        return sum(self.page_bytes)

    def _publish(self, kind: int, r: int, pages: Sequence[int]) -> None:
        g = self.group
        g.check()
        g.channel.publish(kind, np.array([r, len(pages), *pages], dtype=np.int64), g.timeout_s, g.check)

    def _read(self, r: int, pages: Sequence[int]) -> list[np.ndarray]:
        """The canonical pages of ``pages`` (one message's worth) per range ``r`` names (:func:`_ranges`)."""
        rs = _ranges(self.local, r)
        rows = len(pages) * self.block_size
        hb = [self.head_bytes[x] for x in rs]
        with self.lock:
            try:
                self._publish(KV_READ, r, pages)
                mine = np.concatenate([np.frombuffer(self.local.read_pages(x, list(pages)), dtype=np.uint8)
                                       for x in rs])
                parts = self.group.comm.all_gather(_padded(mine, _exchange_size(self.heads, rows, hb)))
            except CollectiveError as e:
                raise self.group.failure(e) from e
        per_rank = [_split(p.numpy(), [self.heads.count(rank) * rows * b for b in hb]) for rank, p in enumerate(parts)]
        return [gather_heads([pr[i] for pr in per_rank], self.heads, rows, b) for i, b in enumerate(hb)]

    def _write(self, r: int, pages: Sequence[int], canonical: list[np.ndarray]) -> None:
        """Write canonical pages (per range ``r`` names, ``pages`` concatenated): each rank its heads."""
        rs = _ranges(self.local, r)
        rows = len(pages) * self.block_size
        whole = torch.from_numpy(np.concatenate(canonical))
        with self.lock:
            try:
                self._publish(KV_WRITE, r, pages)
                self.group.comm.all_gather(whole)
            except CollectiveError as e:
                raise self.group.failure(e) from e
            for x, data in zip(rs, canonical, strict=True):
                _write_local(self.local, x, pages, split_heads(data, self.heads, 0, rows, self.head_bytes[x]))

    def read_pages(self, r: int, pages: list[int] | tuple[int, ...]) -> bytes:
        """Range ``r``'s canonical page of each of ``pages``, concatenated."""
        return b"".join(self._read(r, pages[i:i + self._per])[0].tobytes() for i in range(0, len(pages), self._per))

    def write_pages(self, r: int, pages: Sequence[int], data: bytes | memoryview) -> None:
        """Write canonical pages of range ``r`` (``len(pages)`` pages, concatenated): each rank its heads."""
        pb = self.page_bytes[r]
        if len(data) != pb * len(pages):
            raise ValueError(f"{len(pages)} pages of range {r} are {pb * len(pages)} bytes, got {len(data)}")
        whole = np.frombuffer(data, dtype=np.uint8)
        for i in range(0, len(pages), self._per):
            chunk = list(pages[i:i + self._per])
            self._write(r, chunk, [whole[i * pb:(i + len(chunk)) * pb]])

    def write_page(self, r: int, page: int, data: bytes | memoryview) -> None:
        self.write_pages(r, (page,), data)

    def read_blocks(self, pages: Sequence[int]) -> list[bytes]:
        """The canonical block in each of ``pages`` (every range; one exchange per message's worth of pages)."""
        out: list[bytes] = []
        for i in range(0, len(pages), self._per_block):
            chunk = list(pages[i:i + self._per_block])
            per_range = self._read(ALL_RANGES, chunk)
            for j in range(len(chunk)):
                out.append(b"".join(d[j * pb:(j + 1) * pb].tobytes()
                                    for d, pb in zip(per_range, self.page_bytes, strict=True)))
        return out

    def write_blocks(self, pages: Sequence[int], blocks: Sequence[bytes | memoryview]) -> None:
        """Write canonical blocks (one per page of ``pages``; one exchange per message's worth of pages)."""
        if len(blocks) != len(pages) or any(len(b) != self.block_bytes for b in blocks):
            raise ValueError(f"{len(pages)} blocks of {self.block_bytes} bytes expected")
        for i in range(0, len(pages), self._per_block):
            chunk = list(pages[i:i + self._per_block])
            views = [_split(np.frombuffer(b, dtype=np.uint8), self.page_bytes) for b in blocks[i:i + len(chunk)]]
            self._write(ALL_RANGES, chunk, [np.concatenate([v[x] for v in views]) for x in range(len(self.page_bytes))])

    def read_block(self, page: int) -> bytes:
        return self.read_blocks((page,))[0]

    def write_block(self, page: int, data: bytes | memoryview) -> None:
        self.write_blocks((page,), (data,))
