"""The Grafana dashboard shipped with the gateway (``assets/grafana-dashboard.json``, in the wheel): panels
over the series the gateway's ``/metrics`` exports — requests and latency per model, instances and
routing, prefill/decode disaggregation, KV tiers. Import it into Grafana with a Prometheus data source that
scrapes the gateway (``docs/observability.md``)."""

from __future__ import annotations

import importlib.resources
import json

ASSET = "assets/grafana-dashboard.json"


def dashboard() -> dict:
    """The dashboard's JSON model."""
    return json.loads(importlib.resources.files("xllm.gateway").joinpath(ASSET).read_text())


def queries(dash: dict) -> list[tuple[str, str, str]]:
    """(panel title, PromQL expression, legend) of every query in ``dash``; the template variables' queries
    (Grafana's ``label_values(...)``) come last, titled ``variable NAME``."""
    out = [(p["title"], t["expr"], t.get("legendFormat", "")) for p in dash["panels"] for t in p.get("targets", [])]
    out += [(f"variable {v['name']}", v["query"]["query"], "") for v in dash["templating"]["list"]
            if v["type"] == "query"]
    return out
