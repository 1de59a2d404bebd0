"""Per-event costs of each launcher, from a measured ``benchmarks/recovery.py`` run.

The simulator charges what was measured, never a guess: each :class:`SystemCosts` field
comes from the medians of one recovery run's trials (its ``results.json``), and the
properties that are not timings (does a kill roll back? does the launcher use a notice?
does losing one node end the job?) are facts of the launcher, stated here with why.

=================  ===========================  =====================================
field              elasticd (live / restart)    torchrun (c10d / etcd-v3)
=================  ===========================  =====================================
kill_s             ``sigkill`` recovery         ``sigkill`` recovery
kill_rollback      ``sigkill`` steps lost > 0    ``sigkill`` steps lost > 0
uses_notice        yes (a notice drains)        no (torchrun has no drain protocol)
drain_s            ``sigterm`` recovery         -
join_s             ``join`` recovery            ``join`` recovery
join_pause_s       ``join`` members' pause      ``join`` members' pause
join_rollback      ``join`` steps lost > 0       ``join`` steps lost > 0
cold_start_s       ``join`` recovery            ``join`` recovery
store_host_fatal   no (etcd)                    c10d: yes (the store is in one launcher)
=================  ===========================  =====================================

Whether a kill or a join rolls back is read from the run too (any recovered trial that lost
a step), so it is a property of the launcher *and the script*: ``examples/train.py`` saves at
a stop under torchrun as well, so torchrun's join loses no step there; a plain script that
does not save on SIGTERM would roll back on every join.

A scenario a launcher did not recover from in the run (torchrun's SIGSTOP) is not used:
availability traces have no freezes.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.spotbench.model import SystemCosts

#: The launchers the replay compares, as benchmarks/recovery.py names them.
SYSTEMS = ("elasticd-live", "elasticd", "torchrun-tuned", "torchrun-etcd")

_FACTS: dict[str, dict[str, bool]] = {
    "elasticd-live": {"uses_notice": True, "store_host_fatal": False},
    "elasticd": {"uses_notice": True, "store_host_fatal": False},
    "torchrun-tuned": {"uses_notice": False, "store_host_fatal": True},
    "torchrun-default": {"uses_notice": False, "store_host_fatal": True},
    "torchrun-etcd": {"uses_notice": False, "store_host_fatal": False},
}


class MissingMeasurement(ValueError):
    """A launcher's results lack a scenario the replay needs."""


def _median(trials: list[dict], system: str, scenario: str, key: str) -> float:
    values = [float(t[key]) for t in trials
              if t["system"] == system and t["scenario"] == scenario and t.get("recovered")
              and t.get(key) is not None]
    if not values:
        raise MissingMeasurement(
            f"no recovered {scenario!r} trial with {key!r} for {system!r}; run "
            f"benchmarks/recovery.py --systems {system} --scenarios {scenario}")
    return statistics.median(values)


def _lost_steps(trials: list[dict], system: str, scenario: str) -> bool:
    return any((t.get("steps_lost") or 0) > 0 for t in trials
               if t["system"] == system and t["scenario"] == scenario and t.get("recovered"))


def costs_from_results(results: dict, system: str) -> SystemCosts:
    """The :class:`SystemCosts` of ``system`` from a recovery run's ``results.json``.

    Raises:
        MissingMeasurement: the run has no recovered trial of a scenario the system needs.
        KeyError: ``system`` is not one the replay knows.
    """
    facts = _FACTS[system]
    trials = results["trials"]
    join_s = _median(trials, system, "join", "recovery_s")
    return SystemCosts(
        name=system,
        kill_s=_median(trials, system, "sigkill", "recovery_s"),
        drain_s=_median(trials, system, "sigterm", "recovery_s") if facts["uses_notice"] else 0.0,
        join_s=join_s,
        join_pause_s=_median(trials, system, "join", "pause_s"),
        cold_start_s=join_s,
        kill_rollback=_lost_steps(trials, system, "sigkill"),
        join_rollback=_lost_steps(trials, system, "join"),
        **facts,
    )


def load_costs(paths: list[Path], systems: tuple[str, ...] = SYSTEMS) -> dict[str, SystemCosts]:
    """Every system's costs from the trials of one or more recovery runs' ``results.json``
    (pooled: a launcher that did not recover in one run's trial is measured by the others)."""
    trials = [t for path in paths for t in json.loads(path.read_text())["trials"]]
    return {s: costs_from_results({"trials": trials}, s) for s in systems}


def fixed_size(costs: SystemCosts) -> SystemCosts:
    """The same launcher as a fixed-size job (``--nnodes N``): trains only with all N."""
    return SystemCosts(**{**costs.__dict__, "name": f"{costs.name} (fixed)", "elastic": False})
