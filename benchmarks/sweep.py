"""Search for the highest request rate at which an SLO attainment target still holds.

Attainment falls (roughly monotonically) as the rate grows. The search brackets the boundary by
doubling up (or halving down) from a start rate, then bisects until the bracket is within a relative
tolerance or the evaluation budget is spent. Each evaluation is one benchmark run, so budgets are small.
Pure Python; the evaluation function is injected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class SweepResult:
    best_rate: float | None          # highest rate seen that met the target (None: even the lowest failed)
    first_failing_rate: float | None  # lowest rate seen that missed it (None: never missed up to max_rate)
    target: float
    points: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment), evaluation order

    @property
    def sorted_points(self) -> list[tuple[float, float]]:
        return sorted(self.points)


def find_max_rate(evaluate: Callable[[float], float], target: float, start: float = 1.0, *,
                  min_rate: float = 0.05, max_rate: float = 256.0, rel_tol: float = 0.15,
                  max_evals: int = 8) -> SweepResult:
    """Highest rate (requests/s) with ``evaluate(rate) >= target``, to within ``rel_tol`` of the boundary.

    ``evaluate`` runs the benchmark at a rate and returns the SLO attainment in [0, 1].
    Stops after ``max_evals`` evaluations whatever the bracket.
    """
    if not 0 < target <= 1:
        raise ValueError(f"target attainment must be in (0, 1], got {target}")
    if not 0 < min_rate <= start <= max_rate:
        raise ValueError(f"need 0 < min_rate <= start <= max_rate, got {min_rate}, {start}, {max_rate}")
    if max_evals < 1 or rel_tol <= 0:
        raise ValueError("max_evals must be >= 1 and rel_tol > 0")
    result = SweepResult(None, None, target)
    cache: dict[float, float] = {}

    def ok(rate: float) -> bool:
        if rate not in cache:
            cache[rate] = evaluate(rate)
            result.points.append((rate, cache[rate]))
        return cache[rate] >= target

    def spent() -> bool:
        return len(result.points) >= max_evals

    rate = start
    if ok(rate):
        result.best_rate = rate
        while not spent() and rate < max_rate:       # double up until a miss
            rate = min(rate * 2, max_rate)
            if ok(rate):
                result.best_rate = rate
            else:
                result.first_failing_rate = rate
                break
    else:
        result.first_failing_rate = rate
        while not spent() and rate > min_rate:       # halve down until a pass
            rate = max(rate / 2, min_rate)
            if ok(rate):
                result.best_rate = rate
                break
            result.first_failing_rate = rate
    lo, hi = result.best_rate, result.first_failing_rate
    while lo is not None and hi is not None and not spent() and (hi - lo) > rel_tol * lo:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = result.best_rate = mid
        else:
            hi = result.first_failing_rate = mid
    return result
