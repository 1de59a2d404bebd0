"""Gloo worker that saves (and commits) a checkpoint after EVERY step; one JSON line per step.

Resumes from the newest committed checkpoint, so a restart shows up as a changed pid and a
step trained twice. Environment knobs: OUT (append per-step JSON lines), STEP_S (sleep per
step, default 0.05), STEPS (default 100000). Stops on a drain (saves, exits 0).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from elasticd import worker
from elasticd.checkpoint import CheckpointManager


def main() -> int:
    ctx = worker.init(backend="gloo")
    out = os.environ["OUT"]
    step_s = float(os.environ.get("STEP_S", "0.05"))
    steps = int(os.environ.get("STEPS", "100000"))
    # fence= spelled out so that the script runs on releases where it was not the default.
    ckpt = CheckpointManager(os.environ["ELASTICD_CHECKPOINT_URL"], job=ctx.job or "local",
                             keep_last=3, fence=worker.agent_fence())
    state = {"w": torch.zeros(4)}
    loaded = ckpt.load_latest(state)
    step = loaded.step + 1 if loaded else 0
    t = torch.ones(1)
    while step < steps:
        dist.all_reduce(t.fill_(1.0))
        state["w"] += 1.0
        row = {"step": step, "rank": ctx.rank, "pid": os.getpid(), "time": time.time(),
               "round": ctx.round, "restart": ctx.restart_count,
               "resumed_from": loaded.step if loaded else None}
        with open(out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        worker.report_progress(step)
        if worker.should_stop(step):
            ckpt.save(step, state, blocking=True)
            ckpt.close()
            worker.shutdown()
            return 0
        ckpt.save(step, state)  # async: committed by the agent in the background
        time.sleep(step_s)
        step += 1
    ckpt.close()
    worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
