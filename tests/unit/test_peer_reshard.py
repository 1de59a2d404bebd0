"""The in-memory reshard of a shard-size change: its plan (pure), and the state a snapshot
holds, taken from one FSDP2 model and put into another (one gloo process)."""

from __future__ import annotations

import pytest
import torch

from elasticd.checkpoint.api import CheckpointCorruptError
from elasticd.worker.peer_replica import fill_boxes as fill_targets
from elasticd.worker.peer_replica import parse_snapshot_index
from elasticd.worker.peer_reshard import (
    MemoryReport,
    apply_replica_state,
    needed_ranks,
    plan_memory_reshard,
    replica_state,
)
from elasticd.worker.sharded import NOT_HELD

pytestmark = pytest.mark.timeout(60)


def _joiner() -> MemoryReport:
    return MemoryReport(-1, 0, NOT_HELD)


def test_a_join_with_nobody_lost_reshards_the_live_shards_at_the_newest_step():
    """Old world 2 (both here at step 7) and two joiners: from the live shards, no rollback."""
    plan = plan_memory_reshard([MemoryReport(0, 2, 7, 4), MemoryReport(1, 2, 7, 4), _joiner(), _joiner()])
    assert plan.fallback is None and plan.fresh and plan.step == 7
    assert dict(plan.sources) == {0: 0, 1: 1}


def test_a_node_loss_rolls_back_to_the_replicas_served_by_their_holders():
    """Old 2 x 2, node b (old ranks 2, 3) lost; new ranks 0, 1 are old 1, 0 and hold b's
    replicas of step 8: every old rank's shards come from memory, at step 8."""
    reports = [MemoryReport(1, 4, 9, 8, ((3, 8),)), MemoryReport(0, 4, 9, 8, ((2, 8),))]
    plan = plan_memory_reshard(reports)
    assert plan.fallback is None and not plan.fresh and plan.step == 8 and plan.old_world == 4
    assert dict(plan.sources) == {0: 1, 1: 0, 2: 1, 3: 0}


def test_a_rank_lost_with_the_holder_of_its_replica_reads_the_checkpoint_saying_why():
    """Old world 3 (ring 0 -> 1 -> 2 -> 0): ranks 1 and 2 lost, rank 1's replica was on 2."""
    plan = plan_memory_reshard([MemoryReport(0, 3, 5, 4, ((2, 4),))])
    assert plan.fallback is not None and "rank 1" in plan.fallback
    assert plan_memory_reshard([MemoryReport(0, 2, 5, -1)]).fallback is not None  # no replica at all


def test_replicas_of_different_steps_or_worlds_read_the_checkpoint():
    """A refresh cut short (own 8, held 4), or survivors of two different worlds."""
    assert "different steps" in str(plan_memory_reshard([MemoryReport(0, 2, 9, 8, ((1, 4),))]).fallback)
    mixed = plan_memory_reshard([MemoryReport(0, 2, 9, 8), MemoryReport(1, 3, 9, 8)])
    assert mixed.fallback is not None and "one world" in mixed.fallback
    twice = plan_memory_reshard([MemoryReport(0, 2, 9, 8), MemoryReport(0, 2, 9, 8)])
    assert twice.fallback is not None and "one world" in twice.fallback


def test_a_checkpoint_committed_after_the_replicas_step_is_loaded_instead():
    """Replicas of step 8, the job at 9: a checkpoint committed at step 9 (checkpoints more
    often than every k steps) retrains fewer steps, so the plan reads it, saying why; one at
    8 or older, or a pointer beyond every survivor's step (not this lineage's), leaves the
    replicas in use. A join (the live shards, nobody lost) never reads it."""
    def reports(committed: int) -> list[MemoryReport]:
        return [MemoryReport(1, 4, 9, 8, ((3, 8),), committed), MemoryReport(0, 4, 9, 8, ((2, 8),), -1)]

    newer = plan_memory_reshard(reports(9))
    assert newer.fallback is not None and "step 9" in newer.fallback and "newer than the replicas" in newer.fallback
    for committed in (8, 3, -1, 12):
        assert plan_memory_reshard(reports(committed)).fallback is None, committed
    join = plan_memory_reshard([MemoryReport(0, 2, 7, 4, (), 7), MemoryReport(1, 2, 7, 4), _joiner()])
    assert join.fallback is None and join.fresh


