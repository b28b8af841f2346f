"""Expert parallelism's pieces in one process (:mod:`xllm.models.expert_parallel`): ranks' partial MoE outputs
sum to the dense reference (:func:`xllm.kernels.moe.moe_reference`) under any placement, redundant replicas
split an expert's tokens evenly, and a prepared placement read from a checkpoint (the Hub's per-expert tensors
and transformers 5's stacked ones) serves the same sums after the switch. The two-rank engine runs are in
``packages/xllm-engine/tests/test_expert_parallel.py``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from xllm.kernels.moe import moe_reference
from xllm.models.config import ModelConfig, ModelConfigError
from xllm.models.expert_parallel import CheckpointExperts, ExpertLayers, ExpertMap, ExpertParallelSpec
from xllm.models.moe import RoutedExperts
from xllm.models.tensor_parallel import TPShard
from xllm.sched.eplb import Placement, default_placement

E, H, INTER, K, RANKS = 6, 16, 8, 2, 2


def weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, H, generator=g), torch.randn(E, H, INTER, generator=g)


def rank_modules(placement: Placement, w13: torch.Tensor, w2: torch.Tensor) -> list[RoutedExperts]:
    """Each rank's RoutedExperts of layer 0, loaded from the stacked checkpoint tensors."""
    mods = []
    for r in range(RANKS):
        m = RoutedExperts(E, H, INTER, slots=placement.slots)
        m.place(ExpertMap(placement.layers[0], E, r, placement.slots, torch.device("cpu")), 0, None)
        assert m.load_checkpoint_tensor("gate_up_proj", w13) and m.load_checkpoint_tensor("down_proj", w2)
        assert m.missing_checkpoint_tensors() == []
        mods.append(m)
    return mods


def routed(seed: int = 1, tokens: int = 9):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    return x, torch.rand(tokens, K, generator=g), ids


@pytest.mark.parametrize("layout", ["default", "reversed"])
def test_rank_outputs_sum_to_the_dense_reference(layout):
    w13, w2 = weights()
    p = default_placement(1, E, RANKS, redundant=2)  # 8 slots: experts 0 and 1 twice
    if layout == "reversed":
        p = Placement(E, RANKS, p.slots, (tuple(reversed(p.layers[0])),))
    x, w, ids = routed()
    total = sum(m(x, w, ids) for m in rank_modules(p, w13, w2))
    torch.testing.assert_close(total, moe_reference(x, w13, w2, w, ids), rtol=1e-4, atol=1e-4)


def test_replicas_take_an_even_share_of_their_experts_tokens():
    p = Placement(3, 2, 2, ((0, 1, 0, 2),))  # expert 0 on both ranks
    m = ExpertMap(p.layers[0], 3, 0, 2, torch.device("cpu"))
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 2], [0, 1]])
    phys = m.route(ids)
    zero = phys[:, 0].tolist()
    assert sorted(zero) == [0, 0, 0, 2, 2] or sorted(zero) == [0, 0, 2, 2, 2]  # 5 tokens over 2 replicas
    assert phys[:, 1].tolist() == [1, 3, 1, 3, 1]  # single replicas: their own slot


@pytest.mark.parametrize("stacked", [False, True])
def test_a_prepared_placement_serves_the_same_sums(tmp_path, stacked):
    w13, w2 = weights()
    prefix = "model.layers.1.mlp.experts"
    if stacked:
        tensors = {f"{prefix}.gate_up_proj": w13, f"{prefix}.down_proj": w2}
    else:
        tensors = {}
        for e in range(E):
            tensors[f"{prefix}.{e}.gate_proj.weight"] = w13[e, :INTER].clone()
            tensors[f"{prefix}.{e}.up_proj.weight"] = w13[e, INTER:].clone()
            tensors[f"{prefix}.{e}.down_proj.weight"] = w2[e].clone()
    save_file(tensors, tmp_path / "model.safetensors")
    p = default_placement(1, E, RANKS, redundant=2)
    mods = rank_modules(p, w13, w2)
    source = CheckpointExperts([tmp_path / "model.safetensors"], torch.float32)
    planes = [ExpertLayers([mods[r]], [prefix], r, RANKS, p, source) for r in range(RANKS)]
    new = Placement(E, RANKS, p.slots, ((5, 4, 3, 2, 1, 0, 5, 4),))  # every rank mostly the other's experts
    x, w, ids = routed(seed=3)
    before = sum(m(x, w, ids) for m in mods)
    for plane in planes:
        plane.prepare(new)
    for plane in planes:
        plane._thread.join()  # (the background build)
        assert plane.prepared()
        plane.commit()
    assert mods[0].expert_map.local == (5, 4, 3, 2) and mods[1].expert_map.local == (1, 0, 5, 4)
    after = sum(m(x, w, ids) for m in mods)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after, moe_reference(x, w13, w2, w, ids), rtol=1e-4, atol=1e-4)
    assert planes[0].load is not None and planes[1].load is None  # rank 0 counts the load


def test_expert_parallel_needs_routed_experts():
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "num_hidden_layers": 1, "intermediate_size": 96,
                                 "vocab_size": 500})
    with pytest.raises(ModelConfigError, match="no routed experts"):
        TPShard.for_config(cfg, 0, 2, experts=ExpertParallelSpec())
