"""Workers that finish at different times (torch's ``workers_drift_fail`` case): one
barrier, then every rank but 0 waits for rank 0's row in OUT and works DRIFT_S seconds
longer (so rank 0's node has left by then); each rank appends {"rank", "restart", "done"}
to OUT when it finishes."""

import json
import os
import sys
import time

import torch.distributed as dist


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    if rank != 0:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and '"rank": 0' not in _read(os.environ["OUT"]):
            time.sleep(0.05)
        time.sleep(float(os.environ.get("DRIFT_S", "5")))
    with open(os.environ["OUT"], "a") as fh:
        fh.write(json.dumps({"rank": rank, "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
                             "done": time.time()}) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
