"""Process hygiene: children that die with their parent, and whole-group signalling.

elasticd starts etcd and training workers. None of them may outlive the process that
started them, on any exit path, including ``kill -9`` of the agent: an orphaned worker
keeps a GPU and a rank, and an orphaned etcd keeps a port. Linux's
``PR_SET_PDEATHSIG`` asks the kernel to signal a child when its parent dies; it
survives ``exec`` and is set in the child just before it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
_libc = None


def _prctl():
    global _libc
    if _libc is None:
        # The interpreter's own symbols, libc's among them. ``ctypes.util.find_library``
        # forks ``ldconfig -p`` (or a compiler) every time a process first asks: a fork of
        # an interpreter with torch mapped, on every worker's and standby's start.
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc.prctl


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits."""
    if _prctl()(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def make_non_dumpable() -> bool:
    """Mark this process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``).

    Why: the workers run training code as the agent's uid; a process of the same uid may
    ptrace a dumpable one and read its ``/proc/<pid>/environ`` and ``mem`` (the agent's
    etcd password and client key). A non-dumpable process refuses both to other processes
    of its uid (root excepted) and writes no core dump. Children that ``exec`` (workers,
    standbys, etcd) are dumpable again, as usual.

    Returns:
        True if set; False where the kernel refused (not Linux).
    """
    return set_dumpable(False)


def set_dumpable(dumpable: bool) -> bool:
    """``prctl(PR_SET_DUMPABLE, dumpable)``; False where the kernel refused (not Linux)."""
    try:
        return _prctl()(PR_SET_DUMPABLE, int(dumpable), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(expected_ppid: int | None = None) -> None:
    """SIGKILL on parent death; exit now if the parent is already gone.

    Called by a child itself (the worker launcher), never as a ``preexec_fn`` of a process
    that uses gRPC: see :func:`dying_with_parent`."""
    set_pdeathsig(signal.SIGKILL)
    if expected_ppid is not None and os.getppid() != expected_ppid:
        os._exit(1)


# Run as ``python -I -S -c _DIE_WITH_PARENT_EXEC PPID PROGRAM ARGS...``: PR_SET_PDEATHSIG,
# then exec PROGRAM in the same process (the setting survives exec).
_DIE_WITH_PARENT_EXEC = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def dying_with_parent(argv: list[str], parent: int) -> list[str]:
    """``argv`` wrapped so that the child SIGKILLs itself when ``parent`` dies.

    Why not a ``preexec_fn``: with one, ``subprocess`` forks while holding the GIL and
    runs every ``pthread_atfork`` handler, and gRPC's (on by default in grpcio, which
    elasticd leaves as it is so that forked children can use etcd) wait for gRPC's threads,
    which may need the GIL: beside busy etcd traffic the fork hangs for good. Without one,
    CPython starts the child with ``vfork()``, which runs no fork handlers; this short
    interpreter sets ``PR_SET_PDEATHSIG`` in the child instead and ``exec``s ``argv`` in
    the same process (same pid; the setting survives ``exec``).

    Args:
        argv: the program and its arguments (looked up on PATH as ``execvp`` does).
        parent: the pid the child must outlive no longer (normally ``os.getpid()``).
    """
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT_EXEC, str(parent), *argv]


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Poll until all ``pids`` are gone or the deadline passes. Returns the survivors."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def descendants(pid: int) -> list[int]:
    """All descendants of ``pid`` (children, grandchildren, ...), read from /proc.

    torch starts workers in sessions of their own, so a node's processes share no process
    group: walking the tree is how a fault reaches the whole node.
    """
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
