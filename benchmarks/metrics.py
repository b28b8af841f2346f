"""A served gateway's Prometheus ``/metrics`` as samples, for the benchmarks that read it.

``parse`` turns the text into ``{sample name: [(labels, value), ...]}``; ``total`` sums one sample
over the label sets that include the given labels; ``histogram_quantile`` reads a quantile off
cumulative buckets the way Prometheus does; ``router_reasons`` counts the gateway's routing decisions
by reason.
"""

from __future__ import annotations

import math


def parse(text: str) -> dict[str, list[tuple[dict, float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def scrape(base_url: str) -> dict[str, list[tuple[dict, float]]]:
    """``parse`` of ``base_url``'s ``/metrics``."""
    import httpx

    return parse(httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text)


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
    return sum(v for lb, v in samples.get(name, []) if all(lb.get(k) == x for k, x in labels.items()))


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus-style quantile from cumulative ``(upper bound, count)`` buckets (linear inside one)."""
    buckets = sorted(buckets)
    count_all = buckets[-1][1] if buckets else 0
    if not count_all:
        return math.nan
    rank, lo, prev = q * count_all, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lo
            return lo + (le - lo) * ((rank - prev) / (count - prev) if count > prev else 1.0)
        lo, prev = le, count
    return lo


def router_reasons(metrics_text: str) -> dict[str, int]:
    """Requests per routing reason (``xllm:router_requests_total``), summed over instances."""
    out: dict[str, int] = {}
    for labels, value in parse(metrics_text).get("xllm:router_requests_total", []):
        key = labels.get("reason", "?")
        out[key] = out.get(key, 0) + int(value)
    return dict(sorted(out.items()))
