"""The EPLB placement policies (:mod:`xllm.sched.eplb`): valid placements, balance on skewed loads (against the
default placement and an exhaustive search on a small case), the hierarchical policy's node packing."""

from __future__ import annotations

import itertools
import random

import pytest

from xllm.sched.eplb import (
    Placement,
    default_placement,
    imbalance,
    placement_imbalance,
    rank_loads,
    rebalance,
    slots_per_rank,
)


def zipf_load(layers: int, experts: int, seed: int, s: float = 1.2) -> list[list[float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(layers):
        order = list(range(experts))
        rng.shuffle(order)
        out.append([1000.0 / (order[e] + 1) ** s for e in range(experts)])
    return out


def test_default_placement_holds_every_expert_in_rank_blocks():
    p = default_placement(2, experts=6, ranks=4, redundant=1)
    assert p.slots == slots_per_rank(6, 4, 1) == 2  # 7 slots rounded up to 8: two replicas
    assert p.rank_experts(0, 0) == (0, 1) and p.rank_experts(0, 2) == (4, 5) and p.rank_experts(0, 3) == (0, 1)
    assert p.replicas(0)[0] == [0, 6] and p.replicas(0)[5] == [5]
    assert Placement.from_words(p.words()) == p


def test_placement_rejects_a_missing_expert_and_a_wrong_shape():
    with pytest.raises(ValueError, match="every expert"):
        Placement(3, 2, 2, ((0, 1, 1, 1),))
    with pytest.raises(ValueError, match="slots"):
        Placement(3, 2, 2, ((0, 1, 2),))
    with pytest.raises(ValueError, match="words"):
        Placement.from_words([3, 2, 2, 1, 0, 1])


@pytest.mark.parametrize(("policy", "bound"), [("global", 1.2), ("hierarchical", 1.3)])  # (groups bind it)
def test_rebalance_evens_a_skewed_load(policy, bound):
    load = zipf_load(layers=4, experts=32, seed=3)
    ranks, redundant = 8, 8
    before = default_placement(4, 32, ranks, redundant)
    after = rebalance(load, ranks, before.slots, groups=8, nodes=2, policy=policy)
    assert placement_imbalance(load, before) > 1.5
    assert placement_imbalance(load, after) <= bound
    assert after == rebalance(load, ranks, before.slots, groups=8, nodes=2, policy=policy)  # deterministic
    for i in range(4):  # the hottest expert got the most replicas
        hot = max(range(32), key=lambda e: load[i][e])
        assert len(after.replicas(i)[hot]) == max(len(r) for r in after.replicas(i))


def test_hierarchical_keeps_each_group_on_one_node():
    load = zipf_load(layers=2, experts=16, seed=1)
    p = rebalance(load, ranks=4, slots=5, groups=4, nodes=2, policy="hierarchical")
    half = p.physical // 2
    for layer in p.layers:
        for node in (layer[:half], layer[half:]):
            groups = {e // 4 for e in node}
            assert len(groups) == 2 and all({e for e in node if e // 4 == g} == set(range(4 * g, 4 * g + 4))
                                            for g in groups)


def test_global_matches_the_best_split_of_a_small_case():
    load = [[9.0, 1.0, 1.0, 1.0, 4.0, 4.0]]
    p = rebalance(load, ranks=2, slots=3, policy="global")
    best = min(imbalance(rank_loads(load[0], perm, 2)) for perm in itertools.permutations(range(6)))
    assert imbalance(rank_loads(load[0], p.layers[0], 2)) == pytest.approx(best)


def test_rank_loads_split_an_expert_over_its_replicas():
    assert rank_loads([6.0, 2.0], [0, 1, 0, 0], 2) == [4.0, 4.0]
    assert imbalance([4.0, 4.0]) == 1.0 and imbalance([0.0, 0.0]) == 1.0


def test_rebalance_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="policy"):
        rebalance([[1.0, 2.0]], 2, 1, policy="random")
    with pytest.raises(ValueError, match="hierarchical"):
        rebalance([[1.0, 2.0]], 2, 1, groups=1, nodes=2, policy="hierarchical")
