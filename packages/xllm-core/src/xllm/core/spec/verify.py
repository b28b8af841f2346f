"""Verification of draft tokens: which of a sequence's drafts its target model accepts.

Every proposer's draft distribution ``q`` is a point mass on its draft ``d``. Standard rejection
sampling (Leviathan et al.; vLLM's rejection sampler) then accepts ``d`` with probability
``min(1, p(d)/q(d)) = p(d)`` and on rejection samples the residual ``norm(max(0, p - q))`` = ``p``
without ``d``, renormalised. The engine's sampler draws output position ``i`` by an exponential
race keyed by ``(seed, i)`` (:func:`xllm.kernels.sampling.sample_from_probs`): token
``x = argmax p/E``. Accepting ``d`` exactly when ``x == d`` happens with probability ``p(d)``, and
given ``x != d``, ``x`` is distributed as ``p`` without ``d`` renormalised: the residual. So the
verifier draws every row's token as the non-speculative sampler would (same key, same
processing) and accepts the drafts while they equal those tokens; the first differing token is
the residual sample, and if all ``k`` are accepted the last row's token is the bonus token.
Greedy requests get the argmax at each position; sampled ones the same tokens as without
speculation for the same seed (up to the numerics of computing k+1 rows in one forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xllm.core.sampler import Sampler
from xllm.core.sequence import Sequence


@dataclass
class Verified:
    """One sequence's verified run: ``tokens`` (the accepted drafts, then the target's own token),
    their logprob entries (as :class:`~xllm.core.sampler.SampleResult` has them), and how many of
    ``num_drafts`` drafts were accepted (``len(tokens) - 1``)."""

    seq: Sequence
    tokens: list[int]
    logprobs: list
    num_drafts: int

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


def accepted_prefix(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def verify(sampler: Sampler, logits: torch.Tensor, spans: list[tuple[Sequence, list[int]]]) -> list[Verified]:
    """``logits`` holds, per ``(seq, drafts)`` of ``spans`` in order, ``len(drafts) + 1`` rows: the
    rows of the sequence's last known token and of each draft. Row ``j`` is drawn as output position
    ``seq.num_output_tokens() + j`` would be without speculation."""
    seqs: list[Sequence] = []
    offsets: list[int] = []
    for seq, drafts in spans:
        seqs.extend([seq] * (len(drafts) + 1))
        offsets.extend(range(len(drafts) + 1))
    result = sampler(logits, seqs, offsets=offsets)
    out = []
    row = 0
    for seq, drafts in spans:
        n = len(drafts) + 1
        tokens = result.token_ids[row:row + n]
        a = accepted_prefix(drafts, tokens)
        out.append(Verified(seq, tokens[:a + 1], result.logprobs[row:row + a + 1], len(drafts)))
        row += n
    return out
