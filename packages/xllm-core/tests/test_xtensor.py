"""xTensor and the page pool: states, mapping, reuse, refcounts, eviction, contiguity."""

from __future__ import annotations

import pytest
import torch

from xllm.core.kv import KVCacheLayout, PrefixStats
from xllm.core.kv.page_pool import PagePool, PageStatus
from xllm.core.kv.paged import PagedKVCache
from xllm.core.kv.xtensor import XTensorKVCache, page_aligned_block_size
from xllm.core.model_api import KVCacheSpec
from xllm.core.sampling_params import SamplingParams
from xllm.core.sequence import Sequence

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, v_head_dim=64)  # 512 B/token/range in fp32


def layout(num_blocks=8, max_num_seqs=3, max_model_len=128, block_size=8, prefix=True) -> KVCacheLayout:
    return KVCacheLayout(SPEC, torch.float32, torch.device("cpu"), max_num_seqs, max_model_len, block_size,
                         num_blocks, prefix)


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4), 0.0)


# ---- page pool ------------------------------------------------------------------------------
def test_page_states_and_refcounts():
    pool = PagePool(3)
    a = pool.take("r1")
    assert a.status == PageStatus.ALLOCATED and a.owner == "r1" and a.ref_count == 1
    pool.mark_mapped(a.page_id)
    assert a.status == PageStatus.MAPPED
    pool.share(a.page_id)
    assert a.ref_count == 2
    pool.release(a.page_id)
    assert a.status == PageStatus.MAPPED and pool.num_available == 2
    pool.release(a.page_id)
    assert a.status == PageStatus.REUSABLE and pool.num_available == 3  # reusable pages are allocatable
    with pytest.raises(ValueError):
        pool.release(a.page_id)
    pool.discard(a.page_id)
    assert a.status == PageStatus.FREE
    assert pool.counts() == {"free": 3, "allocated": 0, "mapped": 0, "reusable": 0}


def test_free_pages_first_then_unhashed_then_cached_lru():
    pool = PagePool(4)
    pages = [pool.take(f"r{i}") for i in range(4)]
    assert pool.take("x") is None
    assert pool.set_hash(pages[0].page_id, 100) and pool.set_hash(pages[1].page_id, 101)
    for p in (pages[1], pages[0], pages[3], pages[2]):  # release order = LRU order within each class
        pool.release(p.page_id)
    order = [pool.take("n").page_id for _ in range(4)]
    assert order == [pages[3].page_id, pages[2].page_id, pages[1].page_id, pages[0].page_id]
    assert pool.evictions == 2 and pool.lookup(100) is None and pool.lookup(101) is None


def test_prefix_hash_is_unique_and_revived_on_share():
    pool = PagePool(3)
    a, b = pool.take("r1"), pool.take("r2")
    assert pool.set_hash(a.page_id, 7)
    assert not pool.set_hash(b.page_id, 7)  # a second copy of the same block is not registered
    pool.release(a.page_id)
    assert a.status == PageStatus.REUSABLE and pool.lookup(7) == a.page_id
    pool.share(a.page_id)  # a prefix hit revives the cached page
    assert a.status == PageStatus.MAPPED and a.ref_count == 1 and pool.num_available == 1


def test_take_prefers_a_named_reusable_page():
    pool = PagePool(3)
    a = pool.take("r1")
    pool.release(a.page_id)
    assert pool.take("r2", prefer=a.page_id).page_id == a.page_id


# ---- xTensor ----------------------------------------------------------------------------------
def test_block_size_is_aligned_to_os_pages():
    assert page_aligned_block_size(SPEC, torch.float32) == 16  # 512 B/token -> 8 would do; minimum 16
    smol = KVCacheSpec(30, 3, 64, 64)
    assert page_aligned_block_size(smol, torch.bfloat16) == 32  # 384 B/token: 32 tokens = 3 OS pages
    assert page_aligned_block_size(smol, torch.float32) == 16


