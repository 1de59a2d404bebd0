"""A plain DDP script that knows nothing of elasticd (PyTorch's torchrun tutorial style):
torchrun env, DistributedSampler, DDP, and its own snapshot file for restarts.

Env: SNAPSHOT (path), OUT (per-epoch JSON lines), EPOCHS, CRASH_AT_EPOCH (rank 0, first start),
AT_EXIT=abort|hang (rank 1: an atexit handler aborts, or never returns,
as torch's interpreter teardown sometimes does), EPOCH_S (seconds each epoch lasts at least),
HOLD_FILE (tests: while this file exists and holds a count N, a process that has trained N
epochs waits before its next one, polling, at most 180 s: a fault the test schedules lands
inside the job, whatever epoch a restart resumed at).
"""

import atexit
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from hold import wait_while_held
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> int:
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    at_exit = os.environ.get("AT_EXIT")
    if rank == 1 and at_exit:
        atexit.register(os.abort if at_exit == "abort" else lambda: time.sleep(3600))
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    model = torch.nn.Linear(8, 1)
    snapshot = os.environ["SNAPSHOT"]
    start = 0
    if os.path.exists(snapshot):
        snap = torch.load(snapshot, weights_only=True)
        model.load_state_dict(snap["model"])
        start = snap["epoch"] + 1
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    for epoch in range(start, int(os.environ.get("EPOCHS", "6"))):
        wait_while_held(os.environ.get("HOLD_FILE"), epoch - start)
        sampler.set_epoch(epoch)
        epoch_end = time.monotonic() + float(os.environ.get("EPOCH_S", "0"))
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        time.sleep(max(epoch_end - time.monotonic(), 0.0))
        if rank == 0:
            # Written aside and renamed, as a careful torchrun script does: a SIGTERM or
            # SIGKILL mid-save must not leave a torn snapshot for the next attempt (the
            # stop test once failed on the EOFError of one).
            torch.save({"model": model.state_dict(), "epoch": epoch}, snapshot + ".tmp")
            os.replace(snapshot + ".tmp", snapshot)
            with open(os.environ["OUT"], "a") as fh:
                fh.write(json.dumps({"epoch": epoch, "restart": os.environ["TORCHELASTIC_RESTART_COUNT"],
                                     "world": dist.get_world_size()}) + "\n")
        if (rank == 0 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
                and epoch == int(os.environ.get("CRASH_AT_EPOCH", "-1"))):
            sys.exit(1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
