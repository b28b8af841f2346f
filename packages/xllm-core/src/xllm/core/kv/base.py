"""The KV cache backend interface, its sizes, and building a backend for an engine."""

from __future__ import annotations

import dataclasses
import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from xllm.core.kv.addressing import KVAddressing
from xllm.core.kv.lower_tiers import LoadJob, LowerTiers
from xllm.core.kv.page_store import PageStore
from xllm.core.kv.registry import KV_BACKENDS, KV_CACHE_DTYPES
from xllm.core.model_api import KVCacheSpec
from xllm.kernels import kv_quant
from xllm.kvstore import ROOT_HASH, hash_block

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheLayout:
    """Sizes every backend agrees on.

    ``kv_dtype`` is ``"auto"`` (K/V stored in ``dtype``, ``[..., kv_heads, head_dim]`` tensors) or a
    quantized kind of :data:`~xllm.core.kv.registry.KV_CACHE_DTYPES` (``int8``, ``fp8_e4m3``): then
    every layer's K and V are ``uint8`` tensors of token rows (:mod:`xllm.kernels.kv_quant`: per
    head ``head_dim`` codes + an fp32 scale), each row padded to a multiple of ``row_align`` bytes
    (xTensor: so a block is whole OS pages).
    """

    spec: KVCacheSpec
    dtype: torch.dtype
    device: torch.device
    max_num_seqs: int
    max_model_len: int
    block_size: int
    num_blocks: int  # physical capacity in blocks (pages) of block_size tokens
    enable_prefix_cache: bool = True
    kv_dtype: str = "auto"
    row_align: int = 1

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @property
    def quantized(self) -> bool:
        return self.kv_dtype != "auto"

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one token's row of one layer's K (``head_dim``) or V (``v_head_dim``)."""
        if self.quantized:
            return kv_quant.row_bytes(self.spec.num_kv_heads, head_dim, self.row_align)
        return self.spec.num_kv_heads * head_dim * torch.empty((), dtype=self.dtype).element_size()

    def row_shape(self, head_dim: int) -> tuple[int, ...]:
        """The trailing shape of a K/V cache tensor for one token (after slot/page and position)."""
        return (self.row_bytes(head_dim),) if self.quantized else (self.spec.num_kv_heads, head_dim)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The element type of the K/V cache tensors."""
        return torch.uint8 if self.quantized else self.dtype

    def quant_format(self, head_dim: int) -> kv_quant.KVQuantFormat:
        """The quantized row format of K (``head_dim``) or V (``v_head_dim``) rows."""
        if not self.quantized:
            raise ValueError("the KV cache is not quantized")
        return kv_quant.KVQuantFormat(self.kv_dtype, self.spec.num_kv_heads, head_dim, self.row_bytes(head_dim))

    @property
    def bytes_per_token(self) -> int:
        """Physical KV bytes of one token over every layer (quantized: codes, scales and padding)."""
        s = self.spec
        return s.num_layers * (self.row_bytes(s.head_dim) + (self.row_bytes(s.v_head_dim) if s.v_head_dim else 0))

    @property
    def fingerprint(self) -> str:
        """What two engines must share for one to use the other's KV pages: layers, KV heads, K and V
        widths, the stored format and block size (e.g. ``30L3H64K64V/bfloat16/32``; quantized: the kind and
        the K row's bytes, ``30L3H64K64V/int8@208/256``)."""
        s = self.spec
        dtype = str(self.dtype).removeprefix("torch.")
        if self.quantized:
            dtype = f"{self.kv_dtype}@{self.row_bytes(s.head_dim)}"
        return f"{s.num_layers}L{s.num_kv_heads}H{s.head_dim}K{s.v_head_dim}V/{dtype}/{self.block_size}"


@dataclass(frozen=True)
class PrefixStats:
    """Cumulative prefix-cache lookups of a backend: prompt tokens looked up and found cached
    (first admissions only; a preempted sequence's re-admission is not a new query)."""

    queries: int = 0
    hits: int = 0