def test_sequence_view_is_contiguous_while_its_pages_are_not():
    kv = XTensorKVCache(layout(num_blocks=8))
    a, b = seq("a", list(range(20))), seq("b", list(range(100, 124)))
    assert kv.admit(a, 8) == 8 and kv.admit(b, 24) == 24  # a: 1 page, b: 3 pages
    a.num_computed_tokens = 8
    assert kv.allocate(a, 12)  # a's second and third blocks come after b's pages
    assert a.kv_pages == [0, 4, 5] and b.kv_pages == [1, 2, 3]  # physically interleaved
    # a run of neighbouring blocks on consecutive pages is one mmap per range (2 layers x K/V): b's three
    # blocks in one, a's blocks 1-2 in one
    assert kv.map_stats.maps == 3 * 4
    k, _ = kv.layer_kv(0)
    rows = torch.arange(20 * 2 * 64, dtype=torch.float32).view(20, 2, 64)
    k[a.slot, :20] = rows
    view = k[a.slot, :20]
    assert view.is_contiguous() and torch.equal(view, rows)
    # the bytes really live in pages 0, 4, 5 of the memfd, one block of 8 tokens each
    with open(f"/proc/self/fd/{kv.fd}", "rb") as f:
        fd_bytes = f.read()
    per_page = 8 * 2 * 64 * 4
    for block, page in enumerate(a.kv_pages):
        got = torch.frombuffer(bytearray(fd_bytes[page * per_page:(page + 1) * per_page]), dtype=torch.float32)
        want = rows[block * 8:(block + 1) * 8].flatten()
        assert torch.equal(got[:want.numel()], want)
    kv.close()


def test_a_slots_regions_of_every_layer_lie_side_by_side():
    """Slot-major reservation: slot s's K and V regions of every layer are adjacent ([slot][layer, K|V]
    [block]), every layer's tensor steps slot to slot by the same stride, and each tensor has a storage of
    its own (torch.compile refuses views of one storage with different bases)."""
    kv = XTensorKVCache(layout(num_blocks=4))
    region = 128 * 2 * 64 * 4  # max_model_len tokens of 2 heads x 64 fp32
    tensors = [t for layer in range(SPEC.num_layers) for t in kv.layer_kv(layer)]
    for slot in range(3):
        addrs = [t[slot].data_ptr() for t in tensors]
        assert addrs == [addrs[0] + i * region for i in range(len(tensors))]
    assert {t.stride(0) * 4 for t in tensors} == {len(tensors) * region} == {kv.slot_stride}
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    kv.close()


def test_reads_past_the_mapped_length_do_not_fault():
    kv = XTensorKVCache(layout(num_blocks=4))
    a = seq("a", list(range(5)))
    assert kv.admit(a, 5) == 5
    k, v = kv.layer_kv(1)
    k[a.slot, :5] = 1.0
    whole = k[a.slot].clone()  # reads 120 unmapped tokens: the kernel's zero page
    assert whole[:5].eq(1).all() and whole[8:].eq(0).all()
    assert v[2].sum() == 0  # a slot nobody ever used
    kv.close()


def test_finished_pages_are_reused_in_place_without_mapping():
    kv = XTensorKVCache(layout(num_blocks=4, max_num_seqs=1, prefix=False))
    a = seq("a", list(range(16)))
    assert kv.admit(a, 16) == 16
    maps = kv.map_stats.maps
    assert maps == 4  # 2 blocks on consecutive pages: one mmap per range (2 layers x K/V)
    pages = list(a.kv_pages)
    kv.free(a)
    assert all(kv.pool.pages[p].status == PageStatus.REUSABLE for p in pages)
    b = seq("b", list(range(50, 66)))
    assert kv.admit(b, 16) == 16
    assert b.kv_pages == pages and kv.map_stats.maps == maps  # same slot, same pages: no mmap at all
    assert kv.reused_in_place == 2
    kv.close()


def test_prefix_hit_maps_the_cached_pages_zero_copy():
    kv = XTensorKVCache(layout(num_blocks=8, max_num_seqs=2))
    system = list(range(1000, 1016))  # two full blocks of 8
    a = seq("a", [*system, 1, 2, 3])
    assert kv.admit(a, 19) == 19
    k, _ = kv.layer_kv(0)
    k[a.slot, :19] = torch.randn(19, 2, 64)
    a.num_computed_tokens = 19
    kv.on_computed(a)
    assert a.num_hashed_blocks == 2
    b = seq("b", [*system, 7, 8, 9, 10])
    n = kv.admit(b, 100)
    assert (b.num_computed_tokens, n, b.num_cached_prompt_tokens) == (16, 4, 16)
    assert b.kv_pages[:2] == a.kv_pages[:2] and b.kv_pages[2] != a.kv_pages[2]
    assert kv.pool.pages[a.kv_pages[0]].ref_count == 2
    # zero copy: b's view of the shared prefix is a's data, through a different virtual address
    assert b.slot != a.slot and torch.equal(k[b.slot, :16], k[a.slot, :16])
    k[a.slot, 0] = 5.0
    assert k[b.slot, 0].eq(5.0).all()
    assert kv.prefix_stats == PrefixStats(19 + 20, 16)
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_in_use == 0 and kv.pool.num_cached == 2
    kv.close()


