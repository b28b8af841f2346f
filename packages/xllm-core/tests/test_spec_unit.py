"""Speculative decoding's parts alone: the prompt-lookup index against a brute-force scan, the
verifier's sampled acceptance against rejection sampling's definition (accept a point-mass draft
with probability p(d), else the residual p without d: the output's marginal is p), and the
adaptive k / back-off."""

from __future__ import annotations

import random

import torch

from xllm.core.sampler import Sampler
from xllm.core.sampling_params import SamplingParams
from xllm.core.sequence import Sequence
from xllm.core.spec.ngram import NgramIndex
from xllm.core.spec.speculator import EXPLORE_REQUESTS, FIRST_BACKOFF, MAX_BACKOFF, Speculator
from xllm.core.spec.verify import accepted_prefix, verify


def _seq(tokens, outputs=(), **params) -> Sequence:
    params.setdefault("max_tokens", 1000)
    seq = Sequence("r", list(tokens), SamplingParams(**params), 0.0, seed=params.get("seed") or 0)
    seq.output_ids = list(outputs)
    return seq


def _brute(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n:]
        for e in range(length - 2, n - 2, -1):  # the most recent earlier occurrence
            if tokens[e - n + 1:e + 1] == suffix:
                return tokens[e + 1:e + 1 + k]
    return []


def test_ngram_index_matches_brute_force_as_tokens_arrive():
    rng = random.Random(0)
    for trial in range(30):
        prompt = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
        seq = _seq(prompt)
        index = NgramIndex()
        for _ in range(20):
            k = rng.randrange(1, 6)
            tokens = seq.prompt_ids + seq.output_ids
            assert index.propose(seq, k) == _brute(tokens, k), (trial, tokens)
            seq.output_ids.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


def test_accepted_prefix():
    assert accepted_prefix([1, 2, 3], [1, 2, 4, 9]) == 2
    assert accepted_prefix([1, 2, 3], [1, 2, 3, 9]) == 3
    assert accepted_prefix([5], [1, 2]) == 0


def test_sampled_verification_is_rejection_sampling():
    """Three-token vocabulary, target p, a point-mass draft d = 0: over many seeds the first output
    token's marginal is p and the draft is accepted with probability p(d) (4-sigma tolerances)."""
    p = torch.tensor([0.5, 0.3, 0.2])
    logits = torch.log(p).unsqueeze(0).repeat(2, 1)  # rows: the last known token, the draft
    sampler = Sampler(frozenset())
    n = 4000
    counts = torch.zeros(3)
    accepted = 0
    for seed in range(n):
        seq = _seq([7, 8], temperature=1.0, seed=seed)
        [v] = verify(sampler, logits, [(seq, [0])])
        counts[v.tokens[0]] += 1
        accepted += v.num_accepted
        # exactly the non-speculative draw of the same seed and position
        assert v.tokens[0] == sampler(logits[:1], [seq]).token_ids[0]
    freq = counts / n
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() < 4 * sigma).all(), freq
    assert abs(accepted / n - 0.5) < 4 * (0.25 / n) ** 0.5


class _FixedProposer:
    def __init__(self, drafts):
        self.drafts = drafts

    def propose(self, requests):
        return [self.drafts[:k] for _, k in requests]

    def release(self, seq):
        pass

    def close(self):
        pass


class _RoomyKV:
    def allocate(self, seq, n):
        return True


def test_adaptive_k_shrinks_and_backs_off():
    spec = Speculator(_FixedProposer([1, 2, 3, 4]), k_max=4, max_batch=8)
    seq = _seq([1, 2, 3], [4], temperature=0, max_tokens=1000)
    kv = _RoomyKV()
    ks = []
    from xllm.core.spec.verify import Verified
    for _ in range(40):
        drafts = spec.draft([seq], kv, budget=100, max_model_len=10_000).get(seq, [])
        ks.append(len(drafts))
        if drafts:  # every draft rejected
            spec.land(Verified(seq, [9], [None], len(drafts)), seq.num_tokens - 1)
            seq.num_computed_tokens = seq.num_tokens - 1
    assert 0 in ks                              # speculation pauses
    first_off = ks.index(0)
    before = ks[:first_off]                     # after k shrank with the acceptance rate (EWMA)
    assert before[0] == 4 and before == sorted(before, reverse=True) and before[-1] < 4
    # for FIRST_BACKOFF steps, then it probes again with k = 1
    assert ks[first_off:first_off + FIRST_BACKOFF + 1] == [0] * FIRST_BACKOFF + [1]
    # too many decoding sequences: no speculation at all
    many = [_seq([1, 2, 3], [4], temperature=0, max_tokens=1000) for _ in range(9)]
    assert spec.draft(many, kv, budget=100, max_model_len=10_000) == {}


def test_a_proposer_that_rarely_agrees_backs_new_requests_off_from_the_start():
    """Once the proposer's recent drafts were nearly all rejected (over every request), a new request
    starts backed off for MAX_BACKOFF steps instead of paying its own first drafts, except one in
    EXPLORE_REQUESTS; a proposer that agrees leaves new requests speculating at once."""
    from xllm.core.spec.verify import Verified

    def run(accepted: int) -> list[bool]:
        spec = Speculator(_FixedProposer([1, 2, 3, 4]), k_max=4, max_batch=8)
        kv = _RoomyKV()
        first_step_drafts = []
        for _ in range(3 * EXPLORE_REQUESTS):
            seq = _seq([1, 2, 3], [4], temperature=0, max_tokens=1000)
            for step in range(12):
                drafts = spec.draft([seq], kv, budget=100, max_model_len=10_000).get(seq, [])
                if step == 0:
                    first_step_drafts.append(bool(drafts))
                if drafts:
                    n = min(accepted, len(drafts))
                    spec.land(Verified(seq, [*drafts[:n], 9], [None] * (n + 1), len(drafts)), seq.num_tokens - 1)
                    seq.num_computed_tokens = seq.num_tokens - 1
            spec._sweep()
        return first_step_drafts

    rejecting = run(accepted=0)
    assert all(rejecting[:2])                          # before the proposer-wide rate is known
    later = rejecting[EXPLORE_REQUESTS:]
    assert 0 < sum(later) <= len(later) // EXPLORE_REQUESTS + 1   # only the exploring requests
    assert all(run(accepted=4))                        # a proposer that agrees: every request at once
    spec = Speculator(_FixedProposer([1]), k_max=1, max_batch=8)
    assert spec.proposer_rate is None and MAX_BACKOFF > FIRST_BACKOFF
