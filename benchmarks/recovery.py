"""Recovery after node faults: elasticd (etcd v3) against torchrun (c10d), side by side.

The same training script runs on 3 "nodes" (each a launcher process tree in a session of
its own, 1 gloo worker each, all on 127.0.0.1), launched by

- ``elasticd``: ``elasticd run --etcd ... --nnodes 2:4 --node-ttl 2`` (etcd: one embedded
  member on free ports, shared by all runs, one job name per run);
- ``elasticd-live``: the same agent; ``examples/train.py`` (``LiveState``) re-forms its
  process group in place, the survivors' state is sent to new ranks (``elasticd`` and
  ``elasticd-cold`` run with ``--no-live-reform``: the restart path;
  ``elasticd-live-cold`` is live with ``--no-warm-start``: a cold spare;
  ``elasticd-live-prebuilt`` is live with ``--spare-prebuild``: the spare's script has
  built its model before the admission);
- ``torchrun default``: ``torchrun --rdzv-backend c10d --nnodes 2:4 --max-restarts 100``;
- ``torchrun tuned``: the same plus ``--rdzv-conf last_call_timeout=1,keep_alive_interval=1,
  keep_alive_max_attempt=2``;
- ``torchrun-etcd``: torchrun with ``--rdzv-backend etcd-v3`` (elasticd's rendezvous through
  torchrun's entry point, on the same embedded etcd): torchrun's agent with no store host.
- ``torchft``: torchft 0.2.0 (``pip install torchft==0.2.0``, not a dependency of
  elasticd): one lighthouse per run (``torchft_lighthouse --min_replicas 2
  --heartbeat_timeout_ms 2000``: the heartbeat timeout matches elasticd's ``--node-ttl 2``)
  and one replica group per node, each a ``torchrun --nnodes 1 --nproc-per-node 1`` of
  ``benchmarks/torchft_worker.py`` (torchft's ``train_ddp.py`` loop on the same small
  model). Survivors keep their process and state; a joiner heals from a live peer. Only
  the ``sigkill``, ``join`` and ``rejoin`` scenarios (no drain protocol, no spares).

Both torchrun variants run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (with the shared
store a scale-up hung in earlier measurements). The c10d store lives in the first node's
launcher, so faults always go to the last node (killing the store host ends a torchrun job).

Scenarios, each after the job trains steadily at world 3:

- ``sigkill``: SIGKILL to the whole node (launcher and workers);
- ``sigstop``: SIGSTOP to the whole node (bounded wait, then "did not recover");
- ``hang``: SIGSTOP to the last node's *worker* only, its launcher alive (elasticd ejects
  the node as hung, rendezvous.hang_eject_s; a launcher that does not waits out the
  collective timeout: bounded wait, then "did not recover");
- ``sigterm``: SIGTERM to the launcher only, as systemd would send it;
- ``agentkill``: SIGKILL to the launcher's process group only (``kill -9 -- -PGID`` of the
  agent; the workers run in sessions of their own): elasticd's workers, and their
  DataLoader workers, die with it (PR_SET_PDEATHSIG down the tree) and the survivors
  probe its liveness port; torchrun's workers are orphaned;
- ``join``: a 4th node starts; timed from the start of its launcher;
- ``spare`` (elasticd only): 4 nodes under ``--nnodes 2:3``, the 4th waits as a hot spare;
  SIGKILL of a member; timed to the first step back at world 3 (the spare in it).
- ``rejoin``: SIGKILL to the whole node; once the survivors trained a step at world 2 (and,
  on etcd, the node's record expired), the same node is started again; timed from its
  launcher's start to the first step back at the old size (world 3). With a plain script
  (``--script benchmarks/bench_worker.py``: no worker API) it is the plain-script rejoin of
  issue 52, where elasticd's live default used to wait out ``live_reform_timeout_s``.

Figures: seconds from the fault to the first step that every rank of the new world
completed, and steps lost = (last step completed at the old world size) - (first step at
the new world size) + 1, floored at 0. "Last step at the old world size" rather than
"before the fault" so that steps trained during a drain count as kept. Plus the floor:
a cold worker start (``python SCRIPT`` at world 1) to its first step.

Usage (the full run writes the "## Recovery" section of docs/benchmarks.md)::

    .venv/bin/python benchmarks/recovery.py --reps 3
    .venv/bin/python benchmarks/recovery.py --reps 1 --scenarios sigkill --systems elasticd --no-doc
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    BENCH_WORKER,
    PY,
    ROOT,
    TORCHFT_WORKER,
    TORCHRUN_ENV,
    TORCHRUN_TUNED_CONF,
    TRAIN_SCRIPT,
    Cluster,
    NodeProc,
    StepSource,
    elasticd_argv,
    first_step_at,
    free_port,
    machine_info,
    newer_rounds,
    other_load,
    port_listening,
    sigterm_as_interrupt,
    steps_at,
    torchrun_argv,
    wait_until,
)
from benchmarks.recovery_report import agent_breakdown, live_breakdown, write_report  # noqa: E402

CKPT_LOADED = re.compile(r"checkpoint_loaded\b.*?\bseconds[=\"': ]+([0-9.]+)")
SYSTEMS = ("elasticd-live", "elasticd-live-cold", "elasticd-live-prebuilt", "elasticd", "elasticd-cold", "torchrun-default",
           "torchrun-tuned", "torchrun-etcd", "torchft")
TORCHFT_SCENARIOS = ("sigkill", "join", "rejoin")
TORCHFT_HEARTBEAT_MS = 2000  # the lighthouse's heartbeat timeout: elasticd's --node-ttl 2
SCENARIOS = ("sigkill", "sigstop", "sigterm", "join", "spare", "hang", "agentkill", "rejoin")
HANDED_OVER_PID = re.compile(r"\bpid[=\"': ]+([0-9]+)")
SPARE_NNODES = "2:3"  # the spare scenario: NODES members and one hot spare
NODES = 3
NNODES = "2:4"
TUNED_CONF = [TORCHRUN_TUNED_CONF]  # --torchrun-conf replaces it
TORCHRUN_SCRIPT_ARGS: list[str] = []  # --torchrun-script-args: the torchrun arms' own script flags


@dataclass
class Trial:
    """One run of one scenario under one launcher."""

    system: str
    scenario: str
    rep: int
    recovered: bool = False
    recovery_s: float | None = None
    steps_lost: int | None = None
    old_world: int = NODES
    new_world: int = 0
    last_old_step: int | None = None
    first_new_step: int | None = None
    spawn_s: float | None = None  # fault -> last new worker exec'd
    ready_s: float | None = None  # fault -> last new worker ready (process group, checkpoint)
    phases: dict[str, float] = field(default_factory=dict)  # elasticd agent breakdown
    note: str = ""
    workdir: str = ""
    t0: float = 0.0  # wall-clock time of the fault
    ckpt_load_s: float | None = None  # slowest rank's checkpoint load (examples/train.py logs it)
    pause_s: float | None = None  # last step at the old world -> first step at the new one


def script_available(script: str) -> bool:
    """Does ``script`` run one step standalone (world 1)? Used to pick the default script."""
    if not (ROOT / script).exists():
        return False
    with tempfile.TemporaryDirectory(prefix="elasticd-bench-probe-") as tmp:
        src = StepSource(script, Path(tmp), step_s=0.0)
        args = src.args()
        if not src.is_bench:
            args[args.index("--steps") + 1] = "2"
        try:
            proc = subprocess.run([PY, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0


def start_node(cluster: Cluster, system: str, idx: int, job: str, endpoint: str, src: StepSource,
               nnodes: str = NNODES) -> None:
    name = f"n{idx}"
    logs = cluster.workdir / "logs" / name
    logs.mkdir(parents=True, exist_ok=True)
    if system == "torchft":
        # One replica group per node, as torchft's README launches one: torchrun hosts the
        # group's store; `endpoint` is the lighthouse's address. --max-restarts 10 is
        # torchft's own launcher's (torchft/torchx.py): a replica whose step raised (torchft
        # 0.2.0's DDP comm hook can assert on a peer's reset) restarts and heals from a peer.
        argv = [PY, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                "--max-restarts", "10", "--local-addr", "127.0.0.1", "--log-dir", str(logs),
                TORCHFT_WORKER, "--out", str(src.out), "--replica", str(idx), "--step-s", str(src.step_s)]
        # torchrun shares its store with the worker (its default): the Manager joins it as a
        # client, so TORCHRUN_ENV (which turns the sharing off) is not set here.
        env = {"TORCHFT_LIGHTHOUSE": f"http://{endpoint}", "GLOO_SOCKET_IFNAME": "lo"}
    elif system.startswith("elasticd"):
        # elasticd-live: the workers re-form in place (examples/train.py uses LiveState);
        # elasticd: the restart path (warm standbys); elasticd-cold: standbys off too;
        # elasticd-live-cold: live, standbys off (a cold spare imports torch on admission).
        flags = {"elasticd-live": [], "elasticd-live-cold": ["--no-warm-start"],
                 "elasticd-live-prebuilt": ["--spare-prebuild"],
                 "elasticd": ["--no-live-reform"],
                 "elasticd-cold": ["--no-live-reform", "--no-warm-start"]}[system]
        argv = elasticd_argv(endpoint, job, name, nnodes, 1, [*flags, *src.args()], logs)
        env = {}
    else:
        port = int(endpoint.rsplit(":", 1)[1])
        conf = TUNED_CONF[0] if system == "torchrun-tuned" else None
        backend = "etcd-v3" if system == "torchrun-etcd" else "c10d"
        argv = torchrun_argv(port, job, NNODES, 1, [*src.args(), *TORCHRUN_SCRIPT_ARGS], conf, logs,
                             backend)
        env = dict(TORCHRUN_ENV)
    cluster.start(name, argv, {**env, "PYTHONUNBUFFERED": "1"}, on_line=src.on_line)


def run_trial(system: str, scenario: str, rep: int, etcd_endpoint: str, script: str,
              root: Path, args: argparse.Namespace) -> Trial:
    """Start 3 nodes, wait for steady training at world 3, inject the fault, time recovery."""
    workdir = root / f"{scenario}-{system}-{rep}"
    workdir.mkdir(parents=True)
    trial = Trial(system, scenario, rep, workdir=str(workdir))
    if system == "torchft" and scenario not in TORCHFT_SCENARIOS:
        trial.note = f"torchft runs only {', '.join(TORCHFT_SCENARIOS)} here"
        return trial
    src = StepSource(TORCHFT_WORKER if system == "torchft" else script, workdir, step_s=args.step_s,
                     extra=shlex.split(args.script_args))
    job = f"rec-{scenario}-{rep}-{int(time.time() * 1000) % 10**8}"
    on_etcd = system.startswith("elasticd") or system == "torchrun-etcd"
    endpoint = etcd_endpoint if on_etcd else f"127.0.0.1:{free_port()}"
    spare = scenario == "spare"
    if spare and not system.startswith("elasticd"):
        trial.note = "hot spares are elasticd's"
        return trial
    nnodes = SPARE_NNODES if spare else NNODES
    with Cluster(workdir / "lighthouse") as lighthouse, Cluster(workdir) as cluster:
        if system == "torchft" and not start_lighthouse(lighthouse, endpoint):
            trial.note = "the torchft lighthouse never opened its port"
            return trial
        start_node(cluster, system, 0, job, endpoint, src, nnodes)
        if not on_etcd and system != "torchft":
            # Node 0 must host the c10d store (the first launcher to bind the port does).
            port = int(endpoint.rsplit(":", 1)[1])
            if not wait_until(lambda: port_listening(port), 60):
                trial.note = "torchrun node 0 never opened the store port"
                return trial
        for i in range(1, NODES + (1 if spare else 0)):
            start_node(cluster, system, i, job, endpoint, src, nnodes)
        ranks = src.ranks_per_step(NODES)
        steady = wait_until(lambda: first_step_at(src.records(), NODES, 0, ranks) and
                            steps_at(src.records(), NODES) >= args.warm_steps, args.start_timeout)
        if not steady:
            trial.note = f"never trained steadily at world {NODES} within {args.start_timeout:.0f}s"
            gave_up = sorted({line.split("giving up: ", 1)[1][:200] for log in workdir.glob("n*.log")
                              for line in log.read_text(errors="replace").splitlines() if "giving up: " in line})
            if gave_up:  # e.g. a script's configuration error at this world size (exit 78)
                trial.note += f"; an agent gave up: {gave_up[0]}"
            return trial
        # Faults hit jobs that have been training a while: let every launcher settle (and
        # elasticd's standbys, which start 2 s after the first step, finish importing).
        first = first_step_at(src.records(), NODES, 0, ranks)
        settle_until = (first[1] if first else time.time()) + args.settle_s
        while time.time() < settle_until:
            time.sleep(0.1)
            cluster.refresh()
        cluster.refresh()
        victim = cluster.nodes[NODES - 1]
        if spare:
            # The node that logged spare_waiting is the spare; the fault goes to a member.
            def spare_node() -> object:
                return next((n for n in cluster.nodes
                             if any('"spare_waiting"' in text for _, text in n.lines)), None)

            if not wait_until(spare_node, 30):
                trial.note = "no node waited as a spare"
                return trial
            victim = [n for n in cluster.nodes if n is not spare_node()][-1]
        if scenario == "rejoin":
            t0 = rejoin(cluster, victim, system, job, endpoint, src, trial, args)
            if t0 is None:
                return trial
        elif scenario in ("sigkill", "spare"):
            # With a spare, the job is back at its full size once the spare is in.
            t0, trial.new_world = victim.signal_node(signal.SIGKILL), NODES if spare else NODES - 1
        elif scenario == "sigstop":
            t0, trial.new_world = victim.signal_node(signal.SIGSTOP), NODES - 1
        elif scenario == "hang":
            workers = worker_pids(victim)
            if not workers:
                trial.note = "no worker process found on the victim"
                return trial
            t0, trial.new_world = time.time(), NODES - 1
            for pid in workers:
                signal_pid(pid, signal.SIGSTOP)
        elif scenario == "sigterm":
            t0, trial.new_world = victim.signal_launcher(signal.SIGTERM), NODES - 1
        elif scenario == "agentkill":
            victim.refresh()  # its workers are remembered, so cleanup finds them if orphaned
            t0, trial.new_world = time.time(), NODES - 1
            try:
                os.killpg(victim.pid, signal.SIGKILL)  # the launcher's group, not its workers'
            except ProcessLookupError:
                pass
        else:
            trial.new_world = NODES + 1
            start_node(cluster, system, NODES, job, endpoint, src)
            t0 = cluster.nodes[-1].started_at
        trial.t0 = t0
        timeout = args.stop_timeout if scenario in ("sigstop", "hang") else args.timeout
        ranks = src.ranks_per_step(trial.new_world)
        deadline = time.monotonic() + timeout

        def counted_after() -> float:
            # Same world size before and after (a spare replaces the victim): step lines the
            # old group wrote before the kill still arrive after t0 (their time is their
            # arrival), so a step counts only once the spare is in (its spare_admitted).
            if not spare:
                return t0
            return min((now for n in cluster.nodes for now, text in n.lines
                        if now > t0 and '"spare_admitted"' in text), default=float("inf"))

        def steps() -> list[dict]:
            # A spare's group has the old one's size: count only the rounds after the kill.
            return newer_rounds(src.records(), t0) if spare else src.records()

        while time.monotonic() < deadline:
            if first_step_at(steps(), trial.new_world, counted_after(), ranks):
                break
            time.sleep(0.1)
            cluster.refresh()  # remember new workers, so cleanup finds them even if orphaned
        records, counted = src.records(), steps()
        analyse(trial, records, t0, ranks, after=counted_after(), counted=counted)
        trial.ckpt_load_s = checkpoint_load_s([n.lines for n in cluster.nodes], t0)
        if not trial.recovered:
            trial.note = f"did not recover within {timeout:.0f}s"
        if scenario == "rejoin":
            pass  # the breakdowns follow a fault, not a node's start
        elif system.startswith("elasticd-live") and trial.recovered:
            survivors = [n for n in cluster.nodes if n is not victim or scenario == "join"]
            trial.phases = live_breakdown([n.lines for n in survivors], t0, trial.new_world, counted)
        elif system.startswith("elasticd") and trial.recovered:
            survivors = [n for n in cluster.nodes if n is not victim or scenario == "join"]
            trial.phases = agent_breakdown([n.lines for n in survivors], t0, trial.new_world,
                                           records, src.is_bench)
        (workdir / "trial.json").write_text(json.dumps(asdict(trial), indent=1))
    return trial


def start_lighthouse(cluster: Cluster, endpoint: str) -> bool:
    """Start torchft's lighthouse on ``endpoint`` (127.0.0.1:port); True once it listens."""
    cluster.workdir.mkdir(parents=True, exist_ok=True)
    exe = Path(PY).parent / "torchft_lighthouse"
    cluster.start("lighthouse", [str(exe), "--bind", endpoint, "--min_replicas", "2",
                                 "--heartbeat_timeout_ms", str(TORCHFT_HEARTBEAT_MS)])
    return wait_until(lambda: port_listening(int(endpoint.rsplit(":", 1)[1])), 30)


