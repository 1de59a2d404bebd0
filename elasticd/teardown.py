"""Ending a worker process without torch's process-group destructor race.

torch 2.13's gloo backend can deadlock or abort when a process group is destroyed while
its worker thread (``pt_gloo_runloop``) still releases a finished collective:

- every backward pass stashes a Python object in the thread-local state that each
  collective captures (``torch/autograd/graph.py``: ``_stash_obj_in_tls("context", ...)``),
  so releasing a DDP all-reduce's work object needs the GIL;
- when the last reference to the group goes (``destroy_process_group()`` and then the
  DDP model freed as ``main()`` returns, or module teardown at interpreter exit), the
  main thread runs ``~ProcessGroupGloo`` *holding the GIL* and joins the runloop thread,
  which waits for the GIL in ``~AsyncAllreduceWork``: a deadlock. At interpreter exit
  the same race ends in ``std::terminate`` (SIGABRT, "terminate called without an active
  exception").

Why warm standbys made it worse (3 hangs in 7 runs, none in 3 cold): a standby imports
``torch._dynamo`` before the script runs. When DDP's first use imports it lazily instead
(a cold worker), the DDP module ends up in a reference cycle and is freed by a later GC
pass or at exit (where the race shows as SIGABRT); with dynamo already imported it is
freed by reference count, exactly when ``main()`` returns — microseconds after the last
all-reduce, while the runloop may still be releasing that work. (Checked: with gc off,
``del ddp`` frees DDP and its reducer only if ``torch._dynamo`` was imported first.) The
cause — the group's destructor running when DDP is freed — is what the first measure
below removes, so standbys keep their head start.

Two measures, both used by the worker launcher (``elasticd.agent.worker_exec``) and by
the worker API (``elasticd.worker``):

- ``keep_groups_on_destroy``: ``destroy_process_group`` keeps a reference to every group
  it destroys, so the C++ destructor never runs in the main thread while a runloop may
  still need the GIL. The group is shut down and unregistered as before (a new
  ``init_process_group`` works).
- ``release_destroyed``: drops the groups of every destroy but the newest (a live
  re-formation calls it when it leaves a group). Those groups were aborted and destroyed
  a whole re-formation ago; the DDP wrapper that held them was rebuilt on the group formed
  since, so no collective of theirs is pending and their runloops are idle: joining them
  cannot wait on the GIL, and the last Python reference goes through torch's holder,
  which releases the GIL before the C++ destructor runs. Their threads, sockets and the
  round's TCPStore go (measured: 16 re-formations of one worker, threads and fds flat
  after the second; they grew by 4 threads and 13 fds per re-formation while kept).
- ``end_process``: once the script returned, run ``atexit`` handlers, flush, and
  ``os._exit`` — the interpreter's own teardown (where the race also lives) never runs.

This module imports torch only when torch is already being imported.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NoReturn

C10D = "torch.distributed.distributed_c10d"
# Destroyed process groups, one list per destroy, oldest first: referenced until
# ``release_destroyed`` drops all but the newest destroy's (or until os._exit).
_KEPT: list[list[Any]] = []
_BEFORE_DESTROY: list[Callable[[], None]] = []


def before_destroy(callback: Callable[[], None]) -> None:
    """Call ``callback`` (once per destroy) before any process group is destroyed.

    The worker API settles its pending ``should_stop`` all-reduce here, so no collective
    of its own is in flight when a group goes.
    """
    if callback not in _BEFORE_DESTROY:
        _BEFORE_DESTROY.append(callback)


def kept_groups() -> int:
    """How many destroyed process groups this process keeps referenced (tests, logs)."""
    return sum(len(batch) for batch in _KEPT)


def release_destroyed() -> int:
    """Drop the groups of every destroy but the newest; their C++ destructors run now.

    Call it only where no collective of those groups can be pending and nothing still
    wraps them (a live re-formation leaving the group formed after them: see the module
    doc). No garbage collection is forced (it cost 1.2–2.6 s per call at load 30): a DDP
    wrapper freed into a reference cycle lets its group go at the collector's next pass,
    which is as safe, the group being idle.

    Returns:
        How many groups were released.
    """
    old, _KEPT[:] = _KEPT[:-1], _KEPT[-1:]
    released = sum(len(batch) for batch in old)
    old.clear()
    return released


def keep_groups_alive(c10d: ModuleType | None = None, group: Any = None) -> None:
    """Reference the groups that ``destroy_process_group(group)`` is about to destroy.

    Args:
        c10d: ``torch.distributed.distributed_c10d`` (looked up if None and imported).
        group: the group being destroyed; None (or WORLD) means every group.
    """
    c10d = c10d or sys.modules.get(C10D)
    if c10d is None:
        return
    for callback in list(_BEFORE_DESTROY):
        try:
            callback()
        except Exception:  # noqa: BLE001 - a failed settle must not block the destroy
            pass
    world_group = getattr(getattr(c10d, "GroupMember", None), "WORLD", None)
    if group is None or group is world_group:
        pg_map = getattr(getattr(c10d, "_world", None), "pg_map", None) or {}
        groups = [*pg_map, world_group]
    else:
        groups = [group]
    _KEPT.append([g for g in groups if g is not None])


def _wrap_destroy(c10d: ModuleType) -> None:
    original = c10d.destroy_process_group
    if getattr(original, "_elasticd_keeps_groups", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        keep_groups_alive(c10d, group)
        return original(group)

    destroy_process_group._elasticd_keeps_groups = True  # type: ignore[attr-defined]
    setattr(c10d, "destroy_process_group", destroy_process_group)  # noqa: B010 - a ModuleType
    # torch.distributed re-exports it (``from .distributed_c10d import *``), and scripts
    # call ``dist.destroy_process_group()``: patch the re-export too once it exists.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "destroy_process_group", None) is original:
        setattr(dist, "destroy_process_group", destroy_process_group)  # noqa: B010


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Wraps ``destroy_process_group`` right after ``distributed_c10d`` is executed, so a
    script's own ``import torch`` pays nothing extra and env set before it still counts."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != C10D:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            _wrap_destroy(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def keep_groups_on_destroy() -> None:
    """Make ``torch.distributed.destroy_process_group`` keep the groups it destroys.

    Now if torch.distributed is imported, else as soon as it is. Idempotent.
    """
    c10d = sys.modules.get(C10D)
    if c10d is not None:
        _wrap_destroy(c10d)
        dist = sys.modules.get("torch.distributed")
        wrapped = getattr(c10d, "destroy_process_group", None)
        if dist is not None and getattr(dist, "destroy_process_group", None) is not wrapped:
            setattr(dist, "destroy_process_group", wrapped)  # noqa: B010
        return
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def end_process(code: int) -> NoReturn:
    """Run ``atexit`` handlers, flush stdio and logging, and ``os._exit(code)``.

    What the interpreter would do at exit, minus module teardown and the C++ static
    destructors, where torch's destructor race lives.
    """
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - already reported by atexit; the exit stands
        pass
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more to write
            pass
    os._exit(code)
