"""Shared pieces of the launcher benchmarks: nodes as process trees, faults, logs, reporting.

A "node" is one launcher process (``elasticd run`` or ``torchrun``) started in a session
of its own, plus all its descendants. torch starts workers in sessions of their own and
torchrun's workers do not die with their launcher, so a fault to a whole node walks the
process tree from /proc, and every process ever seen in a node's tree is remembered (by
PID *and* start time, so a recycled PID is never signalled) and killed at the end.

Nothing here imports the tests: the benchmarks must run from a plain checkout.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DOC = ROOT / "docs" / "benchmarks.md"


# -- etcd's own metrics -------------------------------------------------------------------
def scrape_etcd(endpoint: str, counters: dict[str, tuple[str, str | None]]) -> dict[str, float]:
    """Sum etcd's Prometheus counters: ``{key: (metric name, label substring or None)}``."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    out = dict.fromkeys(counters, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        for key, (metric, label) in counters.items():
            if name == metric and (label is None or label in name_labels):
                out[key] += float(value)
    return out


# -- processes ---------------------------------------------------------------------------
def stat_fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (identifies it with its PID)."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields else None


def children_of(pid: int) -> list[int]:
    """All live descendants of ``pid``, from /proc."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(int(entry))
            if fields:
                kids.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class NodeProc:
    """One launcher process and its descendants, started in a session of its own.

    Output (stdout and stderr) goes through a reader thread that stamps every line with
    its arrival time: ``lines`` holds ``(time, text)`` and the log file gets them too.

    Args:
        name: a label for the reports.
        argv: the command.
        env: extra environment.
        log_path: where the node's stamped output is written.
        on_line: called with ``(time, text)`` for every line (from the reader thread).
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path,
                 on_line: Callable[[float, str], None] | None = None) -> None:
        self.name, self.argv, self.log_path = name, argv, log_path
        self.lines: list[tuple[float, str]] = []
        self._on_line = on_line
        self._seen: dict[int, int] = {}
        self._log = open(log_path, "a", buffering=1)  # noqa: SIM115 - closed in kill()
        self.started_at = time.time()
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd=str(ROOT))
        self.pid = self.proc.pid
        self._remember([self.pid])
        self._reader = threading.Thread(target=self._read, name=f"read:{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            now = time.time()
            text = raw.decode(errors="replace").rstrip("\n")
            self.lines.append((now, text))
            try:
                self._log.write(f"{now:.3f} {text}\n")
            except ValueError:
                pass  # log closed during cleanup
            if self._on_line is not None:
                self._on_line(now, text)

    def _remember(self, pids: Iterable[int]) -> None:
        for pid in pids:
            ticks = start_ticks(pid)
            if ticks is not None:
                self._seen.setdefault(pid, ticks)

    def tree(self) -> list[int]:
        """The launcher and its live descendants (and remember them for cleanup)."""
        pids = [self.pid, *children_of(self.pid)] if self.alive() else []
        self._remember(pids)
        return pids

    def refresh(self) -> None:
        """Record the current process tree (call while the node runs, before faults)."""
        self.tree()

    def signal_node(self, sig: int) -> float:
        """Deliver ``sig`` to the launcher and every descendant at once. Returns the time."""
        pids = self.tree()
        now = time.time()
        for pid in pids:
            _kill(pid, sig)
        return now

    def signal_launcher(self, sig: int) -> float:
        """Deliver ``sig`` to the launcher process only (systemd's ``KillMode=mixed``)."""
        self.refresh()
        now = time.time()
        _kill(self.pid, sig)
        return now

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGCONT + SIGKILL to every process ever seen in this node's tree, then reap."""
        self.refresh()
        for pid, ticks in list(self._seen.items()):
            if start_ticks(pid) == ticks:  # still the same process, not a recycled PID
                _kill(pid, signal.SIGCONT)
                _kill(pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(timeout=2)
        self._log.close()


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Cluster:
    """The nodes of one benchmark run; all are killed on exit (also on Ctrl-C)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.nodes: list[NodeProc] = []
        self.extra_cleanup: list[Callable[[], None]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              on_line: Callable[[float, str], None] | None = None) -> NodeProc:
        node = NodeProc(name, argv, env or {}, self.workdir / f"{name}.log", on_line)
        self.nodes.append(node)
        return node

    def refresh(self) -> None:
        for n in self.nodes:
            n.refresh()

    def close(self) -> None:
        for n in self.nodes:
            n.kill()
        for fn in self.extra_cleanup:
            fn()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so ``finally`` blocks kill what we started."""
    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


# -- waiting and parsing -----------------------------------------------------------------
def wait_until(pred: Callable[[], Any], timeout_s: float, interval_s: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something truthy; ``None`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval_s)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_jsonl(path: Path) -> list[dict]:
    """Every whole JSON object line of ``path`` (torn lines of a killed process skipped)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def json_in_line(text: str) -> dict | None:
    """The JSON object in a log line, after any launcher prefix such as ``[default0]:``;
    a JSON-mode agent's ``worker_output`` event yields the object the worker printed."""
    i = text.find("{")
    if i < 0:
        return None
    try:
        rec = json.loads(text[i:])
    except ValueError:
        return None
    if isinstance(rec, dict) and rec.get("event") == "worker_output" and isinstance(rec.get("line"), str):
        return json_in_line(rec["line"])
    return rec if isinstance(rec, dict) else None


def iso_to_epoch(stamp: str) -> float:
    """structlog's ISO UTC timestamp -> seconds since the epoch."""
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


# -- statistics and reporting --------------------------------------------------------------
def summary(values: list[float | None], fmt: str = "{:.1f}") -> str:
    """``median (min–max)`` of the values that are not None; ``n/a`` if none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "n/a"
    med = fmt.format(statistics.median(vals))
    if len(vals) == 1:
        return med
    return f"{med} ({fmt.format(min(vals))}–{fmt.format(max(vals))})"


def median_or_none(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _version_of(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    m = re.search(r"(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else "?"


def machine_info() -> dict[str, str]:
    """What the results depend on: CPUs, RAM, versions, the date, the load when we began."""
    import torch

    from elasticd import __version__
    from elasticd.etcd.embedded import find_etcd_binary

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": str(os.cpu_count()),
        "cpu": cpu,
        "ram": f"{mem_gib:.0f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "elasticd": __version__,
        "etcd": _version_of([find_etcd_binary(), "--version"]),
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }


def machine_line(info: dict[str, str]) -> str:
    return (f"{info['date']}; {info['cpus']} CPUs ({info['cpu']}), {info['ram']} RAM, "
            f"{info['os']}; Python {info['python']}, torch {info['torch']}, "
            f"elasticd {info['elasticd']}, etcd {info['etcd']}; load average at start "
            f"{info['load']}")


def other_load() -> list[str]:
    """Command lines of busy processes that are not ours (to say the machine was shared)."""
    mine = {os.getpid(), *children_of(os.getpid())}
    busy = []
    try:
        out = subprocess.run(["ps", "-eo", "pid,pcpu,args", "--sort=-pcpu"], capture_output=True,
                             text=True, timeout=10).stdout.splitlines()[1:]
    except (OSError, subprocess.TimeoutExpired):
        return []
    for line in out:
        parts = line.split(None, 2)
        if len(parts) == 3 and int(parts[0]) not in mine and float(parts[1]) >= 10.0:
            busy.append(parts[2][:100])
    return busy


def replace_generated_block(heading: str, tag: str, body: str, generator: str = "",
                            path: Path = DOC) -> None:
    """Write ``body`` into section ``## heading`` of ``path``, between generated-block markers.

    Text of the section outside the markers (hand-written analysis) is kept; a block not
    yet in the section is added at its end; a missing section is appended to the file.
    The file is shared with other benchmarks: only our section is touched, and the
    read-modify-write is kept short.
    """
    begin = f"<!-- BEGIN {tag}: generated by {generator or f'benchmarks/{tag}.py'}; edits are overwritten -->"
    end = f"<!-- END {tag} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^## {re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    m = pattern.search(text)
    if m is None:
        text = text.rstrip("\n") + f"\n\n## {heading}\n\n{block}\n"
    else:
        section = m.group(0)
        old = re.search(rf"<!-- BEGIN {re.escape(tag)}:.*?-->.*?{re.escape(end)}", section, re.S)
        if old:
            section = section[:old.start()] + block + section[old.end():]
        else:
            section = section.rstrip("\n") + f"\n\n{block}\n\n"
        text = text[:m.start()] + section + text[m.end():]
        text = text.rstrip("\n") + "\n"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# -- what runs on the nodes ----------------------------------------------------------------
BENCH_WORKER = "benchmarks/bench_worker.py"
TORCHFT_WORKER = "benchmarks/torchft_worker.py"  # torchft's loop; writes bench_worker's lines
TRAIN_SCRIPT = "examples/train.py"


class StepSource:
    """Per-step records ``{"step", "world", "time", "rank"}`` of one run, from either script.

    ``benchmarks/bench_worker.py`` appends its own stamped lines to a file (every rank).
    ``examples/train.py`` prints one JSON line per step on rank 0 only and no time: those
    lines are picked out of the nodes' output and stamped on arrival (torch's log tee
    polls every 0.1 s under elasticd; torchrun's workers write to its stdout directly).

    Args:
        script: the training script (relative to the repository root).
        workdir: this run's scratch directory.
        step_s: the per-step padding handed to the script.
    """

    def __init__(self, script: str, workdir: Path, step_s: float = 0.02,
                 extra: list[str] | None = None) -> None:
        self.script = script
        self.extra = list(extra or [])  # more script arguments (e.g. fsdp_train.py --mesh hsdp --live)
        self.workdir = workdir
        self.step_s = step_s
        self.out = workdir / "steps.jsonl"
        self.ckpt = workdir / "ckpt.json"
        self._lines: list[dict] = []
        self._lock = threading.Lock()

    @property
    def is_bench(self) -> bool:
        return Path(self.script).name in (Path(BENCH_WORKER).name, Path(TORCHFT_WORKER).name)

    def args(self) -> list[str]:
        """The script and its arguments."""
        if self.is_bench:
            return [self.script, "--out", str(self.out), "--ckpt", str(self.ckpt),
                    "--step-s", str(self.step_s)]
        return [self.script, "--steps", "100000000", "--step-sleep", str(self.step_s),
                "--checkpoint-url", f"file://{self.workdir / 'checkpoints'}", *self.extra]

    def on_line(self, now: float, text: str) -> None:
        """Feed one output line of a node (only used for examples/train.py)."""
        if self.is_bench:
            return
        rec = json_in_line(text)
        if rec is None or rec.get("event") not in (None, "started", "drained"):
            return
        if rec.get("event") == "drained":
            rec = {"event": "stopped", "step": rec.get("step"), "rank": 0, "time": now}
        elif rec.get("event") == "started":
            rec = {"event": "start", "rank": 0, "world": rec.get("world_size"), "ready": now,
                   "resume": (rec.get("resumed_from") if rec.get("resumed_from") is not None
                              else -1) + 1}
        elif "step" in rec and "world_size" in rec:
            rec = {"step": rec["step"], "world": rec["world_size"], "time": now, "rank": 0,
                   "round": rec.get("round")}
        else:
            return
        with self._lock:
            self._lines.append(rec)

    def records(self) -> list[dict]:
        """Every line so far: steps and ``event`` lines."""
        if self.is_bench:
            return read_jsonl(self.out)
        with self._lock:
            return list(self._lines)

    def ranks_per_step(self, world: int) -> int:
        """How many lines one step at ``world`` produces (all ranks, or rank 0 only)."""
        return world if self.is_bench else 1


def newer_rounds(records: list[dict], t0: float) -> list[dict]:
    """The records without the steps of the round that trained at ``t0`` or before (a step
    line stamped on arrival after a fault may still be the old group's: its last step can
    complete after the kill lands). Records without a round are kept."""
    before = [int(r["round"]) for r in records if "step" in r and "event" not in r
              and r.get("round") is not None and float(r["time"]) <= t0]
    if not before:
        return records
    old = max(before)
    return [r for r in records if "step" not in r or "event" in r or r.get("round") is None
            or int(r["round"]) > old]


def first_step_at(records: list[dict], world: int, after: float, ranks: int) -> tuple[int, float] | None:
    """(step, time) of the first step at ``world`` begun after ``after`` that every rank finished.

    The time is that of the last rank's line for the step.
    """
    by_step: dict[int, list[float]] = {}
    for r in records:
        if "step" in r and "event" not in r and r.get("world") == world and r["time"] > after:
            by_step.setdefault(int(r["step"]), []).append(float(r["time"]))
    for step in sorted(by_step):
        if len(by_step[step]) >= ranks:
            return step, max(by_step[step])
    return None


def steps_at(records: list[dict], world: int, after: float = 0.0) -> int:
    """How many distinct steps were logged at ``world`` after ``after``."""
    return len({r["step"] for r in records
                if "step" in r and "event" not in r and r.get("world") == world and r["time"] > after})


def elasticd_argv(etcd: str, job: str, name: str, nnodes: str, nproc: int,
                  script_args: list[str], log_dir: Path) -> list[str]:
    """An ``elasticd run`` node as the brief fixes it (TTL 2 s, JSON logs, 127.0.0.1)."""
    return [PY, "-m", "elasticd.cli", "run", "--etcd", etcd, "--job", job, "--nnodes", nnodes,
            "--nproc-per-node", str(nproc), "--node-ttl", "2", "--local-addr", "127.0.0.1",
            "--log-format", "json", "--node-id", name, "--log-dir", str(log_dir), *script_args]


TORCHRUN_TUNED_CONF = "last_call_timeout=1,keep_alive_interval=1"
# With the agent's TCP store shared with the workers (torch's default), a scale-up hung in
# earlier measurements on this machine; every torchrun run here disables the sharing.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_argv(port: int, job: str, nnodes: str, nproc: int, script_args: list[str],
                  rdzv_conf: str | None, log_dir: Path, backend: str = "c10d") -> list[str]:
    """A ``torchrun`` node on the ``backend`` rendezvous (``rdzv_conf`` None: torch's defaults).

    ``backend`` is ``c10d`` (the store on port ``port`` of the first node) or ``etcd-v3``
    (elasticd's handler through torchrun's entry point; ``port`` is the etcd client port).
    ``--max-restarts 100``: torchrun's default of 0 ends the job at the first worker
    failure, and a peer's death is a worker failure to torchrun.
    """
    argv = [PY, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
            "--rdzv-backend", backend, "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job,
            "--max-restarts", "100", "--local-addr", "127.0.0.1", "--log-dir", str(log_dir)]
    if rdzv_conf:
        argv += ["--rdzv-conf", rdzv_conf]
    return argv + script_args


def port_listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False
