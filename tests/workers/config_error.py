"""A worker that hits a deterministic configuration error: a global batch (GLOBAL_BATCH,
default 1) smaller than the world size, planned after ``elasticd.worker.init()``."""

import os
import sys

from elasticd import worker
from elasticd.data.batching import plan_global_batch


def main() -> int:
    ctx = worker.init()
    plan_global_batch(int(os.environ.get("GLOBAL_BATCH", "1")), ctx.world_size, 8)
    return 0


if __name__ == "__main__":
    sys.exit(main())
