"""`make demo`: one minute of elasticd on this machine.

Starts a private etcd on 127.0.0.1, runs the example on two local "nodes" (two agents,
each its own process tree), kills one node halfway (SIGKILL to the whole node), lets the
survivor train on alone, brings the node back, and shows `elasticd status` at each stage.
It ends by drawing the job's history (`elasticd status --plot`) and printing the path.
Everything it starts is stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elasticd.etcd.embedded import EmbeddedEtcd  # noqa: E402
from elasticd.process import descendants  # noqa: E402

JOB = "demo"
STEPS = 400
BOLD = "\033[1m" if sys.stdout.isatty() and not os.environ.get("NO_COLOR") else ""
RESET = "\033[0m" if BOLD else ""


def say(text: str) -> None:
    print(f"\n{BOLD}== {text}{RESET}", flush=True)


class Node:
    def __init__(self, name: str, etcd: str, workdir: Path) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        cmd = [sys.executable, "-m", "elasticd.cli", "run", "--etcd", etcd, "--job", JOB,
               "--nnodes", "1:2", "--nproc-per-node", "1", "--node-id", name, "--node-ttl", "2",
               "--local-addr", "127.0.0.1", "--log-format", "json",
               "--checkpoint-url", f"file://{workdir}/checkpoints",
               str(ROOT / "examples" / "train.py"), "--steps", str(STEPS), "--step-sleep", "0.1",
               "--checkpoint-every", "20"]
        # The agent's runtime dir and its workers' logs go under the demo's dir too (a killed
        # agent cannot remove its own), so the one path printed at the end holds everything.
        tmp = workdir / "tmp"
        tmp.mkdir(mode=0o700, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=str(ROOT),
                                         env={**os.environ, "TMPDIR": str(tmp)})

    def kill(self) -> None:
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()


def steps(nodes: list[Node]) -> list[dict]:
    rows = []
    for n in nodes:
        for line in n.log_path.read_text(errors="replace").splitlines():
            # JSON logs: each worker line is a worker_output event (docs/operations.md)
            try:
                rec = json.loads(line)
                if rec.get("event") == "worker_output" and rec.get("local_rank") == 0 \
                        and rec["line"].startswith('{"step"'):
                    rows.append(json.loads(rec["line"]))
            except (ValueError, AttributeError, KeyError):
                pass
    return sorted(rows, key=lambda r: (r.get("round") or 0, r["step"]))


def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: timed out waiting for {what}")
        time.sleep(0.2)


def status(etcd: str) -> None:
    subprocess.run([sys.executable, "-m", "elasticd.status", "--etcd", etcd, "--job", JOB,
                    "--events", "6"], check=False)


def show_loss(nodes: list[Node], last: int = 3) -> None:
    for r in steps(nodes)[-last:]:
        print(f"   step {r['step']:4d}  world size {r['world_size']}  loss {r['loss']:.4f}")


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="elasticd-demo-"))
    nodes: list[Node] = []
    say("starting a private etcd on 127.0.0.1")
    with EmbeddedEtcd(str(workdir / "etcd")) as etcd:
        try:
            say(f"embedded etcd on {etcd.endpoint}; starting two nodes (agents) for job '{JOB}'")
            nodes = [Node("node-a", etcd.endpoint, workdir), Node("node-b", etcd.endpoint, workdir)]
            wait_for(lambda: any(r["world_size"] == 2 for r in steps(nodes)), 90, "world size 2")
            wait_for(lambda: max(r["step"] for r in steps(nodes)) >= 60, 90, "step 60")
            say("training at world size 2")
            show_loss(nodes)
            status(etcd.endpoint)

            say("SIGKILL node-b (agent and worker): a spot instance vanishing with no notice")
            t_kill = time.time()
            nodes[1].kill()
            killed_at = max(r["step"] for r in steps(nodes))
            killed_round = max(r.get("round") or 0 for r in steps(nodes))

            def after_kill() -> list[dict]:
                return [r for r in steps(nodes) if r["world_size"] == 1
                        and (r.get("round") or 0) > killed_round]

            wait_for(lambda: len(after_kill()) >= 3, 60, "training at world size 1")
            resumed = min(r["step"] for r in after_kill())
            retrained = max(killed_at - resumed + 1, 0)
            print(f"   node-a trains on alone {time.time() - t_kill:.1f}s after the kill, from step "
                  f"{resumed}: {retrained} step(s) retrained (the last step before the kill was "
                  f"{killed_at}; live re-formation keeps the survivor's state, a restart "
                  "resumes from the newest checkpoint)")
            show_loss(nodes)
            status(etcd.endpoint)

            say("node-b comes back: admitted at the next round")
            nodes[1] = Node("node-b", etcd.endpoint, workdir)
            t_back = time.time()
            wait_for(lambda: steps(nodes)[-1]["world_size"] == 2 and steps(nodes)[-1]["step"] > killed_at,
                     60, "world size 2 again")
            print(f"   world size 2 again {time.time() - t_back:.1f}s after node-b's agent started")
            show_loss(nodes)
            status(etcd.endpoint)

            say(f"training to step {STEPS}")
            for n in nodes:
                n.proc.wait(timeout=180)
            show_loss(nodes)
            subprocess.run([sys.executable, "-m", "elasticd.cli", "checkpoints",
                            f"file://{workdir}/checkpoints", "--job", JOB], check=False)
            say("the picture of the job: elasticd status --plot")
            picture = workdir / "demo.png"
            subprocess.run([sys.executable, "-m", "elasticd.status", "--etcd", etcd.endpoint,
                            "--job", JOB, "--plot", str(picture)], check=False)
            say("done: the job survived a node loss and a rejoin, and the loss kept falling")
            print(f"   logs and checkpoints: {workdir}")
            if picture.exists():
                print(f"   picture: {picture}")
            return 0
        finally:
            for n in nodes:
                n.stop()


if __name__ == "__main__":
    sys.exit(main())
