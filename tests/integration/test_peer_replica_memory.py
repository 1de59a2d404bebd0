"""The peer-RAM replica in one process: two ranks' snapshots cross over the TCP transport
(JSON index, raw bytes, no pickle) and reshard in memory to a 1-rank mesh; a ticket planted
in the store by someone outside the group is refused."""

from __future__ import annotations

import threading
import time

import pytest

KEY = bytes(range(32))  # the round key the group agreed (in live.py: by a collective)


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
        replicas = [PeerReplica(r, [1, 0], store, "127.0.0.1", key=KEY, every_steps=5)
                    for r in (0, 1)]

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


def _half(full, rank: int, step: int = 5):
    """Old rank ``rank``'s half (rows) of ``full`` as a sealed snapshot of a 2-rank world."""
    import torch

    from elasticd.checkpoint import shards
    from elasticd.worker import peer_replica as pr

    rows = full[rank * 3:(rank + 1) * 3].contiguous()
    raw = rows.reshape(-1).view(torch.uint8)
    chunk = shards.Chunk("w", "float64", tuple(full.shape), (rank * 3, 0), (3, 4), 0, raw.numel(),
                         pr.checksum(pr.byte_view(raw)), shards.data_name(rank))
    return pr.Snapshot(rank, step, [chunk], raw.clone(), {"sampler": {"samples": 40}})


@pytest.mark.timeout(60)
def test_a_ticket_planted_in_the_open_store_is_refused_and_the_real_state_rebuilt():
    """Another party on the c10d store (a TCPStore on 127.0.0.1) plants rank 1's ticket first,
    pointing at its own listener with forged bytes and matching CRCs: the holder refuses it,
    takes rank 1's real ticket, and the rebuilt tensor is the real one; no ticket in the store
    carries a transfer token."""
    import json
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from elasticd.worker.peer_replica import PeerReplica, fill_from_memory, ticket_tokens
    from elasticd.worker.transfer import TransferSource, byte_view

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))

    def client() -> dist.TCPStore:  # one connection each, as separate processes have
        return dist.TCPStore("127.0.0.1", store.port, is_master=False,
                             timeout=timedelta(seconds=30))

    attacker_store = client()
    forged_source = None
    try:
        full = torch.arange(24, dtype=torch.float64).view(6, 4)
        replicas = [PeerReplica(r, [1, 0], client(), "127.0.0.1", key=KEY, every_steps=5,
                                timeout_s=30) for r in (0, 1)]
        rank0 = threading.Thread(target=replicas[0]._exchange, args=(_half(full, 0), 1))
        rank0.start()
        # Rank 0 has published its own ticket and waits for rank 1's: plant a forged one.
        deadline = time.monotonic() + 20
        while not attacker_store.check(["peer-replica/1/0"]):
            assert time.monotonic() < deadline, "rank 0 published no ticket"
            time.sleep(0.02)
        forged = _half(torch.full((6, 4), 666.0, dtype=torch.float64), 1)
        forged_source = TransferSource("127.0.0.1", [byte_view(forged.data)])
        t = forged_source.ticket
        plant = json.dumps({"host": t.host, "port": t.port, "recv": t.recv_token.hex(),
                            "send": t.send_token.hex(), "total": t.total_bytes,
                            "count": t.count, "index": forged.index().decode()})
        attacker_store.set("peer-replica/1/1", plant)
        served = threading.Thread(target=lambda: _serve_quietly(forged_source, deadline),
                                  daemon=True)
        served.start()
        while getattr(replicas[0], "refused_tickets", 0) < 1 and served.is_alive():
            assert time.monotonic() < deadline, "rank 0 neither refused nor took the ticket"
            time.sleep(0.02)
        rank1 = threading.Thread(target=replicas[1]._exchange, args=(_half(full, 1), 1))
        rank1.start()
        rank0.join(30)
        rank1.join(30)
        assert [rep.error for rep in replicas] == [None, None]
        assert replicas[0].refused_tickets >= 1
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        target = distribute_tensor(torch.zeros(6, 4, dtype=torch.float64), mesh, [Shard(0)])
        out = fill_from_memory({"w": target}, [replicas[0].own, replicas[0].held[1]])
        assert torch.equal(out["w"].to_local(), full)
        # What any reader of the store sees of the real ticket: no token.
        value = attacker_store.get("peer-replica/1/1")
        body = json.loads(value.partition(b"\n")[2])
        assert set(body) == {"rank", "step", "host", "port", "total", "count", "index"}
        for token in ticket_tokens(KEY, "peer-replica/1", 1):
            assert token.hex().encode() not in value and token not in value
    finally:
        if forged_source is not None:
            forged_source.close()
        dist.destroy_process_group()


def _serve_quietly(source, deadline: float) -> None:
    """The attacker's listener: serves rank 0 if it connects, until ``deadline``."""
    from elasticd.worker.transfer import TransferError

    try:
        source.serve([0], deadline)
    except (TransferError, OSError):
        pass