class KVCacheBackend(ABC):
    """KV memory for the running sequences.

    Contract (what the engine's :class:`~xllm.core.scheduler.Scheduler` uses):

    - ``admit(seq, n)`` gives a waiting sequence KV memory, reusing a cached
      prefix where the backend has a prefix cache (advancing
      ``seq.num_computed_tokens``), and returns how many tokens to compute now
      (0 = cannot admit; nothing changed).
    - ``allocate(seq, n)`` reserves room for the next ``n`` tokens of a running
      sequence; False, changing nothing, when memory is exhausted.
    - ``free(seq)`` releases everything (the scheduler resets the sequence's progress).

    Addressing: ``addressing`` (a :class:`~xllm.core.kv.addressing.KVAddressing` built by each
    backend for itself) says how attention reaches a sequence's tokens in ``layer_kv(layer)``.
    """

    addressing: KVAddressing

    def __init__(self, layout: KVCacheLayout) -> None:
        self.layout = layout

    def block_hashes_of(self, seq, num_blocks: int) -> list[int]:
        """``seq.block_hashes`` extended to at least its first ``num_blocks`` full blocks: the chained hashes
        (:mod:`xllm.kvstore.hashing`) that name a block in the prefix cache and in every lower KV tier."""
        bs = self.layout.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            j = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, seq.token_slice(j * bs, (j + 1) * bs)))
        return hashes

    def admit(self, seq, max_new_tokens: int) -> int:
        n = min(seq.num_tokens - seq.num_computed_tokens, max_new_tokens)
        return n if n > 0 and self.allocate(seq, n) else 0

    @abstractmethod
    def allocate(self, seq, num_new_tokens: int) -> bool: ...

    @abstractmethod
    def free(self, seq) -> None: ...

    @abstractmethod
    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    @property
    def kv_quant_kind(self) -> str | None:
        """The quantized kind of ``layer_kv``'s rows (``int8``, ``fp8_e4m3``), None when K/V are in the model dtype."""
        return self.layout.kv_dtype if self.layout.quantized else None

    @property
    @abstractmethod
    def num_free_blocks(self) -> int: ...

    def on_computed(self, seq) -> None:  # noqa: B027 (optional hook)
        """Called after a forward advanced ``seq.num_computed_tokens`` (prefix-cache registration)."""

    def prefetch(self, seqs) -> None:  # noqa: B027 (optional hook)
        """Called before a forward with the sequences that sample this step (map-ahead)."""

    @property
    def prefix_stats(self) -> PrefixStats:
        """Prefix-cache lookups so far (backends without a prefix cache: none)."""
        return PrefixStats()

    def enable_events(self) -> None:  # noqa: B027 (backends without a prefix cache have no events)
        """Start keeping prefix-cache events for :meth:`drain_events` (only someone who drains them
        regularly, such as an engine server publishing them, should ask: they are kept until drained)."""

    def drain_events(self) -> list[tuple[bool, int]]:
        """Prefix-cache events since the last call (after :meth:`enable_events`): ``(True, hash)``
        when a full block became cached, ``(False, hash)`` when it was evicted."""
        return []

    def page_store(self) -> PageStore | None:
        """The backend's pages as bytes (for KV hand-off between engines); None for a backend
        without pages (contiguous)."""
        return None

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release OS resources (only at shutdown: tensors become invalid)."""

    # ---- lower KV tiers (xllm.core.kv.lower_tiers; backends with a prefix cache) -------------------------
    @property
    def has_tiers(self) -> bool:
        """Whether KV tiers below this memory are attached."""
        return False

    @property
    def lower_tiers(self) -> LowerTiers | None:
        """The tiers attached below this memory (prefill/decode hand-offs through the cluster store use
        them), or None."""
        return None

    def attach_tiers(self, tiers: LowerTiers) -> None:
        raise ValueError(f"the {type(self).__name__} backend has no prefix cache to back with KV tiers")

    def begin_load(self, seq) -> LoadJob | None:
        """Start bringing ``seq``'s next prefix blocks up from the lower tiers (None: nothing to load)."""
        return None

    def end_load(self, job: LoadJob) -> int:
        """Register a done load's intact blocks in the prefix cache; returns how many."""
        return 0

    def release_load(self, job: LoadJob) -> None:  # noqa: B027 (optional hook)
        """Drop the pages a load held (once its request was admitted, or went away)."""

    def tier_stats(self) -> dict:
        """Per lower tier (by name) its :class:`~xllm.kvstore.tier.TierStats`; empty without tiers."""
        return {}

    def drain_tier_events(self) -> list[tuple[str, bool, int]]:
        """``(tier, stored?, block hash)``: blocks that became loadable from, or left, a lower tier since
        the last call (empty without tiers)."""
        return []

    @property
    def usage(self) -> float:
        """Fraction of physical KV blocks in use."""
        return 1.0 - self.num_free_blocks / self.layout.num_blocks

    @property
    def free_tokens(self) -> int:
        return self.num_free_blocks * self.layout.block_size

    def physical_bytes_in_use(self) -> int:
        """Bytes of KV memory currently held for live sequences."""
        used = self.layout.num_blocks - self.num_free_blocks
        return used * self.layout.block_size * self.layout.bytes_per_token


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


