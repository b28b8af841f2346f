"""The sampler's output distributions against their definitions, over thousands of seeded draws
(one row per seed, so every draw is independent): top-k / top-p / min-p never emit a token
outside their set and sample the renormalized distribution inside it; temperature rescales as
softmax(logits / T); temperature 0 is greedy whatever else is set; penalties and logit bias
change the logits exactly as specified. Then through the engine: a seeded request's output
does not depend on batch neighbours, chunked prefill or preemption, and a logit bias naming a
token outside the vocabulary is a 400-class error.

Two checks per distribution (``assert_fits``), both against the distribution written from its
definition:

- exact: the sampler draws by the exponential race (the argmax of ``p / E``, ``E ~ Exp(1)`` from the
  row's generator, keyed by (seed, output index)), so replaying each row's seeded noise gives the token the *reference*
  distribution yields for that draw; every draw must match (up to float near-ties). A 1%
  temperature error changes dozens of the 4,000 draws (``test_the_fit_checks_detect_a_small_error``
  shows the check fails on it);
- statistical: Pearson's chi-square over the kept tokens at a false-alarm rate of 1e-4 per check
  (critical value by Wilson–Hilferty), which checks the race itself samples the distribution,
  independently of how the noise is drawn.

The draws are seeded, so the outcome is deterministic.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

from xllm.core.sampler import Sampler
from xllm.core.sampling_params import SamplingParams
from xllm.core.sequence import Sequence
from xllm.engine_api.errors import InvalidRequestError
from xllm.kernels.sampling import draw_generator
from xllm.testing.engine import generate, make_request, run_to_completion

V = 40
DRAWS = 4000


def logits_row(seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * scale


def seq(gen_seed: int, prompt=(1, 2, 3), output=(), **params) -> Sequence:
    """A sequence seeded with ``gen_seed`` (its draw at output index i uses ``draw_generator(gen_seed, i)``)."""
    params.setdefault("max_tokens", 100)
    return Sequence(f"r{gen_seed}", list(prompt), SamplingParams(**params), 0.0, seed=gen_seed,
                    output_ids=list(output))


def draw(row: torch.Tensor, n: int = DRAWS, **params) -> torch.Tensor:
    """``n`` independent draws (one seeded sequence each, seeds ``FIRST_SEED + i``) from ``row``."""
    seqs = [seq(FIRST_SEED + i, **params) for i in range(n)]
    return torch.tensor(Sampler(frozenset())(row.expand(n, -1).clone(), seqs).token_ids)


FIRST_SEED = 10_000
FALSE_ALARM = 1e-4


def chi2_critical(df: int, alpha: float = FALSE_ALARM) -> float:
    """The chi-square quantile ``1 - alpha`` (Wilson–Hilferty; within ~1% for df >= 1 here)."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def race_mismatches(tokens: torch.Tensor, probs: torch.Tensor, first_seed: int, index: int = 0) -> int:
    """Draws that differ from what ``probs`` gives under the same seeded exponential noise
    at output position ``index`` (rows whose top two ratios are within 1e-5 are float near-ties and
    not counted)."""
    noise = torch.stack([torch.empty(len(probs)).exponential_(generator=draw_generator(first_seed + i, index))
                         for i in range(len(tokens))])
    ratio = probs.float().unsqueeze(0) / noise
    top2 = ratio.topk(2, -1).values
    clear = top2[:, 0] > top2[:, 1] * (1 + 1e-5)
    return int(((ratio.argmax(-1) != tokens) & clear).sum())


