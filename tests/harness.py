"""Test harness: "nodes" as real agent processes on this machine, and real faults.

A node is an ``elasticd run`` (or ``torchrun``) process started in a session of its own,
plus every descendant (torch starts workers in sessions of their own). A fault must reach
the whole node, so ``Node.signal`` walks the process tree from /proc.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from elasticd.process import descendants

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def children_of(pid: int) -> list[int]:
    """All descendants of ``pid`` (from /proc), deepest last."""
    return descendants(pid)


def wait_until(pred: Callable[[], object], timeout_s: float, what: str | Callable[[], str],
               interval_s: float = 0.05):
    """Poll ``pred`` until truthy; fail the test with ``what`` (or what it returns: the last
    state seen) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {said}")
        time.sleep(interval_s)


# Environment variables read at import time (by Python, torch, gRPC, the loader): a node
# whose values differ from the zygote's starts as a fresh interpreter instead.
_IMPORT_TIME_ENV = ("PYTHON", "LD_", "TORCH", "GRPC_", "OMP_", "MKL_", "CUDA", "NCCL_",
                    "GLOO_", "KMP_", "TF_", "PYTORCH")
_ELASTICD_RUN = [PY, "-m", "elasticd.cli", "run"]


class ForkedProc:
    """A ``subprocess.Popen``-like handle on an agent the zygote forked (its parent is the
    zygote, which reports its exit status)."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, timeout_s=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self.zygote.exit_code(self.pid, timeout_s=timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout or 0)
            self.returncode = code
        return self.returncode


class _Zygote:
    """The client side of ``tests/elasticd_zygote.py`` (one per pytest process)."""

    def __init__(self) -> None:
        import threading

        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
        self.proc = subprocess.Popen([PY, str(Path(__file__).with_name("elasticd_zygote.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env,
                                     cwd=str(ROOT))
        self._lock, self._cond = threading.Lock(), threading.Condition()
        self._exits: dict[int, int] = {}
        self._replies: list[dict] = []
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()
        self._reply(120)  # {"ready": pid}: its imports are done

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            doc = json.loads(line)
            with self._cond:
                if "exit" in doc:
                    self._exits[doc["exit"]] = doc["code"]
                else:
                    # A reused pid: its earlier exit is not this child's (the zygote answers
                    # a fork before it can reap that child).
                    self._exits.pop(doc.get("pid", -1), None)
                    self._replies.append(doc)
                self._cond.notify_all()
        with self._cond:
            self._replies.append({"error": "the zygote exited"})
            self._cond.notify_all()

    def _reply(self, timeout_s: float) -> dict:
        with self._cond:
            if not self._cond.wait_for(lambda: self._replies, timeout_s):
                raise RuntimeError("the agent zygote did not answer")
            return self._replies.pop(0)

    def usable_for(self, env: dict[str, str]) -> bool:
        """Whether a node with ``env`` may be forked: the same import-time environment."""
        return all(env.get(k) == self.env.get(k) for k in {*env, *self.env}
                   if k.startswith(_IMPORT_TIME_ENV))

    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path) -> ForkedProc:
        assert self.proc.stdin is not None
        with self._lock:
            req = {"argv": argv[3:], "env": env, "log": str(log_path), "cwd": str(ROOT)}
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            doc = self._reply(30)
        if "pid" not in doc:
            raise RuntimeError(f"the agent zygote could not fork: {doc}")
        return ForkedProc(self, doc["pid"])

    def exit_code(self, pid: int, timeout_s: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits, timeout_s)
            return self._exits.get(pid)


_zygote: _Zygote | None = None


def _agent_zygote() -> _Zygote | None:
    """This process's zygote, started at the first agent (None: ELASTICD_TEST_ZYGOTE=0)."""
    global _zygote
    if os.environ.get("ELASTICD_TEST_ZYGOTE", "1") == "0":
        return None
    if _zygote is None or _zygote.proc.poll() is not None:
        _zygote = _Zygote()
    return _zygote