def rejoin(cluster: Cluster, victim: NodeProc, system: str, job: str, endpoint: str,
           src: StepSource, trial: Trial, args: argparse.Namespace) -> float | None:
    """The ``rejoin`` scenario's fault: SIGKILL ``victim``, wait for the survivors' first
    step at world NODES - 1 (and on etcd for the node's record to expire, so that the same
    node id may register again), start the node again. Returns the restart's time, or None
    (with ``trial.note``) when the survivors never trained on."""
    killed_at = victim.signal_node(signal.SIGKILL)
    trial.old_world, trial.new_world = NODES - 1, NODES
    ranks = src.ranks_per_step(NODES - 1)
    if not wait_until(lambda: first_step_at(src.records(), NODES - 1, killed_at, ranks), args.timeout):
        trial.note = f"the survivors did not train on at world {NODES - 1} within {args.timeout:.0f}s"
        return None
    if system.startswith("elasticd"):
        from elasticd.etcd.client import EtcdClient
        from elasticd.keys import JobKeys

        client = EtcdClient(endpoint, timeout_s=2.0)
        try:
            if not wait_until(lambda: client.get(JobKeys(job).node(victim.name)) is None, 30):
                trial.note = "the killed node's record never expired"
                return None
        finally:
            client.close()
    start_node(cluster, system, NODES - 1, job, endpoint, src)
    return cluster.nodes[-1].started_at


