"""The shipped Grafana dashboard queries only metrics the agent really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest

from elasticd.status.metrics import AgentMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "elasticd.json"
METRIC = re.compile(r"\belasticd_[a-zA-Z0-9_]+")


def _exported_names() -> set[str]:
    m = AgentMetrics()
    m.set_identity(job="j", node="n", version="0")
    text = generate_latest(m.registry).decode()
    names = {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines()
             if line and not line.startswith("#")}
    return names


def _exprs(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for var in dashboard["templating"]["list"]:
        if isinstance(var.get("query"), dict):
            out.append((f"${var['name']}", var["query"]["query"]))
    return out


def test_every_queried_metric_is_exported():
    """Every elasticd_* name in every panel's expr (and the $job variable) is a sample the agent exports."""
    exported = _exported_names()
    assert "elasticd_recovery_duration_seconds_bucket" in exported  # the parse itself works
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _exprs(dashboard)
    assert len(exprs) >= 12
    unknown = {(title, name) for title, expr in exprs for name in METRIC.findall(expr)
               if name not in exported and name != "elasticd_job"}  # elasticd_job is a label
    assert not unknown, f"the dashboard queries metrics the agent does not export: {sorted(unknown)}"


def test_dashboard_covers_the_operator_questions():
    """The dashboard shows size, round, restarts by cause, recovery, throughput and checkpoints."""
    text = DASHBOARD.read_text()
    for name in ("elasticd_world_size", "elasticd_round", "elasticd_restarts_total",
                 "elasticd_recovery_duration_seconds_bucket",
                 "elasticd_rendezvous_duration_seconds_bucket",
                 "elasticd_training_steps_per_second", "elasticd_training_samples_per_second",
                 "elasticd_checkpoint_save_duration_seconds_bucket",
                 "elasticd_checkpoint_load_duration_seconds_bucket",
                 "elasticd_checkpoint_save_bytes_total", "elasticd_checkpoint_load_bytes_total",
                 "elasticd_last_checkpoint_step", "elasticd_last_checkpoint_timestamp_seconds"):
        assert name in text, name
    ids = [p["id"] for p in json.loads(text)["panels"]]
    assert len(ids) == len(set(ids))
