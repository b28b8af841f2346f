"""Tensor-parallel loading: two "ranks" loaded in one process with ``load_model(..., tp_rank, tp_size=2)``
(no communicator: every collective a no-op) hold slices that reassemble to the full model's parameters,
and their partial attention / MLP / MoE outputs and embedding lookups sum (the all-reduce) to the full
model's outputs. The split arithmetic (:mod:`xllm.models.tp_plan`), quantized slicing and the vocabulary-
parallel head's tie rule are checked here too; real collectives: ``test_tensor_parallel_ranks``."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from xllm.kernels.quant import dequantize, quantize
from xllm.models import load_model
from xllm.models.config import ModelConfig, ModelConfigError
from xllm.models.tensor_parallel import TPShard
from xllm.models.tp_layers import VocabParallelHead
from xllm.models.tp_plan import HeadSplit, Span, channel_span, gqa_heads, mla_heads, vocab_span
from xllm.testing.models import save_random_hf_model
from xllm.testing.reference import DenseContext

transformers = pytest.importorskip("transformers")

TP = 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (dir, full model, [rank models])."""
    configs = {
        "llama_bias": transformers.LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               attention_bias=True, mlp_bias=True, max_position_embeddings=128),
        "qwen3_moe": transformers.Qwen3MoeConfig(vocab_size=500, hidden_size=64, intermediate_size=96,
                                                 moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2, head_dim=24, num_experts=6,
                                                 num_experts_per_tok=2, mlp_only_layers=[0],
                                                 max_position_embeddings=128),
        "deepseek_v2": transformers.DeepseekV2Config(vocab_size=500, hidden_size=64, intermediate_size=96,
                                                     moe_intermediate_size=32, num_hidden_layers=2,
                                                     num_attention_heads=4, n_routed_experts=6, num_experts_per_tok=2,
                                                     n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=None,
                                                     kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
                                                     v_head_dim=10, max_position_embeddings=128),
    }
    out = {}
    for i, (name, cfg) in enumerate(configs.items()):
        path = tmp_path_factory.mktemp(name)
        save_random_hf_model(path, cfg, seed=i)
        full = load_model(path, torch.float32, progress=False)
        ranks = [load_model(path, torch.float32, progress=False, tp_rank=r, tp_size=TP) for r in range(TP)]
        out[name] = (path, full, ranks)
    return out


def _shards(fused, ranks_fused, kind="weight"):
    """Reassemble a fused column-parallel parameter shard by shard: cat over ranks per shard."""
    parts = []
    for shard, (_, size) in fused.shard_offsets.items():
        assert sum(r.shard_offsets[shard][1] for r in ranks_fused) == size
        parts += [getattr(r, kind)[r.shard_offsets[shard][0]:r.shard_offsets[shard][0] + r.shard_offsets[shard][1]]
                  for r in ranks_fused]
    return torch.cat(parts)


def test_llama_slices_reassemble_to_the_full_weights(checkpoints):
    _, full, ranks = checkpoints["llama_bias"]
    for i, layer in enumerate(full.model.layers):
        rl = [r.model.layers[i] for r in ranks]
        for kind in ("weight", "bias"):
            assert torch.equal(_shards(layer.self_attn.qkv_proj, [r.self_attn.qkv_proj for r in rl], kind),
                               getattr(layer.self_attn.qkv_proj, kind))
            assert torch.equal(_shards(layer.mlp.gate_up_proj, [r.mlp.gate_up_proj for r in rl], kind),
                               getattr(layer.mlp.gate_up_proj, kind))
        assert torch.equal(torch.cat([r.self_attn.o_proj.weight for r in rl], dim=1), layer.self_attn.o_proj.weight)
        assert torch.equal(torch.cat([r.mlp.down_proj.weight for r in rl], dim=1), layer.mlp.down_proj.weight)
        # row-parallel biases: once (rank 0), so the all-reduce adds them exactly once
        assert torch.equal(rl[0].self_attn.o_proj.bias, layer.self_attn.o_proj.bias)
        assert not rl[1].self_attn.o_proj.bias.any() and not rl[1].mlp.down_proj.bias.any()
        # replicated
        assert torch.equal(rl[1].input_layernorm.weight, layer.input_layernorm.weight)
    # vocabulary-parallel: 500 rows as 250 + 250, embedding and (untied) head alike
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert [r.get_parameter(name).shape[0] for r in ranks] == [250, 250]
        assert torch.equal(torch.cat([r.get_parameter(name) for r in ranks]), full.get_parameter(name))
    spec, local = full.kv_cache_spec(), [r.kv_cache_spec() for r in ranks]
    assert sum(s.num_kv_heads for s in local) == spec.num_kv_heads and local[0].head_dim == spec.head_dim


def _attention(model, layer: int, x: torch.Tensor, ctx) -> torch.Tensor:
    """Layer ``layer``'s attention on ``x`` at positions 0..T-1 (whichever RoPE argument form it takes)."""
    attn = model.model.layers[layer].self_attn
    positions = torch.arange(x.shape[0])
    if "rope" in inspect.signature(attn.forward).parameters:
        from xllm.kernels import RopeBatch

        return attn(x.clone(), RopeBatch(model.rotary, positions), ctx)
    cos, sin = model.rotary.lookup(positions, x.dtype)
    return attn(x.clone(), cos, sin, ctx)


