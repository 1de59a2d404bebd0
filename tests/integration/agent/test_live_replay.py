"""A short live replay of a spot trace (issue 27): the ledger against the outside audit.

benchmarks/spotbench/live.py plays a trace on real agents (4 here, a 3-member embedded
etcd, examples/train.py with live re-formation): nodes arrive (their agent starts), get a
notice (SIGTERM: a drain) and are lost (SIGKILL of the whole tree) when the trace says.
The audit then measures, from the workers' own trace, the share of the job's worker-time
that trained the final attempt of a step, and checks every step against a fault-free run;
``elasticd status --goodput`` must tell the same story. The replay's clock starts at the
job's first step (``--clock first-step``), so the agents' start-up, however slow under
load, never eats the short window: every event is played on a training job. The long
replay (8 agents, the busiest 24 h of a real trace) runs outside ``make test``; see
docs/benchmarks.md.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.spotbench import live

pytestmark = pytest.mark.timeout(300)

# Nodes available per 5-minute tick; compressed 50x, a tick lasts 6 s (36 s of replay):
# two gains, a loss of two and a gain, each loss noticed (a drain) before its kill.
COUNTS = [2, 3, 4, 4, 2, 3, 3]
COMPRESS = 50
# The ledger's figure must be this close to the audit's. Its history has 5 s resolution
# and this replay has an event every ~6 s, so most intervals hold one, and a size may be
# held for one interval only. Until 2026-12-07 the ledger's healthy step time was the
# median rate of its 5 s intervals with no event, one or two per size here, averaging in
# whichever checkpoint saves and slowed steps they held (the audit counts a median single
# step): -5.5, +9.4 and -17.4 points in 2026-12-06's fresh-clone runs, -0.7 to +5.5 in
# 11 runs of 2026-12-07 (load 1-22). The samples now carry the workers' own median step
# time, of the size each interval held (elasticd.control.client.StepTimes): -1.76, -1.18,
# -0.27 in 2026-12-07's three runs (load 5-12). -7.7 with an older defect this guards
# against (a size held only briefly got a rate scaled up from its neighbour). The
# ±1-point goal is the long replay's (docs/benchmarks.md), whose intervals are mostly clean.
LEDGER_POINTS = 7.0


def test_a_short_replay_trains_every_sample_once_and_the_ledger_matches_the_audit(tmp_path, monkeypatch):
    """Arrivals, drains and kills played on a training job lose no sample, retrain no step,
    and ``status --goodput`` reports the outside audit's held goodput within 7 points."""
    # As the harness's nodes: no standby refill (live re-formation restarts no worker here).
    monkeypatch.setenv("ELASTICD_WORKERS_STANDBY_REFILL", "false")
    traces = tmp_path / "traces" / "synthetic"
    traces.mkdir(parents=True)
    (traces / "four.json").write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": COUNTS}))
    out = tmp_path / "replay.json"
    hours = (len(COUNTS) - 1) * 300 / 3600
    assert live.main(["--system", "elasticd-live", "--traces", str(tmp_path / "traces"),
                      "--trace", "synthetic/four", "--hours", str(hours), "--compress", str(COMPRESS),
                      "--clock", "first-step",
                      "--scale", "1", "--max-nodes", "4", "--step-s", "0.05",
                      "--workdir", str(tmp_path / "run"), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    print(json.dumps({k: doc[k] for k in ("events", "audit", "ledger", "exactly_once")}))
    assert doc["events"] >= 7, doc["applied"]
    once = doc["exactly_once"]
    assert once is not None and once["steps"] > 100, once
    assert once["ok"], once
    assert once["retrained_steps"] == 0, once  # live re-formation: nothing rolled back
    audit = doc["audit"]
    assert 0.2 < audit["held_goodput"] <= 1.0, audit
    ledger = doc["ledger"]
    assert ledger is not None and ledger["goodput"] is not None, doc["ledger"]
    assert abs(ledger["difference_points"]) <= LEDGER_POINTS, (ledger, audit)