def test_last_block_is_never_a_hit_and_eviction_keeps_accounting():
    kv = PagedKVCache(layout(num_blocks=3, max_num_seqs=3))
    a = seq("a", list(range(16)))
    assert kv.admit(a, 16) == 16
    a.num_computed_tokens = 16
    kv.on_computed(a)
    kv.free(a)
    same = seq("same", list(range(16)))
    assert kv.admit(same, 16) == 8  # block 2 holds the last token: it is recomputed
    assert same.num_computed_tokens == 8
    kv.free(same)
    other = seq("o", list(range(500, 524)))
    assert kv.admit(other, 24) == 24  # needs all 3 pages: both cached blocks are evicted
    assert kv.pool.num_cached == 0 and kv.pool.evictions == 2


def test_async_premap_is_ready_before_the_next_write():
    kv = XTensorKVCache(layout(num_blocks=4, max_num_seqs=1, prefix=False))
    a = seq("a", list(range(8)))
    assert kv.admit(a, 8) == 8
    a.num_computed_tokens = 8
    a.output_ids.append(42)  # 9 tokens: the next write (position 8) starts block 1
    # as the engine does before computing position 7's successor: pages for next step
    a.num_computed_tokens = 7
    a.output_ids.pop()
    kv.prefetch([a])  # position 8 starts a new block
    assert len(a.kv_pages) == 2
    a.num_computed_tokens = 8
    a.output_ids.append(42)
    assert kv.allocate(a, 1)  # waits for the helper thread's mmap
    k, _ = kv.layer_kv(0)
    k[a.slot, 8] = 3.0  # would fault if unmapped
    assert k[a.slot, 8].eq(3.0).all()
    kv.close()


def test_cache_events_record_stores_and_evictions():
    pool = PagePool(2, record_events=True)
    a, b = pool.take("r1"), pool.take("r2")
    pool.set_hash(a.page_id, 11)
    pool.set_hash(b.page_id, 12)
    assert not pool.set_hash(b.page_id, 13)  # already holds 12: no event
    pool.release(a.page_id)
    pool.release(b.page_id)
    pool.take("r3")  # evicts the least recently released cached page (11)
    assert pool.drain_events() == [(True, 11), (True, 12), (False, 11)]
    assert pool.drain_events() == []


def test_latent_cache_values_are_key_channels():
    from xllm.core.kv.addressing import SlotAddress, SlotAttention

    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=64 + 16, v_head_dim=0)  # MLA: latent + rope dims
    bs = page_aligned_block_size(spec, torch.float32)
    lay = KVCacheLayout(spec, torch.float32, torch.device("cpu"), 2, 64, bs, 4, True)
    kv = XTensorKVCache(lay)
    s = seq("a", list(range(5)))
    assert kv.admit(s, 5) == 5
    assert kv.layer_kv(0)[1] is None

    from types import SimpleNamespace

    address = SlotAddress(token_slots=torch.full((5,), s.slot), decode_slots=torch.zeros(0, dtype=torch.long),
                          prefill_slots=[s.slot])
    batch = SimpleNamespace(address=address, positions=torch.arange(5), num_decode=0, prefill_query_starts=[0, 5],
                            prefill_context_lens=[5])

    q, k = torch.randn(5, 4, 80), torch.randn(5, 1, 80)
    out = SlotAttention(kv, batch).attention(0, q, k, None, 0.1, v_dim=64)
    assert out.shape == (5, 4, 64)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).expand(4, 5, 80), k[..., :64].transpose(0, 1).expand(4, 5, 64),
        is_causal=True, scale=0.1).transpose(0, 1)
    assert torch.allclose(out, ref, atol=1e-5)
    kv.close()