@pytest.mark.parametrize("name", ["llama_bias", "qwen3_moe", "deepseek_v2"])
def test_partial_outputs_sum_to_the_full_layer(checkpoints, name):
    _, full, ranks = checkpoints[name]
    x = torch.randn(9, full.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ctx = DenseContext()
    with torch.no_grad():
        for i, layer in enumerate(full.model.layers):
            attn = sum(_attention(r, i, x, ctx) for r in ranks)
            assert torch.allclose(attn, _attention(full, i, x, ctx), atol=1e-5)
            mlp = sum(r.model.layers[i].mlp(x) for r in ranks)
            assert torch.allclose(mlp, layer.mlp(x), atol=1e-5)
        ids = torch.tensor([0, 1, 249, 250, 499, 7])
        assert torch.equal(sum(r.model.embed_tokens(ids) for r in ranks), full.model.embed_tokens(ids))


def test_moe_experts_are_sliced_per_expert(checkpoints):
    _, full, ranks = checkpoints["qwen3_moe"]
    moe, rm = full.model.layers[1].mlp, [r.model.layers[1].mlp for r in ranks]
    assert [r.experts.intermediate for r in rm] == [16, 16]  # 32 channels: fewer 32-blocks than ranks
    for e in range(moe.experts.num_experts):
        gate = torch.cat([r.experts.w13[e, :r.experts.intermediate] for r in rm])
        up = torch.cat([r.experts.w13[e, r.experts.intermediate:] for r in rm])
        assert torch.equal(torch.cat([gate, up]), moe.experts.w13[e])
        assert torch.equal(torch.cat([r.experts.w2[e] for r in rm], dim=1), moe.experts.w2[e])
    assert all(torch.equal(r.gate.weight, moe.gate.weight) for r in rm)  # the router is replicated


def test_mla_splits_heads_and_keeps_the_latent_whole(checkpoints):
    _, full, ranks = checkpoints["deepseek_v2"]
    spec = full.kv_cache_spec()
    assert all(r.kv_cache_spec() == spec for r in ranks)  # every rank caches the same full latent
    a, ra = full.model.layers[0].self_attn, [r.model.layers[0].self_attn for r in ranks]
    assert all(r.dims.num_heads * TP == a.dims.num_heads for r in ra)
    assert torch.equal(torch.cat([r.kv_b_proj.weight for r in ra]), a.kv_b_proj.weight)
    kv_a = a.qkv_a_proj.shard_offsets["kv_a"]
    for r in ra:
        start, size = r.qkv_a_proj.shard_offsets["kv_a"]
        assert torch.equal(r.qkv_a_proj.weight[start:start + size], a.qkv_a_proj.weight[kv_a[0]:kv_a[0] + kv_a[1]])


def test_bad_tensor_parallel_settings(checkpoints):
    path, _, _ = checkpoints["llama_bias"]
    # 2 KV heads on 3 ranks: neither split nor replicated evenly
    with pytest.raises(ModelConfigError, match="--tensor-parallel-size 3 cannot split 2 KV heads"):
        load_model(path, torch.float32, progress=False, tp_rank=0, tp_size=3)
    with pytest.raises(ValueError, match="tp_rank"):
        load_model(path, torch.float32, progress=False, tp_rank=2, tp_size=2)
    with pytest.raises(ModelConfigError, match="not supported for 'GPT2LMHeadModel'"):
        TPShard.for_config(_cfg(architectures=["GPT2LMHeadModel"]), 0, 2)


def _cfg(**overrides) -> ModelConfig:
    """A Llama config: 4 query heads of 2 dims on 2 KV heads, hidden 6, intermediate 64, vocab 5."""
    raw = dict(architectures=["LlamaForCausalLM"], hidden_size=6, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, head_dim=2, intermediate_size=64, vocab_size=5)
    return ModelConfig.from_dict({**raw, **overrides})


def test_shards_are_views_of_the_mapped_tensor():
    shard = TPShard.for_config(_cfg(), 1, 2)
    w = torch.arange(48.0).view(8, 6)
    q = shard.shard("model.layers.0.self_attn.q_proj.weight", w)
    wo = torch.arange(48.0).view(6, 8)
    o = shard.shard("model.layers.0.self_attn.o_proj.weight", wo)
    assert q.data_ptr() == w[4:].data_ptr() and torch.equal(q, w[4:])
    assert torch.equal(o, wo[:, 4:]) and o.untyped_storage().data_ptr() == wo.untyped_storage().data_ptr()
    assert torch.equal(shard.shard("model.norm.weight", w[0]), w[0])
    emb = torch.arange(30.0).view(5, 6)
    assert torch.equal(shard.shard("model.embed_tokens.weight", emb), emb[3:])  # ceil(5 / 2) = 3 rows on rank 0


def test_head_split_follows_the_kv_groups():
    # SmolLM2: 9 query heads on 3 KV heads over 2 ranks -> KV heads 0-1 (q 0-5), KV head 2 (q 6-8)
    assert [gqa_heads(9, 3, 2, r) for r in range(2)] == [HeadSplit(Span(0, 6), Span(0, 2)),
                                                         HeadSplit(Span(6, 9), Span(2, 3))]
    # one KV head, replicated: its 4 query heads split 2 + 2
    assert [gqa_heads(4, 1, 2, r) for r in range(2)] == [HeadSplit(Span(0, 2), Span(0, 1)),
                                                         HeadSplit(Span(2, 4), Span(0, 1))]
    # 2 KV heads on 4 ranks: each KV head on two ranks, its 4 query heads 2 + 2
    assert [gqa_heads(8, 2, 4, r).q for r in range(4)] == [Span(0, 2), Span(2, 4), Span(4, 6), Span(6, 8)]
    assert [gqa_heads(8, 2, 4, r).kv for r in range(4)] == [Span(0, 1), Span(0, 1), Span(1, 2), Span(1, 2)]
    with pytest.raises(ModelConfigError, match="--tensor-parallel-size 4"):
        gqa_heads(6, 2, 4, 0)  # 3 query heads per KV head do not split in two
    assert [mla_heads(3, 2, r) for r in range(2)] == [Span(0, 2), Span(2, 3)]


def test_channels_split_in_whole_blocks_and_vocab_in_ceil_rows():
    assert [channel_span(1536, 2, r, "i") for r in range(2)] == [Span(0, 768), Span(768, 1536)]
    assert [channel_span(96, 2, r, "i") for r in range(2)] == [Span(0, 64), Span(64, 96)]  # 3 blocks: 2 + 1
    assert [channel_span(80, 2, r, "i") for r in range(2)] == [Span(0, 40), Span(40, 80)]  # not whole blocks
    assert [vocab_span(49152, 2, r) for r in range(2)] == [Span(0, 24576), Span(24576, 49152)]
    assert [vocab_span(501, 2, r) for r in range(2)] == [Span(0, 251), Span(251, 501)]
    with pytest.raises(ModelConfigError, match="leaves a rank no rows"):
        vocab_span(5, 4, 0)  # ceil(5 / 4) = 2 rows each: the fourth rank would get none


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "int8", "int4_g32"])
def test_quantized_weights_slice_as_stored(fmt):
    cfg = _cfg(hidden_size=64, intermediate_size=128)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    qw = quantize(w, fmt)
    full = dequantize(qw)
    for rank, cols in enumerate((slice(0, 64), slice(64, 128))):
        shard = TPShard.for_config(cfg, rank, TP)
        down = shard.shard_quantized("model.layers.0.mlp.down_proj.weight", qw)  # columns
        assert torch.equal(dequantize(down), full[:, cols])
        up = shard.shard_quantized("model.layers.0.mlp.up_proj.weight", quantize(w.T.contiguous(), fmt))  # rows
        assert torch.equal(dequantize(up), dequantize(quantize(w.T.contiguous(), fmt))[cols])
    with pytest.raises(ModelConfigError, match="do not fall on the 32-wide blocks"):
        TPShard.for_config(_cfg(hidden_size=64, intermediate_size=80), 0, TP).shard_quantized(
            "model.layers.0.mlp.down_proj.weight", quantize(torch.randn(64, 96), "q8_0"))


