"""A short plain script that says each time it runs: one JSON line per start of each rank
(rank, world size, restart count), then an all-reduce and RUN_S seconds of "training".

Env: OUT (JSON lines, appended), RUN_S (default 2).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo")
    with open(os.environ["OUT"], "a") as fh:
        fh.write(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(),
                             "restart": os.environ["TORCHELASTIC_RESTART_COUNT"],
                             "node": os.environ.get("ELASTICD_NODE", "")}) + "\n")
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(float(os.environ.get("RUN_S", "2")))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
