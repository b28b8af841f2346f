"""The KV memory's contracts, by who uses it (mini-sglang's ``BaseKVCachePool``/``BasePrefixCache``
and vLLM's ``KVCacheManager`` are the models).

Every backend (:class:`~xllm.core.kv.base.KVCacheBackend`) implements all three; each user holds
its backend typed as the one contract it needs:

- :class:`KVAllocator`, the scheduler's (and speculation's): KV memory for sequences (admission
  with prefix reuse, growth, release), prefix-cache registration, and prefixes brought up from
  the lower tiers into pages before admission;
- :class:`KVTensors`, the model runner's (and the compiled decode graph's, beam attention's, a
  model's fused forward's): the per-layer K/V tensors and the addressing that reaches a
  sequence's tokens in them;
- :class:`KVTransfer`, that of moves and hand-offs and of the engine service: the pages as bytes,
  the blocks' chained hashes, the tiers below this memory, their stats, and the events that tell
  other instances what this memory and its tiers hold.

What is left on the backend (usage, free tokens, prefix-cache counts, ``attach_tiers``, ``close``)
is the engine's own accounting and lifecycle.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from xllm.core.kv.addressing import KVAddressing
    from xllm.core.kv.layout import KVCacheLayout
    from xllm.core.kv.lower_tiers import LoadJob, LowerTiers
    from xllm.core.kv.page_store import PageStore
    from xllm.core.sequence import Sequence
    from xllm.kvstore.tier import TierStats


class KVAllocator(Protocol):
    """KV memory for sequences, as the scheduler asks for it. Engine thread only.

    - ``admit(seq, n)`` gives a waiting sequence KV memory, reusing a cached prefix where the
      backend has a prefix cache (advancing ``seq.num_computed_tokens``), and returns how many
      tokens to compute now (0 = cannot admit; nothing changed);
    - ``allocate(seq, n)`` reserves room for the next ``n`` tokens of a running sequence; False,
      changing nothing, when memory is exhausted;
    - ``free(seq)`` releases everything (the scheduler resets the sequence's progress);
    - ``on_computed(seq)`` after a forward advanced ``seq.num_computed_tokens`` (its full blocks join
      the prefix cache); ``prefetch(seqs)`` before a forward, with the sequences that sample in it
      (their next pages taken and mapped ahead);
    - with tiers below (``has_tiers``): ``begin_load(seq)`` takes pages for the next prefix blocks a
      lower tier holds and starts reading them (None: nothing to load), ``end_load(job)`` registers
      a done load's intact blocks in the prefix cache (returns how many), ``release_load(job)``
      drops the pages the load held (once its sequence was admitted, or went away).
    """

    def admit(self, seq: Sequence, max_new_tokens: int) -> int: ...

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool: ...

    def free(self, seq: Sequence) -> None: ...

    def on_computed(self, seq: Sequence) -> None: ...

    def prefetch(self, seqs: Iterable[Sequence]) -> None: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def has_tiers(self) -> bool: ...

    def begin_load(self, seq: Sequence) -> LoadJob | None: ...

    def end_load(self, job: LoadJob) -> int: ...

    def release_load(self, job: LoadJob) -> None: ...


class KVTensors(Protocol):
    """The KV memory as attention reads it (the model runner's view; a superset of
    :class:`~xllm.core.model_api.SlotKV`, what a model's fused forward takes). Any thread that runs
    forwards.

    ``layer_kv(layer)`` gives the layer's K and V tensors (V None for a latent cache), laid out as
    ``addressing`` says (per-slot regions or page pools; ``uint8`` token rows when
    ``kv_quant_kind`` names a quantized kind); ``addressing`` packs a step's addresses and gives its
    attention context (:class:`~xllm.core.kv.addressing.KVAddressing`).
    """

    layout: KVCacheLayout
    addressing: KVAddressing

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    @property
    def kv_quant_kind(self) -> str | None: ...


class KVTransfer(Protocol):
    """The KV memory as moves, hand-offs and the engine service see it: pages as bytes, blocks by
    their chained hashes, the tiers below, and events.

    - ``page_store()``: the pages as bytes (None: a backend without pages cannot hand KV off);
    - ``block_hashes_of(seq, n)``: the chained hashes of ``seq``'s first ``n`` full blocks (a
      block's key in the prefix cache and in every tier; engine thread);
    - ``lower_tiers``: the tiers below this memory, or None; ``tier_stats()`` and
      ``drain_tier_events()`` (``(tier, stored?, hash)`` since the last call) report them (any
      thread);
    - ``enable_events()`` then ``drain_events()``: the prefix cache's ``(stored?, hash)`` changes
      since the last call (engine thread; kept only once enabled, until drained).
    """

    layout: KVCacheLayout

    def page_store(self) -> PageStore | None: ...

    def block_hashes_of(self, seq: Sequence, num_blocks: int) -> list[int]: ...

    @property
    def lower_tiers(self) -> LowerTiers | None: ...

    def tier_stats(self) -> dict[str, TierStats]: ...

    def drain_tier_events(self) -> list[tuple[str, bool, int]]: ...

    def enable_events(self) -> None: ...

    def drain_events(self) -> list[tuple[bool, int]]: ...
