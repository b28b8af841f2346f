"""Per-step sampling over a batch with per-request parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xllm.core.grammar import PendingMasks
from xllm.core.sequence import Sequence
from xllm.kernels.sampling import (
    apply_frequency_presence_penalties,
    apply_repetition_penalty,
    apply_top_k_top_p_min_p,
    argmax_rows,
    draw_generator,
    sample_from_probs,
)


@dataclass
class SampleResult:
    """Chosen tokens plus, for requests that asked, logprob information.

    ``logprobs[i]`` is ``None`` or ``(chosen_logprob, [(token, logprob), ...])``
    with the top alternatives, from the model's raw distribution.
    """

    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    """Applies each sequence's logit processors and draws its next token.

    Order: logit bias, penalties, min-tokens masking, the grammar's mask (constrained decoding:
    :mod:`xllm.core.grammar`), then greedy argmax or
    temperature -> top-k -> top-p -> min-p -> seeded categorical draw. The draw of a
    sequence's output position ``i`` uses a generator keyed by ``(seed, i)``
    (:func:`xllm.kernels.sampling.draw_generator`), so it is the same on any instance and
    after any preemption, resume or hand-off. Called when each sequence's next token is the
    one being drawn (its known outputs, earlier runs' included, are ``num_output_tokens()``).
    """

    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = eos_token_ids

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], masks: PendingMasks | None = None,
                 offsets: list[int] | None = None) -> SampleResult:
        """``offsets[i]`` (speculative verification: :mod:`xllm.core.spec.verify`): row ``i`` is drawn
        as output position ``seqs[i].num_output_tokens() + offsets[i]`` (default 0)."""
        params = [s.params for s in seqs]
        want_lp = [p.logprobs or p.top_logprobs > 0 for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        processed = self._process(logits, seqs)
        if masks is not None:  # constrained rows: only tokens their grammar allows
            constrained = masks.apply(processed)
            # min_tokens may ban the EOS a finished grammar needs (nothing else can empty a row): the grammar wins
            risky = [r for r in masks.rows.tolist() if seqs[r].num_output_tokens() < params[r].min_tokens]
            if risky:
                rows = torch.tensor(risky, dtype=torch.long)
                dead = rows[torch.isinf(constrained[rows]).all(dim=-1)]
                if len(dead):
                    constrained[dead] = masks.apply(logits)[dead]
            processed = constrained
        logits = processed
        greedy = torch.tensor([p.greedy for p in params])
        chosen = argmax_rows(logits)
        if not bool(greedy.all()):
            temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=logits.dtype)
            scaled = logits / temps.unsqueeze(1)
            top_k = torch.tensor([p.top_k for p in params]) if any(p.top_k for p in params) else None
            top_p = torch.tensor([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None
            min_p = torch.tensor([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None
            scaled = apply_top_k_top_p_min_p(scaled, top_k, top_p, min_p)
            probs = scaled.softmax(dim=-1)
            offs = offsets or [0] * len(seqs)
            gens = [None if p.greedy else draw_generator(s.seed, s.num_output_tokens() + o)
                    for s, p, o in zip(seqs, params, offs)]
            sampled = sample_from_probs(probs, gens)
            chosen = torch.where(greedy, chosen, sampled)
        token_ids = chosen.tolist()
        out_lp: list = [None] * len(seqs)
        if raw_logprobs is not None:
            for i, p in enumerate(params):
                if not want_lp[i]:
                    continue
                row = raw_logprobs[i]
                top: list[tuple[int, float]] = []
                if p.top_logprobs:
                    vals, idx = row.topk(p.top_logprobs)
                    top = list(zip(idx.tolist(), vals.tolist()))
                out_lp[i] = (float(row[token_ids[i]]), top)
        return SampleResult(token_ids, out_lp)

    @staticmethod
    def plain_greedy(seqs: list[Sequence]) -> bool:
        """Whether :meth:`__call__` (without grammar masks) returns the argmax of the raw logits for every
        one of ``seqs`` and no logprobs: greedy, no logit bias, no penalties, past ``min_tokens`` (nothing
        masked), no beam search. Such a step needs the tokens alone (:class:`SampleResult` from
        :meth:`greedy_result`), which a model's greedy head gives without writing the logits."""
        for s in seqs:
            p = s.params
            if (not p.greedy or p.logprobs or p.top_logprobs or p.logit_bias or p.needs_penalties
                    or s.num_output_tokens() < p.min_tokens or p.beam_width is not None):
                return False
        return bool(seqs)

    @staticmethod
    def greedy_result(tokens: torch.Tensor) -> SampleResult:
        """The result of a :meth:`plain_greedy` step whose argmax tokens are ``tokens``."""
        ids = tokens.tolist()
        return SampleResult(ids, [None] * len(ids))

    def _process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        vocab = logits.shape[-1]
        rows_bias = [(i, s.params.logit_bias) for i, s in enumerate(seqs) if s.params.logit_bias]
        if rows_bias:
            logits = logits.clone()
            for i, bias in rows_bias:
                ids = torch.tensor([t for t in bias if 0 <= t < vocab], dtype=torch.long)
                vals = torch.tensor([bias[t] for t in bias if 0 <= t < vocab], dtype=logits.dtype)
                logits[i].index_add_(0, ids, vals)
        if any(s.params.needs_penalties for s in seqs):
            logits = self._penalties(logits, seqs)
        masked = [(i, s) for i, s in enumerate(seqs) if s.num_output_tokens() < s.params.min_tokens]
        if masked:
            logits = logits.clone()
            for i, s in masked:
                banned = set(s.params.stop_token_ids)
                if not s.params.ignore_eos:
                    banned |= self.eos_token_ids
                if banned:
                    logits[i, sorted(t for t in banned if 0 <= t < vocab)] = float("-inf")
        return logits

    @staticmethod
    def _penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        b, vocab = logits.shape
        counts = torch.zeros(b, vocab, dtype=torch.int32)
        seen = torch.zeros(b, vocab, dtype=torch.bool)
        for i, s in enumerate(seqs):
            generated = s.all_output_ids()
            if generated:
                out = torch.tensor(generated, dtype=torch.long)
                counts[i].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
            if s.params.repetition_penalty != 1.0:
                seen[i, torch.tensor(s.prompt_ids, dtype=torch.long)] = True
        seen |= counts > 0
        rep = torch.tensor([s.params.repetition_penalty for s in seqs], dtype=logits.dtype)
        freq = torch.tensor([s.params.frequency_penalty for s in seqs], dtype=logits.dtype)
        pres = torch.tensor([s.params.presence_penalty for s in seqs], dtype=logits.dtype)
        logits = apply_repetition_penalty(logits, seen, rep)
        return apply_frequency_presence_penalties(logits, counts, freq, pres)


@torch.inference_mode()
def prompt_logprobs(logits: torch.Tensor, spans: list[tuple[Sequence, int, int]]
                    ) -> list[tuple[Sequence, int, list[tuple[int, float, list[tuple[int, float]]]]]]:
    """Teacher-forced prompt logprobs from the model's raw distribution: ``logits`` holds, for each
    ``(seq, first, count)`` of ``spans`` in order, the rows of positions ``first..first+count-1``;
    row ``p`` scores prompt token ``p + 1``. Returns ``(seq, first, [(token, logprob, top)])``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    row = 0
    for seq, first, count in spans:
        rows = lp[row:row + count]
        targets = torch.tensor(seq.prompt_ids[first + 1:first + 1 + count], dtype=torch.long)
        chosen = rows.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        k = seq.params.prompt_logprobs or 0
        if k:
            vals, idx = rows.topk(k, dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
        else:
            tops = [[] for _ in range(count)]
        out.append((seq, first, list(zip(targets.tolist(), chosen, tops, strict=True))))
        row += count
    return out
