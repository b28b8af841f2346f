"""xTensor: logically contiguous, physically discrete KV memory (xLLM §4.3).

Physical memory is one ``memfd`` cut into pages; page ``p`` of a sequence
block holds ``block_size`` tokens for one (layer, K|V) range. Every range
reserves, per sequence slot, a virtual region as long as ``max_model_len``;
pages are mapped into it on demand with ``mmap(MAP_FIXED)``, so each sequence
sees one contiguous ``[max_len, kv_heads, head_dim]`` region per layer and
attention reads it with (slot, length) — no block table.

- A page ID stands for the same page index in every range (one mmap per range).
- Prefix-cache hits map the cached pages into the new slot (zero copy).
- A finished sequence's pages become REUSABLE and stay mapped: the next
  sequence in that slot takes them in place with no mmap at all.
- Pages a decode step will need next are mapped ahead on a helper thread while
  the current step computes (:meth:`prefetch`).
- The pages an admission or a prefill chunk places are mapped together before
  the step computes: a run of neighbouring blocks on consecutive pages is one
  mmap per range (a 512-token chunk on fresh pages: 2 calls per layer, not 32).
- Every mapped (slot, block) position costs one memory mapping per range (two
  per layer), and Linux caps a process's mappings (``vm.max_map_count``, 65,530
  by default). The backend keeps the positions mapped at once within that cap
  (:attr:`map_budget`): the page pool never holds more pages than fit, and a
  position a free slot or a retargeted page left mapped is unmapped (oldest
  first) before a new one would exceed it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import logging
import math
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from xllm.core.kv.addressing_quant import slot_addressing
from xllm.core.kv.layout import KVCacheLayout
from xllm.core.kv.page_pool import PageStatus
from xllm.core.kv.page_store import PageStore
from xllm.core.kv.prefix import PrefixCachingBackend
from xllm.core.kv.vmm import OS_PAGE, VirtualMemory, VMMError, free_map_slots, supported
from xllm.core.model_api import KVCacheSpec
from xllm.kernels import kv_quant

log = logging.getLogger(__name__)


# xTensor's default block (vLLM-CPU's default too). Each mapped (slot, block) costs a memory mapping per layer
# and K/V: SmolLM2's 2 GiB of KV in 32-token blocks needed ~3x what Linux's default vm.max_map_count allows, so
# the pool was capped at ~28k of its 93k tokens, and a 64-sequence decode step spent 3-6 ms of the mapper's time
# remapping pages it could have reused in place (docs/performance.md, "xTensor's block size")
DEFAULT_BLOCK_TOKENS = 128


def default_block_size(unit: int, max_model_len: int) -> int:
    """xTensor's block size when none is asked for: the least multiple of ``unit`` (the page-aligned size,
    :func:`page_aligned_block_size`) of at least :data:`DEFAULT_BLOCK_TOKENS`, but not past
    ``max_model_len`` rounded up to the unit (a longer block could not be filled). It depends on the model and
    ``max_model_len`` only, so the instances of a cluster agree on it (KV hand-offs and shared tiers need one
    layout) whatever memory each has."""
    longest = -(-max_model_len // unit) * unit
    return max(unit, min(longest, -(-DEFAULT_BLOCK_TOKENS // unit) * unit))


def page_aligned_block_size(spec: KVCacheSpec, dtype: torch.dtype, minimum: int = 16, os_page: int = 4096) -> int:
    """The smallest multiple of ``minimum`` tokens whose per-layer K and V blocks are
    whole OS pages (what xTensor's mmap needs)."""
    elem = torch.empty((), dtype=dtype).element_size()
    sizes = [spec.num_kv_heads * d * elem for d in (spec.head_dim, spec.v_head_dim) if d]
    bs = minimum
    while any((bs * s) % os_page for s in sizes):
        bs += minimum
        if bs > 4096:
            raise ValueError(f"no block size up to 4096 tokens aligns KV rows of {sizes} bytes to {os_page}")
    return bs


def quantized_block_layout(spec: KVCacheSpec, block_size: int | None, minimum: int = 16, os_page: int = 4096,
                           max_padding: float = 1 / 16, max_block: int = 256) -> tuple[int, int]:
    """``(block_size, row_align)`` of a quantized xTensor cache: a block of quantized rows must be whole OS
    pages, so rows are padded to a multiple of ``os_page / gcd(block_size, os_page)`` bytes. With
    ``block_size`` given, only the padding is chosen; otherwise the smallest multiple of ``minimum``
    tokens (up to ``max_block``) whose padding costs at most ``max_padding`` of the row, else the one
    with the least padding (SmolLM2-135M, 3 KV heads of 64: 204-byte rows, 256-token blocks of 208-byte
    rows; 8 KV heads of 128: 1056-byte rows, 64-token blocks of 1088-byte rows)."""
    raw = max(kv_quant.row_bytes(spec.num_kv_heads, d) for d in (spec.head_dim, spec.v_head_dim) if d)

    def align(bs: int) -> int:
        return os_page // math.gcd(bs, os_page)

    if block_size is not None:
        return block_size, align(block_size)
    best = None
    for bs in range(minimum, max_block + 1, minimum):
        padded = kv_quant.row_bytes(spec.num_kv_heads, spec.head_dim, align(bs))
        if padded - raw <= raw * max_padding:
            return bs, align(bs)
        if best is None or padded < best[0]:
            best = (padded, bs)
    return best[1], align(best[1])


@dataclasses.dataclass
class _MappingLog:
    """The mapping changes of an xTensor backend, in the order they took effect (record_mappings)."""

    ops: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class XTensorKVCache(PrefixCachingBackend):
    """The xTensor KV backend (Linux; needs ``memfd_create``).

    ``map_budget`` is how many (slot, block) positions may be mapped at once (each costs a mapping per
    range, plus one per range and run of neighbouring positions: a slot's blocks are one run); None
    takes it from the process's mapping limit (:func:`~xllm.core.kv.vmm.free_map_slots`). The page
    pool is capped to it (with a warning).
    """

    def __init__(self, layout: KVCacheLayout, map_budget: int | None = None) -> None:
        spec, bs = layout.spec, layout.block_size
        dims = []  # (layer, kind, head_dim) for every range that exists
        for layer in range(spec.num_layers):
            dims.append((layer, 0, spec.head_dim))
            if spec.v_head_dim:
                dims.append((layer, 1, spec.v_head_dim))
        free = None
        if map_budget is None:
            free = free_map_slots()
            map_budget = layout.num_blocks if free is None else \
                max(1, (free - layout.max_num_seqs * len(dims)) // len(dims))
        if layout.num_blocks > map_budget:
            log.warning("xTensor: room for %d mapped blocks of %d tokens (%s more memory mappings allowed by "
                        "vm.max_map_count): KV capacity capped from %d to %d tokens (raise vm.max_map_count "
                        "with sysctl, or --block-size, for more)", map_budget, layout.block_size,
                        "?" if free is None else free, layout.capacity_tokens, map_budget * layout.block_size)
            layout = dataclasses.replace(layout, num_blocks=map_budget)
        super().__init__(layout)
        self.map_budget = map_budget
        self._mapped: dict[tuple[int, int], None] = {}  # positions mapped now, oldest first
        self._map_log: _MappingLog | None = None  # record_mappings(): tensor parallelism's mirror
        self.addressing = slot_addressing(self, layout)
        self.vm = VirtualMemory()
        self.blocks_per_slot = math.ceil(layout.max_model_len / bs)
        self._ranges: list[tuple[int, int, int]] = []  # (virtual base of slot 0, page bytes, memfd base)
        self._range_layers: list[int] = []
        self._mapper: ThreadPoolExecutor | None = None
        self._file_map: mmap.mmap | None = None  # the whole memfd, mapped once for page_store()
        self._reserved: tuple[int, int] | None = None  # (address, bytes) of the one virtual reservation
        self.k: list[torch.Tensor] = [None] * spec.num_layers  # type: ignore[list-item]
        self.v: list[torch.Tensor | None] = [None] * spec.num_layers
        self.fd = os.memfd_create("xllm-kv", os.MFD_CLOEXEC)
        try:
            page_sizes = [bs * layout.row_bytes(head_dim) for _, _, head_dim in dims]
            for page_bytes in page_sizes:
                if page_bytes % OS_PAGE:
                    raise VMMError(
                        f"a {bs}-token block of layer K/V is {page_bytes} bytes, not a multiple of the OS page "
                        f"({OS_PAGE}); pick a block size that makes it one (see EngineConfig.block_size)")
            # Slot-major: one reservation in which a slot's regions of every range lie side by side
            # ([slot][range][block]), so the pages live sequences use are close together in the address
            # space. Range-major reservations (one per range, [range][slot][block]) spread them over
            # ranges as long as max_num_seqs regions each, and the decode attention read KV ~1.4x slower
            # from them on the AMD build machine (docs/performance.md, "xTensor's reservation").
            self.slot_stride = self.blocks_per_slot * sum(page_sizes)
            total = layout.max_num_seqs * self.slot_stride
            addr = self.vm.reserve(total)
            self._reserved = (addr, total)
            offset = fd_offset = 0
            for (layer, kind, head_dim), page_bytes in zip(dims, page_sizes):
                self._ranges.append((addr + offset, page_bytes, fd_offset))
                self._range_layers.append(layer)
                fd_offset += layout.num_blocks * page_bytes
                (self.k if kind == 0 else self.v)[layer] = self._range_view(addr + offset, page_bytes, head_dim)
                offset += self.blocks_per_slot * page_bytes
            os.ftruncate(self.fd, fd_offset)
        except BaseException:
            self.close()
            raise
        self.physical_bytes_total = fd_offset
        self._slot_pages: list[list[int | None]] = [[None] * self.blocks_per_slot
                                                     for _ in range(layout.max_num_seqs)]
        self._free_slots = list(range(layout.max_num_seqs - 1, -1, -1))
        # the `keep` of the last _make_room that found nothing to unmap; None once a slot is freed or a
        # page retargeted (the only events that make a mapped position unused), so a full map budget is
        # not rescanned on every allocation attempt
        self._no_room_for: int | None = None
        self._pending: dict[tuple[int, int], Future] = {}
        # positions placed but not mapped yet -> page: mapped by _flush, in runs, before anything reads them
        self._unflushed: dict[tuple[int, int], int] = {}
        self._mapper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xtensor-map")

    # ---- sizing (asked by build_kv_cache) --------------------------------------------------------
    @classmethod
    def substitute(cls, device: torch.device) -> str | None:
        """The paged backend where virtual memory control is unavailable (non-Linux, or a device other
        than the CPU for now)."""
        if device.type == "cpu" and supported():
            return None
        log.warning("xTensor needs Linux virtual memory control on the CPU here; using the paged backend")
        return "paged"

    @classmethod
    def block_layout(cls, spec: KVCacheSpec, dtype: torch.dtype, max_model_len: int, block_size: int | None,
                     kv_dtype: str) -> tuple[int, int]:
        """Blocks whose every layer's K and V are whole OS pages (what the mappings need): by default
        :func:`default_block_size`; quantized rows padded so that the block asked for (or the one
        :func:`quantized_block_layout` picks) is whole pages."""
        if kv_dtype != "auto":
            return quantized_block_layout(spec, block_size)
        if block_size is None:
            return default_block_size(page_aligned_block_size(spec, dtype), max_model_len), 1
        return block_size, 1

    def _range_view(self, base: int, page_bytes: int, head_dim: int) -> torch.Tensor:
        """``[max_num_seqs, max_len, *row]`` over one range's regions (slot ``s``'s at ``base + s *
        slot_stride``). Each range gets a buffer of its own (from its slot 0 to its last slot's end): tensors
        of one storage with different bases are aliased inputs torch.compile refuses."""
        layout = self.layout
        span = (layout.max_num_seqs - 1) * self.slot_stride + self.blocks_per_slot * page_bytes
        raw = torch.frombuffer((ctypes.c_uint8 * span).from_address(base), dtype=torch.uint8)
        elems = raw.view(layout.cache_dtype)
        shape = (layout.max_num_seqs, self.blocks_per_slot * layout.block_size, *layout.row_shape(head_dim))
        inner = torch.empty(shape[1:], device="meta").stride()  # a slot's region: row-major
        return elems.as_strided(shape, (self.slot_stride // elems.element_size(), *inner))

    def _address(self, base: int, page_bytes: int, slot: int, block: int) -> int:
        """Where (slot, block) of the range at ``base`` (of ``page_bytes`` pages) lies."""
        return base + slot * self.slot_stride + block * page_bytes

    # ---- slots -----------------------------------------------------------------
    def _acquire_slot(self, seq, hit_pages: list[int]) -> int | None:
        """The free slot that already has the most of ``hit_pages`` (then most
        reusable pages) mapped in place; None when every slot is taken."""
        if not self._free_slots:
            return None
        # counted from the mapped positions (at most the map budget), not by scanning every free slot's
        # whole page row: with many slots that scan cost ~2 ms a request
        free = set(self._free_slots)
        hits: dict[int, int] = {}
        for j, page_id in enumerate(hit_pages):
            for slot, block in self.pool.pages[page_id].mapped_at:
                if block == j and slot in free and self._slot_pages[slot][j] == page_id:
                    hits[slot] = hits.get(slot, 0) + 1
        reusable: dict[int, int] = {}
        for slot, block in self._mapped:
            page_id = self._slot_pages[slot][block] if slot in free else None
            if page_id is not None and self.pool.pages[page_id].status == PageStatus.REUSABLE:
                reusable[slot] = reusable.get(slot, 0) + 1
        best = max(self._free_slots, key=lambda slot: (hits.get(slot, 0), reusable.get(slot, 0)))
        self._free_slots.remove(best)
        return best

    def _release_slot(self, slot: int) -> None:
        self._free_slots.append(slot)
        self._no_room_for = None

    # ---- page placement ----------------------------------------------------------
    def _make_room(self, keep: int) -> bool:
        """Unmap positions nobody uses (a free slot's, or one whose page was retargeted), oldest first,
        until a new one fits the map budget; ``keep`` is the slot being placed into. False when every
        mapped position is in use."""
        if len(self._mapped) < self.map_budget:
            return True
        if self._no_room_for == keep:
            return False  # nothing became unused since the last scan found nothing
        free = set(self._free_slots)
        for slot, block in list(self._mapped):
            if slot == keep or (slot not in free and self._slot_pages[slot][block] is not None):
                continue
            self._unmap(slot, block)
            if len(self._mapped) < self.map_budget:
                return True
        self._no_room_for = keep
        return False

    def _unmap(self, slot: int, block: int) -> None:
        self._wait_mapped(slot, block)
        self._unflushed.pop((slot, block), None)
        page_id = self._slot_pages[slot][block]
        if page_id is not None:
            self.pool.pages[page_id].mapped_at.discard((slot, block))
            self._slot_pages[slot][block] = None
        if self._map_log is None:
            self._unmap_now(slot, block)
        else:
            with self._map_log.lock:
                self._unmap_now(slot, block)
                self._map_log.ops.append((slot, block, -1, 1))
        del self._mapped[(slot, block)]

    def _unmap_now(self, slot: int, block: int) -> None:
        for base, page_bytes, _ in self._ranges:
            self.vm.unmap_to_reserve(self._address(base, page_bytes, slot, block), page_bytes)

    def _place(self, slot: int, block: int, page_id: int, sync: bool = True) -> bool:
        """Make ``page_id`` the page mapped at (slot, block) in every range; False (nothing changed) when
        the position is new and the map budget has no room left. ``sync``: mapped by the next
        :meth:`_flush` (which every caller reaches before the position is read); otherwise on the
        mapper thread."""
        row = self._slot_pages[slot]
        old = row[block]
        if old == page_id and (slot, block) in self.pool.pages[page_id].mapped_at:
            return True  # already there: in-place reuse, no syscall
        if (slot, block) not in self._mapped and not self._make_room(slot):
            return False
        self._mapped[(slot, block)] = None
        if old is not None:
            self.pool.pages[old].mapped_at.discard((slot, block))
        row[block] = page_id
        self.pool.pages[page_id].mapped_at.add((slot, block))
        if sync:
            self._unflushed[(slot, block)] = page_id
        else:
            self._pending[(slot, block)] = self._mapper.submit(self._map_now, slot, block, page_id)
        return True

    def _map_now(self, slot: int, block: int, page_id: int, run: int = 1) -> None:
        """Map pages ``page_id ..`` at blocks ``block ..`` of ``slot`` (``run`` of them) in every range
        (recorded while :meth:`record_mappings` is on: under the log's lock, so the log has the order the
        mappings took effect in, the mapper thread's among the engine thread's)."""
        log_ = self._map_log
        if log_ is None:
            self._map_fixed(slot, block, page_id, run)
            return
        with log_.lock:
            self._map_fixed(slot, block, page_id, run)
            log_.ops.append((slot, block, page_id, run))

    def _map_fixed(self, slot: int, block: int, page_id: int, run: int) -> None:
        for base, page_bytes, fd_base in self._ranges:
            self.vm.map_fixed(self._address(base, page_bytes, slot, block), run * page_bytes, self.fd,
                              fd_base + page_id * page_bytes)

    # ---- tensor parallelism: worker ranks mirror rank 0's mappings -------------------------
    def record_mappings(self) -> None:
        """From now on log every mapping change (:meth:`drain_mappings`): rank 0 of a tensor-parallel
        instance does, and each worker rank's backend (same layout, its own KV heads) applies the log
        (:meth:`apply_mappings`) before the step that follows, so every rank's slot rows show the same
        pages. Safe with the mapper thread (the log is appended to under its lock)."""
        if self._map_log is None:
            self._map_log = _MappingLog()

    def drain_mappings(self) -> list[tuple[int, int, int, int]]:
        """The mapping changes since the last drain, in the order they took effect: ``(slot, block,
        page, run)`` maps pages ``page..page+run-1`` at blocks ``block..`` of ``slot``; ``page`` -1 unmaps
        (slot, block). Empty unless :meth:`record_mappings` is on."""
        log_ = self._map_log
        if log_ is None or not log_.ops:
            return []
        with log_.lock:
            ops, log_.ops = log_.ops, []
        return ops

    def apply_mappings(self, ops) -> None:
        """A mirror's side of :meth:`drain_mappings`: apply rank 0's ``(slot, block, page, run)`` operations in
        order to this backend's own memfd. The mirror places nothing itself (its page pool is unused), so
        only the mappings change; ``ValueError`` for an operation outside the layout."""
        nslots, nblocks, npages = self.layout.max_num_seqs, self.blocks_per_slot, self.layout.num_blocks
        for slot, block, page_id, run in (tuple(int(x) for x in op) for op in ops):
            if not (0 <= slot < nslots and block >= 0 and block + run <= nblocks and run >= 1
                    and page_id >= -1 and page_id + run <= npages):
                raise ValueError(f"apply_mappings: ({slot}, {block}, {page_id}, {run}) is outside the layout "
                                 f"({nslots} slots x {nblocks} blocks, {npages} pages)")
            if page_id < 0:
                self._unmap_now(slot, block)
            else:
                self._map_fixed(slot, block, page_id, run)

    def _flush(self) -> None:
        """Map every placed position not mapped yet: neighbouring blocks of a slot on consecutive pages
        in one call per range."""
        if not self._unflushed:
            return
        items = sorted(self._unflushed.items())
        self._unflushed.clear()
        i = 0
        while i < len(items):
            (slot, block), page_id = items[i]
            run = 1
            while i + run < len(items) and items[i + run] == ((slot, block + run), page_id + run):
                run += 1
            self._map_now(slot, block, page_id, run)
            i += run

    def _retarget(self, page_id: int) -> None:
        """A page taken for a new owner is no longer valid where it was mapped before."""
        page = self.pool.pages[page_id]
        for slot, block in page.mapped_at:
            if self._slot_pages[slot][block] == page_id:
                self._slot_pages[slot][block] = None
                self._no_room_for = None
        page.mapped_at.clear()

    def _reuse_candidate(self, slot: int, block: int) -> int | None:
        page_id = self._slot_pages[slot][block]
        if page_id is None:
            return None
        page = self.pool.pages[page_id]
        if page.status == PageStatus.REUSABLE and page.block_hash is None and (slot, block) in page.mapped_at:
            return page_id
        return None

    def _wait_mapped(self, slot: int, block: int) -> None:
        fut = self._pending.pop((slot, block), None)
        if fut is not None:
            fut.result()

    # ---- PrefixCachingBackend hooks -------------------------------------------------
    def _attach(self, seq, hit_pages: list[int]) -> bool:
        slot = self._acquire_slot(seq, hit_pages)
        if slot is None:
            return False
        seq.slot = slot
        for block, page_id in enumerate(hit_pages):
            if not self._place(slot, block, page_id):
                self._flush()
                self._release_slot(slot)  # no room to map the hit now: not admitted this step
                seq.slot = None
                return False
        self._flush()
        return True

    def _detach(self, seq) -> None:
        if seq.slot is None:
            return
        self._flush()  # positions stay valid for in-place reuse: they must hold their pages
        for block in range(len(seq.kv_pages)):
            self._wait_mapped(seq.slot, block)
        self._release_slot(seq.slot)
        seq.slot = None

    def _new_page(self, seq, block: int, sync: bool = True) -> int | None:
        page = self.pool.take(seq.request_id, prefer=self._reuse_candidate(seq.slot, block))
        if page is None:
            return None
        in_place = self._slot_pages[seq.slot][block] == page.page_id and \
            (seq.slot, block) in page.mapped_at
        if not in_place:
            self._retarget(page.page_id)
            if not self._place(seq.slot, block, page.page_id, sync=sync):
                self.pool.release(page.page_id)  # no room to map it: KV pressure
                return None
        else:
            self.reused_in_place += 1
        self.pool.mark_mapped(page.page_id)
        return page.page_id

    def _before_compute(self, seq, first_block: int, last_block: int) -> None:
        self._flush()
        for block in range(first_block, last_block + 1):
            self._wait_mapped(seq.slot, block)

    def _take_detached(self, owner: str) -> int | None:
        page = self.pool.take(owner)
        if page is None:
            return None
        self._retarget(page.page_id)  # its old mappings no longer show valid contents
        return page.page_id

    # ---- the attention-facing side ---------------------------------------------------
    def layer_kv(self, layer: int):
        return self.k[layer], self.v[layer]

    def page_store(self) -> PageStore:
        """The memfd itself (mapped once more, whole) and each range's place in it."""
        if self._file_map is None:
            self._file_map = mmap.mmap(self.fd, self.physical_bytes_total, mmap.MAP_SHARED,
                                       mmap.PROT_READ | mmap.PROT_WRITE)
        whole = memoryview(self._file_map)
        buffers = tuple(whole[fd_base:fd_base + self.layout.num_blocks * page_bytes]
                        for _, page_bytes, fd_base in self._ranges)
        return PageStore(self.layout.fingerprint, buffers, tuple(pb for _, pb, _ in self._ranges),
                         tuple(self._range_layers), self.fd, tuple(fd_base for _, _, fd_base in self._ranges), whole)

    @property
    def map_stats(self):
        return self.vm.stats

    def physical_bytes_in_use(self) -> int:
        return self.pool.num_in_use * sum(pb for _, pb, _ in self._ranges)

    def release_memory(self) -> int:
        """Punch the whole memfd out (its pages go back to the OS; every mapping stays, reading zeros) once
        no sequence holds KV; returns the bytes it spanned. Pages come back on demand as they are written."""
        if self.fd is None:
            return 0
        for page in self.pool.pages:
            if page.ref_count:
                raise ValueError(f"page {page.page_id} is still in use: release KV memory only when idle")
        for future in list(self._pending.values()):
            future.result()
        if not _punch_hole(self.fd, self.physical_bytes_total):
            os.ftruncate(self.fd, 0)  # (no hole punching: truncating frees the pages too)
            os.ftruncate(self.fd, self.physical_bytes_total)
        return self.physical_bytes_total

    def close(self) -> None:
        """Unmap and release everything (also what a failed ``__init__`` had set up)."""
        super().close()  # the lower tiers first: their writer may still read queued blocks, never pages
        if self._mapper is not None:
            self._mapper.shutdown(wait=True)
            self._mapper = None
        self._ranges = []
        if self._reserved is not None:
            self.vm.release(*self._reserved)
            self._reserved = None
        if self._file_map is not None:
            with contextlib.suppress(BufferError):  # views still alive: unmapped when they go
                self._file_map.close()
            self._file_map = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def _punch_hole(fd: int, length: int) -> bool:
    """``fallocate(PUNCH_HOLE | KEEP_SIZE)`` over ``[0, length)`` of ``fd``; False where it is unavailable."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        ok = libc.fallocate(ctypes.c_int(fd), ctypes.c_int(_FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE),
                            ctypes.c_long(0), ctypes.c_long(length)) == 0
    except (OSError, AttributeError):
        return False
    return ok