class Node:
    """One agent process (and its workers) started with ``argv`` in its own session.

    ``elasticd run`` nodes are forked from the agent zygote (``tests/elasticd_zygote.py``:
    the agent's imports are done once per pytest process) unless their environment differs
    in what is read at import time; other commands start as given."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.argv, self.log_path = argv, log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in cleanup()
        full_env = {**os.environ, **env}
        zygote = _agent_zygote() if argv[:4] == _ELASTICD_RUN else None
        self.proc: subprocess.Popen | ForkedProc
        if zygote is not None and zygote.usable_for(full_env):
            self.proc = zygote.spawn(argv, full_env, log_path)
        else:
            self.proc = subprocess.Popen(argv, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(ROOT))
        self.pid = self.proc.pid

    def tree(self) -> list[int]:
        return [self.pid, *children_of(self.pid)]

    def signal(self, sig: int) -> None:
        """Deliver ``sig`` to the agent and every descendant (the whole node)."""
        for pid in self.tree():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def signal_agent(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def cleanup(self) -> None:
        """Kill whatever is left of the node (SIGCONT first, in case it is stopped)."""
        pids = self.tree()
        for pid in pids:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def elasticd_argv(etcd: str, job: str, script: str, *, nnodes: str = "1:3", nproc: int = 1,
                  node_id: str | None = None, extra: list[str] | None = None,
                  script_args: list[str] | None = None, standby_refill: bool = False) -> list[str]:
    """``elasticd run`` for a test node. Its standbys are not refilled once the workers
    train (``--no-standby-refill``) unless ``standby_refill``: a refill is a torch import
    that a short test job rarely uses (about 15 % of an agent test's CPU), and the tests
    about restarts from standbys ask for it."""
    argv = [PY, "-m", "elasticd.cli", "run", "--etcd", etcd, "--job", job, "--nnodes", nnodes,
            "--nproc-per-node", str(nproc), "--node-ttl", "2", "--local-addr", "127.0.0.1",
            "--log-format", "json"]
    if not standby_refill:
        argv.append("--no-standby-refill")
    if node_id:
        argv += ["--node-id", node_id]
    return argv + (extra or []) + [script] + (script_args or [])


def rows_after(rows: list[dict], old_world: int, new_world: int, key: str = "world") -> list[dict]:
    """Rows at ``new_world`` written after the last row at ``old_world`` (rows are appended
    in time order). A node alone at the start trains at a smaller world size until its peer
    joins: those early rows are not the ones after a kill or a drain."""
    ends = [i for i, r in enumerate(rows) if r[key] == old_world]
    return [r for r in rows[ends[-1]:] if r[key] == new_world] if ends else []


@dataclass
class _Parsed:
    """What ``read_jsonl`` parsed of one file: its rows up to ``offset`` (whole lines)."""

    inode: int
    offset: int
    check: bytes  # the bytes just before ``offset``: a file rewritten in place is reparsed
    rows: list[dict]


_PARSED: dict[str, _Parsed] = {}
_CHECK_BYTES = 64


def _parse_lines(data: bytes) -> list[dict]:
    out = []
    for line in data.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line torn by a kill
    return out


def read_jsonl(path: Path) -> list[dict]:
    """Every row of a JSON-lines file that parses (a line torn by a kill does not), in order.

    Tests poll growing ledgers many times a second: what was parsed of the file's whole
    lines is kept and only what was appended since is read (the last line, not yet ended by
    a newline, is parsed on each call as before). A file replaced or rewritten is reparsed.
    """
    key = str(path)
    try:
        with open(path, "rb") as fh:
            inode = os.fstat(fh.fileno()).st_ino
            seen = _PARSED.get(key)
            data = b""
            if seen is not None and seen.inode == inode:
                fh.seek(seen.offset - len(seen.check))
                data = fh.read()
            if seen is None or seen.inode != inode or not data.startswith(seen.check):
                fh.seek(0)
                data = fh.read()
                seen = _PARSED[key] = _Parsed(inode, 0, b"", [])
            data = data[len(seen.check):]
    except FileNotFoundError:
        _PARSED.pop(key, None)
        return []
    whole = data.rfind(b"\n") + 1
    if whole:
        seen.rows.extend(_parse_lines(data[:whole]))
        seen.offset += whole
        seen.check = (seen.check + data[:whole])[-_CHECK_BYTES:]
    return seen.rows + _parse_lines(data[whole:])


def worker_lines(log_text: str, *, local_rank: int = 0) -> list[str]:
    """What one local rank printed, from a node log in JSON mode (the harness's default):
    each worker line is a ``worker_output`` event (elasticd.agent.worker_logs)."""
    out = []
    for line in log_text.splitlines():
        if "worker_output" not in line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("event") == "worker_output" \
                and obj.get("local_rank") == local_rank:
            out.append(obj["line"])
    return out


def event_time(event: dict) -> float:
    """An agent event's ``timestamp`` (ISO 8601, UTC, ``...Z``) as Unix seconds."""
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def agent_events(log_text: str, event: str) -> list[dict]:
    """The agent's JSON log lines (the harness's default format) of one event, in order."""
    out = []
    for line in log_text.splitlines():
        if event not in line:  # no need to parse it (tests poll long logs)
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("event") == event:
            out.append(obj)
    return out


def decisions(nodes: list[Node]) -> str:
    """The agents' decisions (``agent_decided``) of ``nodes``, one line each, for an
    assertion's message: CI shows a failure's head, where the nodes' digests may not fit."""
    lines = []
    for node in nodes:
        for e in agent_events(node.log(), "agent_decided"):
            lines.append(f"{e.get('timestamp', '')[11:23]} {node.log_path.stem} round "
                         f"{e.get('round')} {e.get('verdict')}: {e.get('reason', '')[:160]}")
    return "\n".join(sorted(lines))


def pids_by_round(rows: list[dict]) -> str:
    """Which worker pid trained which (round, rank, world), from its first step: one line
    each, for an assertion's message."""
    first: dict[tuple, int] = {}
    for r in rows:
        first.setdefault((r["round"], r["rank"], r["world"], r["pid"]), r["step"])
    return "\n".join(f"round {k[0]} rank {k[1]} world {k[2]} pid {k[3]} from step {v}"
                     for k, v in sorted(first.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])))


