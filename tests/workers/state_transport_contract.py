"""One rank of the state-transport contract suite: ``broadcast_state`` from rank 0 over real
gloo, on the transport named by ``TRANSPORT`` (``tcp`` or ``collective``).

Environment: RANK, WORLD_SIZE (3), MASTER_ADDR, MASTER_PORT (the group, formed through
``elasticd.worker`` as under an agent); REFORM_PORT: the survivors' new group; OUT: a
directory for the reports. Four phases in one run (process start-up is the cost):

1. ``receive``: ranks 1 and 2 receive rank 0's state, rank 1 into a partial state of its
   own (tensors missing, of another shape or dtype), rank 2 into a full one;
2. ``stand_by``: only rank 1 receives; rank 2 needs nothing and gets None;
3. ``die``: rank 0 SIGKILLs itself after its first tensor left; ranks 1 and 2 report;
4. ``stall``: ranks 1 and 2 form a new group; rank 1 (new rank 0) SIGSTOPs itself before
   sending a byte; rank 2 reports when (and how) its 2-second deadline ended the wait. The
   test SIGKILLs the stopped rank.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from state_transfer import flat, state  # noqa: E402 - the same awkward state as the TCP test


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _partial(seed: int) -> dict:
    """A receiver that lacks tensors or holds them in another shape or dtype."""
    full = state(seed)
    return {"model": {"w": full["model"]["w"], "b": full["model"]["b"].float()},  # dtype differs
            "optim": {"state": {0: {"step": full["optim"]["state"][0]["step"],
                                    "m": torch.zeros(5, 3)}}},  # shape differs
            "extra": [full["extra"][0]]}  # "t", the bool and int tensors are missing


def receive(rank: int, kind: object, out: Path) -> None:
    from elasticd.worker.state_broadcast import broadcast_state

    into = {1: _partial(99), 2: state(99)}.get(rank)
    own: list[torch.Tensor] = []
    flat(into, own)
    got = broadcast_state(state(7) if rank == 0 else None, 0, torch.device("cpu"),
                          timeout_s=30, transport=kind, into=into)  # type: ignore[arg-type]
    if rank == 0:
        return
    expected: list[torch.Tensor] = []
    flat(state(7), expected)
    received: list[torch.Tensor] = []
    flat(got, received)
    same = len(received) == len(expected) and all(map(_bits, received, expected))
    # In place: the received tensor is the receiver's own memory, and that memory now holds
    # the source's bytes.
    in_place = [r for r in received if any(r.data_ptr() == m.data_ptr() and r.numel() for m in own)]
    own_hold_it = all(any(_bits(m, e) for e in expected) for m in own
                      if any(m.data_ptr() == r.data_ptr() for r in in_place))
    out.write_text(json.dumps({"same": same, "in_place": len(in_place), "own_hold_it": own_hold_it,
                               "step": got["__step__"] if got else None,
                               "lr": got["optim"]["param_groups"][0]["lr"] if got else None,
                               "x": got["extra"][1][1] if got else None}))


def stand_by(rank: int, kind: object, out: Path) -> None:
    from elasticd.worker.state_broadcast import broadcast_state

    t0 = time.monotonic()
    got = broadcast_state(state(7) if rank == 0 else None, 0, torch.device("cpu"), receivers=[1],
                          timeout_s=30, transport=kind)  # type: ignore[arg-type]
    if rank:
        expected: list[torch.Tensor] = []
        flat(state(7), expected)
        received: list[torch.Tensor] = []
        flat(got, received)
        out.write_text(json.dumps({"none": got is None, "tensors": len(received),
                                   "same": len(received) == len(expected) and all(map(_bits, received, expected)),
                                   "seconds": time.monotonic() - t0}))


def _failure(fn) -> dict:  # type: ignore[no-untyped-def]
    from elasticd.worker.transport.api import TransferError

    t0 = time.monotonic()
    try:
        fn()
    except TransferError as exc:
        return {"error": "TransferError", "message": str(exc)[:300], "after_s": time.monotonic() - t0}
    except Exception as exc:  # noqa: BLE001 - the contract says TransferError: report the rest
        return {"error": type(exc).__name__, "message": str(exc)[:300], "after_s": time.monotonic() - t0}
    return {"error": None, "after_s": time.monotonic() - t0}


def die(rank: int, kind: object, out: Path) -> None:
    """Rank 0 sends its first tensor (TCP: its first buffer; collective: its first
    broadcast), then SIGKILLs itself."""
    from elasticd.worker import transfer
    from elasticd.worker.state_broadcast import broadcast_state
    from elasticd.worker.transport.api import TransportKind

    if rank == 0 and kind is TransportKind.TCP:
        real_send = transfer._send_views

        def send_part_then_die(sock, views, deadline):  # type: ignore[no-untyped-def]
            real_send(sock, views[:1], deadline)
            os.kill(os.getpid(), signal.SIGKILL)

        transfer._send_views = send_part_then_die
    elif rank == 0:
        import torch.distributed as dist

        real_broadcast, calls = dist.broadcast, []

        def broadcast_then_die(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(1)
            if len(calls) > 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_broadcast(*args, **kwargs)

        dist.broadcast = broadcast_then_die
    result = _failure(lambda: broadcast_state(state(7) if rank == 0 else None, 0, torch.device("cpu"),
                                              timeout_s=30, transport=kind, into=state(99)))
    out.write_text(json.dumps(result))


def stall(rank: int, kind: object, out: Path) -> None:
    """In the survivors' group: the source stops itself before sending a byte."""
    from elasticd.worker.state_broadcast import broadcast_state
    from elasticd.worker.transport.collective import CollectiveStateTransport
    from elasticd.worker.transport.tcp import TcpStateTransport

    if rank == 0:
        def stop_instead(self, receivers, deadline):  # type: ignore[no-untyped-def]
            os.kill(os.getpid(), signal.SIGSTOP)

        TcpStateTransport.send = stop_instead  # type: ignore[method-assign]
        CollectiveStateTransport.send = stop_instead  # type: ignore[method-assign]
    result = _failure(lambda: broadcast_state(state(7) if rank == 0 else None, 0, torch.device("cpu"),
                                              timeout_s=2.0, transport=kind, into=state(99)))
    out.write_text(json.dumps(result))


def main() -> int:
    import torch.distributed as dist

    from elasticd.teardown import end_process
    from elasticd.worker.context import init, leave_group, rejoin
    from elasticd.worker.transport.api import TransportKind

    init("gloo", timeout_s=60)
    kind = TransportKind(os.environ["TRANSPORT"])
    rank = dist.get_rank()
    out = Path(os.environ["OUT"])
    receive(rank, kind, out / f"receive-{rank}.json")
    dist.barrier()
    stand_by(rank, kind, out / f"stand_by-{rank}.json")
    dist.barrier()
    die(rank, kind, out / f"die-{rank}.json")
    leave_group()  # rank 0 is dead: the survivors form a group of their own
    rejoin(rank - 1, 2, 1, "127.0.0.1", int(os.environ["REFORM_PORT"]), timeout_s=30)
    (out / f"stall-{rank}.pid").write_text(str(os.getpid()))
    stall(dist.get_rank(), kind, out / f"stall-{rank}.json")
    end_process(0)  # the group is broken (its source is stopped): leave without tearing it down


if __name__ == "__main__":
    sys.exit(main())
