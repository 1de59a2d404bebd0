"""Minimal gloo worker for agent tests: allreduce in a loop, one JSON line per step.

Environment knobs (tests set them): STEPS (default 10), STEP_S (sleep per step, default
0.05), OUT (append per-step JSON lines here), EXIT_CODE_AT ("step:code": exit with code at
that step on RANK 0 of TORCHELASTIC_RESTART_COUNT 0), END_FILE (once it holds a step count
N, written whole by the test: train N steps if fewer than STEPS; every rank reads it at
every step, so the job ends on the test's word, at one step on every rank).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def _end_step(end: str | None, steps: int) -> int:
    if end:
        try:
            with open(end) as fh:
                return min(steps, int(fh.read()))
        except (FileNotFoundError, ValueError):
            pass
    return steps


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    steps = int(os.environ.get("STEPS", "10"))
    step_s = float(os.environ.get("STEP_S", "0.05"))
    out = os.environ.get("OUT")
    crash = os.environ.get("EXIT_CODE_AT")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    end = os.environ.get("END_FILE")
    t = torch.ones(1)
    step = 0
    while step < _end_step(end, steps):
        dist.all_reduce(t.fill_(1.0))
        line = {"step": step, "rank": rank, "world": int(t.item()), "time": time.time(),
                "round": os.environ.get("ELASTICD_ROUND"), "restart": restart, "pid": os.getpid()}
        if out:
            with open(out, "a") as fh:
                fh.write(json.dumps(line) + "\n")
        if crash and restart == 0 and rank == 0 and step == int(crash.split(":")[0]):
            sys.exit(int(crash.split(":")[1]))
        time.sleep(step_s)
        step += 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