def no_leftovers(nodes: list[Node]) -> list[int]:
    """PIDs of any node process still alive (should be empty after cleanup)."""
    from elasticd.process import pid_alive

    return [p for n in nodes for p in [n.pid, *children_of(n.pid)] if pid_alive(p)]


def trained_samples(trace_path: Path) -> Counter:
    """Multiset of (epoch, sample) from an example ``--trace`` file, counting each step's
    final attempt only (its highest round): steps after the last checkpoint are retrained
    after a failure, and only the final attempt is in the model."""
    rows = read_jsonl(trace_path)
    last: dict[int, int] = {}
    for r in rows:
        last[r["step"]] = max(last.get(r["step"], -1), r["round"] or 0)
    counts: Counter = Counter()
    if rows and all("global" in r for r in rows):
        # Rows carry the step's whole global batch: count each step once, from any row of
        # its final attempt (after a live re-formation a step completed by one survivor is
        # in the model with every rank's share, though only that survivor wrote its row).
        seen: set[int] = set()
        for r in rows:
            if (r["round"] or 0) == last[r["step"]] and r["step"] not in seen:
                seen.add(r["step"])
                counts.update((r["epoch"], i) for i in r["global"])
        return counts
    for r in rows:
        if (r["round"] or 0) == last[r["step"]]:
            counts.update((r["epoch"], i) for i in r["idx"])
    return counts


def example_args(tmp_path: Path, tag: str, *, steps: int, dataset_size: int) -> list[str]:
    """Arguments of examples/train.py for exact-comparison tests (float64, tracing on)."""
    return ["--steps", str(steps), "--dataset-size", str(dataset_size), "--global-batch", "24",
            "--micro-batch", "8", "--dtype", "float64", "--checkpoint-every", "5",
            "--step-sleep", "0.04", "--trace", str(tmp_path / f"trace-{tag}.jsonl"),
            "--final-params", str(tmp_path / f"final-{tag}.pt")]


