"""Three gloo ranks re-form live twice with a non-finite state among the holders.

Round 1 (``REFORM_PORT``): ranks 0 and 2 hold step 41, rank 0's weights hold a NaN, rank
1 holds nothing; rank 2 must be the source of both. Writes rank<r>.json (step, whether the
state is finite, its fingerprint). Then rank 1 reports a NaN first loss after that
transfer: every rank's ``step_done`` refuses the transferred state (refused<r>.txt: why;
no agent, so it raises rather than falling back). Round 2 (``REFORM_PORT2``): every rank's weights hold a
NaN; nobody may be a source, so every rank falls back to the restart path (exit 0, its
``stopped`` marker names why). Env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
ELASTICD_CONTROL_DIR, OUT.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main() -> int:
    import torch.distributed as dist

    from elasticd.checkpoint.first_loss import RestoreRefusedError
    from elasticd.control.messages import LeaveReason
    from elasticd.control.reform import ReformOrder, write_order
    from elasticd.worker import LiveState
    from elasticd.worker.context import control_dir, init, report_progress
    from elasticd.worker.fingerprint import fingerprint, non_finite, state_tensors

    init("gloo", timeout_s=60)
    rank = dist.get_rank()
    out = Path(os.environ["OUT"])
    torch.manual_seed(rank)  # each rank other weights: the receivers must end with rank 2's
    model = torch.nn.Linear(64, 32, dtype=torch.float64)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {"model": model, "optim": optim}
    live = LiveState(state, timeout_s=30)
    if rank != 1:
        live.step, live._has_state = 41, True  # as after step_done(41)
    if rank == 0:
        with torch.no_grad():
            model.weight[3, 4] = float("nan")
    cdir = control_dir()
    assert cdir is not None
    for round_, port in ((1, "REFORM_PORT"), (2, "REFORM_PORT2")):
        write_order(cdir, ReformOrder(round=round_, world_size=3, master_addr="127.0.0.1",
                                      master_port=int(os.environ[port]), ranks={0: rank}))
        live._reform(LeaveReason.ORDERED)  # round 2: does not return (falls back, exits 0)
        tensors = state_tensors(state)
        (out / f"rank{rank}.json").write_text(json.dumps(
            {"step": live.step, "finite": not non_finite(tensors), "print": fingerprint(tensors)}))
        if round_ == 1:  # the first loss after the transfer: NaN on rank 1 alone
            report_progress(42, loss=float("nan") if rank == 1 else 0.5)
            try:
                live.step_done(42)
                refused = ""
            except RestoreRefusedError as exc:  # every rank, at the same step
                refused = str(exc)
            (out / f"refused{rank}.txt").write_text(refused)
        with torch.no_grad():
            model.weight[0, 0] = float("inf")  # for round 2: nobody holds a usable state
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
