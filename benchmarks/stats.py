"""Statistics of benchmark runs: percentiles, latency summaries, SLO attainment and goodput.

Pure Python (no numpy) so the unit tests run in any venv. Latencies are seconds in
:class:`RequestRecord` and milliseconds in the summaries (the unit people read).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics.

    Same definition as ``numpy.percentile(values, q)`` (method "linear"). NaN for no values.
    """
    xs = sorted(values)
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def stdev(values: Sequence[float]) -> float:
    """Population standard deviation (numpy's default ``ddof=0``)."""
    if not values:
        return math.nan
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / len(values))


def cv(values: Sequence[float]) -> float:
    """Coefficient of variation: stdev / mean."""
    m = mean(values)
    return stdev(values) / m if m else math.nan


def summarize(values: Iterable[float], scale: float = 1.0, percentiles: Sequence[float] = PERCENTILES) -> dict:
    """mean, std, min, max and the given percentiles of ``values`` times ``scale``; count ``n``."""
    xs = [v * scale for v in values]
    out = {"n": len(xs), "mean": mean(xs), "std": stdev(xs),
           "min": min(xs) if xs else math.nan, "max": max(xs) if xs else math.nan}
    for p in percentiles:
        out[f"p{p:g}"] = percentile(xs, p)
    return out


@dataclass
class RequestRecord:
    """What one request did, as the client saw it (times in seconds)."""

    prompt_tokens: int
    output_tokens: int = 0
    success: bool = True
    ttft: float | None = None        # send -> first token
    e2e: float | None = None         # send -> last byte
    itls: list[float] = field(default_factory=list)  # gaps between successive streamed chunks
    start: float = 0.0               # send time, relative to the run's start
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if not self.success or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


@dataclass(frozen=True)
class SLO:
    """Latency objectives in milliseconds; ``None`` means no objective on that figure."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        """A request meets the SLO when it succeeded and each set objective holds.

        A one-token response has no TPOT; it meets a TPOT objective trivially.
        """
        if not r.success:
            return False
        if self.ttft_ms is not None and (r.ttft is None or r.ttft * 1e3 > self.ttft_ms):
            return False
        if self.tpot_ms is not None and r.tpot is not None and r.tpot * 1e3 > self.tpot_ms:
            return False
        return not (self.e2e_ms is not None and (r.e2e is None or r.e2e * 1e3 > self.e2e_ms))

    def describe(self) -> str:
        parts = [f"{k} <= {v:g} ms" for k, v in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms),
                                                  ("E2E", self.e2e_ms)) if v is not None]
        return ", ".join(parts) or "none"


def slo_attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """Fraction of all requests (failed ones included, as misses) that meet ``slo``."""
    if not records:
        return math.nan
    return sum(slo.met_by(r) for r in records) / len(records)


def goodput(records: Sequence[RequestRecord], slo: SLO, duration: float) -> float:
    """Requests per second that meet ``slo`` over a run of ``duration`` seconds."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    return sum(slo.met_by(r) for r in records) / duration


def serving_summary(records: Sequence[RequestRecord], duration: float, slo: SLO | None = None) -> dict:
    """Throughput, latency percentiles (ms), SLO attainment and goodput of an online run."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": summarize([r.ttft for r in ok if r.ttft is not None], 1e3),
        "tpot_ms": summarize([t for r in ok if (t := r.tpot) is not None], 1e3),
        "itl_ms": summarize([x for r in ok for x in r.itls], 1e3),
        "e2e_ms": summarize([r.e2e for r in ok if r.e2e is not None], 1e3),
    }
    tpot_p50 = summary["tpot_ms"]["p50"]
    summary["decode_tok_s_per_request"] = 1e3 / tpot_p50 if tpot_p50 and not math.isnan(tpot_p50) else math.nan
    if slo is not None:
        summary["slo"] = asdict(slo)
        summary["slo_attainment"] = slo_attainment(records, slo)
        summary["goodput"] = goodput(records, slo, duration)
    errors = sorted({r.error for r in records if r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def offline_summary(prompt_tokens: int, output_tokens: int, elapsed: float, step_latencies: Sequence[float],
                    requests: int) -> dict:
    """Throughput and step latency (ms) of an offline run."""
    if elapsed <= 0:
        raise ValueError(f"elapsed must be > 0, got {elapsed}")
    return {
        "requests": requests,
        "elapsed_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": requests / elapsed,
        "output_throughput": output_tokens / elapsed,
        "total_throughput": (prompt_tokens + output_tokens) / elapsed,
        "step_ms": summarize(step_latencies, 1e3),
    }
