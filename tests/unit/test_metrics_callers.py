"""Every public AgentMetrics method has a caller in the product, and the PromQL subset reads honestly."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
from promql import PromQLError, Scrapes, as_vector, evaluate

from elasticd.status.metrics import AgentMetrics

PACKAGE = Path(__file__).resolve().parents[2] / "elasticd"


def _metrics_calls() -> set[str]:
    """Names of methods called on something named ``metrics`` (``metrics.x()``, ``self.metrics.x()``)."""
    called: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "metrics.py" and path.parent.name == "status":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                name = owner.id if isinstance(owner, ast.Name) else (
                    owner.attr if isinstance(owner, ast.Attribute) else "")
                if name == "metrics":
                    called.add(node.func.attr)
    return called


def test_every_public_agent_metrics_method_is_called_in_the_product():
    """No AgentMetrics series is left unfed: each public method is called from elasticd/."""
    public = {n for n, v in vars(AgentMetrics).items() if callable(v) and not n.startswith("_")}
    assert {"set_identity", "observe_checkpoint_save", "observe_checkpoint_load"} <= public
    missing = public - _metrics_calls()
    assert not missing, f"AgentMetrics methods nobody in elasticd/ calls: {sorted(missing)}"


def _data() -> Scrapes:
    data = Scrapes()
    for t, n in ((100.0, 0), (110.0, 10)):
        data.add_text(f'a_total{{cause="x"}} {n}\nb{{le="1.0"}} {n}\nb{{le="+Inf"}} {2 * n}\n'
                      f'info{{elasticd_job="j"}} 1\n', t, {"instance": "h:1"})
    return data


def test_promql_subset_evaluates_rates_joins_and_quantiles():
    """rate over a window, on(instance) group_left joins and histogram_quantile give Prometheus' values."""
    data = _data()
    (r,) = as_vector(evaluate('sum by (cause) (rate(a_total[1m]) * on(instance) group_left() '
                              'info{elasticd_job="j"})', data), "q")
    assert r.value == 1.0 and r.get("cause") == "x"
    (q,) = as_vector(evaluate("histogram_quantile(0.5, sum by (le) (rate(b[1m])))", data), "q")
    assert q.value == 1.0
    assert evaluate("time() - 10", data) == 100.0


def test_promql_subset_is_honest_about_what_it_cannot_select():
    """A metric that is not exported, or a job that does not match, selects nothing; an
    unsupported function is an error, never an empty answer."""
    data = _data()
    assert evaluate("elasticd_never_exported", data) == []
    assert evaluate('a_total * on(instance) group_left() info{elasticd_job="other"}', data) == []
    with pytest.raises(PromQLError, match="not supported"):
        evaluate("predict_linear(a_total[1m], 60)", data)
    assert evaluate("rate(a_total[5s])", data) == []  # one sample in the window: no rate
    assert math.isnan(as_vector(evaluate("histogram_quantile(0.5, b * 0)", data), "q")[0].value)