def build_kv_cache(backend: str, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device, max_num_seqs: int,
                   max_model_len: int, memory_gib: float, block_size: int | None = None,
                   enable_prefix_cache: bool = True, kv_dtype: str = "auto") -> KVCacheBackend:
    """Size and create the KV backend for an engine.

    ``"xtensor"`` falls back to ``"paged"`` where virtual memory control is
    unavailable (non-Linux, or a device other than the CPU for now). The block
    size defaults to 16 tokens (xTensor: :func:`~xllm.core.kv.xtensor.default_block_size`, 128 tokens
    rounded up to whole OS pages; quantized: :func:`quantized_block_layout`). ``kv_dtype`` ``"auto"``
    stores K/V in ``dtype``;
    ``"int8"``/``"fp8_e4m3"`` stores quantized rows (about half the bytes of bf16, so about twice
    the tokens in ``memory_gib``). Raises ``ValueError`` when the memory cannot hold one block, the
    backend is unknown, or the KV dtype does not apply (latent caches, head widths not divisible by 4).
    """
    from xllm.core.kv import vmm

    backend = KV_BACKENDS.canonical(backend)
    if kv_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {kv_dtype!r}; known: {', '.join(KV_CACHE_DTYPES)}")
    quantized = kv_dtype != "auto"
    if quantized:
        if not spec.v_head_dim:
            raise ValueError(f"--kv-cache-dtype {kv_dtype} is not implemented for latent KV caches (MLA, e.g. "
                             "DeepSeek): use --kv-cache-dtype auto")
        if spec.head_dim % 4 or spec.v_head_dim % 4:
            raise ValueError(f"--kv-cache-dtype {kv_dtype} needs head widths divisible by 4, got "
                             f"{spec.head_dim}/{spec.v_head_dim}")
        if device.type != "cpu":
            raise ValueError(f"--kv-cache-dtype {kv_dtype} is implemented for the CPU only")
    if backend == "xtensor" and (device.type != "cpu" or not vmm.supported()):
        log.warning("xTensor needs Linux virtual memory control on the CPU here; using the paged backend")
        backend = "paged"
    row_align = 1
    if quantized and backend == "xtensor":
        block_size, row_align = quantized_block_layout(spec, block_size)
    if block_size is None and backend == "xtensor":
        from xllm.core.kv.xtensor import default_block_size

        block_size = default_block_size(page_aligned_block_size(spec, dtype), max_model_len)
    elif block_size is None:
        block_size = 16
    layout = KVCacheLayout(spec, dtype, device, max_num_seqs, max_model_len, block_size, 1,
                           enable_prefix_cache and backend != "contiguous", kv_dtype, row_align)
    per_block = layout.bytes_per_token * block_size
    num_blocks = int(memory_gib * 2**30 // per_block)
    if num_blocks < 1:
        raise ValueError(f"kv cache memory of {memory_gib} GiB is too small for one {block_size}-token block "
                         f"({per_block} bytes)")
    return KV_BACKENDS.create(backend, dataclasses.replace(layout, num_blocks=num_blocks))
