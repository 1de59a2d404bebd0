"""Minimal elasticd-aware worker: resumes from a JSON "checkpoint", stops on should_stop().

Env: OUT (per-step JSON lines), CKPT (JSON file with the last saved step), STEPS (default
1,000,000: a job ends on the test's signal, drain or stop unless a test sets a count; the old
default, 1,000 steps of 0.05 s, had to outlast joins and drains under load), STEP_S, CKPT_EVERY (rank 0 saves after every N-th step, default 1; a stop always
saves), IGNORE_STOP=1 (calls should_stop but ignores it: tests the hard stop), HANG_AT (rank 0
sleeps forever at that step), EXIT_CODE_AT ("step:code" on rank 0 of the first start).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from elasticd import worker


def save(ckpt: str, step: int) -> None:
    tmp = ckpt + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"step": step}, fh)
    os.replace(tmp, ckpt)


def main() -> int:
    ctx = worker.init()
    out, ckpt = os.environ["OUT"], os.environ["CKPT"]
    steps, step_s = int(os.environ.get("STEPS", "1000000")), float(os.environ.get("STEP_S", "0.05"))
    start = 0
    if os.path.exists(ckpt):
        with open(ckpt) as fh:
            start = json.load(fh)["step"] + 1
    ckpt_every = int(os.environ.get("CKPT_EVERY", "1"))
    hang_at = int(os.environ.get("HANG_AT", "-1"))
    crash = os.environ.get("EXIT_CODE_AT")
    t = torch.ones(1)
    for step in range(start, steps):
        dist.all_reduce(t.fill_(1.0))
        with open(out, "a") as fh:
            fh.write(json.dumps({"step": step, "rank": ctx.rank, "world": int(t.item()),
                                 "time": time.time(), "round": ctx.round,
                                 "restart": ctx.restart_count}) + "\n")
        worker.report_progress(step, force=True)
        if ctx.rank == 0 and step == hang_at and ctx.restart_count == 0:
            time.sleep(3600)
        if crash and ctx.rank == 0 and ctx.restart_count == 0 and step == int(crash.split(":")[0]):
            sys.exit(int(crash.split(":")[1]))
        time.sleep(step_s)
        if worker.should_stop(step) and os.environ.get("IGNORE_STOP") != "1":
            if ctx.rank == 0:
                save(ckpt, step)
            dist.barrier()
            worker.shutdown()  # destroy the process group: exit promptly and cleanly
            return 0
        if ctx.rank == 0 and (step + 1) % ckpt_every == 0:
            save(ckpt, step)
    worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
