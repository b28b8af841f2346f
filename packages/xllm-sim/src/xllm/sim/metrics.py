"""Per-request records and the run's report: throughput, TTFT/TPOT/E2E percentiles, SLO
attainment, goodput, offline throughput, role flips and per-instance utilisation.

Definitions follow ``benchmarks/stats.py`` (the live benchmarks'), so simulated and measured runs
compare figure for figure: percentiles interpolate linearly between order statistics (numpy's
default); TTFT is arrival → first token, E2E arrival → last token, TPOT (E2E − TTFT) / (output − 1)
(none for one-token outputs, which meet a TPOT objective trivially); SLO attainment and goodput
count online requests only; the duration is first arrival → last finish.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from xllm.sim.trace import RequestSpec

PERCENTILES = (50, 90, 99)


class Request:
    """One request's life in the simulation (times in simulated seconds)."""

    __slots__ = ("block_size", "decode_instance", "encoded", "finish", "first_token", "instance", "matched_tokens",
                 "moves", "preemptions", "priority", "spec", "transfer_bytes")

    def __init__(self, spec: RequestSpec, block_size: int, priority: int) -> None:
        self.spec = spec
        self.block_size = block_size
        self.priority = priority
        self.instance = ""          # where it was prefilled (mixed: where it ran)
        self.decode_instance = ""   # PD: where it decoded
        self.first_token: float | None = None
        self.finish: float | None = None
        self.preemptions = 0
        self.moves = 0
        self.matched_tokens = 0     # prompt tokens the routed instance held (the gateway's match)
        self.transfer_bytes = 0
        self.encoded = False        # EPD: its images were encoded on another instance (e+p+d, ed+p)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.spec.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.spec.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None or self.spec.output_len < 2:
            return None
        return (self.finish - self.first_token) / (self.spec.output_len - 1)

    def meets(self, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
        if self.finish is None:
            return False
        if slo_ttft_s is not None and self.ttft > slo_ttft_s:
            return False
        tpot = self.tpot
        return not (slo_tpot_s is not None and tpot is not None and tpot > slo_tpot_s)

    def to_dict(self) -> dict:
        s = self.spec
        return {"rid": s.rid, "arrival": s.arrival, "prompt_len": s.prompt_len, "output_len": s.output_len,
                "offline": s.offline, "prefix_group": s.prefix_group, "instance": self.instance,
                "decode_instance": self.decode_instance, "ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e,
                "preemptions": self.preemptions, "moves": self.moves, "matched_tokens": self.matched_tokens}


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear interpolation (numpy's default); NaN for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict:
    xs = [v * scale for v in values]
    out = {"n": len(xs), "mean": math.fsum(xs) / len(xs) if xs else math.nan}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(xs, p)
    return out


@dataclass
class InstanceReport:
    instance_id: str
    role: str
    utilisation: float
    steps: int
    prefill_tokens: int
    decode_tokens: int
    preemptions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    role_flips: int
    encoded_images: int = 0


def report(requests: Sequence[Request], instances: Sequence[InstanceReport], slo_ttft_s: float | None,
           slo_tpot_s: float | None, role_flips: Sequence[dict] = (), extra: dict | None = None) -> dict:
    """The run's figures (JSON-ready; latencies in ms)."""
    done = [r for r in requests if r.finish is not None]
    start = min((r.spec.arrival for r in requests), default=0.0)
    end = max((r.finish for r in done), default=start)
    duration = max(end - start, 1e-9)
    online = [r for r in done if not r.spec.offline]
    offline = [r for r in done if r.spec.offline]
    online_all = [r for r in requests if not r.spec.offline]
    good = sum(r.meets(slo_ttft_s, slo_tpot_s) for r in online_all)
    out_tokens = sum(r.spec.output_len for r in done)

    def latencies(rs: Sequence[Request]) -> dict:
        return {"ttft_ms": summarize([r.ttft for r in rs], 1e3),
                "tpot_ms": summarize([t for r in rs if (t := r.tpot) is not None], 1e3),
                "e2e_ms": summarize([r.e2e for r in rs], 1e3)}

    queries = sum(r.spec.prompt_len for r in requests)
    hits = sum(i.prefix_hit_tokens for i in instances)
    out = {
        "requests": len(requests), "completed": len(done), "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_throughput": (out_tokens + sum(r.spec.prompt_len for r in done)) / duration,
        **latencies(online),
        "slo": {"ttft_ms": None if slo_ttft_s is None else slo_ttft_s * 1e3,
                "tpot_ms": None if slo_tpot_s is None else slo_tpot_s * 1e3},
        "slo_attainment": good / len(online_all) if online_all else math.nan,
        "goodput": good / duration,
        "online": {"requests": len(online_all), "completed": len(online),
                   "output_throughput": sum(r.spec.output_len for r in online) / duration},
        "offline": {"requests": sum(r.spec.offline for r in requests), "completed": len(offline),
                    "output_throughput": sum(r.spec.output_len for r in offline) / duration,
                    **latencies(offline)},
        "preemptions": sum(r.preemptions for r in requests),
        "moves": sum(r.moves for r in requests),
        "prefix_hit_rate": hits / asked if (asked := sum(i.prefix_query_tokens for i in instances)) else 0.0,
        "routed_match_rate": sum(min(r.matched_tokens, r.spec.prompt_len) for r in requests) / queries
        if queries else 0.0,
        "kv_transfer_bytes": sum(r.transfer_bytes for r in requests),
        "role_flips": len(role_flips),
        "role_flip_log": list(role_flips),
        "utilisation": {"mean": math.fsum(i.utilisation for i in instances) / len(instances) if instances else 0.0,
                        "min": min((i.utilisation for i in instances), default=0.0),
                        "max": max((i.utilisation for i in instances), default=0.0)},
        "instances": [vars(i) for i in instances],
    }
    if extra:
        out.update(extra)
    return out
