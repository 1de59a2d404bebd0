"""The shipped Grafana dashboard reads a real agent: every panel's query selects a series."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
from harness import ROOT, wait_until
from promql import PromQLError, Scrapes, as_vector, evaluate, label_values

from elasticd.etcd.embedded import free_port

DASHBOARD = ROOT / "deploy" / "grafana" / "elasticd.json"
SCRIPT = str(ROOT / "examples" / "train.py")
pytestmark = pytest.mark.timeout(300)


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def _a_worker(pids: list[int]) -> int:
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if b"train.py" in fh.read() and pid != pids[0]:
                    return pid
        except OSError:
            continue
    raise AssertionError(f"no worker running train.py among {pids}")


def _seen(data: Scrapes) -> dict[str, float]:
    return {name: _value(data, name, **labels) for name, labels in (
        ("elasticd_restarts_total", {"cause": "failure"}),
        ("elasticd_checkpoint_load_duration_seconds_count", {}),
        ("elasticd_recovery_duration_seconds_count", {}),
        ("elasticd_checkpoint_save_duration_seconds_count", {}),
        ("elasticd_training_samples_per_second", {}), ("elasticd_round", {}))}


def _value(data: Scrapes, name: str, **labels: str) -> float:
    selector = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    found = as_vector(evaluate(selector, data), selector)
    return found[0].value if found else math.nan


def test_every_dashboard_panel_selects_series_of_a_real_agent(nodes, tmp_path):
    """A real agent (2 workers, checkpoints, one worker killed and restarted from its
    checkpoint) is scraped during its job; the $job variable lists the job and every panel's
    query of deploy/grafana/elasticd.json selects at least one finite series."""
    port = free_port()
    a = nodes.start("dash", SCRIPT, nnodes="1", nproc=2,
                    extra=["--no-warm-start", "--metrics-port", str(port), "--metrics-addr", "127.0.0.1",
                           "--checkpoint-url", f"file://{tmp_path / 'ckpt'}",
                           "--max-restarts", "2", "--restart-backoff", "0.1"],
                    script_args=["--steps", "100000", "--checkpoint-every", "5",
                                 "--step-sleep", "0.02"])
    url, target = f"http://127.0.0.1:{port}/metrics", {"instance": f"127.0.0.1:{port}",
                                                       "job": "elasticd"}
    data = Scrapes()

    def scraped(pred) -> bool:
        try:
            data.scrape(url, target, timeout_s=2)
        except OSError:
            return False  # not listening yet
        return pred()

    try:
        wait_until(lambda: scraped(lambda: _value(data, "elasticd_checkpoint_save_duration_seconds_count") >= 2),
                   120, lambda: f"two checkpoint saves in the metrics: {_seen(data)}", interval_s=0.5)
        # A worker killed: the group restarts and every rank loads the newest checkpoint.
        os.kill(_a_worker(a.tree()), signal.SIGKILL)
        wait_until(lambda: scraped(lambda: _value(data, "elasticd_restarts_total", cause="failure") >= 1
                                   and _value(data, "elasticd_checkpoint_load_duration_seconds_count") >= 2
                                   and _value(data, "elasticd_recovery_duration_seconds_count") >= 1
                                   and _value(data, "elasticd_training_samples_per_second") > 0),
                   120, lambda: f"restart, loads, recovery and samples/s: {_seen(data)}",
                   interval_s=0.5)
        wait_until(lambda: scraped(lambda: _value(data, "elasticd_checkpoint_save_duration_seconds_count")
                                   >= 3), 60, "a save after the restart", interval_s=0.5)
        # The goodput ledger needs two history samples (5 s apart): a fast run is done
        # before it (a quiet fresh-clone run scraped NaN and failed the goodput panel).
        wait_until(lambda: scraped(lambda: math.isfinite(_value(data, "elasticd_goodput_ratio",
                                                                window="life"))),
                   60, lambda: f"a finite goodput ratio: {_seen(data)}", interval_s=0.5)
    finally:
        a.signal_agent(signal.SIGTERM)
        a.wait(60)

    info = as_vector(evaluate("elasticd_agent_info", data), "info")
    assert [(s.get("elasticd_job"), s.get("node")) for s in info] == [("dash", "n0")]
    assert _value(data, "elasticd_checkpoint_load_bytes_total") > 0
    assert _value(data, "elasticd_checkpoint_save_bytes_total") > 0

    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    (job_var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "job"]
    assert label_values(job_var["query"]["query"], data) == ["dash"]
    span = f"[{math.ceil(data.times[-1] - data.times[0]) + 1}s]"
    queries = _queries(dashboard)
    assert len(queries) >= 22
    empty = []
    for title, expr in queries:
        q = (expr.replace('"$job"', '"dash"').replace("[$__rate_interval]", span)
             .replace("[$__range]", span))
        try:
            result = evaluate(q, data)
        except PromQLError as exc:
            empty.append((title, expr, f"unreadable: {exc}"))
            continue
        values = [result] if isinstance(result, float) else [s.value for s in as_vector(result, q)]
        if not any(math.isfinite(v) for v in values):
            empty.append((title, expr, f"selected {values}"))
    assert not empty, "panels without data:\n" + "\n".join(map(str, empty))
