"""Sampling ops: penalties against hand-computed values, the top-k / top-p / min-p
sets against their definitions, and the seeded categorical draw."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xllm.kernels import native
from xllm.kernels.sampling import (
    apply_frequency_presence_penalties,
    apply_repetition_penalty,
    apply_token_bitmask,
    apply_top_k_top_p_min_p,
    sample_from_probs,
)

NEG_INF = float("-inf")


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def logits_for(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log().unsqueeze(0)


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 4.0],
                           [2.0, -1.0, 0.5, -3.0, 4.0]])
    seen = torch.tensor([[True, True, False, False, True],
                         [True, True, True, True, True]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0, 1.0]))
    assert torch.equal(out[0], torch.tensor([1.0, -2.0, 0.5, -3.0, 2.0]))
    assert torch.equal(out[1], logits[1])  # penalty 1.0 is neutral
    # A penalty below 1 rewards seen tokens.
    out = apply_repetition_penalty(logits[:1], seen[:1], torch.tensor([0.5]))
    assert torch.equal(out[0], torch.tensor([4.0, -0.5, 0.5, -3.0, 8.0]))


def test_frequency_and_presence_penalties_hand_computed():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0],
                           [0.0, 0.0, 0.0, 0.0],
                           [3.0, 2.0, 1.0, 0.0]])
    counts = torch.tensor([[0, 1, 3, 0],
                           [2, 0, 1, 0],
                           [5, 5, 5, 5]], dtype=torch.int32)
    out = apply_frequency_presence_penalties(logits, counts, torch.tensor([0.5, -1.0, 0.0]),
                                             torch.tensor([1.0, 0.25, 0.0]))
    assert torch.allclose(out[0], torch.tensor([1.0, -0.5, -1.5, 1.0]))   # 1 - 0.5*c - 1*(c>0)
    assert torch.allclose(out[1], torch.tensor([1.75, 0.0, 0.75, 0.0]))  # 0 + 1*c - 0.25*(c>0)
    assert torch.equal(out[2], logits[2])


@pytest.mark.parametrize("k", [1, 2, 5, 31])
def test_top_k_never_keeps_a_token_outside_the_top_k(k):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(6, 64, generator=g) * 3
    logits[2, :] = 0.25            # all tied: any k of them, but exactly k
    logits[3, 10:20] = 9.0         # ten-way tie at the top
    out = apply_top_k_top_p_min_p(logits, torch.full((6,), k), None, None)
    for b in range(6):
        keep = kept(out[b])
        assert len(keep) == k
        kth = logits[b].topk(k).values[-1]
        assert all(logits[b, t] >= kth for t in keep)
        assert torch.equal(out[b, sorted(keep)], logits[b, sorted(keep)])  # kept logits unchanged


def test_top_k_neutral_values_and_mixed_rows():
    logits = torch.randn(3, 10)
    out = apply_top_k_top_p_min_p(logits, torch.tensor([0, 10, 3]), None, None)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[1], logits[1])
    assert kept(out[2]) == set(logits[2].topk(3).indices.tolist())
    assert apply_top_k_top_p_min_p(logits, None, None, None) is logits


def test_top_p_hand_computed():
    probs = [0.5, 0.3, 0.15, 0.05]
    order = [2, 0, 3, 1]  # shuffle the vocabulary so the sort matters
    row = [0.0] * 4
    for pos, tok in enumerate(order):
        row[tok] = probs[pos]
    logits = logits_for(row)
    for top_p, expect_ranks in ((0.4, 1), (0.45, 1), (0.75, 2), (0.81, 3), (0.96, 4)):
        out = apply_top_k_top_p_min_p(logits, None, torch.tensor([top_p]), None)
        assert kept(out[0]) == set(order[:expect_ranks]), top_p


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.6, 0.9, 0.99])
def test_top_p_keeps_the_smallest_nucleus(top_p):
    g = torch.Generator().manual_seed(int(top_p * 100))
    logits = torch.randn(8, 200, generator=g) * 2
    out = apply_top_k_top_p_min_p(logits, None, torch.full((8,), top_p), None)
    probs = logits.softmax(-1)
    for b in range(8):
        keep = kept(out[b])
        ranked = probs[b].argsort(descending=True).tolist()
        assert keep == set(ranked[: len(keep)])           # a prefix of the sorted tokens
        mass = float(probs[b, sorted(keep)].sum())
        smallest = float(probs[b, sorted(keep)].min())
        assert mass >= top_p - 1e-6                        # enough mass
        assert mass - smallest < top_p + 1e-6              # and no token could be spared


def test_top_p_of_one_leaves_its_row_unchanged_when_other_rows_use_top_p():
    # 32k-way float32 cumsums overshoot 1.0; a neutral row must still keep its whole tail.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 32768, generator=g) * 3
    out = apply_top_k_top_p_min_p(logits, None, torch.tensor([1.0, 0.9, 1.0, 1.0]), None)
    for b in (0, 2, 3):
        assert torch.equal(out[b], logits[b])
    assert len(kept(out[1])) < 32768


def test_min_p_hand_computed_and_relative_to_the_top_token():
    logits = logits_for([0.4, 0.3, 0.2, 0.06, 0.04])
    for min_p, expect in ((0.0, 5), (0.11, 4), (0.14, 4), (0.16, 3), (0.49, 3), (0.51, 2), (1.0, 1)):
        out = apply_top_k_top_p_min_p(logits, None, None, torch.tensor([min_p]))
        assert kept(out[0]) == set(range(expect)), min_p


def test_filters_apply_in_order_top_k_then_top_p_on_the_renormalized_distribution():
    logits = logits_for([0.4, 0.3, 0.2, 0.1])
    # top_p alone: 0.4 < 0.5, so two tokens are needed.
    assert kept(apply_top_k_top_p_min_p(logits, None, torch.tensor([0.5]), None)[0]) == {0, 1}
    # after top_k=2 the first token has 4/7 > 0.5 of the mass: it alone is the nucleus.
    assert kept(apply_top_k_top_p_min_p(logits, torch.tensor([2]), torch.tensor([0.5]), None)[0]) == {0}
    # all three filters at once, per row
    out = apply_top_k_top_p_min_p(logits.repeat(3, 1), torch.tensor([3, 0, 0]), torch.tensor([1.0, 0.65, 1.0]),
                                  torch.tensor([0.0, 0.0, 0.6]))
    assert [kept(r) for r in out] == [{0, 1, 2}, {0, 1}, {0, 1}]


def test_most_likely_token_is_always_kept():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 2.0, -1.0]])
    out = apply_top_k_top_p_min_p(logits, torch.tensor([1, 1]), torch.tensor([1e-9, 1e-9]), torch.tensor([1.0, 1.0]))
    assert kept(out[0]) == {1}
    assert len(kept(out[1])) == 1 and kept(out[1]) <= {0, 1}


def test_sampling_is_reproducible_per_seed_and_independent_of_other_rows():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 50, generator=g), -1)

    def draws(seed_row: int, rows: list[int], steps: int = 40) -> list[int]:
        gens = [torch.Generator().manual_seed(seed_row if r == 1 else 1000 + r) for r in rows]
        idx = rows.index(1)
        return [int(sample_from_probs(probs[rows], gens)[idx]) for _ in range(steps)]

    alone = draws(7, [1])
    assert draws(7, [1]) == alone
    assert draws(7, [0, 1, 2]) == alone            # other rows (and their generators) do not matter
    assert draws(7, [2, 0, 1]) == alone
    assert draws(8, [1]) != alone                  # a different seed gives a different sequence


def test_sampling_matches_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0, 0.0])
    n = 40000
    gen = torch.Generator().manual_seed(123)
    tokens = torch.cat([sample_from_probs(probs.expand(8000, -1).contiguous(), [gen] * 8000) for _ in range(n // 8000)])
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[4] == 0 and counts[5] == 0       # zero-probability tokens are never drawn
    expected = probs.double() * n
    chi2 = float(((counts[:4] - expected[:4]) ** 2 / expected[:4]).sum())
    assert chi2 < 27.9  # 3 degrees of freedom, p = 1e-5
    assert torch.allclose(counts[:4] / n, probs[:4].double(), atol=0.01)


def test_sampling_from_a_one_hot_row_is_deterministic():
    probs = torch.zeros(4, 9)
    probs[torch.arange(4), torch.tensor([3, 0, 8, 5])] = 1.0
    gens = [torch.Generator().manual_seed(s) for s in range(4)]
    for _ in range(20):
        assert sample_from_probs(probs, gens).tolist() == [3, 0, 8, 5]


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("vocab", [49152, 1000, 37])  # whole 16-token groups, a tail, less than one word
def test_token_bitmask_against_the_bits_one_by_one(path, vocab, monkeypatch):
    """Every token of a masked row whose bit (llguidance's layout: bit j of word w = token 32 w + j)
    is clear is -inf, every other value is unchanged, rows outside ``rows`` untouched, the input
    untouched; the native kernel and the torch fallback alike."""
    if path == "native" and native.library() is None:
        pytest.skip("no native kernels here")
    if path == "torch":
        monkeypatch.setattr(native, "for_tensors", lambda *t: None)
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    before = logits.clone()
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[1] = 0  # a row with nothing allowed
    rows = torch.tensor([4, 0, 2])
    out = apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, before)
    want = before.clone()
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    for i, r in enumerate(rows.tolist()):
        want[r, torch.from_numpy(allowed[i] == 0)] = NEG_INF
    assert torch.equal(out, want)
    assert torch.isinf(out[0]).all() and torch.equal(out[1], before[1]) and torch.equal(out[3], before[3])
