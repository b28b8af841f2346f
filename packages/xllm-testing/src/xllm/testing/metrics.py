"""Reading a Prometheus ``/metrics`` scrape in tests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> ``{sample name: [(labels, value), ...]}``."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def metric_value(samples: dict, name: str, missing_ok: bool = False, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``.

    KeyError if there is none, unless ``missing_ok`` (then 0: a labelled series appears on first use).
    """
    rows = [v for lb, v in samples.get(name, []) if all(lb.get(k) == want for k, want in labels.items())]
    if not rows:
        if missing_ok:
            return 0.0
        raise KeyError(f"{name}{labels}")
    return sum(rows)
