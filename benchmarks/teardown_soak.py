"""Teardown soak: the seed-style plain DDP script, N runs in a row under ``elasticd run``.

Why: torch 2.13's gloo backend can deadlock (or abort with SIGABRT) while a process group
is destroyed at the end of a script, so a job that trained every epoch could hang forever
after its last epoch or be re-run from the start (issue 11, item 4). This runs the plain
script of ``tests/workers/plain_ddp.py`` (setup, DDP, DistributedSampler, cleanup; two
workers) ``--runs`` times with warm standbys and ``--runs`` times without, and counts the
runs that exit 0 within ``--timeout-s`` having trained each epoch exactly once.

    PYTHONPATH=$PWD python benchmarks/teardown_soak.py --runs 30 --epochs 3

Exit status 0 when every run passed. Nothing is left running: each run is a process
group of its own, killed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "workers" / "plain_ddp.py"


def one_run(workdir: Path, job: str, *, warm: bool, epochs: int, timeout_s: float) -> dict:
    """Run the script once; return {"outcome", "rc", "seconds", "epochs"}."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "epochs.jsonl"
    env = {**os.environ, "SNAPSHOT": str(workdir / "snap.pt"), "OUT": str(out), "EPOCHS": str(epochs)}
    argv = [sys.executable, "-m", "elasticd.cli", "run", "--standalone", "--job", job,
            "--nnodes", "1", "--nproc-per-node", "2", "--log-format", "json",
            "--log-dir", str(workdir / "logs"), *([] if warm else ["--no-warm-start"]), str(SCRIPT)]
    t0 = time.monotonic()
    with open(workdir / "agent.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(ROOT))
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:  # the agent's session: agent, embedded etcd, standbys (workers die with it)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    seconds = time.monotonic() - t0
    trained = []
    if out.exists():
        for line in out.read_text().splitlines():
            try:
                trained.append(json.loads(line)["epoch"])
            except (ValueError, KeyError):
                continue
    if rc is None:
        # A teardown hang trains every epoch first; no epoch at all is a stall before
        # training (e.g. a box so loaded that importing torch took the whole timeout).
        outcome = "hang after training" if trained == list(range(epochs)) else (
            f"timeout after {len(trained)}/{epochs} epochs")
    elif rc != 0:
        outcome = f"exit {rc}"
    elif trained != list(range(epochs)):
        outcome = "epochs " + ",".join(map(str, trained))
    else:
        outcome = "ok"
    result = {"outcome": outcome, "rc": rc, "seconds": round(seconds, 1), "epochs": trained}
    if outcome != "ok":
        result["load"] = os.getloadavg()
        result["log_tail"] = (workdir / "agent.log").read_text(errors="replace")[-3000:]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30, help="runs per mode (warm, cold)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=120.0, help="a run still going then is a hang")
    p.add_argument("--modes", default="warm,cold", help="warm,cold or one of them")
    p.add_argument("--json", help="write per-run results here")
    args = p.parse_args(argv)
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="elasticd-soak-") as tmp:
        for mode in args.modes.split(","):
            runs = results.setdefault(mode, [])
            for i in range(args.runs):
                r = one_run(Path(tmp) / f"{mode}{i}", f"soak-{mode}-{i}", warm=mode == "warm",
                            epochs=args.epochs, timeout_s=args.timeout_s)
                runs.append(r)
                print(f"{mode} run {i + 1}/{args.runs}: {r['outcome']} in {r['seconds']}s", flush=True)
    failed = 0
    for mode, runs in results.items():
        counts = Counter(r["outcome"] for r in runs)
        secs = sorted(r["seconds"] for r in runs)
        failed += len(runs) - counts["ok"]
        print(f"{mode}: {counts['ok']}/{len(runs)} ok ({dict(counts)}); seconds "
              f"min {secs[0]} median {secs[len(secs) // 2]} max {secs[-1]}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
