"""One rank of a live state transfer test: ``broadcast_state`` from rank 0, over real gloo.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (the group, formed through
``elasticd.worker`` as under an agent); ELASTICD_CONTROL_DIR: this rank's control directory;
REFORM_PORT: the re-formed group's port; OUT: a directory for each rank's reports. Two
phases in one run (one process start-up for both): ``check``, then ``reform_kill``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch


def state(seed: int) -> dict:
    """A deterministic state with every awkward case: float64, bfloat16, bool, int64, a
    0-dim tensor, a non-contiguous one, nesting through lists and tuples, non-tensors."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(512, 1024, generator=g, dtype=torch.float64)  # 4 MiB
    return {"model": {"w": big, "b": torch.randn(7, generator=g, dtype=torch.float64),
                      "t": torch.randn(64, 32, generator=g, dtype=torch.float64).t()},
            "optim": {"state": {0: {"step": torch.tensor(12.0), "m": torch.randn(3, 5, generator=g)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
            "extra": [torch.randn(9, generator=g).to(torch.bfloat16), (torch.rand(4, generator=g) > 0.5, "x"),
                      torch.randint(0, 1 << 40, (6,), generator=g)],
            "__step__": 41}


def flat(obj: object, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            flat(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            flat(v, out)


def check(rank: int, world: int, out: Path) -> None:
    """Every other rank receives; the last one into its own tensors. Writes what it got."""
    from elasticd.worker.state_broadcast import broadcast_state

    into = state(99) if rank == world - 1 and rank > 0 else None  # same structure, other values
    mine: list[torch.Tensor] = []
    flat(into, mine)
    t0 = time.monotonic()
    got = broadcast_state(state(7) if rank == 0 else None, 0, torch.device("cpu"), timeout_s=30, into=into)
    expected: list[torch.Tensor] = []
    flat(state(7), expected)
    received: list[torch.Tensor] = []
    flat(got, received)
    same = len(received) == len(expected) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                  b.reshape(-1).view(torch.uint8))
        for a, b in zip(received, expected, strict=False))
    in_place = sum(any(r.data_ptr() == m.data_ptr() and r.numel() for m in mine) for r in received)
    out.write_text(json.dumps({"same": same, "in_place": in_place, "step": got["__step__"] if got else None,
                               "lr": got["optim"]["param_groups"][0]["lr"] if got else None,
                               "x": got["extra"][1][1] if got else None,
                               "seconds": time.monotonic() - t0}))


def reform_kill(rank: int, out: Path) -> None:
    """A live re-formation into a new group (``REFORM_PORT``) in which rank 0 holds the
    newest state, rank 1 none, rank 2 the newest too; rank 0 sends rank 1 its first tensor
    (the RNG state, 5 kB of 4 MiB), then SIGKILLs itself. Rank 1 must fall back (``stopped-1`` marker, exit 0);
    rank 2, which needs nothing, re-forms. Rank 2 writes a report; rank 1 exits in
    ``_fall_back``."""
    from elasticd.control.messages import LeaveReason
    from elasticd.control.reform import ReformOrder, write_order
    from elasticd.worker import LiveState, transfer
    from elasticd.worker.context import control_dir

    torch.manual_seed(rank if rank == 1 else 0)  # rank 1 holds other (unused) weights
    model = torch.nn.Linear(1024, 512, dtype=torch.float64)  # 4 MiB: the rest of the state
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    live = LiveState({"model": model, "optim": optim}, timeout_s=30)
    if rank != 1:
        live.step, live._has_state = 41, True  # as after step_done(41)
    cdir = control_dir()
    assert cdir is not None
    write_order(cdir, ReformOrder(round=1, world_size=3, master_addr="127.0.0.1",
                                  master_port=int(os.environ["REFORM_PORT"]), ranks={0: rank}))
    if rank == 0:
        real = transfer._send_views

        def send_part_then_die(sock, views, deadline):  # type: ignore[no-untyped-def]
            real(sock, views[:1], deadline)
            os.kill(os.getpid(), signal.SIGKILL)

        transfer._send_views = send_part_then_die
    (out.parent / f"rank{rank}-reform-started").write_text(str(time.time()))
    live._reform(LeaveReason.ORDERED)  # rank 1 does not return: it falls back and exits 0
    out.write_text(json.dumps({"reforms": live.reforms, "step": live.step}))


def main() -> int:
    from elasticd.teardown import end_process
    from elasticd.worker.context import init

    init("gloo", timeout_s=60)
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(os.environ["OUT"])
    check(rank, world, out / f"rank{rank}.json")
    dist.barrier()
    reform_kill(rank, out / f"rank{rank}-kill.json")
    end_process(0)  # the group is broken (its rank 0 is dead): leave without tearing it down


if __name__ == "__main__":
    sys.exit(main())