def chi2_statistic(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the support (cells with < 5 expected pooled) and its degrees of freedom."""
    support = probs > 0
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    keep = support & (expected >= 5)
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    rest_c, rest_e = float(counts[support & ~keep].sum()), float(expected[support & ~keep].sum())
    df = int(keep.sum()) - 1
    if rest_e >= 5:
        chi2 += (rest_c - rest_e) ** 2 / rest_e
        df += 1
    return chi2, df


def assert_fits(tokens: torch.Tensor, probs: torch.Tensor, first_seed: int = FIRST_SEED, index: int = 0) -> None:
    """Every draw is inside the support, is the reference's draw under the same noise (draws at
    output position ``index``), and the counts fit ``probs`` (chi-square at a 1e-4 false-alarm rate)."""
    support = probs > 0
    assert bool(support[tokens].all()), "a token outside the allowed set was drawn"
    wrong = race_mismatches(tokens, probs, first_seed, index)
    assert wrong == 0, f"{wrong} of {len(tokens)} draws differ from the reference distribution's"
    chi2, df = chi2_statistic(tokens, probs)
    if df >= 1:
        assert chi2 < chi2_critical(df), f"chi2 {chi2:.1f} >= {chi2_critical(df):.1f} ({df} degrees of freedom)"


def renormalized(probs: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    out = torch.where(kept, probs, torch.zeros_like(probs))
    return out / out.sum()


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_draws_stay_in_the_top_k_and_follow_the_distribution(k):
    row, t = logits_row(k), 1.3
    tokens = draw(row, temperature=t, top_k=k)
    top = torch.zeros(V, dtype=torch.bool)
    top[row.topk(k).indices] = True
    assert set(tokens.tolist()) <= set(torch.nonzero(top).flatten().tolist())
    assert_fits(tokens, renormalized((row / t).softmax(-1), top))


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.95])
def test_top_p_draws_stay_in_the_nucleus(top_p):
    row, t = logits_row(1), 0.8
    probs = (row / t).softmax(-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = torch.zeros(V, dtype=torch.bool)
    nucleus[order[mass_before < top_p]] = True  # the smallest prefix whose mass reaches top_p
    tokens = draw(row, temperature=t, top_p=top_p)
    assert_fits(tokens, renormalized(probs, nucleus))


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_draws_are_at_least_min_p_times_the_best(min_p):
    row, t = logits_row(2), 1.0
    probs = (row / t).softmax(-1)
    kept = probs >= min_p * probs.max()
    assert 1 < int(kept.sum()) < V
    assert_fits(draw(row, temperature=t, min_p=min_p), renormalized(probs, kept))


@pytest.mark.parametrize("t", [0.5, 1.0, 2.0])
def test_temperature_samples_softmax_of_scaled_logits(t):
    row = logits_row(3, scale=1.0)
    assert_fits(draw(row, temperature=t), (row / t).softmax(-1))


def test_the_fit_checks_detect_a_small_error():
    """The checks have power: draws at a temperature 1% off fail the exact check by many draws, and
    the chi-square bound alone rejects a 10% error at the 4,000 draws the tests use."""
    row, t = logits_row(0), 1.0
    probs = (row / t).softmax(-1)
    assert race_mismatches(draw(row, temperature=t), probs, FIRST_SEED) == 0
    assert race_mismatches(draw(row, temperature=t * 1.01), probs, FIRST_SEED) >= 10
    chi2, df = chi2_statistic(draw(row, temperature=t * 1.10), probs)
    assert chi2 > chi2_critical(df)


def test_temperature_zero_is_greedy_whatever_else_is_set():
    rows = torch.stack([logits_row(s) for s in range(6)])
    seqs = [seq(s, temperature=0.0, top_k=5, top_p=0.3, min_p=0.2, seed=s) for s in range(6)]
    assert Sampler(frozenset())(rows, seqs).token_ids == rows.argmax(-1).tolist()
    # a vanishing temperature concentrates sampling on the argmax too
    assert set(draw(logits_row(4), n=200, temperature=1e-4).tolist()) == {int(logits_row(4).argmax())}


def reference_logits(row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """The specification, written out: logit bias, then repetition penalty over prompt and output
    tokens (divide positive logits, multiply negative ones), then frequency and presence penalties
    over output tokens (``-= f * count + p * (count > 0)``)."""
    out = row.clone()
    for tok, bias in p.logit_bias.items():
        out[tok] += bias
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / p.repetition_penalty if out[tok] > 0 else out[tok] * p.repetition_penalty
    for tok in set(output):
        c = output.count(tok)
        out[tok] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_penalties_and_bias_change_the_logits_as_specified():
    g = torch.Generator().manual_seed(5)
    rows, seqs, refs = [], [], []
    for i in range(300):
        row = torch.randn(V, generator=g) * 2
        prompt = torch.randint(0, V, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(0, V, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
        params = dict(temperature=0.0, repetition_penalty=float(torch.empty(1).uniform_(0.5, 2.0, generator=g)),
                      frequency_penalty=float(torch.empty(1).uniform_(-2, 2, generator=g)),
                      presence_penalty=float(torch.empty(1).uniform_(-2, 2, generator=g)),
                      logit_bias={int(torch.randint(0, V, (1,), generator=g)): float(torch.randn(1, generator=g) * 3)})
        s = seq(i, prompt=prompt, output=output, **params)
        rows.append(row)
        seqs.append(s)
        refs.append(reference_logits(row, prompt, output, s.params))
    refs_t = torch.stack(refs)
    top2 = refs_t.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4  # skip exact ties (none expected)
    got = torch.tensor(Sampler(frozenset())(torch.stack(rows), seqs).token_ids)
    assert bool((got == refs_t.argmax(-1))[clear].all())
    assert int(clear.sum()) > 290
    # and under sampling the draws follow softmax(processed logits / T)
    row, prompt, output = logits_row(6, scale=1.0), [3, 4, 5], [5, 5, 7, 9]
    params = dict(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.5,
                  logit_bias={11: 1.5, 4: -2.0})
    seqs = [seq(20_000 + i, prompt=prompt, output=output, **params) for i in range(DRAWS)]
    tokens = torch.tensor(Sampler(frozenset())(row.expand(DRAWS, -1).clone(), seqs).token_ids)
    ref = reference_logits(row, prompt, output, seqs[0].params)
    assert_fits(tokens, (ref / 0.9).softmax(-1), first_seed=20_000, index=len(output))


def test_same_seed_same_draws_and_different_seeds_differ():
    row = logits_row(7, scale=0.5)
    sampler = Sampler(frozenset())

    def run(s: int) -> list[int]:
        sq = seq(s, temperature=1.0, seed=s)
        for _ in range(50):  # each draw at the next output position
            sq.output_ids.append(sampler(row[None], [sq]).token_ids[0])
        return sq.output_ids

    assert run(42) == run(42)
    assert run(42) != run(43)


# ---- through the engine ------------------------------------------------------------------
def test_seeded_output_ignores_neighbours_chunking_and_preemption(new_engine, tiny_model):
    p = [5, 9, 14, 2, 30, 7, 7, 19, 3, 11, 25, 4]
    seeded = dict(temperature=1.2, top_p=0.95, seed=777, max_tokens=40, ignore_eos=True)
    alone = generate(new_engine(tiny_model, kv_cache_backend="paged"), [make_request("s", p, **seeded)])
    per_block = tiny_model.kv_cache_spec().bytes_per_token(torch.float32) * 16
    tight = new_engine(tiny_model, kv_cache_backend="paged", block_size=16, max_num_batched_tokens=5,
                       kv_cache_memory_gib=7 * per_block / 2**30, enable_prefix_cache=False)
    others = [make_request(f"o{i}", [i + 1] * (6 + 3 * i), temperature=1.0, max_tokens=40, ignore_eos=True)
              for i in range(3)]
    crowded = generate(tight, [others[0], make_request("s", p, **seeded), *others[1:]])
    assert tight.counters.num_preemptions > 0  # the seeded request ran through preemption and chunked prefill
    assert crowded.tokens["s"] == alone.tokens["s"]
    assert crowded.text["s"] == alone.text["s"]


def test_logit_bias_outside_the_vocabulary_is_rejected(new_engine, tiny_model):
    eng = new_engine(tiny_model)
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(make_request("b", [1, 2], logit_bias={tiny_model.vocab_size: 5.0}))
    assert err.value.param == "logit_bias"
    eng.add_request(make_request("ok", [1, 2], logit_bias={tiny_model.vocab_size - 1: 5.0}, max_tokens=2))
    assert len(run_to_completion(eng).tokens["ok"]) >= 1