class _Parts:
    """A communicator stub for one rank: ``all_gather`` returns the other ranks' parts given up front."""

    def __init__(self, rank: int, others: list[torch.Tensor]) -> None:
        self.rank, self.size, self.others = rank, len(others) + 1, others

    def all_gather(self, x):
        return [*self.others[:self.rank], x, *self.others[self.rank:]]


class _Rows:
    def __init__(self, logits: torch.Tensor) -> None:
        self._logits = logits

    def logits(self, x):
        return self._logits


def test_parallel_greedy_takes_the_first_index_of_the_max_across_ranks():
    full = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0], [1.0, 0.0, 2.0, 5.0, 5.0], [float("nan"), 0.0, 9.0, 1.0, 1.0]])
    shard = TPShard.for_config(_cfg(), 1, TP)  # vocab 5: rows 0-2 on rank 0, 3-4 on rank 1
    mine, theirs = full[:, 3:], full[:, :3]
    best, index = theirs.max(-1)
    other = torch.stack([best.double(), index.double()], -1)
    head = VocabParallelHead(_Rows(mine), dataclasses.replace(shard, comm=_Parts(1, [other])))
    assert torch.equal(head.greedy(torch.zeros(3, 6)), full.argmax(-1))  # [1 (tie with 3), 3 (tie with 4), 0 (nan)]
    head = VocabParallelHead(_Rows(mine), dataclasses.replace(shard, comm=_Parts(1, [theirs])))
    logits = head.logits(torch.zeros(3, 6))  # rank 1's 2 columns padded to 3 for the gather, then cut
    torch.testing.assert_close(logits, full, rtol=0, atol=0, equal_nan=True)
