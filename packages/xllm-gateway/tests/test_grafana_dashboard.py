"""The Grafana dashboard shipped with the gateway (:mod:`xllm.gateway.grafana`): every
query names a series the gateway exports, with labels that series has (oracle: the metric families the
gateway's metrics classes register, read back through ``prometheus_client``'s own collection, not a list
kept by hand). ``integration_tests/test_cluster_local.py`` runs every query against a real Prometheus."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry

from xllm.gateway.grafana import dashboard, queries
from xllm.gateway.kv_tier_metrics import KVTierCollector
from xllm.gateway.metrics import (
    EngineMetrics,
    HttpMetrics,
    MoveMetrics,
    PDMetrics,
    PDRoleMetrics,
    RegistryMetrics,
    RouterMetrics,
)

SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "summary": ("", "_sum", "_count", "_created")}
METRIC = re.compile(r"(xllm:[A-Za-z0-9_:]+)(\{[^}]*\})?")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def exported() -> dict[str, set[str]]:
    """Every series name the gateway's metrics can export -> its label names (``le`` on buckets)."""
    registry = CollectorRegistry()
    EngineMetrics(registry)
    for cls in (RouterMetrics, MoveMetrics, PDMetrics, PDRoleMetrics, RegistryMetrics, HttpMetrics):
        cls(registry)
    registry.register(KVTierCollector(lambda: []))
    names: dict[str, set[str]] = {}
    for family in registry.collect():
        labels = set(getattr(family, "_labelnames", ()) or ())
        for child in _children(registry, family.name):
            labels |= child
        for suffix in SUFFIXES[family.type]:
            names[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return names


def _children(registry: CollectorRegistry, name: str) -> list[set[str]]:
    """Label names of ``name``'s collector (a labelled metric without children exports none yet)."""
    collector = registry._names_to_collectors.get(name) or registry._names_to_collectors.get(name + "_total")
    labels = getattr(collector, "_labelnames", None)
    if labels is not None:
        return [set(labels)]
    if isinstance(collector, KVTierCollector):
        return [{"model_name", "instance", "tier"}]
    return []


def test_the_dashboard_is_grafana_json_with_panels_and_a_model_variable():
    dash = dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    assert {"Requests and latency (per model)", "Prefill / decode disaggregation", "KV tiers"} <= \
        {p["title"] for p in dash["panels"] if p["type"] == "row"}
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "model"]
    assert len(queries(dash)) > 40
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(("title", "expr", "legend"), queries(dashboard()))
def test_every_query_names_an_exported_series_with_its_labels(title, expr, legend):
    series = exported()
    used = METRIC.findall(expr)
    assert used, f"{title}: {expr} names no xllm series"
    labels: set[str] = set()
    for name, selector in used:
        assert name in series, f"{title}: {name} is not exported by the gateway"
        labels |= series[name]
        for label, _ in MATCHER.findall(selector or ""):
            assert label in series[name], f"{title}: {name} has no label {label!r} (it has {sorted(series[name])})"
    for group in GROUPING.findall(expr):
        for label in filter(None, (x.strip() for x in group.split(","))):
            assert label in labels, f"{title}: grouping by {label!r}, which none of {[n for n, _ in used]} has"
    kept = _kept_labels(expr, labels)
    for name in re.findall(r"\{\{(\w+)\}\}", legend):
        assert name in kept, f"{title}: the legend names {name!r}, which the result's series do not carry"


def _kept_labels(expr: str, labels: set[str]) -> set[str]:
    """The labels an expression's result keeps: its outermost ``by (...)`` grouping, or all of them."""
    groups = GROUPING.findall(expr)
    return {x.strip() for x in groups[0].split(",")} if groups else labels - {"le"}
