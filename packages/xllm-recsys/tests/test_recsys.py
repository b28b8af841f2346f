import random

import pytest
import torch

from xllm.recsys import ItemTrie, beam_topk


def test_trie_allows_only_prefixes_of_items():
    trie = ItemTrie([(1, 2, 3), (1, 2, 4), (1, 5, 6), (7, 8, 9)])
    assert trie.allowed(()) == [1, 7]
    assert trie.allowed((1,)) == [2, 5]
    assert trie.allowed((1, 2)) == [3, 4]
    assert trie.allowed((1, 8)) == []
    assert trie.is_item((1, 5, 6)) and not trie.is_item((1, 5, 3))


def test_logit_mask_blocks_invalid_tokens():
    trie = ItemTrie([(1, 2, 3), (7, 8, 9)])
    mask = trie.logit_mask([(), (7,), (7, 8)], vocab_size=10)
    assert mask.shape == (3, 10)
    assert torch.isfinite(mask[0]).nonzero().flatten().tolist() == [1, 7]
    assert torch.isfinite(mask[1]).nonzero().flatten().tolist() == [8]
    logits = torch.randn(3, 10) + mask
    assert logits[2].argmax().item() == 9


def test_trie_rejects_ragged_items_and_out_of_vocab():
    with pytest.raises(ValueError):
        ItemTrie([(1, 2, 3), (1, 2)])
    with pytest.raises(ValueError):
        ItemTrie([(1, 20, 3)]).logit_mask([(1,)], vocab_size=10)


@pytest.mark.parametrize("seed", range(20))
def test_beam_topk_equals_full_sort(seed):
    rng = random.Random(seed)
    width = rng.randint(1, 8)
    beams = [rng.uniform(-5, 0) for _ in range(width)]
    cands = [sorted((rng.uniform(-8, 0) for _ in range(rng.randint(1, 12))), reverse=True) for _ in beams]
    got, examined = beam_topk(beams, cands, width)
    full = sorted(((b + lp, i, r) for i, (b, c) in enumerate(zip(beams, cands)) for r, lp in enumerate(c)),
                  key=lambda t: (-t[0], t[1], t[2]))[:width]
    assert [(c.score, c.beam, c.rank) for c in got] == [(s, i, r) for s, i, r in full]
    assert examined <= sum(len(c) for c in cands)


def test_beam_topk_terminates_early():
    beams = [0.0, -10.0, -20.0]
    cands = [[-0.1, -0.2, -0.3, -0.4], [-0.1, -0.2, -0.3, -0.4], [-0.1, -0.2, -0.3, -0.4]]
    got, examined = beam_topk(beams, cands, 3)
    assert [c.beam for c in got] == [0, 0, 0]
    assert examined == 4 + 1 + 1  # beams 1 and 2 stop at their first candidate


def test_beam_topk_requires_sorted_candidates():
    with pytest.raises(ValueError):
        beam_topk([0.0], [[-1.0, -0.5]], 2)
