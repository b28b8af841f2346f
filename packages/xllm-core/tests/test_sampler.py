"""Sampler: greedy = argmax, raw logprobs, min_tokens, logit bias, penalties, seeds."""

from __future__ import annotations

import pytest
import torch

from xllm.core.sampler import Sampler
from xllm.core.sampling_params import SamplingParams
from xllm.core.sequence import Sequence

EOS = 2
V = 12


def seq(prompt=(5, 6), output=(), seed: int | None = 0, **params) -> Sequence:
    params.setdefault("max_tokens", 50)
    return Sequence("r", list(prompt), SamplingParams(**params), 0.0, seed=seed if seed is not None else 7,
                    output_ids=list(output))


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax_even_next_to_sampled_rows():
    logits = random_logits(6)
    seqs = [seq(temperature=0.0), seq(temperature=1.0, top_k=3), seq(temperature=0.0),
            seq(temperature=2.0, top_p=0.5), seq(temperature=0.0, top_k=2, min_p=0.3), seq(temperature=0.7)]
    res = Sampler(frozenset({EOS}))(logits, seqs)
    argmax = logits.argmax(-1).tolist()
    for i in (0, 2, 4):
        assert res.token_ids[i] == argmax[i]
    assert res.token_ids[1] in logits[1].topk(3).indices.tolist()
    assert all(lp is None for lp in res.logprobs)


def test_logprobs_come_from_the_raw_distribution():
    logits = random_logits(2, seed=1)
    seqs = [seq(temperature=0.0, logprobs=True, top_logprobs=3, repetition_penalty=1.5, logit_bias={0: 5.0}),
            seq(temperature=0.0)]
    res = Sampler(frozenset())(logits, seqs)
    raw = logits[0].log_softmax(-1)
    chosen, top = res.logprobs[0]
    assert chosen == pytest.approx(float(raw[res.token_ids[0]]), abs=1e-6)
    vals, idx = raw.topk(3)
    assert [t for t, _ in top] == idx.tolist()
    assert [lp for _, lp in top] == pytest.approx(vals.tolist(), abs=1e-6)
    assert res.logprobs[1] is None


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0
    logits[0, 7] = 9.0
    logits[0, 4] = 8.0
    sampler = Sampler(frozenset({EOS}))
    assert sampler(logits, [seq(temperature=0.0, min_tokens=2, output=[9])]).token_ids == [7]
    assert sampler(logits, [seq(temperature=0.0, min_tokens=2, output=[9, 9])]).token_ids == [EOS]
    # stop_token_ids are banned too; with ignore_eos only the stop tokens are
    both = seq(temperature=0.0, min_tokens=1, stop_token_ids=frozenset({7}))
    assert sampler(logits, [both]).token_ids == [4]
    ignoring = seq(temperature=0.0, min_tokens=1, stop_token_ids=frozenset({7}), ignore_eos=True)
    assert sampler(logits, [ignoring]).token_ids == [EOS]
    # under sampling too: EOS never appears while masked
    draws = [sampler(logits * 0.1, [seq(temperature=1.0, min_tokens=3, seed=s)]).token_ids[0] for s in range(50)]
    assert EOS not in draws


def test_logit_bias_forces_and_bans_tokens():
    logits = random_logits(1, seed=3)
    sampler = Sampler(frozenset())
    for s in range(20):
        assert sampler(logits, [seq(temperature=1.0, seed=s, logit_bias={9: 100.0})]).token_ids == [9]
    top = int(logits.argmax())
    assert sampler(logits, [seq(temperature=0.0, logit_bias={top: -100.0})]).token_ids[0] != top
    # ids outside the vocabulary are ignored rather than crashing
    assert sampler(logits, [seq(temperature=0.0, logit_bias={V + 5: 10.0})]).token_ids == [top]


def test_repetition_penalty_covers_prompt_and_output_tokens():
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 3], logits[0, 8] = 2.0, 1.5, 1.2
    sampler = Sampler(frozenset())
    assert sampler(logits, [seq(prompt=[5], temperature=0.0)]).token_ids == [5]
    assert sampler(logits, [seq(prompt=[5], temperature=0.0, repetition_penalty=2.0)]).token_ids == [3]  # 2/2 < 1.5
    assert sampler(logits, [seq(prompt=[5], output=[3], temperature=0.0, repetition_penalty=2.0)]).token_ids == [8]


def test_frequency_and_presence_penalties_count_only_output_tokens():
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 3] = 2.0, 1.0
    sampler = Sampler(frozenset())
    # 5 is in the prompt only: frequency/presence penalties do not touch it
    assert sampler(logits, [seq(prompt=[5, 5], temperature=0.0, frequency_penalty=2.0)]).token_ids == [5]
    # 2 - 0.4*2 = 1.2 > 1.0 ; 2 - 0.4*3 = 0.8 < 1.0
    assert sampler(logits, [seq(output=[5, 5], temperature=0.0, frequency_penalty=0.4)]).token_ids == [5]
    assert sampler(logits, [seq(output=[5, 5, 5], temperature=0.0, frequency_penalty=0.4)]).token_ids == [3]
    assert sampler(logits, [seq(output=[5], temperature=0.0, presence_penalty=1.5)]).token_ids == [3]


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = random_logits(4, seed=4)
    sampler = Sampler(frozenset())

    def run(neighbours: bool) -> list[int]:
        mine = seq(temperature=1.0, seed=42)
        others = [seq(temperature=0.5, seed=1, top_k=2), seq(temperature=0.0), seq(temperature=1.0, seed=5)]
        batch, row = ([mine], logits[1:2]) if not neighbours else ([others[0], mine, others[1], others[2]], logits)
        drawn = []
        for _ in range(30):  # each draw at the next output position
            tokens = sampler(row, batch).token_ids
            for s, t in zip(batch, tokens):
                s.output_ids.append(t)
            drawn.append(tokens[batch.index(mine)])
        return drawn

    alone = run(False)
    assert run(True) == alone
    assert len(set(alone)) > 1  # really sampled
