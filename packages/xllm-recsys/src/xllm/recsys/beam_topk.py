"""Beam candidate selection with a min-heap and early termination (xLLM §4.5.1).

Each of the ``beam_width`` beams offers candidates whose log-probs are sorted
in descending order. The best ``beam_width`` (beam score + candidate log-prob)
are kept in a min-heap; scanning a beam's candidates stops at the first one
that cannot beat the heap's minimum, since every later one is smaller.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, order=True)
class BeamCandidate:
    score: float
    beam: int
    rank: int  # index into that beam's sorted candidates


def beam_topk(beam_scores: Sequence[float], candidate_logprobs: Sequence[Sequence[float]],
              beam_width: int) -> tuple[list[BeamCandidate], int]:
    """Top ``beam_width`` candidates by total score, best first.

    ``candidate_logprobs[b]`` must be sorted descending. Returns the
    candidates and the number of candidates examined (to show the saving of
    early termination over ``sum(len(c))``).
    """
    if beam_width < 1:
        raise ValueError(f"beam_width must be >= 1, got {beam_width}")
    if len(beam_scores) != len(candidate_logprobs):
        raise ValueError("one candidate list per beam is required")
    heap: list[tuple[float, int, int]] = []  # (score, -beam, -rank): ties keep the earlier beam/rank
    examined = 0
    for b, (base, cands) in enumerate(zip(beam_scores, candidate_logprobs)):
        prev = float("inf")
        for r, lp in enumerate(cands):
            if lp > prev:
                raise ValueError(f"candidate log-probs of beam {b} are not sorted descending")
            prev = lp
            examined += 1
            score = base + lp
            entry = (score, -b, -r)
            if len(heap) < beam_width:
                heapq.heappush(heap, entry)
            elif entry > heap[0]:
                heapq.heapreplace(heap, entry)
            else:
                break  # every later candidate of this beam scores lower still
    best = sorted(heap, reverse=True)
    return [BeamCandidate(s, -nb, -nr) for s, nb, nr in best], examined


@dataclass(frozen=True)
class TopCandidates:
    """The best candidates of one beam step, best first (tensors of one length ``M``).

    ``scores`` are beam score + candidate log-prob, ``beams`` the beam each extends and ``cols`` the
    column of the candidate in its beam's row of the candidate matrix. ``scanned`` counts the
    candidates a heap scan over the per-beam sorted lists examines before every beam stops: per beam,
    those scoring above the final heap minimum plus the one that stops it (bounded by its list)."""

    scores: torch.Tensor  # float32 [M]
    beams: torch.Tensor   # int64 [M]
    cols: torch.Tensor    # int64 [M]
    scanned: int


def topk_candidates(beam_scores: torch.Tensor, cand_logprobs: torch.Tensor, keep: int,
                    per_beam: int | None = None, row_offsets: torch.Tensor | None = None) -> TopCandidates:
    """The ``keep`` best (beam score + log-prob) over beams x candidates, best first; ``-inf``
    candidates (masked, padding) are never returned, so ``M`` may be less than ``keep``.

    Two torch passes instead of a Python heap: each beam's ``k = min(keep, per_beam, C)`` best
    candidates (``topk`` per row, sorted), then the ``keep`` best of those ``B x k`` totals. Equal to
    one ``topk`` over all ``B x C`` totals (a candidate outside its beam's top ``keep`` has ``keep``
    better ones in that beam alone) when ``per_beam`` does not cut; with ``per_beam`` it is xLLM's
    top-k per beam. ``cand_logprobs`` is ``[B, C]``, ``beam_scores`` ``[B]``; ``row_offsets`` (``[B]``)
    is subtracted from each row first (pass raw logits and their log-sum-exp: the log-softmax is then
    computed for the ``k`` survivors only, never written for the whole row).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    rows, width = cand_logprobs.shape
    k = min(keep, width, per_beam or width)
    vals, cols = cand_logprobs.topk(k, dim=1)  # sorted descending per beam
    if row_offsets is not None:
        vals = vals - row_offsets.to(vals.dtype)[:, None]
    total = beam_scores.to(vals.dtype)[:, None] + vals
    m = min(keep, rows * k)
    best, flat = total.reshape(-1).topk(m)
    finite = int(torch.isfinite(best).sum())
    best, flat = best[:finite], flat[:finite]
    if finite == keep:
        scanned = int(torch.clamp((total > best[-1]).sum(dim=1) + 1, max=k).sum())
    else:
        scanned = int(torch.isfinite(total).sum())  # the heap never filled: every candidate examined
    return TopCandidates(best.float(), flat // k, cols.reshape(-1)[flat], scanned)
