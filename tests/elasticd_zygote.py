"""The test suite's agent zygote: one process per pytest process that imported torch and
elasticd's agent once, and forks each test node's ``elasticd run`` from that state.

Why: an agent's own start (``import torch``, torch elastic, gRPC, elasticd) cost about 1.7
CPU-s, paid by every one of the several hundred agents the suite starts on a 2-core
machine. The fork skips only the imports: each agent then runs ``elasticd.cli.main`` in a
session of its own, with its own environment, working directory and log file, exactly as
``python -m elasticd.cli run ...`` would from there (the harness starts nodes through the
zygote only when nothing in their environment is read at import time: ``Node``).

The zygote runs no code of its own beside the imports (torch's import starts one idle
native thread, as in any process that forks after ``import torch``) and never opens an etcd
connection, so each fork is as clean as a fresh interpreter's state after its imports (no
lock held by a Python thread, no gRPC channel). The child restores what the interpreter's
start sets (SIGPIPE and SIGXFSZ ignored, the other signals at their defaults) and the
node's environment, so that ``tempfile`` and everything read at run time see the node's.

Protocol, one JSON object per line: the harness writes ``{"argv", "env", "log", "cwd"}``;
the zygote answers ``{"pid"}`` (or ``{"error"}``) and, whenever one of its children exits,
``{"exit": pid, "code": exit code}`` (negative: a signal, as ``subprocess`` reports it). It exits when its stdin closes (pytest exited, however it ended).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import tempfile
import traceback


def _preload() -> None:
    """What every agent imports before it serves (the early path imports most of it late)."""
    import torch  # noqa: F401
    import torch.distributed.elastic.agent.server.api  # noqa: F401

    import elasticd.agent.early  # noqa: F401
    import elasticd.agent.elastic_agent  # noqa: F401
    import elasticd.agent.runner  # noqa: F401
    import elasticd.cli  # noqa: F401
    import elasticd.etcd.client  # noqa: F401
    import elasticd.rendezvous.etcd_handler  # noqa: F401


def _child(req: dict) -> None:
    """In the forked child: become the node's agent, then exit with its status."""
    code = 1
    try:
        os.setsid()
        for sig in range(1, signal.NSIG):
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # as the interpreter's start sets them
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        tempfile.tempdir = None  # read TMPDIR again
        log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin
        import elasticd.cli
        from elasticd.cli import main

        argv = req["argv"]
        sys.argv = [os.path.join(os.path.dirname(elasticd.cli.__file__), "__main__.py"), *argv]
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int) and exc.code is not None:
                sys.stderr.write(f"{exc.code}\n")
    except BaseException:  # noqa: BLE001 - the child must exit through os._exit
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            import atexit
            atexit._run_exitfuncs()  # what a normal interpreter exit runs
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code & 0xFF if isinstance(code, int) else 1)


def _say(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve() -> None:
    # No PR_SET_PDEATHSIG: it follows the thread that started the zygote, which may be a
    # test's helper thread. The zygote ends when its stdin closes: pytest exited, however.
    _preload()
    import atexit
    atexit._clear()  # the children run their own handlers only
    _say({"ready": os.getpid(), "threads": len(os.listdir("/proc/self/task"))})
    buf = b""
    stdin = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        _reap()
        if not ready:
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:
            os._exit(0)  # stdin closed: pytest is done (its children were ended by the tests)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if not line.strip():
                continue
            req = json.loads(line)
            try:
                pid = os.fork()
            except OSError as exc:
                _say({"error": str(exc)})
                continue
            if pid == 0:
                _child(req)
            _say({"pid": pid})


if __name__ == "__main__":
    serve()
