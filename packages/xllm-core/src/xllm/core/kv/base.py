"""The KV cache backend base class and building a backend for an engine."""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from xllm.core.kv.addressing import KVAddressing
from xllm.core.kv.contracts import KVAllocator, KVTensors, KVTransfer
from xllm.core.kv.layout import KVCacheLayout, PrefixStats
from xllm.core.kv.lower_tiers import LoadJob, LowerTiers
from xllm.core.kv.page_store import PageStore
from xllm.core.model_api import KVCacheSpec
from xllm.engine_api.names import KV_BACKENDS, KV_CACHE_DTYPES
from xllm.kvstore import ROOT_HASH, hash_block

log = logging.getLogger(__name__)


class KVCacheBackend(KVAllocator, KVTensors, KVTransfer, ABC):
    """KV memory for the running sequences: the three contracts of :mod:`xllm.core.kv.contracts`
    (:class:`KVAllocator` for the scheduler, :class:`KVTensors` for the model runner,
    :class:`KVTransfer` for moves, hand-offs and the engine service), plus the engine's own
    accounting (``usage``, ``free_tokens``, ``prefix_stats``) and lifecycle (``attach_tiers``,
    ``close``).

    Sizing is the backend's own (:meth:`block_layout`, :meth:`substitute`, ``prefix_cache``):
    :func:`build_kv_cache` asks the backend it builds and never names one.
    Addressing: ``addressing`` (a :class:`~xllm.core.kv.addressing.KVAddressing` built by each
    backend for itself) says how attention reaches a sequence's tokens in ``layer_kv(layer)``.
    """

    addressing: KVAddressing
    prefix_cache: ClassVar[bool] = False
    """Whether the backend keeps a prefix cache (when the engine asks for one)."""

    def __init__(self, layout: KVCacheLayout) -> None:
        self.layout = layout

    # ---- sizing (build_kv_cache asks the backend class) ------------------------------------------------
    @classmethod
    def substitute(cls, device: torch.device) -> str | None:
        """The backend to build instead of this one on ``device`` (None: this one runs there)."""
        return None

    @classmethod
    def block_layout(cls, spec: KVCacheSpec, dtype: torch.dtype, max_model_len: int, block_size: int | None,
                     kv_dtype: str) -> tuple[int, int]:
        """``(block_size, row_align)`` of this backend's layout: ``block_size`` as asked, 16 tokens if
        none was; rows unpadded."""
        return (16 if block_size is None else block_size), 1

    def block_hashes_of(self, seq, num_blocks: int) -> list[int]:
        """``seq.block_hashes`` extended to at least its first ``num_blocks`` full blocks: the chained hashes
        (:mod:`xllm.kvstore.hashing`) that name a block in the prefix cache and in every lower KV tier, the first
        one's parent ``seq.hash_root`` (a LoRA adapter's identity: two adapters never share a block)."""
        bs = self.layout.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            j = len(hashes)
            parent = hashes[-1] if hashes else getattr(seq, "hash_root", ROOT_HASH)  # (an adapter's: xllm.core.lora)
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

    def on_computed(self, seq) -> None:
        """Called after a forward advanced ``seq.num_computed_tokens`` (prefix-cache registration)."""

    def prefetch(self, seqs) -> None:
        """Called before a forward with the sequences that sample this step (map-ahead)."""

    @property
    def prefix_stats(self) -> PrefixStats:
        """Prefix-cache lookups so far (backends without a prefix cache: none)."""
        return PrefixStats()

    def enable_events(self) -> None:
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

    def close(self) -> None:
        """Release OS resources (only at shutdown: tensors become invalid)."""

    # ---- sleep (xllm.core.engine_weights; only while no sequence holds KV) ------------------------------
    def drop_cached(self) -> int:
        """Forget every prefix-cached block nobody references (not written down to lower tiers); returns
        how many (backends without a prefix cache: none)."""
        return 0

    def release_memory(self) -> int:
        """Hand the KV memory back to the OS while no sequence holds KV (engine sleep); returns the bytes
        released. The tensors stay valid (reading zeros) until :meth:`restore_memory`. Default: none."""
        return 0

    def restore_memory(self) -> None:
        """Undo :meth:`release_memory` (the memory is taken again, zeroed)."""

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

    def detach_tiers(self) -> None:
        """Stop using the attached tiers (the caller closes them); nothing without tiers."""

    def begin_load(self, seq) -> LoadJob | None:
        """Start bringing ``seq``'s next prefix blocks up from the lower tiers (None: nothing to load)."""
        return None

    def end_load(self, job: LoadJob) -> int:
        """Register a done load's intact blocks in the prefix cache; returns how many."""
        return 0

    def release_load(self, job: LoadJob) -> None:
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


