"""One rank of the peer-RAM replica inside the state-transport contract: three processes,
``PeerReplica`` exchanges over the ``StateTransport`` seam (TCP), its tickets sealed in a
real ``TCPStore`` on 127.0.0.1 (rank 2 hosts it).

Environment: RANK (0..2), STORE_PORT, OUT (a directory for the reports). Three phases:

1. ``exchange``: a ring (0 -> 1 -> 2 -> 0); every rank reports the replica it holds;
2. ``die``: rank 0 SIGKILLs itself after the first bytes of its snapshot left for rank 1;
   rank 1 reports how (and when) its refresh failed;
3. ``stall``: rank 1 stops itself (SIGSTOP) before sending a byte to rank 2; rank 2 reports
   when its 2-second bound ended the wait. The test SIGKILLs the stopped rank.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

KEY = bytes(range(32))  # the round key (agreed by a collective under an agent)
NO = -1  # NO_HOLDER


def snapshot(rank: int, step: int):  # type: ignore[no-untyped-def]
    """Rank ``rank``'s third (rows) of a float64 tensor, as a sealed snapshot."""
    from elasticd.checkpoint import shards
    from elasticd.worker import peer_replica as pr

    full = torch.arange(36 * 1024, dtype=torch.float64).view(-1, 4) + 1000 * step
    third = full.shape[0] // 3
    rows = full[rank * third:(rank + 1) * third].contiguous()
    raw = rows.reshape(-1).view(torch.uint8)
    chunk = shards.Chunk("w", "float64", tuple(full.shape), (rank * third, 0), (third, 4), 0, raw.numel(),
                         pr.checksum(pr.byte_view(raw)), shards.data_name(rank))
    return pr.Snapshot(rank, step, [chunk], raw.clone(), {"sampler": {"samples": 8 * step}})


def run(rank: int, store: object, holders: list[int], phase: str, timeout_s: float) -> dict:
    from elasticd.worker.peer_replica import PeerReplica

    replica = PeerReplica(rank, holders, store, "127.0.0.1", key=KEY, allowed_peers=frozenset({"127.0.0.1"}),
                          every_steps=1, timeout_s=timeout_s, prefix=f"contract/{phase}")
    t0 = time.monotonic()
    replica._exchange(snapshot(rank, 5))  # what refresh() runs on its thread
    held = {str(peer): bool(torch.equal(snap.data, snapshot(peer, 5).data)) and snap.extra == {"sampler": {"samples": 40}}
            for peer, snap in replica.held.items()}
    error = replica.error
    return {"held": held, "error": type(error).__name__ if error else None,
            "message": str(error)[:300] if error else None, "after_s": time.monotonic() - t0}


def barrier(store, name: str, ranks: int) -> None:  # type: ignore[no-untyped-def]
    """Bounded: every one of ``ranks`` ranks has arrived (polls the store's counter)."""
    store.add(f"barrier/{name}", 1)
    deadline = time.monotonic() + 60
    while int(store.add(f"barrier/{name}", 0)) < ranks:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}")
        time.sleep(0.02)


def main() -> int:
    import torch.distributed as dist

    from elasticd.worker import transfer
    from elasticd.worker.transport.tcp import TcpStateTransport

    rank = int(os.environ["RANK"])
    out = Path(os.environ["OUT"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["STORE_PORT"]), 3, is_master=rank == 2,
                          timeout=timedelta(seconds=60))
    (out / f"exchange-{rank}.json").write_text(json.dumps(run(rank, store, [1, 2, 0], "exchange", 30)))
    barrier(store, "exchange", 3)
    if rank == 0:
        real_send = transfer._send_views

        def send_part_then_die(sock, views, deadline):  # type: ignore[no-untyped-def]
            real_send(sock, [views[0][:4096]], deadline)
            os.kill(os.getpid(), signal.SIGKILL)

        transfer._send_views = send_part_then_die
    die = run(rank, store, [1, NO, NO], "die", 30)
    if rank == 1:
        (out / "die-1.json").write_text(json.dumps(die))
    if rank == 0:
        return 0  # not reached: it killed itself
    barrier(store, "die", 2)  # ranks 1 and 2: rank 2's bound starts with rank 1's offer
    if rank == 1:
        def stop_instead(self, receivers, deadline):  # type: ignore[no-untyped-def]
            os.kill(os.getpid(), signal.SIGSTOP)

        TcpStateTransport.send = stop_instead  # type: ignore[method-assign]
    stall = run(rank, store, [NO, 2, NO], "stall", 2.0)
    if rank == 2:
        (out / "stall-2.json").write_text(json.dumps(stall))
    return 0


if __name__ == "__main__":
    sys.exit(main())
