"""One prepared run on a GPU machine: does elasticd train, recover and checkpoint on CUDA?

Made for a borrowed machine with a hard time limit and no network: every wait is bounded,
every child process is killed (by process tree and group) on every path, and the script
needs nothing but the repository root on PYTHONPATH plus the wheels listed in
docs/benchmarks.md ("GPU check"). Agents are started as ``python -m elasticd.cli run``
(no install, no entry points).

Steps:

a. environment: torch, CUDA, NCCL, GPUs, and the versions elasticd's control plane needs;
b. throughput: ``examples/train.py`` under ``elasticd run --standalone`` with one worker
   per GPU (NCCL refuses two ranks on one device), steps/s and a clean finish;
c. recovery: SIGKILL to the worker's process group (the agent survives), seconds to the
   first step of the restarted worker, steps lost, resumed from the newest committed
   checkpoint; then SIGTERM to the agent (a drain): seconds to exit 0, steps lost 0;
d. live re-formation's communicator mechanism (``benchmarks/gpu_live_probe.py``): with 2+
   GPUs, rank 1 of an NCCL pair is SIGKILLed mid-all-reduce, rank 0 aborts the group from
   a watcher thread (time to the error), forms a new group with a fresh joiner and sends
   it 1 GiB of model state (time, checked byte for byte); with 1 GPU, abort of a live NCCL
   group and a new group of one;
e. checkpoints: ``CheckpointManager.save`` of ~1.4 GiB of CUDA model and Adam state into
   pinned host buffers: the time ``save()`` blocks the loop, the time until the
   device-to-host copy is done, until committed; against a synchronous ``torch.save``;
   the loaded state must equal the state at ``save()`` (it is mutated right after).

f. sharded checkpoints (FSDP2 on a 1-rank mesh): ``fully_shard`` a model on the device,
   an async ``CheckpointManager.save`` of its CUDA DTensors (parameters and Adam moments:
   each rank's shards staged into pinned buffers), the state mutated at once, then a
   differently seeded model sharded on a new mesh loads it; the gathered tensors must equal
   the state at ``save()``; against a synchronous ``torch.distributed.checkpoint.save``.
   Then the live in-memory reshard's data path (a pure FSDP2 job after a node loss): the
   DTensors snapshotted to host memory as a peer-RAM replica holds them, a third model
   filled from it; equality, and the times of both halves.

``--cpu-dry-run`` runs b, c, d, e and f on the CPU (gloo, tiny sizes) so the script is tested
without a GPU. Results: a summary on stdout and ``$OUT/gpu_check.json`` (or
``./gpu_check.json``). Exit 0 when every check passed (or CUDA is absent without
``--cpu-dry-run``: skipped), 1 otherwise.

Usage::

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/gpu_check.py --cpu-dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import PY, NodeProc, json_in_line, wait_until  # noqa: E402
from benchmarks.gpu_live_probe import probe  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    """How big each step is: real on a GPU, tiny for the CPU dry run."""

    device: str
    train_args: tuple[str, ...]  # examples/train.py arguments shared by b and c
    throughput_steps: int
    throughput_timeout_s: float
    kill_after_steps: int  # steps after the first committed checkpoint before the kill
    start_timeout_s: float
    recover_timeout_s: float
    drain_timeout_s: float
    ckpt_layers: int
    ckpt_width: int


GPU = Sizes("cuda", ("--checkpoint-every", "10"), throughput_steps=3000,
            throughput_timeout_s=150, kill_after_steps=30, start_timeout_s=90,
            recover_timeout_s=60, drain_timeout_s=60, ckpt_layers=30, ckpt_width=2048)
DRY = Sizes("cpu", ("--checkpoint-every", "5", "--dataset-size", "512", "--global-batch", "16",
                    "--micro-batch", "16"), throughput_steps=20, throughput_timeout_s=60,
            kill_after_steps=3, start_timeout_s=60, recover_timeout_s=45, drain_timeout_s=30,
            ckpt_layers=4, ckpt_width=128)


def say(msg: str) -> None:
    print(msg, flush=True)


# -- a. environment ----------------------------------------------------------------------
def environment() -> dict[str, Any]:
    """Versions and devices; never raises (a missing piece is reported as such)."""
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda_available": torch.cuda.is_available(),
                           "cuda": torch.version.cuda, "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - report, do not stop
            env["nccl"] = f"unavailable: {exc!r}"
        env["gpu_count"] = torch.cuda.device_count()
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    if shutil.which("nvidia-smi"):
        try:
            env["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=15).stdout.strip()[:300]
        except (OSError, subprocess.TimeoutExpired) as exc:
            env["nvidia_smi"] = f"failed: {exc!r}"
    for mod in ("google.protobuf", "grpc", "fsspec", "structlog", "tenacity", "etcd3"):
        try:
            env[mod] = getattr(__import__(mod, fromlist=["__version__"]), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - e.g. protobuf too old for etcd3's gencode
            env[mod] = f"import failed: {exc!r}"[:200]
    try:
        from elasticd.etcd.embedded import find_etcd_binary

        out = subprocess.run([find_etcd_binary(), "--version"], capture_output=True, text=True,
                             timeout=20).stdout
        env["etcd"] = out.splitlines()[0] if out else "?"
    except Exception as exc:  # noqa: BLE001
        env["etcd"] = f"not found: {exc}"[:200]
    return env


# -- b/c. agents ---------------------------------------------------------------------------
class Run:
    """One ``elasticd run --standalone`` of examples/train.py, its output parsed as it arrives.

    Step lines (rank 0 prints one JSON object per step) are stamped on arrival; torch's
    log tee polls every 0.1 s, so times are good to about 0.1 s.
    """

    def __init__(self, name: str, workdir: Path, nproc: int, script_args: list[str]) -> None:
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True)
        self.ckpt_url = f"file://{self.workdir / 'ckpt'}"
        self.steps: list[tuple[float, dict]] = []  # (arrival, record)
        self.events: list[tuple[float, dict]] = []  # started / drained / finished / agent events
        argv = [PY, "-m", "elasticd.cli", "run", "--standalone", "--job", "gpucheck",
                "--nproc-per-node", str(nproc), "--log-format", "json",
                "--log-dir", str(self.workdir / "logs"), "--checkpoint-url", self.ckpt_url,
                "examples/train.py", *script_args]
        self.node = NodeProc(name, argv, {"PYTHONUNBUFFERED": "1"}, self.workdir / "agent.log",
                             on_line=self._on_line)

    def _on_line(self, now: float, text: str) -> None:
        rec = json_in_line(text)
        if rec is None:
            return
        if "event" not in rec and "step" in rec and "world_size" in rec:
            self.steps.append((now, rec))
        elif "event" in rec:
            self.events.append((now, rec))

    def event_after(self, name: str, after: float) -> tuple[float, dict] | None:
        return next(((t, e) for t, e in list(self.events) if e.get("event") == name and t > after), None)

    def steps_after(self, after: float) -> list[tuple[float, dict]]:
        return [(t, r) for t, r in list(self.steps) if t > after]

    def commits(self) -> list[tuple[int, int]]:
        """(round, step) of each save the agent's commit fence accepted (its
        ``checkpoint_committed`` events), in the order logged.

        A save counts only once the fence accepts it: a worker killed after writing a
        manifest and before its fence commit leaves a save that no resume may use.
        """
        return [(int(e.get("round", -1)), int(e["step"])) for _, e in list(self.events)
                if e.get("event") == "checkpoint_committed" and "step" in e]

    def committed_steps(self, round_: int | None = None) -> list[int]:
        """Steps the fence accepted (of round ``round_`` only, if given), ascending."""
        return sorted(s for r, s in self.commits() if round_ is None or r == round_)

    def written_steps(self) -> list[int]:
        """Steps of the saves with a manifest in the storage listing (fenced or not)."""
        from elasticd.checkpoint.store import FsspecCheckpointStore

        try:
            saves = FsspecCheckpointStore(self.ckpt_url, "gpucheck").list_saves()
        except Exception:  # noqa: BLE001 - the directory appears with the first save
            return []
        return sorted(s.step for s in saves if s.has_manifest)

    def worker_pids(self) -> list[int]:
        """Live worker processes: standbys handed over (agent event) or cold-started ones."""
        from elasticd.process import descendants, pid_alive

        handed = {int(e["pid"]) for _, e in list(self.events)
                  if e.get("event") == "standby_handed_over" and "pid" in e}
        out = []
        for pid in descendants(self.node.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if pid in handed or b"elasticd.agent.worker_exec" in cmd:
                out.append(pid)
        return [p for p in out if pid_alive(p)]

    def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.node.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def tail(self, n: int = 15) -> str:
        return "\n".join(text[:300] for _, text in self.node.lines[-n:])


def start_throughput(workdir: Path, nproc: int, sz: Sizes, runs: list[Run]) -> Run:
    """b, first half: launch the whole job (to its last step)."""
    run = Run("throughput", workdir, nproc, [*sz.train_args, "--steps", str(sz.throughput_steps)])
    runs.append(run)
    return run


def throughput(run: Run, nproc: int, sz: Sizes) -> dict[str, Any]:
    """b: wait for the job's exit; steps/s over the steady part (after 10 steps)."""
    code = run.wait_exit(max(1.0, run.node.started_at + sz.throughput_timeout_s - time.time()))
    res: dict[str, Any] = {"nproc": nproc, "steps": sz.throughput_steps, "exit_code": code,
                           "wall_s": round(time.time() - run.node.started_at, 2)}
    steps = run.steps
    if steps:
        res["first_step_s"] = round(steps[0][0] - run.node.started_at, 2)
        steady = steps[min(10, len(steps) - 1):]
        span = steady[-1][0] - steady[0][0]
        # Lines arrive in 0.1 s bursts (the tee polls): a rate needs a span well above that.
        res["steps_per_s"] = round((len(steady) - 1) / span, 1) if span >= 2.0 else None
        times = sorted(float(r.get("step_s", 0)) for _, r in steady)
        res["median_step_ms"] = round(1000 * times[len(times) // 2], 2)
        res["last_step"] = steps[-1][1]["step"]
    finished = any(e.get("event") == "finished" for _, e in run.events)
    res["ok"] = code == 0 and finished and res.get("last_step") == sz.throughput_steps - 1
    if not res["ok"]:
        res["tail"] = run.tail()
    return res


def kill_and_drain(workdir: Path, nproc: int, sz: Sizes, runs: list[Run]) -> dict[str, Any]:
    """c: SIGKILL the worker process group(s), time the resume; then SIGTERM the agent."""
    run = Run("recovery", workdir, nproc, [*sz.train_args, "--steps", "100000000"])
    runs.append(run)
    res: dict[str, Any] = {"kill": {"ok": False}, "drain": {"ok": False}}
    kill = res["kill"]
    first_ckpt = wait_until(lambda: run.committed_steps(), sz.start_timeout_s)
    if not first_ckpt:
        kill["note"] = f"no committed checkpoint within {sz.start_timeout_s:.0f}s"
        kill["tail"] = run.tail()
        return res
    target = run.steps[-1][1]["step"] + sz.kill_after_steps if run.steps else 0
    wait_until(lambda: run.steps and run.steps[-1][1]["step"] >= target, 30)
    # A job that has trained a while has its next workers waiting as warm standbys (started
    # once the group trains): kill only then, or the figure measures a cold start.
    ready = wait_until(lambda: len([e for _, e in list(run.events)
                                    if e.get("event") == "standby_started"]) >= 2 * nproc, 20)
    kill["standby_ready"] = bool(ready)
    pids = run.worker_pids()
    if not pids:
        kill["note"] = "no worker process found under the agent"
        return res
    agent_pgid = os.getpgid(run.node.pid)
    groups = sorted({g for p in pids if (g := _pgid(p)) not in (None, agent_pgid)})
    commits = run.commits()
    killed_round = commits[-1][0] if commits else None
    committed_at_kill = max(run.committed_steps(killed_round), default=None)
    written_at_kill = max(run.written_steps(), default=None)
    t0 = time.time()
    for g in groups:
        os.killpg(g, signal.SIGKILL)
    kill.update(worker_pids=pids, process_groups=groups, committed_at_kill=committed_at_kill,
                written_at_kill=written_at_kill)
    started = wait_until(lambda: run.event_after("started", t0 + 0.2), sz.recover_timeout_s)
    if not started:
        kill["note"] = f"no restarted worker within {sz.recover_timeout_s:.0f}s"
        kill["tail"] = run.tail()
        return res
    t_start, ev = started
    resumed = ev.get("resumed_from")
    new = wait_until(lambda: next(((t, r) for t, r in run.steps_after(t_start)
                                   if resumed is not None and r["step"] == resumed + 1), None),
                     sz.recover_timeout_s)
    old = [r["step"] for t, r in run.steps if t <= t_start]
    last_old = max(old) if old else None
    kill.update(resumed_from=resumed, last_step_before_kill=last_old,
                restart_started_s=round(t_start - t0, 2),
                first_new_step_s=round(new[0] - t0, 2) if new else None,
                steps_lost=(last_old - resumed) if last_old is not None and resumed is not None else None,
                agent_alive=run.node.alive(),
                warm_standby_used=run.event_after("standby_handed_over", t0) is not None)
    # The killed round's newest commit: one in flight at the kill may land after it (and the
    # resume must then use it); the worker's "started" line arrives through the log tee
    # after the new round's first commits, so those are told apart by round, not by time.
    committed = max(run.committed_steps(killed_round), default=None)
    kill["committed_before_restart"] = committed
    kill["ok"] = bool(new and resumed is not None and committed is not None
                      and resumed >= committed and run.node.alive())
    # Drain: a few steps after the resume, SIGTERM to the agent only (systemd's KillMode=mixed).
    drain = res["drain"]
    if not run.node.alive():
        drain["note"] = "agent not running"
        return res
    base = new[1]["step"] if new else 0
    wait_until(lambda: run.steps and run.steps[-1][1]["step"] >= base + 5, 20)
    t1 = run.node.signal_launcher(signal.SIGTERM)
    code = run.wait_exit(sz.drain_timeout_s)
    t_exit = time.time()
    wait_until(lambda: run.event_after("drained", t1), 2)  # the tee may lag the exit
    drained = run.event_after("drained", t1)
    last = max((r["step"] for _, r in run.steps), default=None)
    stop = drained[1]["step"] if drained else None
    newest = max(run.committed_steps(), default=None)
    drain.update(exit_code=code, exit_s=round(t_exit - t1, 2), drained_step=stop, last_step=last,
                 newest_checkpoint=newest,
                 steps_lost=(last - newest) if last is not None and newest is not None else None)
    drain["ok"] = code == 0 and stop is not None and newest == stop == last
    if not drain["ok"]:
        drain["tail"] = run.tail()
    return res


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


# -- e. checkpoints of CUDA tensors -------------------------------------------------------------
def checkpoint(workdir: Path, sz: Sizes) -> dict[str, Any]:
    """e: async save of model + Adam state through elasticd's CheckpointManager."""
    import logging

    import structlog
    import torch

    from elasticd.checkpoint import CheckpointManager

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    dev = torch.device(sz.device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(sz.ckpt_width, sz.ckpt_width)
                                  for _ in range(sz.ckpt_layers)]).to(dev)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, sz.ckpt_width, device=dev)).sum().backward()
    optim.step()  # materialises exp_avg / exp_avg_sq
    optim.zero_grad(set_to_none=True)
    state = {"model": model, "optim": optim}
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(model.state_dict(), optim.state_dict()))
    sync = _synchronize(dev)
    url = f"file://{workdir / 'ckpt-e'}"
    res: dict[str, Any] = {"state_bytes": nbytes, "state_gib": round(nbytes / 2**30, 3),
                           "device": str(dev), "saves": []}
    with CheckpointManager(url, job="gpucheck", keep_last=1) as mgr:
        for step in (1, 2):  # 1: allocates the pinned buffers; 2: reuses them (steady state)
            ref = [t.clone() for t in _tensors(model.state_dict(), optim.state_dict())]
            sync()
            t0 = time.perf_counter()
            mgr.save(step, state)
            t1 = time.perf_counter()
            with torch.no_grad():  # the next optimizer step rewrites the state in place
                for t in _tensors(model.state_dict(), optim.state_dict()):
                    if t.is_floating_point():
                        t.add_(1.0)
            sync()
            t2 = time.perf_counter()
            result = mgr.wait()
            t3 = time.perf_counter()
            res["saves"].append({
                "step": step, "save_blocked_s": round(t1 - t0, 4), "copy_done_s": round(t2 - t0, 4),
                "copy_gb_per_s": round(nbytes / max(t2 - t0, 1e-9) / 1e9, 2),
                "committed_s": round(t3 - t0, 3), "written_bytes": result.nbytes if result else None,
                "manager_blocked_s": round(result.blocked_s, 4) if result else None})
        loaded = mgr.load_latest(None)
    got = _tensors(loaded.state["model"], loaded.state["optim"]) if loaded else []
    res["loaded_step"] = loaded.step if loaded else None
    res["equal"] = len(got) == len(ref) and all(torch.equal(g, r.cpu()) for g, r in zip(got, ref, strict=True))
    res["pinned_buffers"] = bool(sz.device == "cuda" and _stager_pinned())
    # The baseline: what a loop blocks for with a plain synchronous torch.save (+ fsync).
    path = workdir / "sync.pt"
    sync()
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    res["torch_save_sync_s"] = round(time.perf_counter() - t0, 3)
    res["torch_save_bytes"] = path.stat().st_size
    path.unlink()
    shutil.rmtree(workdir / "ckpt-e", ignore_errors=True)
    warm = res["saves"][-1]
    res["ok"] = bool(res["equal"] and loaded and loaded.step == 2 and warm["written_bytes"])
    return res