def worker_pids(node: NodeProc) -> list[int]:
    """The training workers in a launcher's tree (not its idle warm standbys): processes
    started with torch's per-worker ``RANK`` in their environment, and standbys the agent
    handed a worker's place (its ``standby_handed_over`` lines)."""
    tree = set(node.tree())
    handed = {int(m.group(1)) for _, text in node.lines
              if "standby_handed_over" in text and (m := HANDED_OVER_PID.search(text))}
    out = []
    for pid in sorted(tree - {node.pid}):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if pid in handed or any(e.startswith(b"RANK=") for e in env):
            out.append(pid)
    return out


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def analyse(trial: Trial, records: list[dict], t0: float, ranks: int,
            after: float | None = None, counted: list[dict] | None = None) -> None:
    """Fill in recovery time, steps lost and the worker-start split from the step records
    (the first step at the new world counted from ``after``, default ``t0``, among
    ``counted``, default all records)."""
    first = first_step_at(records if counted is None else counted, trial.new_world,
                          t0 if after is None else after, ranks)
    if first is None:
        return
    step, at = first
    trial.recovered, trial.first_new_step = True, step
    trial.recovery_s = at - t0
    old = [int(r["step"]) for r in records
           if "step" in r and "event" not in r and r.get("world") == trial.old_world and r["time"] < at]
    if old:
        trial.last_old_step = max(old)
        trial.steps_lost = max(0, trial.last_old_step - step + 1)
    old_times = [float(r["time"]) for r in records if "step" in r and "event" not in r
                 and r.get("world") == trial.old_world and r["time"] < at]
    if old_times:
        trial.pause_s = at - max(old_times)
    starts = [r for r in records if r.get("event") == "start" and r.get("world") == trial.new_world
              and float(r.get("ready", 0)) > t0]
    if starts:
        if all("spawned" in r for r in starts):
            trial.spawn_s = max(float(r["spawned"]) for r in starts) - t0
        trial.ready_s = max(float(r["ready"]) for r in starts) - t0


