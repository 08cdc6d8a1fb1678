"""The Grafana dashboard and Prometheus config query only metrics the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

import fleetwise.streams.metrics  # noqa: F401 - registers the metrics

ROOT = Path(__file__).resolve().parents[1]


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_names() -> set[str]:
    """Series names of every registered metric (labelled ones have no samples until used)."""
    return {metric.name + suffix for metric in REGISTRY.collect()
            for suffix in SUFFIXES.get(metric.type, ("",))}


def test_every_dashboard_query_names_an_exported_metric():
    dashboard = json.loads((ROOT / "deploy/grafana/fleetwise.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    used = {name for expr in exprs for name in re.findall(r"\bfleetwise_[a-z_]+", expr)}
    assert used, "the dashboard queries no fleetwise metric"
    missing = used - exported_names()
    assert not missing, f"dashboard queries metrics nobody exports: {sorted(missing)}"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