def check_kv_dtype(kv_dtype: str, spec: KVCacheSpec, device: torch.device) -> None:
    """``ValueError`` unless ``kv_dtype`` is a known KV dtype that applies to ``spec`` on ``device``
    (quantized rows: separate K and V with head widths divisible by 4, on the CPU)."""
    if kv_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {kv_dtype!r}; known: {', '.join(KV_CACHE_DTYPES)}")
    if kv_dtype == "auto":
        return
    if not spec.v_head_dim:
        raise ValueError(f"--kv-cache-dtype {kv_dtype} is not implemented for latent KV caches (MLA, e.g. "
                         "DeepSeek): use --kv-cache-dtype auto")
    if spec.head_dim % 4 or spec.v_head_dim % 4:
        raise ValueError(f"--kv-cache-dtype {kv_dtype} needs head widths divisible by 4, got "
                         f"{spec.head_dim}/{spec.v_head_dim}")
    if device.type != "cpu":
        raise ValueError(f"--kv-cache-dtype {kv_dtype} is implemented for the CPU only")


def build_kv_cache(backend: str, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device, max_num_seqs: int,
                   max_model_len: int, memory_gib: float, block_size: int | None = None,
                   enable_prefix_cache: bool = True, kv_dtype: str = "auto") -> KVCacheBackend:
    """Size and create the KV backend ``backend`` names for an engine.

    The backend class decides what is its own: a backend that cannot run on ``device`` names the
    one to build instead (:meth:`KVCacheBackend.substitute`: xTensor falls back to ``"paged"`` where
    virtual memory control is unavailable), its block size and row padding
    (:meth:`KVCacheBackend.block_layout`: 16 tokens by default; xTensor's whole OS pages, see
    :mod:`xllm.core.kv.xtensor`) and whether it keeps a prefix cache. ``kv_dtype`` ``"auto"``
    stores K/V in ``dtype``; ``"int8"``/``"fp8_e4m3"`` stores quantized rows (about half the bytes
    of bf16, so about twice the tokens in ``memory_gib``). Raises ``ValueError`` when the memory
    cannot hold one block, the backend is unknown, or the KV dtype does not apply (latent caches,
    head widths not divisible by 4).
    """
    name = KV_BACKENDS.canonical(backend)
    check_kv_dtype(kv_dtype, spec, device)
    cls: type[KVCacheBackend] = KV_BACKENDS.get(name)
    instead = cls.substitute(device)
    if instead is not None:
        cls = KV_BACKENDS.get(instead)
    block_size, row_align = cls.block_layout(spec, dtype, max_model_len, block_size, kv_dtype)
    layout = KVCacheLayout(spec, dtype, device, max_num_seqs, max_model_len, block_size, 1,
                           enable_prefix_cache and cls.prefix_cache, kv_dtype, row_align)
    per_block = layout.bytes_per_token * block_size
    num_blocks = int(memory_gib * 2**30 // per_block)
    if num_blocks < 1:
        raise ValueError(f"kv cache memory of {memory_gib} GiB is too small for one {block_size}-token block "
                         f"({per_block} bytes)")
    return cls(dataclasses.replace(layout, num_blocks=num_blocks))
