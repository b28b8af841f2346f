"""What a decode step costs by its number of rows, learned from the engine's own steps, and the
choice of how many drafts each speculating sequence gets (:func:`plan_drafts`).

Verifying k drafts makes a decoding sequence's chunk k+1 rows. Whether that pays depends on the
hardware, the model and the kernels: on the 2-core Zen 4 of docs/performance.md a SmolLM2 step of 8
rows costs ~1.2x one row through the fused decode kernel, but when its projections were the
row-streaming GEMV a 4-row step cost ~1.65x (compute-bound there), and 3 drafts accepted at 80 %
lost to 2; a step of more rows than the decode kernel takes runs the general step, dearer again.
:class:`StepCosts` keeps the last measured forward + sampling seconds of the steps made of decode
rows and verify chunks only, by row count, and estimates each count by their lower quartile (a step
slowed by another process on the cores does not make its row count look dear for long); row counts
never seen are estimated optimistically from the nearest smaller count seen (so they get tried), and a
count seen fewer than :data:`SETTLED` times by the lower of its measurements and that optimistic
estimate: the first step of a row count pays one-off costs (SmolLM2's first 4-row verify step
measured 94-149 ms, later ones 15 ms, one row 15 ms), and judged on that alone the count and every
larger one looked dear for good, so speculation never ran again (seen in CI).

Drafting has a price of its own where the proposer runs a model (``self``, ``draft``, ``mtp``: a
forward of the drafter per round, batched over the drafting sequences, plus any catch-up):
:class:`DraftCosts` learns the proposer's seconds per round from its calls, and the plan charges a
step the rounds its deepest draft needs. Without it, ``self`` on SmolLM2 (a drafter of a quarter of
the layers) was planned as if its drafts were free and ran at 0.87x of no speculation.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

WINDOW = 16          # measurements kept per row count
SETTLED = 3          # measurements after which a row count's estimate is its own
OPTIMISM = 0.05      # an unseen row count is estimated this much dearer per extra row than the last seen


@dataclass
class StepCosts:
    """Seconds of a step by its row count (decode rows + verify rows; steps with a prompt chunk are
    not counted). Engine thread only."""

    seconds: dict[int, float] = field(default_factory=dict)  # the estimate by row count
    _recent: dict[int, deque] = field(default_factory=dict)

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or not seconds > 0:
            return
        recent = self._recent.setdefault(rows, deque(maxlen=WINDOW))
        recent.append(seconds)
        self.seconds[rows] = sorted(recent)[(len(recent) - 1) // 4]

    @property
    def known(self) -> bool:
        return bool(self.seconds)

    def estimate(self, rows: int) -> float | None:
        """The learned seconds of ``rows`` rows; unseen: the nearest smaller count seen, dearer by
        :data:`OPTIMISM` per extra row (or, with only larger counts seen, the nearest of those: a
        step is never cheaper for having more rows); seen fewer than :data:`SETTLED` times: the lower
        of its measurements and that extrapolation. None before any step was seen."""
        below = [r for r in self.seconds if r < rows]
        optimistic = None
        if below:
            r = max(below)
            optimistic = self.estimate(r) * (1 + OPTIMISM * (rows - r))
        if rows in self.seconds:
            if optimistic is None or len(self._recent[rows]) >= SETTLED:
                return self.seconds[rows]
            return min(self.seconds[rows], optimistic)
        if optimistic is not None:
            return optimistic
        above = [r for r in self.seconds if r > rows]
        return self.seconds[min(above)] if above else None


@dataclass
class DraftCosts:
    """The proposer's seconds per drafting round (one draft token for each drafting sequence: the
    drafts of a step take as many rounds as its deepest sequence's), learned as the lower quartile of
    recent calls' seconds per round. Unknown (no call yet): free, so drafting gets tried, then known.
    Engine thread only."""

    per_round: float = 0.0
    _recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    def observe(self, rounds: int, seconds: float) -> None:
        if rounds < 1 or not seconds > 0:
            return
        self._recent.append(seconds / rounds)
        self.per_round = sorted(self._recent)[(len(self._recent) - 1) // 4]

    def estimate(self, rounds: int) -> float:
        return rounds * self.per_round


def plan_drafts(costs: StepCosts, base_rows: int, candidates: list[tuple[object, int, float]],
                explore: bool = False, drafting: DraftCosts | None = None) -> dict[object, int]:
    """How many drafts each candidate gets in a step of ``base_rows`` decode rows (every decoding
    sequence's own row, candidates included): ``candidates`` are ``(key, most drafts, acceptance
    probability per draft position)``. A draft that would be the (j+1)-th of its sequence adds
    ``p^(j+1)`` expected tokens (it counts only if the j before it are accepted) and one row. Gains
    fall along each sequence, so for every row count the best drafts are the most valuable ones
    overall; the plan is the row count with the most expected tokens per estimated second (the cost
    curve need not be convex: a kernel may turn compute-bound at some row count), the seconds being the
    step's and, with ``drafting``, the proposer's for as many rounds as the deepest sequence's drafts.
    ``explore``: one draft more than that (keeps the estimate of the next row count fresh). Requires
    ``costs.known``."""
    heap = [(-p, i, key, 1, k, p) for i, (key, k, p) in enumerate(candidates) if k >= 1 and p > 0]
    heapq.heapify(heap)
    order: list[object] = []  # drafts, most valuable first (a key once per draft it gets)
    tokens = float(base_rows)
    best_n, best_rate = 0, tokens / costs.estimate(base_rows)
    rounds = 0  # the deepest draft so far (drafting rounds it needs)
    while heap:
        neg_gain, i, key, j, k, p = heapq.heappop(heap)
        order.append(key)
        tokens -= neg_gain
        rounds = max(rounds, j)
        seconds = costs.estimate(base_rows + len(order)) + (drafting.estimate(rounds) if drafting else 0.0)
        rate = tokens / seconds
        if rate > best_rate:
            best_n, best_rate = len(order), rate
        if j < k:
            heapq.heappush(heap, (neg_gain * p, i, key, j + 1, k, p))
    n = min(best_n + 1, len(order)) if explore else best_n
    given: dict[object, int] = {}
    for key in order[:n]:
        given[key] = given.get(key, 0) + 1
    return given
