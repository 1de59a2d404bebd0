"""Workers that finish at different times (torch's ``workers_drift_fail`` case): one
barrier, then every rank but 0 works DRIFT_S seconds longer; each rank appends
{"rank", "restart", "done"} to OUT when it finishes."""

import json
import os
import sys
import time

import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    if rank != 0:
        time.sleep(float(os.environ.get("DRIFT_S", "6")))
    with open(os.environ["OUT"], "a") as fh:
        fh.write(json.dumps({"rank": rank, "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
                             "done": time.time()}) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
