"""A KV backend's pages as bytes: what moving KV between engines reads and writes (no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@runtime_checkable
class PageAccess(Protocol):
    """What moving KV between engines (the hand-off transports, the KV tiers) uses of an engine's pages.

    For every (layer, K|V) range in layout order (``range_layers[r]``: its layer) a page is
    ``page_bytes[r]`` bytes; a block's bytes are its page in every range, concatenated (``block_bytes``).
    ``layout`` is the fingerprint of the pages' format
    (:attr:`~xllm.core.kv.layout.KVCacheLayout.fingerprint`). ``memfd`` (None: the pages are in no
    file another process can map), ``memfd_offsets`` and ``memfd_map`` are :class:`PageStore`'s.
    Implementations: :class:`PageStore` (one process's KV memory) and
    :class:`~xllm.core.executor.kv_pages.ShardedPageStore` (a tensor-parallel instance's ranks, whole heads).
    """

    layout: str
    page_bytes: tuple[int, ...]
    range_layers: tuple[int, ...]
    memfd: int | None
    memfd_offsets: tuple[int, ...]
    memfd_map: memoryview | None

    def ranges_of_layer(self, layer: int) -> list[int]: ...

    @property
    def block_bytes(self) -> int: ...

    def read_block(self, page: int) -> bytes: ...

    def read_pages(self, r: int, pages: list[int] | tuple[int, ...]) -> bytes: ...

    def write_page(self, r: int, page: int, data: bytes | memoryview) -> None: ...

    def write_pages(self, r: int, pages: Sequence[int], data: bytes | memoryview) -> None: ...

    def write_block(self, page: int, data: bytes | memoryview) -> None: ...


@dataclass(frozen=True)
class PageStore:
    """Where a backend's KV pages physically are, for moving blocks between engines.

    For every (layer, K|V) range in layout order (``range_layers[r]``: its layer), page ``p`` is
    bytes ``[p * page_bytes[r], (p + 1) * page_bytes[r])`` of the writable ``buffers[r]``; a block's
    bytes are its page in every range, concatenated. A backend over a memfd (xTensor) also names it:
    range ``r`` starts at ``memfd_offsets[r]`` in the file, so another process holding the fd can map
    it and copy pages out.
    """

    layout: str
    buffers: tuple[memoryview, ...]
    page_bytes: tuple[int, ...]
    range_layers: tuple[int, ...]
    memfd: int | None = None
    memfd_offsets: tuple[int, ...] = ()
    memfd_map: memoryview | None = None  # the whole memfd, mapped writable (the ranges' buffers are slices of it)

    def ranges_of_layer(self, layer: int) -> list[int]:
        return [r for r, lay in enumerate(self.range_layers) if lay == layer]

    @property
    def block_bytes(self) -> int:
        return sum(self.page_bytes)

    def read_block(self, page: int) -> bytes:
        return b"".join(self.read_pages(r, (page,)) for r in range(len(self.buffers)))

    def read_pages(self, r: int, pages: list[int] | tuple[int, ...]) -> bytes:
        """Range ``r``'s page of each of ``pages``, concatenated."""
        buf, pb = self.buffers[r], self.page_bytes[r]
        return b"".join(buf[p * pb:(p + 1) * pb] for p in pages)

    def write_page(self, r: int, page: int, data: bytes | memoryview) -> None:
        pb = self.page_bytes[r]
        if len(data) != pb:
            raise ValueError(f"a page of range {r} is {pb} bytes, got {len(data)}")
        self.buffers[r][page * pb:(page + 1) * pb] = data

    def write_pages(self, r: int, pages: Sequence[int], data: bytes | memoryview) -> None:
        """Range ``r``'s page of each of ``pages`` from ``data`` (their pages, concatenated)."""
        pb = self.page_bytes[r]
        if len(data) != pb * len(pages):
            raise ValueError(f"{len(pages)} pages of range {r} are {pb * len(pages)} bytes, got {len(data)}")
        view = memoryview(data)
        for i, page in enumerate(pages):
            self.write_page(r, page, view[i * pb:(i + 1) * pb])

    def write_block(self, page: int, data: bytes | memoryview) -> None:
        if len(data) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got {len(data)}")
        view, at = memoryview(data), 0
        for r, pb in enumerate(self.page_bytes):
            self.write_page(r, page, view[at:at + pb])
            at += pb
