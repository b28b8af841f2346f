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
