"""Tensor-parallel loading: two "ranks" loaded with ``load_model(..., tp_rank, tp_size=2)``
hold slices that reassemble to the full model's parameters, and their partial attention /
MLP / MoE outputs sum (the all-reduce) to the full model's outputs."""

from __future__ import annotations

import inspect

import pytest
import torch

from xllm.models import load_model
from xllm.models.config import ModelConfigError
from xllm.models.tensor_parallel import TPShard
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
        local_size = ranks_fused[0].shard_offsets[shard][1]
        assert local_size * TP == size
        parts += [getattr(r, kind)[r.shard_offsets[shard][0]:r.shard_offsets[shard][0] + local_size]
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
    assert all(torch.equal(r.model.embed_tokens.weight, full.model.embed_tokens.weight) for r in ranks)
    spec, local = full.kv_cache_spec(), ranks[0].kv_cache_spec()
    assert local.num_kv_heads * TP == spec.num_kv_heads and local.head_dim == spec.head_dim


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


def test_moe_experts_are_sliced_per_expert(checkpoints):
    _, full, ranks = checkpoints["qwen3_moe"]
    moe, rm = full.model.layers[1].mlp, [r.model.layers[1].mlp for r in ranks]
    inter = moe.experts.intermediate
    assert all(r.experts.intermediate * TP == inter for r in rm)
    for e in range(moe.experts.num_experts):
        gate = torch.cat([r.experts.w13[e, :inter // TP] for r in rm])
        up = torch.cat([r.experts.w13[e, inter // TP:] for r in rm])
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
    with pytest.raises(ModelConfigError, match="num_attention_heads=4 is not divisible by tensor-parallel size 3"):
        load_model(path, torch.float32, progress=False, tp_rank=0, tp_size=3)
    with pytest.raises(ValueError, match="tp_rank"):
        load_model(path, torch.float32, progress=False, tp_rank=2, tp_size=2)
    with pytest.raises(ModelConfigError, match="not supported for 'GPT2LMHeadModel'"):
        TPShard.for_architecture("GPT2LMHeadModel", 0, 2)


def test_shards_are_views_of_the_mapped_tensor():
    shard = TPShard.for_architecture("LlamaForCausalLM", 1, 2)
    w = torch.arange(24.0).view(4, 6)
    q = shard.shard("model.layers.0.self_attn.q_proj.weight", w)
    o = shard.shard("model.layers.0.self_attn.o_proj.weight", w)
    assert q.data_ptr() == w[2:].data_ptr() and torch.equal(q, w[2:])
    assert torch.equal(o, w[:, 3:]) and o.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    assert shard.shard("model.norm.weight", w[0]) is w[0] or torch.equal(shard.shard("model.norm.weight", w[0]), w[0])
