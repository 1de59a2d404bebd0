"""Worker launcher: ``python -m elasticd.agent.worker_exec [-m] TARGET [ARGS...]``.

The agent starts every worker through this module instead of ``python TARGET`` so that,
before the user's code runs, the worker:

- becomes ``workers.user`` when the agent names one (``ELASTICD_RUN_AS``; the launcher
  starts as root then): the user's groups, gid and uid, first of all (a credential change
  clears ``PR_SET_PDEATHSIG``, so that is set after), see :func:`become_worker_user`;
- asks the kernel to SIGKILL it when the agent dies (``PR_SET_PDEATHSIG``), so even
  ``kill -9`` of the agent leaves no worker holding a GPU and a rank; and does the same for
  every process it forks (DataLoader workers): they die with the worker. Why: a forked
  child inherits the worker's collective sockets, and DataLoader workers notice their
  parent's death only at their own 5 s check, so peers' collectives neither failed nor
  finished and a node whose agent was killed was taken for a hang (3.7-4.7 s);
- registers ``faulthandler`` on SIGUSR1, so the agent can ask a hung worker for the
  stacks of all its threads (they land in the worker's stderr log);
- records an uncaught exception in torch's error file (``TORCHELASTIC_ERROR_FILE``) so the
  agent's failure summary shows the real traceback.

Then it runs TARGET exactly as ``python TARGET`` would (``__main__``, ``sys.argv``,
``sys.path[0]``), in the same process: no second interpreter start-up.

When TARGET's code is over, the launcher ends the process itself (``elasticd.teardown``):

- status 0 (the script returned, or ``sys.exit(0)``): it writes ``done-<rank>`` in the
  control dir first, so the agent knows the rank completed its work whatever happens next;
- an uncaught ``ConfigError`` (a deterministic configuration error, e.g. a global batch
  that the world size cannot split): status 78 (EX_CONFIG), which the agent never retries;
- any other uncaught exception: the traceback on stderr (and in the error file), status 1;

then it runs ``atexit`` handlers, flushes, and ``os._exit``: the interpreter's teardown,
where torch's gloo destructor race deadlocks or aborts (SIGABRT), never runs. And
``destroy_process_group`` keeps the groups it destroys referenced until then, so that race
cannot start inside the script either (see ``elasticd.teardown``).
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys
import time
from collections.abc import Iterable, MutableMapping
from typing import NoReturn

from elasticd.control.api import DONE_PREFIX, ENV_LOG_FORMAT, ENV_RUN_AS
from elasticd.control.environment import RunAs, run_as
from elasticd.errors import EX_CONFIG, ConfigError
from elasticd.logs import configure_worker_logging
from elasticd.process import die_with_parent, set_dumpable
from elasticd.teardown import end_process, keep_groups_on_destroy


def main(argv: list[str]) -> NoReturn:
    try:
        if become_worker_user(os.environ) is not None:
            # The agent set it so that nothing in the (worker-writable) working directory
            # was imported as root; the training code and its children get the usual path.
            os.environ.pop(SAFE_PATH_ENV, None)
    except ConfigError as exc:  # nothing of the user's code runs as root by mistake
        sys.stderr.write(f"elasticd worker: {exc}\n")
        os._exit(EX_CONFIG)
    agent_pid = os.environ.get("ELASTICD_AGENT_PID")
    die_with_parent(int(agent_pid) if agent_pid else None)
    register_children_die_with_parent()
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    keep_groups_on_destroy()
    # JSON when the agent logs JSON: the worker API's events stay one object per line.
    configure_worker_logging(os.environ.get(ENV_LOG_FORMAT))
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        sys.stderr.write("usage: python -m elasticd.agent.worker_exec [-m] TARGET [ARGS...]\n")
        end_process(2)
    end_process(run_target(argv[0], argv[1:], as_module=as_module))


def register_children_die_with_parent() -> None:
    """Every process this one forks from now on (DataLoader workers, a fork-started pool,
    and their own forks: the hook is inherited) is SIGKILLed when its parent dies, and
    exits at once if the parent is already gone: the worker's whole process tree goes down
    with it. The signal follows the forking thread, as PR_SET_PDEATHSIG does (DataLoaders
    fork from the training thread)."""
    forker = [0]  # the forking process's pid, read by the child it forks

    def before() -> None:
        forker[0] = os.getpid()

    def after_in_child() -> None:
        die_with_parent(forker[0])

    os.register_at_fork(before=before, after_in_child=after_in_child)


ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
SAFE_PATH_ENV = "PYTHONSAFEPATH"  # Python 3.11+: no cwd / script dir prepended to sys.path


def become_worker_user(environ: MutableMapping[str, str]) -> RunAs | None:
    """Switch to ``ELASTICD_RUN_AS``'s user for good, if the agent names one.

    Still root: torch's per-rank directory (where the worker writes its error file) is
    given to the user, and ``TORCHELASTIC_ERROR_FILE`` points at it through a descriptor
    (``/proc/self/fd/N/error.json``), since the levels above it are private to root.
    Then the user's supplementary groups (``os.initgroups``: the GPU device groups come
    with the user), gid and uid; the process is made dumpable again (the kernel clears it
    on a credential change; NCCL's ``pidfd_getfd`` between a node's workers needs it).

    Returns:
        The user, or None when the agent names none.

    Raises:
        ConfigError: the variable is malformed, or the launcher is neither root nor
            already that user.
    """
    user = run_as(environ)
    if user is None:
        return None
    if os.geteuid() != 0:
        if os.getuid() == user.uid and os.getgid() == user.gid:
            return user  # e.g. a launcher started by an already switched process
        raise ConfigError(f"{ENV_RUN_AS} names uid {user.uid} but the launcher runs as uid "
                          f"{os.geteuid()}, not root: start workers through the agent")
    error_file = environ.get(ERROR_FILE_ENV)
    if error_file:
        rank_dir = os.open(os.path.dirname(error_file) or ".",
                           os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        os.fchown(rank_dir, user.uid, user.gid)
        os.fchmod(rank_dir, 0o700)
        environ[ERROR_FILE_ENV] = f"/proc/self/fd/{rank_dir}/{os.path.basename(error_file)}"
    os.initgroups(user.name, user.gid)
    os.setresgid(user.gid, user.gid, user.gid)
    os.setresuid(user.uid, user.uid, user.uid)
    if os.getresuid() != (user.uid,) * 3 or os.getresgid() != (user.gid,) * 3:
        raise ConfigError(f"could not switch to {user.name} (uid {user.uid})")
    set_dumpable(True)
    return user


def run_target(target: str, args: list[str], *, as_module: bool) -> int:
    """Run TARGET as ``__main__``; return the exit status Python would have used.

    Writes ``done-<rank>`` (control dir) when the status is 0.
    """
    sys.argv = [target, *args]
    try:
        # Under PYTHONSAFEPATH (workers.user) the interpreter prepended nothing: add what
        # `python TARGET` / `python -m TARGET` would have, instead of replacing sys.path[0].
        if as_module:
            if sys.flags.safe_path:
                sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            script_dir = os.path.dirname(os.path.abspath(target))
            if sys.flags.safe_path:
                sys.path.insert(0, script_dir)
            else:
                sys.path[0] = script_dir
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exit_status(exc)
    except BaseException as exc:  # noqa: BLE001 - reported as Python would, then exit
        code = EX_CONFIG if isinstance(exc, ConfigError) else 130 if isinstance(exc, KeyboardInterrupt) else 1
        if os.environ.get(ERROR_FILE_ENV):
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(exc)
        sys.excepthook(type(exc), exc, exc.__traceback__)
    if code == 0:
        _mark_done()
    return code


def exit_status(exc: SystemExit) -> int:
    """The status ``python`` exits with for ``SystemExit(exc.code)`` (printing a message)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    sys.stderr.write(f"{exc.code}\n")
    return 1


def _mark_done() -> None:
    # Tell the agent this rank's script completed, before anything in torch's teardown
    # can abort or hang the process.
    control_dir, rank = os.environ.get("ELASTICD_CONTROL_DIR"), os.environ.get("RANK", "0")
    if not control_dir:
        return
    try:
        with open(os.path.join(control_dir, f"{DONE_PREFIX}{rank}"), "w"):
            pass
    except OSError:  # the agent is gone or restarting us: nothing to tell
        pass


if __name__ == "__main__":
    main(sys.argv[1:])


def request_stacks(pids: Iterable[int], *, settle_s: float = 0.5) -> None:
    """The agent's side of the SIGUSR1 contract above: ask each worker for the stacks of
    all its threads (they land in the worker's stderr log), then give faulthandler
    ``settle_s`` to write them before the caller stops the workers."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(settle_s)