def checkpoint_load_s(node_lines: list[list[tuple[float, str]]], t0: float) -> float | None:
    """The slowest ``checkpoint_loaded`` after the fault, from the workers' logs (None if none)."""
    found = [float(m.group(1)) for lines in node_lines for now, text in lines
             if now > t0 and (m := CKPT_LOADED.search(text))]
    return max(found) if found else None


def cold_start(script: str, root: Path, rep: int) -> dict[str, float] | None:
    """A worker started by hand at world 1: seconds from exec to ready and to the first step."""
    workdir = root / f"cold-{rep}"
    workdir.mkdir(parents=True)
    src = StepSource(script, workdir, step_s=0.02)
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    with Cluster(workdir) as cluster:
        node = cluster.start("cold", [PY, *src.args()], env, on_line=src.on_line)
        first = wait_until(lambda: first_step_at(src.records(), 1, 0, 1), 120)
        if not first:
            return None
        starts = [r for r in src.records() if r.get("event") == "start"]
        ready = float(starts[0]["ready"]) if starts else None
        return {"first_step_s": first[1] - node.started_at,
                "ready_s": (ready - node.started_at) if ready else None,
                "imports_s": (float(starts[0]["imported"]) - float(starts[0]["spawned"]))
                if starts and "imported" in starts[0] else None}


