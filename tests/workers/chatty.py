"""Worker that talks: a stdout line, a stderr line, a line without a newline, and one
checkpoint saved and loaded through elasticd's CheckpointManager (its structlog events).
Exits 0. Env: ELASTICD_CHECKPOINT_URL (from --checkpoint-url)."""

import os
import sys

import torch

from elasticd import worker
from elasticd.checkpoint import CheckpointManager


def main() -> int:
    ctx = worker.init(backend="gloo")
    print(f"hello from rank {ctx.rank}", flush=True)
    print(f"rank {ctx.rank} on stderr", file=sys.stderr, flush=True)
    ckpt = CheckpointManager(os.environ["ELASTICD_CHECKPOINT_URL"], job=ctx.job or "local",
                             keep_last=2, fence=worker.agent_fence())
    state = {"w": torch.zeros(2)}
    ckpt.save(0, state, blocking=True)
    ckpt.load_latest(state)
    ckpt.close()
    sys.stdout.write(f"rank {ctx.rank} last words, no newline")
    sys.stdout.flush()
    worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