def end_job(end_file: Path, trace: Path | int, *, margin: int = 10, epoch_steps: int = 1) -> int:
    """End a job of examples/train.py started with ``--end-file end_file`` on the test's
    word, after the phase it is about: every rank trains ``margin`` steps past the newest
    step in ``trace`` (or past that step, given as a number), rounded up to whole epochs
    of ``epoch_steps`` steps (so that "every sample exactly once" stays checkable), and
    finishes as ``--steps`` would have it. ``margin`` covers the steps the job trains
    between the test's reading of the trace and its write.

    Returns:
        The job's step count now (its last step is one less).
    """
    newest = trace if isinstance(trace, int) else max((r["step"] for r in read_jsonl(trace)),
                                                       default=-1)
    total = -(-(newest + 1 + margin) // epoch_steps) * epoch_steps
    staged = end_file.with_name(end_file.name + ".staged")
    staged.write_text(str(total))
    os.replace(staged, end_file)  # whole or absent: a rank never reads half a number
    return total


# Fault schedules ------------------------------------------------------------------------
@dataclass(frozen=True)
class Fired:
    """What the trace showed when a phase of a :class:`FaultSchedule` fired."""

    name: str
    rows: int  # trace rows written before the phase's action
    round: int  # newest round in the trace then
    step: int  # newest step in the trace then (-1: none yet)
    at: float  # time.monotonic() of the action


Trigger = Callable[[list[dict], Fired | None], bool]


def at_step(step: int, *, world: int | None = None, ranks: int | None = None,
            world_key: str = "world") -> Trigger:
    """Fires once the trace has a row of ``step`` or later (at ``world``, from at least
    ``ranks`` distinct ranks) written after the previous phase fired."""
    def fired(rows: list[dict], prev: Fired | None) -> bool:
        seen = {r["rank"] for r in rows[prev.rows if prev else 0:]
                if r["step"] >= step and (world is None or r[world_key] == world)}
        return len(seen) >= (ranks or 1)
    return fired


def in_newer_round(*, world: int | None = None, rank: int | None = None,
                   world_key: str = "world") -> Trigger:
    """Fires once a row of a round newer than the one at the previous phase is in the
    trace (at ``world``, from ``rank``): the job re-formed after that phase's fault."""
    def fired(rows: list[dict], prev: Fired | None) -> bool:
        old = prev.round if prev else -1
        return any((r["round"] or 0) > old and (world is None or r[world_key] == world)
                   and (rank is None or r["rank"] == rank) for r in rows)
    return fired


class FaultSchedule:
    """A multi-phase fault schedule over one job, keyed by (node, step or event), in the
    manner of torchft's ``EventInjector``: each phase waits (polling the job's trace against
    its own deadline) for its trigger, then acts, and remembers what the trace showed, so
    that later triggers and the test's assertions can refer to it::

        fired = (FaultSchedule(trace)
                 .when(at_step(14, world=2), "step 14 at world 2").kill(b)
                 .when(in_newer_round(world=1), "world 1 after the kill").start(lambda: ...)
                 .when(in_newer_round(world=2), "world 2 after the join").mark()
                 .run())

    A phase's trigger sees the rows and the previous phase's :class:`Fired` record (None
    for the first). Nothing sleeps in place of an event; a trigger that never fires fails
    the test naming the phase.
    """

    def __init__(self, trace: Path, *, timeout_s: float = 120.0) -> None:
        self.trace, self.timeout_s = trace, timeout_s
        self._phases: list[tuple[str, Trigger, float, Callable[[], object]]] = []
        self._pending: tuple[str, Trigger, float] | None = None
        self.fired: dict[str, Fired] = {}
        self.results: dict[str, object] = {}

    def when(self, trigger: Trigger, name: str, *, timeout_s: float | None = None) -> FaultSchedule:
        """The next action waits for ``trigger``; ``name`` labels the phase (unique)."""
        if self._pending is not None:
            raise ValueError(f"phase {self._pending[0]!r} has no action")
        if name in {p[0] for p in self._phases}:
            raise ValueError(f"two phases named {name!r}")
        self._pending = (name, trigger, timeout_s or self.timeout_s)
        return self

    def do(self, action: Callable[[], object]) -> FaultSchedule:
        """Run ``action`` when the pending trigger fires (its value is kept in ``results``)."""
        if self._pending is None:
            raise ValueError("an action needs a when() before it")
        self._phases.append((*self._pending, action))
        self._pending = None
        return self

    def kill(self, node: Node, sig: int = signal.SIGKILL) -> FaultSchedule:
        """Signal the node's whole process tree (SIGKILL: the node dies)."""
        return self.do(lambda: node.signal(sig))

    def signal_agent(self, node: Node, sig: int = signal.SIGTERM) -> FaultSchedule:
        """Signal the node's agent only (SIGTERM: a drain)."""
        return self.do(lambda: node.signal_agent(sig))

    def start(self, make: Callable[[], Node]) -> FaultSchedule:
        """Start a node (a join); the Node is kept in ``results`` under the phase's name."""
        return self.do(make)

    def mark(self) -> FaultSchedule:
        """No action: the phase only records when its trigger fired."""
        return self.do(lambda: None)

    def run(self) -> dict[str, Fired]:
        """Run every phase in order; returns each phase's record by name.

        Raises:
            AssertionError: a phase's trigger did not fire within its timeout (named).
        """
        if self._pending is not None:
            raise ValueError(f"phase {self._pending[0]!r} has no action")
        prev: Fired | None = None
        for name, trigger, timeout_s, action in self._phases:
            rows = wait_until(lambda t=trigger, p=prev: _rows_if(self.trace, t, p), timeout_s,
                              f"phase {name!r}")
            prev = self.fired[name] = Fired(
                name, len(rows), max((r["round"] or 0 for r in rows), default=0),
                max((r["step"] for r in rows), default=-1), time.monotonic())
            self.results[name] = action()
        return self.fired


def _rows_if(trace: Path, trigger: Trigger, prev: Fired | None) -> list[dict] | None:
    rows = read_jsonl(trace)
    return rows if rows and trigger(rows, prev) else None
