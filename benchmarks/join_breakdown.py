"""Where a live join's seconds go, from the logs of ``recovery.py --workdir DIR``.

The recovery table's live phases put the joining node's whole start-up into "detection".
This splits it (issue 14: "≤ 2 s from its agent's start"), per trial and as median
(min–max), from the joining node's (``n3``) and the members' JSON logs:

- agent → standby spawned: the launcher's start to its first standby's ``Popen`` (Python,
  the CLI, the config; from ``standby_handed_over``'s ``warm_for_s``, ±0.05 s);
- standby import: spawn → ``standbys_ready`` (torch, ``torch._dynamo``, ``elasticd.worker``);
- ready → registered → rendezvous: the joiner in etcd, the members parked at an agreed step,
  one round with 4 nodes;
- hand-over → first step: the standby runs the script, joins the group, receives the
  state from a peer, trains the first step at world 4;
- ready → first step: the figure from the joiner being ready; members' pause: their park
  request → the first step at world 4.

Usage::

    .venv/bin/python benchmarks/recovery.py --reps 3 --scenarios join --systems elasticd-live \\
        --no-doc --workdir /tmp/join
    .venv/bin/python benchmarks/join_breakdown.py /tmp/join
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recovery_report import agent_events  # noqa: E402

PHASES = ("total", "agent → standby spawned", "standby import", "ready → registered",
          "registered → rendezvous", "rendezvous → hand-over", "hand-over → first step",
          "ready → first step", "members' pause")


def _events(path: Path, after: float) -> list[dict]:
    lines = [(0.0, line.split(" ", 1)[1] if " " in line else line)
             for line in path.read_text(errors="replace").splitlines()]
    return agent_events(lines, after)


def trial_phases(trial_dir: Path) -> dict[str, float] | None:
    """The phases of one recovered join trial (None when it did not recover)."""
    trial = json.loads((trial_dir / "trial.json").read_text())
    if not trial.get("recovered"):
        return None
    t0, end = trial["t0"], trial["t0"] + trial["recovery_s"]
    joiner = _events(trial_dir / "n3.log", t0 - 1)

    def first(name: str) -> dict:
        return next(e for e in joiner if e["event"] == name)

    handed, ready = first("standby_handed_over"), first("standbys_ready")
    registered, formed = first("node_registered"), first("rendezvous_completed")
    spawned = handed["_t"] - float(handed["warm_for_s"])
    parks = [e["_t"] for n in ("n0", "n1", "n2") for e in _events(trial_dir / f"{n}.log", t0)
             if e["event"] == "live_park_requested"]
    return {"total": trial["recovery_s"], "agent → standby spawned": spawned - t0,
            "standby import": ready["_t"] - spawned, "ready → registered": registered["_t"] - ready["_t"],
            "registered → rendezvous": formed["_t"] - registered["_t"],
            "rendezvous → hand-over": handed["_t"] - formed["_t"],
            "hand-over → first step": end - handed["_t"], "ready → first step": end - ready["_t"],
            "members' pause": end - min(parks) if parks else float("nan")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workdir", type=Path, help="recovery.py's --workdir")
    args = p.parse_args(argv)
    rows = [r for d in sorted(args.workdir.glob("join-elasticd-live-*")) if (r := trial_phases(d))]
    if not rows:
        print("no recovered elasticd-live join trial under", args.workdir)
        return 1
    print("| phase | " + " | ".join(f"trial {i}" for i in range(len(rows))) + " | median (min–max) |")
    print("|---|" + "---:|" * (len(rows) + 1))
    for ph in PHASES:
        vals = [r[ph] for r in rows]
        print(f"| {ph} | " + " | ".join(f"{v:.2f}" for v in vals)
              + f" | {statistics.median(vals):.2f} ({min(vals):.2f}–{max(vals):.2f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
