"""Churn: one worker through many live re-formations, on each process-group lifecycle.

Why: a live re-formation that leaks (a destroyed group's threads, sockets and store kept
until the process ends) turns a week of spot churn into ``Too many open files`` and a
restart (issue 46). This drives the worker side of elasticd's re-formation
(:mod:`elasticd.worker.process_group`, the same objects ``LiveState`` uses) through
``--cycles`` leave/join cycles and records the survivor's threads, fds and RSS and the
re-form latency at every re-formation:

- the survivor (rank 0 throughout) and ``--world - 1`` peers train a small DDP model; each
  step ends with a one-int MAX all-reduce (elasticd's stop agreement);
- a **drain**: the last peer leaves at an agreed step and waits (it rejoins later); a
  **kill** (every ``--kill-every``-th cycle): the last peer is SIGKILLed mid-step, the
  survivors' collective fails, and a fresh process (started at once, like a hot spare)
  takes its place at the next join; a **join**: the peer comes back at an agreed step;
- latency: failure seen (kill) or stop agreed (drain, join) to the first step completed
  at the new size, on the survivor.

Lifecycles: ``rebuild`` (destroy, re-init; the destroyed group released at the next
re-formation), ``rebuild-keep`` (today's main: every destroyed group kept until exit), and
``reconfigure`` (torch 2.14+: c10d ``_reconfigure``; run with a torch that has it).

    PYTHONPATH=$PWD python benchmarks/churn.py --lifecycles rebuild,rebuild-keep --world 2,4 --cycles 20

Only 127.0.0.1. Every process it starts is killed at the end (its own process group).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS_PER_ROUND = 3
WAKE_GRACE_S = 0.5
LIFECYCLES = ("rebuild", "rebuild-keep", "reconfigure")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _resources() -> tuple[int, int, int]:
    rss_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return (len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")),
            rss_pages * os.sysconf("SC_PAGE_SIZE") // 1024)


# -- a worker process ---------------------------------------------------------------------
def worker(ctl_port: int, ident: int, lifecycle: str, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elasticd import teardown
    from elasticd.worker import process_group as pgl
    from elasticd.worker.sockets import socket_links

    store = dist.TCPStore("127.0.0.1", ctl_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    teardown.keep_groups_on_destroy()
    if lifecycle == "rebuild-keep":  # today's main: nothing destroyed is ever released
        teardown.release_destroyed = lambda: 0  # type: ignore[assignment]
    kind = pgl.LifecycleKind.RECONFIGURE if lifecycle == "reconfigure" else pgl.LifecycleKind.REBUILD
    lc = pgl.make_lifecycle(pgl.LifecycleChoice(kind, "benchmark"), "gloo", timeout_s, None)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    store.set(f"alive/{ident}", "1")
    current = {"round": -1, "sockets": frozenset()}
    watch = dist.TCPStore("127.0.0.1", ctl_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    threading.Thread(target=_wake_on_next_round, args=(watch, current), daemon=True).start()
    joins, formed = 0, False
    rnd = int(store.get(f"wait/{ident}/{joins}"))
    seen = time.monotonic()
    while True:
        spec_doc = json.loads(store.get(f"round/{rnd}"))
        members = spec_doc["members"]
        spec = pgl.GroupSpec("gloo", members.index(ident), len(members), rnd, "127.0.0.1",
                             spec_doc["port"], timeout_s)
        before = socket_links()
        if formed:
            lc.join(spec)
        else:
            lc.form(spec)
            formed = True
        current.update(round=rnd, sockets=frozenset(socket_links() - before))
        ddp = DDP(model)
        flag = torch.zeros(1)
        steps = 0
        while True:
            try:
                ddp(torch.randn(32, 256)).sum().backward()
                optim.step()
                optim.zero_grad(set_to_none=True)
                flag[0] = 1 if store.check([f"stop/{rnd}"]) else 0
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            except RuntimeError as exc:
                if not pgl.is_peer_failure(exc):
                    raise
                seen = time.monotonic()  # a peer died: the failure was seen now
                break
            steps += 1
            store.add(f"steps/{rnd}", 1)
            if steps == 1 and ident == 0 and rnd > 0:
                threads, fds, rss_kib = _resources()
                store.set(f"m/{rnd}", json.dumps({"threads": threads, "fds": fds, "rss_kib": rss_kib,
                                                  "latency_s": time.monotonic() - seen}))
            if flag[0] > 0:
                seen = time.monotonic()  # the stop was agreed now
                break
        del ddp
        lc.leave([dist.group.WORLD], lambda: None)
        nxt = json.loads(store.get(f"round/{rnd + 1}"))
        if ident in nxt["members"]:
            rnd += 1
            continue
        joins += 1  # drained: wait to be let back in
        rnd = int(store.get(f"wait/{ident}/{joins}"))


def _wake_on_next_round(store: object, current: dict) -> None:
    """What LiveState's watcher does on the agent's order: a survivor blocked on a live
    peer that already left (world >= 3: only the dead rank's neighbours fail at once) is
    woken by aborting the group and shutting its connections down."""
    import torch.distributed as dist

    from elasticd.worker.sockets import shutdown_group_connections

    while True:
        rnd = current["round"]
        if rnd >= 0 and store.check([f"round/{rnd + 1}"]):  # type: ignore[attr-defined]
            time.sleep(WAKE_GRACE_S)  # an agreed stop leaves within a step
            if current["round"] == rnd:
                try:
                    dist.group.WORLD.abort()
                except (RuntimeError, AttributeError, ValueError):
                    pass
                shutdown_group_connections(current["sockets"])
                while current["round"] == rnd:
                    time.sleep(0.01)
        time.sleep(0.02)


# -- the driver ---------------------------------------------------------------------------
class Driver:
    def __init__(self, lifecycle: str, world: int, timeout_s: float, logs: Path) -> None:
        import torch.distributed as dist

        self.logs = logs
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))
        self.lifecycle, self.timeout_s = lifecycle, timeout_s
        self.procs: dict[int, subprocess.Popen] = {}
        self.joins: dict[int, int] = {}
        self.next_ident = 0
        self.round = -1
        self.members: list[int] = []
        for _ in range(world):
            self.members.append(self.spawn())
        self.wait_alive(self.members)
        self.open_round(self.members)
        for m in self.members:
            self.store.set(f"wait/{m}/0", str(self.round))
        self.wait_steps()

    def spawn(self) -> int:
        ident = self.next_ident
        self.next_ident += 1
        self.procs[ident] = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(ident), "--ctl-port", str(self.store.port),
             "--lifecycles", self.lifecycle, "--timeout-s", str(self.timeout_s)],
            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=open(self.logs / f"worker-{ident}.log", "wb"))  # noqa: SIM115
        self.joins[ident] = 0
        return ident

    def wait_alive(self, idents: list[int]) -> None:
        for i in idents:
            self.store.wait([f"alive/{i}"], timedelta(seconds=self.timeout_s))

    def open_round(self, members: list[int]) -> None:
        self.round += 1
        self.members = members
        self.store.set(f"round/{self.round}", json.dumps({"members": members, "port": _free_port()}))

    def wait_steps(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self.store.add(f"steps/{self.round}", 0) < STEPS_PER_ROUND * len(self.members):
            if time.monotonic() > deadline:
                raise TimeoutError(f"round {self.round} did not train {STEPS_PER_ROUND} steps")
            dead = [i for i in self.members if self.procs[i].poll() is not None]
            if dead:
                log = (self.logs / f"worker-{dead[0]}.log").read_text(errors="replace")
                raise RuntimeError(f"worker {dead[0]} died: {log[-2000:]}")
            time.sleep(0.01)

    def metric(self) -> dict:
        self.store.wait([f"m/{self.round}"], timedelta(seconds=self.timeout_s))
        return json.loads(self.store.get(f"m/{self.round}"))

    def cycle(self, kill: bool) -> tuple[dict, dict]:
        victim = self.members[-1]
        old = self.round
        self.open_round(self.members[:-1])
        if kill:
            os.killpg(self.procs[victim].pid, signal.SIGKILL)
            self.procs[victim].wait()
            victim = self.spawn()  # a hot spare: starts now, joins at the next join
        else:
            self.store.set(f"stop/{old}", "1")
        self.wait_steps()
        left = {"kind": "kill" if kill else "drain", **self.metric()}
        self.wait_alive([victim])
        old = self.round
        self.open_round([*self.members, victim])
        self.joins[victim] += 1 if not kill else 0
        self.store.set(f"wait/{victim}/{self.joins[victim]}", str(self.round))
        self.store.set(f"stop/{old}", "1")
        self.wait_steps()
        joined = {"kind": "join", **self.metric()}
        return left, joined

    def close(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _summary(rows: list[dict], edge: int) -> dict:
    def avg(rs: list[dict], key: str) -> float:
        return sum(r[key] for r in rs) / max(len(rs), 1)

    # The baseline is the second cycle's (the first re-formations warm up lazily built state).
    start, end = rows[2:2 + edge], rows[-edge:]
    out: dict = {"reformations": len(rows)}
    for key in ("threads", "fds", "rss_kib"):
        out[f"{key}_start"], out[f"{key}_end"] = round(avg(start, key)), round(avg(end, key))
    half = len(rows) // 2  # latency medians over each half: every kind occurs in both
    for kind in ("kill", "drain", "join"):
        for label, part in (("start", rows[:half]), ("end", rows[half:])):
            rs = [r for r in part if r["kind"] == kind]
            if rs:
                out[f"{kind}_ms_{label}"] = round(1000 * sorted(r["latency_s"] for r in rs)[len(rs) // 2], 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lifecycles", default="rebuild,rebuild-keep", help=f"comma list of {LIFECYCLES}")
    p.add_argument("--world", default="2", help="comma list of world sizes (>= 2)")
    p.add_argument("--cycles", type=int, default=10, help="leave/join cycles (2 re-formations each)")
    p.add_argument("--kill-every", type=int, default=5, help="every k-th leave is a SIGKILL (0: none)")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--json", help="write every re-formation's sample here")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ctl-port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.ctl_port, args.worker, args.lifecycles, args.timeout_s)
        return 0
    results = {}
    print(f"load {os.getloadavg()[0]:.1f}", flush=True)
    for world in (int(w) for w in args.world.split(",")):
        for lifecycle in args.lifecycles.split(","):
            if lifecycle not in LIFECYCLES:
                raise SystemExit(f"--lifecycles: {lifecycle!r} is not one of {LIFECYCLES}")
            logs = Path(tempfile.mkdtemp(prefix=f"elasticd-churn-{lifecycle}-{world}-"))
            driver = Driver(lifecycle, world, args.timeout_s, logs)
            rows: list[dict] = []
            try:
                for c in range(args.cycles):
                    pair = driver.cycle(kill=bool(args.kill_every) and c % args.kill_every == args.kill_every - 1)
                    rows.extend(pair)
                    for row in pair:  # as they come: a run that fails late keeps its samples
                        print(f"row {lifecycle} world {world}: {json.dumps(row)}", flush=True)
            finally:
                driver.close()
            s = _summary(rows, edge=max(2, min(5, len(rows) // 8)))
            results[f"{lifecycle}/world{world}"] = {"summary": s, "rows": rows}
            print(f"{lifecycle} world {world}: {json.dumps(s)}", flush=True)
    print(f"load {os.getloadavg()[0]:.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