def reanalyse(root: Path) -> dict:
    """Recompute every trial's figures from the logs a run left in ``root`` (no new run)."""
    results = json.loads((root / "results.json").read_text())
    for t in results["trials"]:
        workdir = Path(t["workdir"])
        src = StepSource(results["script"], workdir)
        nodes = {}
        for log in sorted(workdir.glob("n*.log")):
            lines = []
            for raw in log.read_text(errors="replace").splitlines():
                stamp, _, text = raw.partition(" ")
                try:
                    lines.append((float(stamp), text))
                except ValueError:
                    continue
            nodes[log.stem] = lines
            for now, text in lines:
                src.on_line(now, text)
        trial = Trial(**{k: v for k, v in t.items() if k in Trial.__dataclass_fields__})
        records = src.records()
        ranks = src.ranks_per_step(trial.new_world)
        if not trial.t0 and trial.recovered:
            first = first_step_at(records, trial.new_world, 0, ranks)
            trial.t0 = first[1] - trial.recovery_s if first else 0.0
        if trial.recovered and trial.t0:
            counted = newer_rounds(records, trial.t0) if trial.scenario == "spare" else None
            analyse(trial, records, trial.t0, ranks, counted=counted)
            trial.ckpt_load_s = checkpoint_load_s(list(nodes.values()), trial.t0)
            if trial.system == "elasticd":
                keep = [v for k, v in nodes.items() if k != f"n{NODES - 1}" or trial.scenario == "join"]
                trial.phases = agent_breakdown(keep, trial.t0, trial.new_world, records, src.is_bench)
        t.update(asdict(trial))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3, help="repetitions per scenario and launcher")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset")
    p.add_argument("--systems", default=",".join(s for s in SYSTEMS
                                                 if s not in ("elasticd-live-cold", "elasticd-live-prebuilt")),
                   help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--script", default=None,
                   help=f"training script (default: {TRAIN_SCRIPT} if it runs, else {BENCH_WORKER})")
    p.add_argument("--script-args", default="", help="more arguments for the script, e.g. "
                   "'--mesh hsdp --live' with --script examples/fsdp_train.py (HSDP live re-formation)")
    p.add_argument("--torchrun-script-args", default="",
                   help="more arguments for the script under torchrun only, e.g. "
                   "--torchrun-script-args=--dcp with "
                   "--script examples/fsdp_train.py (torchrun + DCP checkpoints beside elasticd's)")
    p.add_argument("--step-s", type=float, default=0.02, help="per-step padding handed to the script")
    p.add_argument("--warm-steps", type=int, default=20, help="steps at world 3 before the fault")
    p.add_argument("--settle-s", type=float, default=10.0,
                   help="seconds of training at world 3 (from its first step) before the fault")
    p.add_argument("--timeout", type=float, default=120.0, help="recovery wait bound, s")
    p.add_argument("--stop-timeout", type=float, default=240.0, help="recovery wait bound for sigstop, s")
    p.add_argument("--start-timeout", type=float, default=180.0, help="wait for steady training, s")
    p.add_argument("--torchrun-conf", default=TORCHRUN_TUNED_CONF, help="rdzv-conf of the tuned torchrun")
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temp dir)")
    p.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    p.add_argument("--report-from", metavar="DIR",
                   help="do not run: recompute the figures from the logs of an earlier run's --workdir "
                        "and write the report")
    p.add_argument("--doc-block", default="recovery",
                   help="name of the generated block in the Recovery section (one per script)")
    args = p.parse_args(argv)
    if args.report_from:
        results = reanalyse(Path(args.report_from))
        print(write_report(results, block=None if args.no_doc else args.doc_block))
        return 0
    scenarios = [s for s in args.scenarios.split(",") if s]
    systems = [s for s in args.systems.split(",") if s]
    bad = [x for x in scenarios if x not in SCENARIOS] + [x for x in systems if x not in SYSTEMS]
    if bad:
        p.error(f"unknown scenario/system {bad}; choose from {SCENARIOS} and {SYSTEMS}")
    if "torchft" in systems and not (Path(PY).parent / "torchft_lighthouse").exists():
        p.error(f"--systems torchft: torchft is not installed beside {PY} "
                "(pip install torchft==0.2.0 into this virtualenv)")
    TUNED_CONF[0] = args.torchrun_conf
    TORCHRUN_SCRIPT_ARGS[:] = shlex.split(args.torchrun_script_args)
    script = args.script or (TRAIN_SCRIPT if script_available(TRAIN_SCRIPT) else BENCH_WORKER)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="elasticd-recovery-"))
    root.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    busy = other_load()
    print(f"script {script}; logs under {root}", flush=True)
    from elasticd.etcd.embedded import EmbeddedEtcd

    trials: list[Trial] = []
    colds: list[dict] = []
    etcd = EmbeddedEtcd(data_dir=str(root / "etcd"))
    started = time.time()
    with sigterm_as_interrupt():
        try:
            etcd.start()
            for rep in range(args.reps):
                cold = cold_start(script, root, rep)
                if cold:
                    colds.append(cold)
                for scenario in scenarios:
                    for system in systems:
                        if any(t.system == system and t.scenario == scenario and not t.recovered
                               for t in trials):
                            continue  # no recovery once: one repetition is enough
                        t = run_trial(system, scenario, rep, etcd.endpoint, script, root, args)
                        trials.append(t)
                        print(json.dumps({k: v for k, v in asdict(t).items() if k != "workdir"}),
                              flush=True)
        finally:
            etcd.stop(remove_data=False)
    results = {"machine": info, "script": script, "argv": sys.argv[1:], "trials": [asdict(t) for t in trials],
               "cold": colds, "wall_s": time.time() - started, "tuned_conf": args.torchrun_conf,
               "busy": sorted(set(busy) | set(other_load()))}
    (root / "results.json").write_text(json.dumps(results, indent=1))
    report = write_report(results, block=None if args.no_doc else args.doc_block)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