def test_a_report_survives_the_all_gather_encoding():
    r = MemoryReport(3, 4, 17, 16, ((1, 16), (2, 16)), 15)
    assert MemoryReport.decode(r.encode()) == r
    assert len(r.encode()) == len(_joiner().encode())


@pytest.fixture
def one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    finally:
        dist.destroy_process_group()


def _job(mesh, seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double(),
                        mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01 * seed)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    model(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
    optim.step()
    sched.step()
    sampler = {"epoch": seed, "position": 10 * seed}
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    return {"model": model, "optim": optim, "sched": sched, "sampler": sampler}, names, params


def test_a_snapshot_s_state_fills_another_model_with_the_same_values(one_rank_mesh):
    """Model, Adam state (DTensor moments and the scalar step), LR and scheduler, the
    sampler and the RNG: taken from job A as JSON + bytes, resharded, put into job B."""
    from elasticd.checkpoint import rng
    from elasticd.worker.peer_replica import take_snapshot

    a, names, params = _job(one_rank_mesh, 1)
    torch.manual_seed(123)
    tensors, extra = replica_state(a, a["model"], names, params, rng.capture())
    expected_draw = torch.rand(3)
    snap = take_snapshot(0, 6, tensors, extra)
    rank, step, chunks, size, state = parse_snapshot_index(snap.index())
    assert (rank, step, size) == (0, 6, snap.data.numel())

    b, names_b, params_b = _job(one_rank_mesh, 2)
    targets = {k: torch.empty_like(t) for k, t in tensors.items()}
    assert needed_ranks(targets, {0: chunks}) == {0}
    filled = fill_targets(targets, {0: chunks}, {0: size}, {0: snap.data})
    restored = apply_replica_state(b, b["model"], names_b, params_b, filled, state)
    rng.restore([restored], 0)
    assert torch.equal(torch.rand(3), expected_draw)
    for pa, pb in zip(params, params_b, strict=True):
        assert torch.equal(pa.to_local(), pb.to_local())
    sa, sb = a["optim"].state, b["optim"].state
    for pa, pb in zip(params, params_b, strict=True):
        assert torch.equal(sa[pa]["exp_avg"].to_local(), sb[pb]["exp_avg"].to_local())
        assert torch.equal(sa[pa]["step"], sb[pb]["step"])
    assert b["optim"].param_groups[0]["lr"] == a["optim"].param_groups[0]["lr"]
    assert b["sched"].state_dict() == a["sched"].state_dict()
    assert b["sampler"] == {"epoch": 1, "position": 10}


def test_state_a_replica_cannot_hold_is_named(one_rank_mesh):
    a, names, params = _job(one_rank_mesh, 1)
    a["sampler"] = {"generator": torch.Generator()}
    with pytest.raises(TypeError):
        replica_state(a, a["model"], names, params, {})


def test_a_missing_shard_or_missing_bytes_is_refused(one_rank_mesh):
    """Old rank 1's index absent (a gap), or its bytes never arrived."""
    from elasticd.checkpoint import shards
    from elasticd.checkpoint.manifest import checksum

    target = torch.empty_like(_job(one_rank_mesh, 1)[2][0])  # an (3, 4) DTensor on 1 rank
    half = [shards.Chunk("w", "float64", (3, 4), (0, 0), (2, 4), 0, 64, checksum(bytes(64)),
                         shards.data_name(0)),
            shards.Chunk("w", "float64", (3, 4), (2, 0), (1, 4), 0, 32, 0, shards.data_name(1))]
    with pytest.raises(CheckpointCorruptError, match="cover"):
        fill_targets({"w": target}, {0: half[:1]}, {0: 64}, {0: torch.zeros(64, dtype=torch.uint8)})
    with pytest.raises(CheckpointCorruptError, match="did not arrive"):
        fill_targets({"w": target}, {0: half[:1], 1: half[1:]}, {0: 64, 1: 32},
                     {0: torch.zeros(64, dtype=torch.uint8)})