def sharded(workdir: Path, sz: Sizes) -> dict[str, Any]:
    """f: FSDP2 on a 1-rank mesh: async sharded save of DTensors, load on a new mesh, equality."""
    import logging

    import structlog
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elasticd.checkpoint import CheckpointManager

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    dev = torch.device(sz.device)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)
    try:
        def build(seed: int) -> tuple[Any, Any]:
            torch.manual_seed(seed)
            model = torch.nn.Sequential(*[torch.nn.Linear(sz.ckpt_width, sz.ckpt_width)
                                          for _ in range(sz.ckpt_layers)]).to(dev)
            mesh = init_device_mesh(dev.type, (1,), mesh_dim_names=("shard",))
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model, torch.optim.Adam(model.parameters(), lr=1e-3)

        def full(model: Any, optim: Any) -> list[Any]:
            # clone: on a 1-rank mesh full_tensor() is the live local tensor itself
            return [(t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
                    for t in _tensors(model.state_dict(), optim.state_dict())]

        model, optim = build(0)
        model(torch.randn(8, sz.ckpt_width, device=dev)).sum().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        nbytes = sum(t.numel() * t.element_size() for t in full(model, optim))
        res: dict[str, Any] = {"state_bytes": nbytes, "device": str(dev), "saves": []}
        sync = _synchronize(dev)
        url = f"file://{workdir / 'ckpt-f'}"
        with CheckpointManager(url, job="gpucheck-sharded", keep_last=1, fence=None) as mgr:
            for step in (1, 2):  # 1 allocates the pinned buffers, 2 reuses them
                ref = full(model, optim)
                sync()
                t0 = time.perf_counter()
                mgr.save(step, {"model": model, "optim": optim})
                t1 = time.perf_counter()
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
                result = mgr.wait()
                res["saves"].append({"step": step, "save_blocked_s": round(t1 - t0, 4),
                                     "committed_s": round(time.perf_counter() - t0, 3),
                                     "written_bytes": result.nbytes if result else None})
            fresh, fresh_optim = build(1)
            loaded = mgr.load_latest({"model": fresh, "optim": fresh_optim})
            got = full(fresh, fresh_optim)
        res["loaded_step"] = loaded.step if loaded else None
        res["equal"] = len(got) == len(ref) and all(torch.equal(g, r) for g, r in zip(got, ref, strict=True))
        res["peer_reshard"] = _peer_reshard(fresh, fresh_optim, build, full, sync)
        res["dtensors"] = type(next(fresh.parameters())).__name__
        msd, osd = get_state_dict(model, optim)
        sync()
        t0 = time.perf_counter()
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(workdir / "dcp-f"))
        res["dcp_save_sync_s"] = round(time.perf_counter() - t0, 3)
        res["blocked_vs_dcp"] = round(res["saves"][-1]["save_blocked_s"] / max(res["dcp_save_sync_s"], 1e-9), 3)
        shutil.rmtree(workdir / "ckpt-f", ignore_errors=True)
        shutil.rmtree(workdir / "dcp-f", ignore_errors=True)
        res["ok"] = bool(res["equal"] and res["loaded_step"] == 2 and res["dtensors"] == "DTensor"
                         and res["peer_reshard"]["equal"])
        return res
    finally:
        dist.destroy_process_group()


