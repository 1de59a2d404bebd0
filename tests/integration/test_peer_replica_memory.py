"""The peer-RAM replica in one process: two ranks' snapshots cross over the TCP transport
(JSON index, raw bytes, no pickle) and reshard in memory to a 1-rank mesh."""

from __future__ import annotations

import threading

import pytest


@pytest.mark.timeout(60)
def test_replicas_exchange_over_tcp_and_reshard_in_memory():
    """Rank 0's and rank 1's halves of a float64 tensor, exchanged through PeerReplica, fill a
    1-rank DTensor equal to the full tensor, with the sampler state carried along."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from elasticd.worker.peer_replica import PeerReplica, Snapshot, fill_from_memory

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        full = torch.arange(24, dtype=torch.float64).view(6, 4)
        target = distribute_tensor(torch.zeros(6, 4, dtype=torch.float64), mesh, [Shard(0)])
        store = dist.HashStore()
        replicas = [PeerReplica(r, [1, 0], store, "127.0.0.1", every_steps=5) for r in (0, 1)]

        # Each "old rank" snapshots its half (a DTensor box of its own), as at 2 ranks.
        from elasticd.checkpoint import shards
        from elasticd.worker import peer_replica as pr

        def half(rank: int) -> Snapshot:
            rows = full[rank * 3:(rank + 1) * 3].contiguous()
            raw = rows.reshape(-1).view(torch.uint8)
            chunk = shards.Chunk("w", "float64", (6, 4), (rank * 3, 0), (3, 4), 0, raw.numel(),
                                 pr.checksum(pr.byte_view(raw)), shards.data_name(rank))
            return Snapshot(rank, 5, [chunk], raw.clone(), {"sampler": {"samples": 40}})

        threads = [threading.Thread(target=rep._exchange, args=(half(rep.rank),)) for rep in replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert [rep.error for rep in replicas] == [None, None]
        assert replicas[0].held[1].extra == {"sampler": {"samples": 40}}
        # Rank 1 is lost: rank 0 reshards from its own snapshot and the replica it holds.
        out = fill_from_memory({"w": target}, [replicas[0].own, replicas[0].held[1]])
        assert torch.equal(out["w"].to_local(), full)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_snapshot_of_dtensors_round_trips_and_a_flipped_byte_is_refused():
    """take_snapshot(crc=False) + seal of real DTensors parses back equal; one flipped byte of
    the received buffer raises CheckpointCorruptError when the chunk is read (no state from
    a damaged replica), a buffer of another size at once."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from elasticd.checkpoint.api import CheckpointCorruptError
    from elasticd.worker.peer_replica import fill_from_memory, parse_snapshot, seal, take_snapshot

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        w = distribute_tensor(torch.randn(5, 3, dtype=torch.float64), mesh, [Shard(0)])
        m = distribute_tensor(torch.randn(7, dtype=torch.float64), mesh, [Shard(0)])
        snap = seal(take_snapshot(0, 9, {"w": w, "optim.m": m}, {"samples": 72}, crc=False))
        back = parse_snapshot(snap.index(), snap.data.clone())
        assert (back.step, back.extra) == (9, {"samples": 72})
        out = fill_from_memory({"w": distribute_tensor(torch.zeros(5, 3, dtype=torch.float64), mesh, [Shard(0)]),
                                "optim.m": distribute_tensor(torch.zeros(7, dtype=torch.float64), mesh, [Shard(0)])},
                               [back])
        assert torch.equal(out["w"].to_local(), w.to_local())
        assert torch.equal(out["optim.m"].to_local(), m.to_local())
        bad = snap.data.clone()
        bad[3] ^= 1
        with pytest.raises(CheckpointCorruptError):  # when a recovery reads the chunk
            fill_from_memory({"w": distribute_tensor(torch.zeros(5, 3, dtype=torch.float64), mesh, [Shard(0)])},
                             [parse_snapshot(snap.index(), bad)])
        with pytest.raises(CheckpointCorruptError):  # bytes of another size
            parse_snapshot(snap.index(), bad[:-1])
    finally:
        dist.destroy_process_group()