def test_mapped_positions_stay_within_the_map_budget():
    """Every mapped (slot, block) costs a memory mapping per range and Linux caps them (vm.max_map_count):
    positions a free slot left mapped are unmapped before a new one would exceed the budget, the pool
    holds no more pages than fit, and the data of sequences in use is untouched."""
    kv = XTensorKVCache(layout(num_blocks=8, max_num_seqs=3, prefix=False), map_budget=4)
    assert kv.layout.num_blocks == 4  # capped to the budget
    k, _ = kv.layer_kv(0)
    a, b = seq("a", list(range(16))), seq("b", list(range(100, 116)))
    assert kv.admit(a, 16) == 16 and kv.admit(b, 16) == 16  # two slots, two blocks each: 4 positions
    assert a.slot != b.slot and len(kv._mapped) == 4
    kv.free(a)
    kv.free(b)
    c = seq("c", list(range(200, 232)))  # four blocks in one slot: two of them new positions
    assert kv.admit(c, 32) == 32
    k[c.slot, :32] = 7.0
    assert len(kv._mapped) == 4 and kv.map_stats.unmaps == 2 * 2 * 2  # 2 positions x 2 layers x K/V
    assert all(slot == c.slot for slot, _ in kv._mapped)
    assert k[c.slot, :32].eq(7.0).all()
    d = seq("d", list(range(300, 316)))
    assert kv.admit(d, 16) == 0  # the pool (4 pages) is c's: no room, and nothing crashed
    kv.free(c)
    assert kv.admit(d, 16) == 16 and len(kv._mapped) <= 4
    kv.close()


def test_full_map_budget_is_not_rescanned_until_a_position_is_released():
    """With every mapped position in use, making room fails (and later attempts answer from the last
    scan instead of rescanning every position); freeing a sequence makes its positions unmappable."""
    kv = XTensorKVCache(layout(num_blocks=8, max_num_seqs=3, prefix=False), map_budget=4)
    a, b = seq("a", list(range(16))), seq("b", list(range(100, 116)))
    assert kv.admit(a, 16) == 16 and kv.admit(b, 16) == 16
    spare = next(s for s in range(3) if s not in (a.slot, b.slot))
    assert not kv._make_room(spare)
    scanned = []
    kv._mapped = _Recording(kv._mapped, scanned)
    assert not kv._make_room(spare) and scanned == []  # answered without a scan
    kv.free(a)
    assert kv._make_room(spare) and scanned  # a's positions are unused now: one was unmapped
    assert all(slot != a.slot for slot, _ in kv._mapped) or len(kv._mapped) < 4
    kv.close()


class _Recording(dict):
    """A dict that records when it is iterated."""

    def __init__(self, data: dict, log: list) -> None:
        super().__init__(data)
        self._log = log

    def __iter__(self):
        self._log.append(1)
        return super().__iter__()


def test_map_budget_from_the_process_limit_caps_capacity(monkeypatch):
    from xllm.core.kv import xtensor

    # 4 ranges (2 layers x K/V): a mapping per range for each of 3 positions and each of 3 slots (runs)
    monkeypatch.setattr(xtensor, "free_map_slots", lambda: 3 * 4 + 3 * 4)
    kv = XTensorKVCache(layout(num_blocks=8, max_num_seqs=3))
    assert kv.map_budget == 3 and kv.layout.num_blocks == 3
    kv.close()


def test_default_block_size_is_128_tokens_in_whole_os_pages_whatever_the_memory():
    from xllm.core.kv.base import build_kv_cache
    from xllm.core.kv.xtensor import default_block_size

    def block(spec: KVCacheSpec, dtype: torch.dtype, max_len: int = 8192) -> int:
        return default_block_size(page_aligned_block_size(spec, dtype), max_len)

    smol = KVCacheSpec(30, 3, 64, 64)
    assert block(smol, torch.bfloat16) == 128  # 4 of its 32-token units
    assert block(KVCacheSpec(2, 1, 8, 8), torch.bfloat16) == 256  # 16 B rows: one OS page is 256 tokens
    assert block(smol, torch.bfloat16, max_len=100) == 128  # max_model_len rounded up to the 32-token unit
    assert block(smol, torch.bfloat16, max_len=40) == 64
    # the engine's builder takes it when no block size is given, and keeps one that is; the memory does not
    # change it (a prefill and a decode instance with different memory must share a layout)
    for memory, given, expected in ((0.05, None, 128), (4.0, None, 128), (0.05, 64, 64)):
        kv = build_kv_cache("xtensor", smol, torch.bfloat16, torch.device("cpu"), 64, 8192, memory, block_size=given)
        assert kv.layout.block_size == expected
        kv.close()