def _peer_reshard(model: Any, optim: Any, build: Any, full: Any, sync: Any) -> dict[str, Any]:
    """f, second part: the live in-memory reshard's data path on the device (what a pure
    FSDP2 job's survivors run after a node loss): the snapshot of the CUDA DTensors to host
    memory, the fill of a differently seeded model's DTensors from it, equality."""
    import torch

    from elasticd.checkpoint import rng
    from elasticd.worker.peer_replica import fill_boxes, take_snapshot
    from elasticd.worker.peer_reshard import apply_replica_state, replica_state

    def named(m: Any) -> tuple[list[str], list[Any]]:
        pairs = list(m.named_parameters())
        return [n for n, _ in pairs], [p for _, p in pairs]

    names, params = named(model)
    ref = full(model, optim)
    sync()
    t0 = time.perf_counter()
    tensors, extra = replica_state({"model": model, "optim": optim}, model, names, params, rng.capture())
    snap = take_snapshot(0, 2, tensors, extra)
    t1 = time.perf_counter()
    other, other_optim = build(2)
    other_names, other_params = named(other)
    state = {"model": other, "optim": other_optim}
    targets = {k: torch.empty_like(t) for k, t in tensors.items()}
    sync()
    t2 = time.perf_counter()
    filled = fill_boxes(targets, {0: snap.chunks}, {0: int(snap.data.numel())}, {0: snap.data})
    apply_replica_state(state, other, other_names, other_params, filled, extra)
    sync()
    t3 = time.perf_counter()
    got = full(other, other_optim)
    return {"snapshot_s": round(t1 - t0, 4), "fill_s": round(t3 - t2, 4),
            "bytes": int(snap.data.numel()),
            "equal": len(got) == len(ref) and all(torch.equal(g, r) for g, r in zip(got, ref, strict=True))}


