"""Turn recovery trials into the "## Recovery" section of docs/benchmarks.md.

Also holds ``agent_breakdown``: where an elasticd recovery's seconds went, read from the
agents' JSON logs (``agent_decided``/``membership_changed``, ``rendezvous_completed``) and
the workers' own start lines.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common import (
    BENCH_WORKER,
    first_step_at,
    iso_to_epoch,
    json_in_line,
    machine_line,
    other_load,
    replace_generated_block,
    summary,
)

SCENARIO_TITLES = {
    "sigkill": "SIGKILL of a node",
    "sigstop": "SIGSTOP of a node",
    "sigterm": "SIGTERM to a node's launcher",
    "join": "a 4th node joins",
    "spare": "SIGKILL of a member, a hot spare waiting",
    "agentkill": "SIGKILL of a node's agent only (`kill -9 -- -PGID`)",
}
SYSTEM_TITLES = {"elasticd-live": "elasticd, live re-formation",
                 "elasticd-live-cold": "elasticd, live, `--no-warm-start`",
                 "elasticd-live-prebuilt": "elasticd, live, `--spare-prebuild`", "elasticd": "elasticd, restart", "elasticd-cold": "elasticd, `--no-warm-start`",
                 "torchrun-default": "torchrun, defaults", "torchrun-tuned": "torchrun, tuned",
                 "torchft": "torchft 0.2.0"}
# (elasticd goal in s, torchrun default, torchrun tuned) measured earlier on this machine.
REFERENCE = {
    "sigkill": (5.0, "49 s", "9.8 s"),
    "sigstop": (7.0, "no recovery in 240 s", "no recovery in 240 s"),
    "sigterm": (5.0, "48 s", "9.1 s"),
    "join": (5.0, "10.3 s", "12.3 s"),
    "spare": (5.0, "n/a (no spares)", "n/a (no spares)"),
    "agentkill": (5.0, "not measured before", "not measured before"),
}
# Live re-formation's goals (issue 14), s: kill 1.0, freeze TTL (2) + 0.5, drain 0.5, join 2.
LIVE_GOALS = {"sigkill": 1.0, "sigstop": 2.5, "sigterm": 0.5, "join": 2.0, "spare": 1.0,
              "agentkill": 1.0}
LIVE_PHASES = ("detection", "rendezvous", "re-form + state + first step")
PHASES = ("drain", "new agent start-up", "detection", "stop old workers", "rendezvous", "agent starts workers",
          "worker ready", "first step")


def agent_events(lines: list[tuple[float, str]], after: float) -> list[dict]:
    out = []
    for _, text in lines:
        rec = json_in_line(text)
        if rec and "event" in rec and "timestamp" in rec:
            try:
                rec["_t"] = iso_to_epoch(str(rec["timestamp"]))
            except ValueError:
                continue
            if rec["_t"] >= after:
                out.append(rec)
    return out


def agent_breakdown(node_lines: list[list[tuple[float, str]]], t0: float, new_world: int,
                    records: list[dict], is_bench: bool) -> dict[str, float]:
    """Seconds per recovery phase of an elasticd run (boundaries: the slowest node's).

    drain (SIGTERM only): fault -> every old worker stopped at the agreed step;
    new agent start-up (join only): the new launcher's start -> its node registered in etcd;
    detection: -> every surviving agent decided to restart for membership (after a
    drain this is mostly the workers' interpreter exit);
    stop old workers + rendezvous: -> ``rendezvous_completed`` at the new size (its
    ``seconds`` field splits the two); agent starts workers: -> last worker exec'd;
    worker ready: -> last worker has imports, process group and checkpoint;
    first step: -> every rank finished the first step.
    """
    detect, rdzv_end, rdzv_len, registered = [], [], [], []
    for lines in node_lines:
        evs = agent_events(lines, t0)
        registered += [e["_t"] for e in evs if e["event"] == "node_registered"]
        d = [e["_t"] for e in evs if e["event"] == "membership_changed"
             or (e["event"] == "agent_decided" and e.get("verdict") == "restart_membership")]
        if d:
            detect.append(min(d))
        r = [e for e in evs if e["event"] == "rendezvous_completed"
             and e.get("nnodes", e.get("world_size")) == new_world]
        if r:
            rdzv_end.append(r[0]["_t"])
            rdzv_len.append(float(r[0].get("seconds", 0.0)))
    starts = [r for r in records if r.get("event") == "start" and r.get("world") == new_world
              and float(r.get("ready", 0)) > t0]
    first = first_step_at(records, new_world, t0, new_world if is_bench else 1)
    if not rdzv_end or not starts or first is None:
        return {}
    t_rdzv = max(rdzv_end)
    t_rdzv_start = max(e - s for e, s in zip(rdzv_end, rdzv_len, strict=True))
    t_detect = max(detect) if detect else t_rdzv_start
    stopped = [float(r["time"]) for r in records if r.get("event") == "stopped" and r["time"] > t0]
    t_drained = max(stopped) if stopped else t0
    t_registered = min(registered) if registered else None  # only a joiner registers after t0
    t_ready = max(float(r["ready"]) for r in starts)
    t_spawn = max(float(r["spawned"]) for r in starts) if all("spawned" in r for r in starts) else None
    out = {"detection": t_detect - (t_registered or t_drained),
           "stop old workers": max(t_rdzv_start - t_detect, 0.0),
           "rendezvous": t_rdzv - max(t_rdzv_start, t_detect)}
    if stopped:
        out["drain"] = t_drained - t0
    if t_registered is not None:
        out["new agent start-up"] = t_registered - t0
    if t_spawn is not None:
        out["agent starts workers"] = t_spawn - t_rdzv
        out["worker ready"] = t_ready - t_spawn
    else:
        out["worker ready"] = t_ready - t_rdzv
    out["first step"] = first[1] - t_ready
    return out


def live_breakdown(node_lines: list[list[tuple[float, str]]], t0: float, new_world: int,
                   records: list[dict]) -> dict[str, float]:
    """Seconds per phase of a live re-formation (boundaries: the slowest surviving agent).

    detection: fault -> every surviving agent started the re-formation
    (``live_reform_started``: a failed collective, a lease, a drain or a join);
    rendezvous: -> every agent ordered its workers into the new round;
    re-form + state + first step: -> every rank finished the first step at the new size.
    """
    started, ordered = [], []
    for lines in node_lines:
        evs = agent_events(lines, t0)
        s = [e["_t"] for e in evs if e["event"] == "live_reform_started"]
        o = [e["_t"] for e in evs if e["event"] == "live_reform_ordered"]
        if s and o:
            started.append(min(s))
            ordered.append(min(o))
    first = first_step_at(records, new_world, t0, 1)
    if not started or first is None:
        return {}
    return {"detection": max(started) - t0, "rendezvous": max(ordered) - max(started),
            "re-form + state + first step": first[1] - max(ordered)}


def _trials(results: dict, system: str, scenario: str) -> list[dict]:
    return [t for t in results["trials"] if t["system"] == system and t["scenario"] == scenario]


def _verdict(scenario: str, ts: list[dict]) -> str:
    goal = REFERENCE[scenario][0]
    times = [t["recovery_s"] for t in ts if t["recovered"]]
    if not ts:
        return ""
    if len(times) < len(ts):
        return f"goal ≤ {goal:.0f} s: **missed** (did not always recover)"
    med = statistics.median(times)
    lost_ok = scenario != "sigterm" or all(t["steps_lost"] == 0 for t in ts)
    ok = med <= goal and lost_ok
    extra = ", 0 steps lost" if scenario == "sigterm" else ""
    return f"goal ≤ {goal:.0f} s{extra}: **{'met' if ok else 'missed'}**"


def main_table(results: dict) -> str:
    rows = ["| scenario | launcher | fault → first step at new world (s) | steps lost | "
            "recovered | reference |",
            "|---|---|---:|---:|---:|---|"]
    for scenario in SCENARIO_TITLES:
        for system in SYSTEM_TITLES:
            ts = _trials(results, system, scenario)
            if not ts:
                continue
            ok = [t for t in ts if t["recovered"]]
            time_s = summary([t["recovery_s"] for t in ok]) if ok else \
                f"did not recover in {_bound(ts[0])}"
            lost = summary([t["steps_lost"] for t in ok], "{:.0f}") if ok else "–"
            if system == "elasticd-live":
                goal = LIVE_GOALS[scenario]
                met = ok and statistics.median([t["recovery_s"] for t in ok]) <= goal and len(ok) == len(ts) \
                    and all(t["steps_lost"] == 0 for t in ok)
                ref = f"goal ≤ {goal:g} s, 0 lost: **{'met' if met else 'missed'}**"
            elif system == "elasticd":
                ref = _verdict(scenario, ts)
            elif system in ("elasticd-cold", "elasticd-live-cold"):
                ref = "same run, standbys off"
            elif system == "elasticd-live-prebuilt":
                ref = "same run, the spare's model built ahead"
            else:
                ref = "earlier: " + REFERENCE[scenario][1 if system == "torchrun-default" else 2]
            rows.append(f"| {SCENARIO_TITLES[scenario]} | {SYSTEM_TITLES[system]} | {time_s} | {lost} "
                        f"| {len(ok)}/{len(ts)} | {ref} |")
    return "\n".join(rows)


def _bound(trial: dict) -> str:
    note = trial.get("note", "")
    return note.replace("did not recover within ", "") if "within" in note else "the bound"


def phase_table(results: dict, system: str = "elasticd", phases: tuple[str, ...] = PHASES) -> str:
    """Per-scenario phase breakdown of one system's recovered trials (median and range)."""
    rows = ["| scenario | " + " | ".join(phases) + " | total |", "|---|" + "---:|" * (len(phases) + 1)]
    for scenario in SCENARIO_TITLES:
        ts = [t for t in _trials(results, system, scenario) if t["recovered"] and t["phases"]]
        if not ts:
            continue
        cells = [summary([t["phases"].get(p) for t in ts]).replace("n/a", "–") for p in phases]
        rows.append(f"| {SCENARIO_TITLES[scenario]} | " + " | ".join(cells)
                    + f" | {summary([t['recovery_s'] for t in ts])} |")
    return "\n".join(rows)


def worker_table(results: dict) -> str:
    trials = [t for t in results["trials"] if t["recovered"] and t["ready_s"]]
    spawned = any(t["spawn_s"] is not None for t in trials)
    loads = any(t.get("ckpt_load_s") is not None for t in trials)
    head = ("| scenario | launcher | " + ("fault → new workers exec'd | → workers ready | " if spawned
                                         else "fault → new workers ready | ")
            + ("of which checkpoint load | " if loads else "") + "→ first step done |")
    rows = [head, "|---|---|" + "---:|" * (2 + spawned + loads)]
    for scenario in SCENARIO_TITLES:
        for system in SYSTEM_TITLES:
            ts = [t for t in trials if t["system"] == system and t["scenario"] == scenario]
            if not ts:
                continue
            step = summary([t["recovery_s"] - t["ready_s"] for t in ts])
            ckpt = [summary([t.get("ckpt_load_s") for t in ts], "{:.2f}")] if loads else []
            if spawned:
                cells = [summary([t["spawn_s"] for t in ts]),
                         summary([t["ready_s"] - t["spawn_s"] if t["spawn_s"] is not None else None
                                  for t in ts])]
            else:
                cells = [summary([t["ready_s"] for t in ts])]
            rows.append(f"| {SCENARIO_TITLES[scenario]} | {SYSTEM_TITLES[system]} | "
                        + " | ".join([*cells, *ckpt]) + f" | {step} |")
    return "\n".join(rows)


def script_notes(script: str) -> str:
    """What the script does on checkpoints and drains, which decides steps lost and SIGTERM."""
    if script == BENCH_WORKER:
        return ("Rank 0 checkpoints every step. The SIGTERM goes to the launcher only; under "
                "torchrun the script stops only the ranks that got it (torchrun has no drain "
                "protocol: see benchmarks/bench_worker.py), and the survivors fail in their next "
                "collective.")
    return (f"`{script}` checkpoints every 10 steps (its default) and on a drain, so a kill loses "
            "up to 10 steps under any launcher. Its step lines come from rank 0's output, "
            "stamped on arrival (±0.1 s: elasticd's agent tees worker output by polling). "
            "The SIGTERM goes to the launcher only; the script's `should_stop()` is job-wide (all "
            "ranks stop at the same step), which under torchrun makes the survivors' workers exit 0 "
            "as well, and torchrun then treats the job as finished.")


def build_markdown(results: dict) -> str:
    reps = max((t["rep"] for t in results["trials"]), default=0) + 1
    cold = results["cold"]
    busy = results.get("busy", [])
    lines = [
        f"Measured {machine_line(results['machine'])}.",
        "" if not busy else f"The machine was shared while this ran (2 cores; other busy processes "
                            f"at the start: {len(busy)}), so treat the figures as ±30 %.",
        "",
        "```",
        f".venv/bin/python benchmarks/recovery.py {' '.join(results['argv'])}".rstrip(),
        "```",
        "",
        f"Script: `{results['script']}`"
        + (" (examples/train.py did not run when this was measured)" if results["script"] == BENCH_WORKER
           and results.get("train_failed") else "")
        + f"; {reps} repetition(s) per cell, median (min–max). 3 nodes × 1 gloo worker on "
        "127.0.0.1, each node a process tree in its own session; `--nnodes 2:4`. elasticd: "
        "`--node-ttl 2`, default `--last-call-timeout 1`, one embedded etcd. torchrun "
        "(c10d): `--max-restarts 100` (its default 0 ends the job at the first peer failure); "
        f"tuned = `--rdzv-conf {results['tuned_conf']}`; both torchrun rows run with "
        "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (with the shared store a scale-up hung in "
        "earlier measurements). Faults go to the last node; the c10d store lives in the "
        "first node's torchrun, whose loss ends a torchrun job. A launcher that does not "
        "recover is run once. Steps lost = last step at the old world size − first step at "
        "the new one + 1, floored at 0. " + script_notes(results["script"]),
        "",
        main_table(results),
        "",
        "Where live re-formation's seconds go (from the agents' JSON logs; the slowest node):",
        "",
        phase_table(results, "elasticd-live", LIVE_PHASES),
        "",
        f"Floor, a cold worker start at world 1 (exec → first step): "
        f"{summary([c['first_step_s'] for c in cold], '{:.2f}')} s"
        + (f", of which imports {summary([c.get('imports_s') for c in cold], '{:.2f}')} s."
           if any(c.get("imports_s") for c in cold) else "."),
        "",
        "Where elasticd's seconds go (boundaries are the slowest node's; from the agents' JSON "
        "logs and the workers' start lines):",
        "",
        phase_table(results),
        "",
        "Worker restart, all launchers:",
        "",
        worker_table(results),
    ]
    return "\n".join(x for x in lines if x is not None)


def write_report(results: dict[str, Any], *, block: str | None) -> str:
    """Render the results; write them into docs/benchmarks.md as ``block`` unless None."""
    results.setdefault("busy", other_load())
    text = build_markdown(results)
    if block:
        replace_generated_block("Recovery", block, text, generator="benchmarks/recovery.py")
    return text
