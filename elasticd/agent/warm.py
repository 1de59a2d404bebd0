"""Warm standby workers: one process per local rank that has already imported torch.

Starting a worker from scratch costs about 3 s before its first step on a quiet machine
(importing torch ~1.6 s; the first optimizer or DDP use imports ``torch._dynamo``, ~1.2 s)
and 4–8 s when several workers start at once on few cores. Every recovery pays it. So
once a worker group is training, the agent starts a *standby* per local rank:
``python -m elasticd.agent.warm`` imports what every worker imports, then blocks reading
one line from its stdin. At the next restart the agent hands each standby its worker's
environment, argv, working directory and log files; the standby takes them over and runs
the worker exactly as ``elasticd.agent.worker_exec`` would.

Safety rules (when in doubt, start cold):

- A standby is used only if its environment equals the worker's except for the variables
  the launcher sets per worker and round (ranks, world sizes, master address, restart
  count, error file, ``TORCHELASTIC_*``, round): anything read at import time
  (``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``, ``[workers.env]``) is then the same as for
  a cold start. So the first workers' standbys can start with the agent, before the
  first round is known.
- Only the agent's own launcher line (``python -m elasticd.agent.worker_exec ...`` with the
  agent's interpreter) is replaced; anything else (a NUMA wrapper, say) starts cold.
- A standby that died, or is still importing, is not waited for: a dead one is replaced,
  a busy one simply starts the worker when its imports are done (still sooner than cold).
- Standbys die with the agent (``PR_SET_PDEATHSIG``) and are killed by process group when
  the agent exits, so none outlives it.
- The first workers' standbys start before the agent itself imports torch
  (``elasticd.agent.early``), at the normal CPU priority (nothing trains on the node yet):
  a node joining a running job is ready about one torch import after its agent started,
  not two. elasticd's own per-agent variables (:data:`AGENT_ENV`) are not compared: some
  are known only later (the run id comes from etcd), none is read at import time, and the
  hand-over sets them.

Preloading ``torch._dynamo`` changes when a DDP model is freed (by reference count as
``main()`` returns, not by a later GC pass), which used to make torch's gloo teardown
deadlock far more often under standbys; ``elasticd.teardown`` removes that race for cold
and warm workers alike (see its docstring).

Scripts that must set import-time state themselves *before* importing torch (e.g. an
``os.environ[...]`` line at the top of the script) should set it in ``[workers.env]``
instead, or turn standbys off (``workers.warm_start = false``, ``--no-warm-start``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from elasticd.agent.worker_env import scrub
from elasticd.control import handover
from elasticd.control.api import (
    ENV_AGENT_PID,
    ENV_CHECKPOINT_URL,
    ENV_CONTROL_DIR,
    ENV_CONTROL_SOCKET,
    ENV_JOB,
    ENV_LIVE,
    ENV_LIVE_TIMEOUT,
    ENV_LOG_FORMAT,
    ENV_NODE,
    ENV_RESUME,
    ENV_ROUND,
    ENV_RUN_ID,
    ENV_SPARE,
)

log = structlog.get_logger(__name__)

LAUNCHER = ("-m", "elasticd.agent.worker_exec")

# What a standby imports ahead of its worker. Names, not imports: the standby process
# becomes a worker, but the agent's code never depends on the worker API (elasticd.control
# is the only seam between them).
WARM_IMPORTS = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "torch.optim",
                "elasticd.worker")

# Variables the launcher sets per worker and round (torch's LocalElasticAgent and ours);
# none is read when torch is imported. Everything else must match for a standby to be used.
PER_ROUND_ENV = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", ENV_ROUND,
})
PER_ROUND_PREFIXES = ("TORCHELASTIC_",)
# elasticd's own variables, set by the agent for all its workers. The worker API and the
# launcher read them only once the worker runs (elasticd.worker.context, worker_exec.main),
# never at import time, and the hand-over sets them; some are known only after the agent
# reached etcd (the run id), long after a standby that starts with the agent began importing.
AGENT_ENV = frozenset({
    ENV_JOB, ENV_NODE, ENV_AGENT_PID, ENV_CONTROL_DIR, ENV_CONTROL_SOCKET, ENV_CHECKPOINT_URL,
    ENV_LOG_FORMAT, ENV_LIVE, ENV_LIVE_TIMEOUT, ENV_RUN_ID, ENV_RESUME, ENV_SPARE,
})
URGENT_FLAG = "--urgent"  # argv of a standby that imports at the normal priority


def _per_round(name: str) -> bool:
    return name in PER_ROUND_ENV or name in AGENT_ENV or name.startswith(PER_ROUND_PREFIXES)


def past_imports(pid: int) -> bool:
    """True once process ``pid`` has imported torch and reached its process group, from /proc.

    Lets the agent refill standbys as soon as a plain script's workers run, without
    competing with their imports: libtorch is mapped early in ``import torch`` (0.1 s into
    a 1.3 s import here), so the sign that the imports are over is the first socket, opened
    by ``init_process_group`` (or the worker API's control channel). False when /proc
    cannot tell.
    """
    try:
        with open(f"/proc/{pid}/maps", "rb") as fh:
            if not any(b"libtorch" in line for line in fh):
                return False
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                if os.readlink(f"{fd_dir}/{fd}").startswith("socket:"):
                    return True
            except OSError:
                continue  # closed meanwhile
    except OSError:
        pass
    return False


def env_mismatch(standby_env: Mapping[str, str], worker_env: Mapping[str, str]) -> list[str]:
    """Names whose value differs between a standby's and a worker's environment. Pure.

    Per-worker and per-round variables (``PER_ROUND_ENV``, ``TORCHELASTIC_*``) and
    elasticd's per-agent ones (``AGENT_ENV``) are ignored: the standby gets the worker's.
    """
    names = {n for n in set(standby_env) | set(worker_env) if not _per_round(n)}
    return sorted(n for n in names if standby_env.get(n) != worker_env.get(n))


READY_PREFIX = "standby-ready-"  # in the control dir: this standby finished its imports


@dataclass
class Standby:
    """One warm process for one local rank."""

    local_rank: int
    proc: subprocess.Popen[bytes]
    env: dict[str, str]
    started_at: float
    # A hot spare's standby runs the worker's script ahead of its round (StandbyPool.run_ahead):
    # the launcher argv it runs, which the worker it becomes must have.
    ahead_argv: list[str] | None = None


class StandbyPool:
    """The agent's standbys, one per local rank, and the hand-over to a worker.

    Used from the agent's main thread only (the standby's ``PR_SET_PDEATHSIG`` fires when
    the *thread* that started it exits).
    """

    def __init__(self, enabled: bool, log_dir: Path) -> None:
        self.enabled = enabled
        self.log_dir = log_dir
        self._slots: dict[int, Standby] = {}
        self.handed_over = 0  # hand-overs so far (tests, logs)
        self.cold_starts = 0
        # Why scripts no longer run ahead on this agent ("" while they may): one that died
        # before its admission would die again in the next spare wait.
        self.ahead_failed = ""

    def ready(self, local_ranks: range) -> bool:
        """Every local rank has a live standby whose imports are done."""
        for r in local_ranks:
            sb = self._slots.get(r)
            if sb is None or sb.proc.poll() is not None:
                return False
            cdir = sb.env.get("ELASTICD_CONTROL_DIR", "")
            if not cdir or not Path(cdir, f"{READY_PREFIX}{sb.proc.pid}").exists():
                return False
        return True

    def missing(self, local_ranks: range) -> list[int]:
        """Local ranks without a live standby."""
        for r, sb in list(self._slots.items()):
            if sb.proc.poll() is not None:
                if sb.ahead_argv is not None:
                    self._ahead_died(sb)
                else:
                    log.warning("standby_died", local_rank=r, exit_code=sb.proc.returncode,
                                log=str(self._log_path(r)))
                del self._slots[r]
        return [r for r in local_ranks if r not in self._slots]

    def fill(self, envs: Mapping[int, Mapping[str, str]], *, urgent: bool = False,
             announce: bool = True) -> None:
        """Start a standby for every local rank in ``envs`` that has none.

        Args:
            envs: each local rank's worker environment in the current group (the agent's
                environment is added, as for a worker).
            urgent: import at the normal CPU priority: no worker of this node trains yet
                (the first group, a node joining), so the standby competes with nothing
                it stands by for, and the node waits for it.
            announce: log ``standby_started`` (False before logging is configured).
        """
        if not self.enabled:
            return
        for r in self.missing(range(max(envs, default=-1) + 1)):
            if r not in envs:
                continue
            # A standby's own environment is a worker's: no etcd credential, ever.
            env = scrub({**os.environ, **envs[r]})
            argv = [sys.executable, "-m", "elasticd.agent.warm", *([URGENT_FLAG] if urgent else [])]
            try:
                err = _fresh_log(self._log_path(r))
            except OSError as exc:  # a name the workers planted: no standby (a cold start)
                log.warning("standby_not_started", local_rank=r, error=repr(exc))
                continue
            try:  # the standby keeps its own copy of the fd
                proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
            finally:
                os.close(err)
            self._slots[r] = Standby(r, proc, env, time.monotonic())
            if announce:
                log.info("standby_started", local_rank=r, pid=proc.pid, urgent=urgent)

    def pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of the standbys held now."""
        return {r: sb.proc.pid for r, sb in self._slots.items()}

    def hurry(self) -> None:
        """Let the standbys still importing at low priority (a refill beside training
        workers) finish at the agent's: no worker of this node trains any more (it was
        ejected as hung) and its rejoin waits for them. Best effort (root only lowers)."""
        niceness = os.getpriority(os.PRIO_PROCESS, 0)
        for sb in self._slots.values():
            try:
                tids = os.listdir(f"/proc/{sb.proc.pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
                except (OSError, ValueError):
                    pass

    def run_ahead(self, local_rank: int, args: tuple[str, ...], env: Mapping[str, str]) -> bool:
        """Start the worker's script in this rank's standby before its round exists (a hot
        spare): it imports and builds its model, then waits in the worker API for the round,
        which :meth:`take` hands it at the admission. False when it cannot (no standby, not
        the agent's launcher, a run ahead already failed on this agent).

        Args:
            local_rank: the worker's local rank.
            args: the command line torch will run (the launcher's), without the round.
            env: the worker's environment without the round's variables.
        """
        sb = self._slots.get(local_rank)
        if (not self.enabled or self.ahead_failed or sb is None or sb.ahead_argv is not None
                or sb.proc.poll() is not None or tuple(args[:3]) != (sys.executable, *LAUNCHER)):
            return False
        argv = list(args[3:])
        msg = handover.message(scrub(env), argv=argv, cwd=os.getcwd(), spare=True)
        try:
            assert sb.proc.stdin is not None
            sb.proc.stdin.write(msg)
            sb.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return False
        sb.ahead_argv = argv
        log.info("spare_script_started", local_rank=local_rank, pid=sb.proc.pid,
                 log=str(self._log_path(local_rank)))
        return True

    def _ahead_died(self, sb: Standby) -> None:
        self.ahead_failed = (f"a spare's script exited with {sb.proc.returncode} before its "
                             f"admission (its output: {self._log_path(sb.local_rank)})")
        log.warning("spare_script_failed", local_rank=sb.local_rank, exit_code=sb.proc.returncode,
                    log=str(self._log_path(sb.local_rank)),
                    fix="spares of this agent now start their script at the admission; see "
                        "docs/worker-api.md, 'Hot spares build their model ahead'")

    def take(self, local_rank: int, args: tuple[str, ...], env: Mapping[str, str],
             stdout: str | None, stderr: str | None) -> subprocess.Popen[bytes] | None:
        """Hand a worker to this rank's standby; None if it cannot be used (start cold).

        Args:
            local_rank: the worker's local rank.
            args: the full command line torch would run.
            env: the worker's full environment.
            stdout, stderr: the worker's log files (torch opened and truncated them).
        """
        if not self.enabled:
            return None
        sb = self._slots.pop(local_rank, None)
        if sb is None:
            self.cold_starts += 1
            return None
        why = ""
        if tuple(args[:3]) != (sys.executable, *LAUNCHER):
            why = f"command is not the agent's launcher: {' '.join(args[:3])}"
        elif sb.proc.poll() is not None:
            why = f"standby exited with {sb.proc.returncode}"
            if sb.ahead_argv is not None:
                self._ahead_died(sb)
        elif bad := env_mismatch(sb.env, env):
            why = f"environment differs in {', '.join(bad[:5])}"
        elif sb.ahead_argv is not None and sb.ahead_argv != list(args[3:]):
            why = "the spare's script ran ahead with other arguments"
        if why:
            log.info("standby_not_used", local_rank=local_rank, reason=why)
            _discard(sb)
            self.cold_starts += 1
            return None
        if sb.ahead_argv is not None:  # the script runs: its round, environment and logs
            msg = handover.message(scrub(env), stdout=stdout, stderr=stderr)
        else:
            msg = handover.message(scrub(env), argv=list(args[3:]), cwd=os.getcwd(),
                                   stdout=stdout, stderr=stderr)
        try:
            assert sb.proc.stdin is not None
            sb.proc.stdin.write(msg)
            sb.proc.stdin.close()
        except (BrokenPipeError, OSError) as exc:  # it died just now
            log.info("standby_not_used", local_rank=local_rank, reason=f"hand-over failed: {exc}")
            _discard(sb)
            self.cold_starts += 1
            return None
        self.handed_over += 1
        log.info("standby_handed_over", local_rank=local_rank, pid=sb.proc.pid,
                 warm_for_s=round(time.monotonic() - sb.started_at, 1),
                 ran_ahead=sb.ahead_argv is not None)
        return sb.proc

    def close(self) -> None:
        """Kill every standby (process group) and reap it."""
        slots, self._slots = self._slots, {}
        for sb in slots.values():
            _discard(sb)

    def _log_path(self, local_rank: int) -> Path:
        return self.log_dir / f"standby-{local_rank}.log"


def _fresh_log(path: Path) -> int:
    """A new, empty log file at ``path`` (fd): never through a symlink or into a file the
    workers planted (the control dir is shared with them under workers.user)."""
    path.unlink(missing_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _discard(sb: Standby) -> None:
    with contextlib.suppress(OSError):
        if sb.proc.stdin is not None:
            sb.proc.stdin.close()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(sb.proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        sb.proc.wait(timeout=5)


@contextlib.contextmanager
def warm_handlers(pool: StandbyPool) -> Iterator[None]:
    """While active, torch's ``SubprocessContext`` starts workers through ``pool``.

    torch builds each worker's ``SubprocessHandler`` through the module-level
    ``get_subprocess_handler`` of ``torch.distributed.elastic.multiprocessing.api``; we
    swap in a handler whose ``_popen`` asks the pool first. On a torch without that hook
    every worker starts cold.
    """
    from torch.distributed.elastic.multiprocessing import api

    original = getattr(api, "get_subprocess_handler", None)
    if not pool.enabled or original is None:
        yield
        return
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    class WarmSubprocessHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]) -> subprocess.Popen[bytes]:
            proc = pool.take(self.local_rank_id, tuple(str(a) for a in args), env,
                             getattr(self._stdout, "name", None), getattr(self._stderr, "name", None))
            return proc if proc is not None else super()._popen(args, env)

    def get_handler(**kwargs: Any) -> SubprocessHandler:
        return WarmSubprocessHandler(**kwargs)

    api.get_subprocess_handler = get_handler  # type: ignore[assignment]
    try:
        yield
    finally:
        api.get_subprocess_handler = original


# --- the standby process -----------------------------------------------------------------
def main() -> None:
    """Import what workers import, wait for a hand-over, then become the worker."""
    from elasticd.process import die_with_parent

    agent_pid = os.environ.get("ELASTICD_AGENT_PID")
    die_with_parent(int(agent_pid) if agent_pid else None)
    # Import at the lowest CPU priority, so a standby never slows the training it stands by
    # for, and take the normal priority back at the hand-over. Only root may raise it back,
    # so an unprivileged agent's standbys import at normal priority. An urgent standby (no
    # worker of this node runs yet: the node waits for it) keeps the normal priority.
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = os.geteuid() == 0 and niceness < 19 and URGENT_FLAG not in sys.argv[1:]
    if lowered:
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    # The hand-over may come while we still import (a restart soon after the group
    # started): a thread takes it at once and gives the normal priority back, so the rest
    # of the imports never starve behind busy training processes.
    lines: list[bytes] = []
    arrived = threading.Event()

    def wait_for_handover() -> None:
        line = sys.stdin.buffer.readline()
        if not line:
            os._exit(0)  # discarded by the agent, possibly mid-import
        lines.append(line)
        if lowered:
            _set_niceness_of_all_threads(niceness)
        arrived.set()

    threading.Thread(target=wait_for_handover, name="standby-handover", daemon=True).start()
    # The imports every worker pays for; torch._dynamo is what the first optimizer step
    # or DDP forward would import. Failures here are not fatal: the worker imports again.
    for module in WARM_IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as exc:
            sys.stderr.write(f"standby: import of {module} failed: {exc!r}\n")
    control_dir = os.environ.get("ELASTICD_CONTROL_DIR")
    if control_dir:  # tell the agent the imports are done (StandbyPool.ready)
        with contextlib.suppress(OSError):  # O_EXCL|O_NOFOLLOW: the dir may be the workers'
            os.close(os.open(Path(control_dir, f"{READY_PREFIX}{os.getpid()}"),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
    arrived.wait()
    msg = handover.parse(lines[0])
    if msg.argv is None:
        raise SystemExit("standby: the first hand-over line carries no argv")
    ahead = msg.spare
    # A spare's script runs ahead of its round: stdin stays open for the second line
    # (the worker API reads it, elasticd.control.handover), and its output goes to the
    # standby's log until then.
    handover.become(msg, keep_stdin=ahead)
    if ahead:
        os.dup2(2, 1)
    from elasticd.agent import worker_exec

    worker_exec.main(msg.argv)


def _set_niceness_of_all_threads(niceness: int) -> None:
    # Linux keeps a niceness per thread, and threads started during the imports inherited
    # the low priority: set it on every one.
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)


if __name__ == "__main__":
    main()