def _tensors(*trees: Any) -> list[Any]:
    import torch

    out: list[Any] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    for tree in trees:
        walk(tree)
    return out


def _synchronize(dev: Any) -> Any:
    import torch

    return torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


def _stager_pinned() -> bool:
    """Does StateStager give CUDA tensors pinned host buffers? (checked on a small tensor)"""
    import torch

    from elasticd.checkpoint.staging import StateStager

    stager = StateStager()
    staged, event = stager.stage({"x": torch.ones(4, device="cuda")})
    if event is not None:
        event.synchronize()
    pinned = bool(staged["x"].is_pinned())
    stager.release()
    return pinned


# -- main -------------------------------------------------------------------------------------
def summary(results: dict[str, Any]) -> str:
    """The figures, one line each, for the last lines of a log."""
    env, lines = results["environment"], ["== elasticd GPU check: summary =="]
    lines.append(f"mode {results['mode']}; torch {env.get('torch')} CUDA {env.get('cuda')} NCCL "
                 f"{env.get('nccl')}; GPUs {env.get('gpu_count', 0)} {env.get('gpus', '')}")
    tp = results.get("throughput") or {}
    if tp:
        lines.append(f"b throughput [{'ok' if tp.get('ok') else 'FAIL'}]: nproc {tp['nproc']}, "
                     f"{tp.get('steps_per_s')} steps/s (median step {tp.get('median_step_ms')} ms), "
                     f"first step {tp.get('first_step_s')} s after launch, exit {tp.get('exit_code')} "
                     f"in {tp.get('wall_s')} s")
    kd = results.get("recovery") or {}
    k, d = kd.get("kill", {}), kd.get("drain", {})
    if kd:
        lines.append(f"c SIGKILL worker [{'ok' if k.get('ok') else 'FAIL'}]: first new step "
                     f"{k.get('first_new_step_s')} s after the kill (restart {k.get('restart_started_s')} s), "
                     f"resumed from {k.get('resumed_from')} (committed {k.get('committed_before_restart')}, "
                     f"written {k.get('written_at_kill')} at the kill), "
                     f"steps lost {k.get('steps_lost')}, warm standby {k.get('warm_standby_used')} {k.get('note', '')}")
        lines.append(f"c SIGTERM drain [{'ok' if d.get('ok') else 'FAIL'}]: exit {d.get('exit_code')} in "
                     f"{d.get('exit_s')} s, drained at {d.get('drained_step')}, checkpoint "
                     f"{d.get('newest_checkpoint')}, steps lost {d.get('steps_lost')} {d.get('note', '')}")
    lr = results.get("reformation") or {}
    if lr:
        s, j = lr.get("survivor", {}), lr.get("joiner", {})
        lines.append(f"d live re-formation [{'ok' if lr.get('ok') else 'FAIL'}] ({lr.get('backend')}, "
                     f"{lr.get('ranks')} rank(s)): kill -> error {s.get('abort_to_error_s')} s after the "
                     f"abort (failed by itself: {s.get('failed_before_abort')}), new group "
                     f"{s.get('new_group_s')} s, state {j.get('gib')} GiB sent in {s.get('state_sent_s')} s, "
                     f"equal {j.get('state_equal')}")
    ck = results.get("checkpoint") or {}
    for s in ck.get("saves", []):
        lines.append(f"e save #{s['step']} of {ck['state_gib']} GiB ({ck['device']}): save() blocked "
                     f"{s['save_blocked_s']} s, D2H copy done {s['copy_done_s']} s "
                     f"({s['copy_gb_per_s']} GB/s), committed {s['committed_s']} s")
    if ck:
        lines.append(f"e [{'ok' if ck.get('ok') else 'FAIL'}] sync torch.save {ck.get('torch_save_sync_s')} s; "
                     f"loaded == saved: {ck.get('equal')}; pinned host buffers: {ck.get('pinned_buffers')}")
    sh = results.get("sharded") or {}
    if sh:
        warm = (sh.get("saves") or [{}])[-1]
        lines.append(f"f sharded FSDP2 [{'ok' if sh.get('ok') else 'FAIL'}] ({sh.get('device')}, "
                     f"{sh.get('state_bytes')} B): save() blocked {warm.get('save_blocked_s')} s, "
                     f"committed {warm.get('committed_s')} s; sync DCP save {sh.get('dcp_save_sync_s')} s "
                     f"(ratio {sh.get('blocked_vs_dcp')}); loaded == saved: {sh.get('equal')}")
        pr = sh.get("peer_reshard") or {}
        lines.append(f"  in-memory reshard: snapshot {pr.get('snapshot_s')} s, fill {pr.get('fill_s')} s "
                     f"({pr.get('bytes')} B); filled == snapshotted: {pr.get('equal')}")
    for name, err in results.get("errors", {}).items():
        lines.append(f"ERROR in {name}: {err.splitlines()[-1][:300]}")
    lines.append(f"all ok: {results['ok']}; total {results['wall_s']} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-dry-run", action="store_true", help="run b-f on the CPU, tiny sizes")
    p.add_argument("--budget-s", type=float, default=330.0, help="stop everything after this long")
    p.add_argument("--only", default="b,c,d,e,f", help="comma-separated subset of b,c,d,e,f")
    p.add_argument("--workdir", help="scratch directory (default: a temp dir, removed at the end)")
    args = p.parse_args(argv)
    started = time.time()
    out_dir = Path(os.environ.get("OUT") or ".")
    out_path = out_dir / "gpu_check.json"
    import torch

    results: dict[str, Any] = {"mode": "cpu-dry-run" if args.cpu_dry_run else "gpu",
                               "environment": environment(), "errors": {}}
    say(json.dumps({"environment": results["environment"]}))
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        results.update(mode="skipped", ok=True, wall_s=0.0,
                       skipped="CUDA is not available on this machine; run with --cpu-dry-run to "
                       "exercise the script on the CPU")
        say(f"gpu_check: skipped: {results['skipped']}")
        out_path.write_text(json.dumps(results, indent=1))
        return 0
    sz = DRY if args.cpu_dry_run else GPU
    if args.cpu_dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # workers take gloo even on a GPU machine
    nproc = 1 if args.cpu_dry_run else max(1, torch.cuda.device_count())
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="elasticd-gpucheck-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    only = set(args.only.split(","))

    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"--budget-s {args.budget_s:.0f} s exceeded")

    old_alarm = signal.signal(signal.SIGALRM, on_alarm)
    old_term = signal.signal(signal.SIGTERM, on_alarm)
    signal.alarm(max(1, int(args.budget_s)))
    try:
        steps = [("b", "throughput"), ("c", "recovery"), ("d", "reformation"), ("e", "checkpoint"),
                 ("f", "sharded")]
        early: Run | None = None
        if args.cpu_dry_run and {"b", "c"} <= only:
            # No figures to protect on the CPU: b's job runs alongside c's, which keeps the
            # dry run (and its test) short on a small machine.
            early = start_throughput(workdir, nproc, sz, runs)
            steps = [steps[1], steps[0], steps[2], steps[3], steps[4]]
        for key, name in steps:
            if key not in only:
                continue
            say(f"gpu_check: {name} ...")
            try:
                if key == "b":
                    results[name] = throughput(early or start_throughput(workdir, nproc, sz, runs),
                                               nproc, sz)
                elif key == "c":
                    results[name] = kill_and_drain(workdir, nproc, sz, runs)
                elif key == "d":
                    results[name] = probe("gloo" if args.cpu_dry_run else "nccl",
                                          2 if args.cpu_dry_run or torch.cuda.device_count() >= 2 else 1,
                                          8 if args.cpu_dry_run else 1024, 60.0)
                elif key == "e":
                    results[name] = checkpoint(workdir, sz)
                else:
                    results[name] = sharded(workdir, sz)
            except Exception:  # noqa: BLE001 - one failed step must not hide the others
                results["errors"][name] = traceback.format_exc()
                say(traceback.format_exc()[-1500:])
            finally:
                for run in runs:  # every agent of the step, whatever happened
                    if run is not early or key == "b":
                        run.node.kill()
            say(json.dumps({name: _short(results.get(name))}))
            if "budget" in results["errors"].get(name, ""):
                break
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_alarm)
        signal.signal(signal.SIGTERM, old_term)
        for run in runs:
            run.node.kill()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    steps_ok = [results[k].get("ok") for k in ("throughput", "reformation", "checkpoint", "sharded")
                if k in results]
    if "recovery" in results:
        steps_ok += [results["recovery"]["kill"].get("ok"), results["recovery"]["drain"].get("ok")]
    results["ok"] = bool(steps_ok) and all(steps_ok) and not results["errors"] and \
        len([k for k in ("throughput", "recovery", "reformation", "checkpoint", "sharded")
             if k in results]) == len(only & {"b", "c", "d", "e", "f"})
    results["wall_s"] = round(time.time() - started, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1, default=str))
    say(summary(results))
    say(f"results: {out_path}")
    return 0 if results["ok"] else 1


def _short(value: Any) -> Any:
    """A result without its log tails (they are in the JSON file)."""
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items() if k != "tail"}
    return value


if __name__ == "__main__":
    sys.exit(main())
