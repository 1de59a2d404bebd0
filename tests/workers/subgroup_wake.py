"""A gloo collective of a group made after ``elasticd.worker.init()`` (``new_group``, as a
DeviceMesh's subgroups are), stuck on a surviving peer that left it, is woken by shutting
down the groups' connections, as live re-formation does.

3 ranks; every rank makes the subgroup {0, 1}. Rank 1 never enters its collective (it left
for the re-formation); rank 0 enters an all-reduce on it while a thread shuts down every
connection ``group_sockets()`` names. Rank 0 writes what happened to ``$OUT/rank0.json``;
the others wait for that file (bounded) and exit.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import elasticd.worker as ew
from elasticd.worker import context
from elasticd.worker.sockets import shutdown_group_connections

TIMEOUT_S = float(os.environ.get("GROUP_TIMEOUT_S", "60"))


def main() -> int:
    out = Path(os.environ["OUT"])
    ctx = ew.init("gloo", timeout_s=TIMEOUT_S)
    world_only = len(context.group_sockets())
    sub = dist.new_group([0, 1], backend="gloo")
    done = out / "rank0.json"
    if ctx.rank != 0:
        deadline = time.monotonic() + 2 * TIMEOUT_S
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)  # the group is broken on purpose: no teardown collectives
    entering = threading.Event()
    shut: list[int] = []

    def wake() -> None:
        entering.wait()
        shut.append(shutdown_group_connections(context.group_sockets()))

    threading.Thread(target=wake, daemon=True).start()
    started = time.monotonic()
    error = ""
    entering.set()
    try:
        dist.all_reduce(torch.ones(4), group=sub)
    except Exception as exc:  # the wake-up: a closed connection, not the timeout
        error = f"{type(exc).__name__}: {exc}"
    result = {"error": error[:500], "seconds": round(time.monotonic() - started, 3),
              "world_sockets": world_only, "group_sockets": len(context.group_sockets()),
              "shut_down": shut[0] if shut else None}
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, done)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
