"""Sharded (FSDP2/HSDP) checkpoints reshard: saved by 4 ranks on a 2 x 2 HSDP mesh, loaded
by 3 ranks on a 1-D FSDP mesh and by 1 rank; a corrupt shard is skipped with its path named,
and ``--verify`` checks every shard's checksum and the coverage.

Real processes over gloo (tests/workers/sharded_ckpt.py, forked from one that imported
torch): four go through the phases, the
ranks beyond a phase's world leave. The test steps in between phases, through ``go-<n>``
files, to check storage and to corrupt a shard.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticd.checkpoint import list_checkpoints

WORKER = Path(__file__).resolve().parents[1] / "workers" / "sharded_ckpt.py"
PHASES = [[4, "hsdp", "save"], [3, "fsdp", "load"], [1, "fsdp", "load"]]


def _wait_for(paths: list[Path], procs: list[subprocess.Popen], deadline: float) -> None:
    while not all(p.exists() for p in paths):
        for proc in procs:
            if proc.poll() not in (None, 0):
                raise AssertionError(f"a rank failed:\n{proc.stderr.read().decode()[-4000:]}")
        assert time.monotonic() < deadline, f"no {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.02)


def _close(a, b, tol=1e-12) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b, strict=True))
    return abs(a - b) <= tol


@pytest.mark.timeout(180)
def test_hsdp_4_ranks_reshard_to_fsdp_3_and_1_rank_corrupt_shard_skipped(tmp_path):
    """Parameters and Adam moments loaded at 3 and at 1 rank equal the gathered values saved at
    4 (HSDP 2x2); flipping a byte of one rank's shard file makes the load fall back to the
    previous save, naming the file, and ``list_checkpoints(verify=True)`` marks it invalid."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=str(WORKER.parents[2]))
    # One process imports torch and forks the four ranks; it fails if any rank does.
    procs = [subprocess.Popen([sys.executable, str(WORKER), "4", str(tmp_path), json.dumps(PHASES)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                              start_new_session=True)]
    deadline = time.monotonic() + 160
    try:
        (tmp_path / "go-0").touch()
        _wait_for([tmp_path / f"0-r{r}.json" for r in range(4)], procs, deadline)
        infos = list_checkpoints(f"file://{tmp_path}/ckpt", "sharded", verify=True)
        assert [(i.step, i.valid, i.world_size) for i in infos] == [(2, True, 4), (1, True, 4)], infos
        (tmp_path / "go-1").touch()
        _wait_for([tmp_path / f"1-r{r}.json" for r in range(3)], procs, deadline)

        # Flip one byte of rank 1's shards in the newest save.
        newest = next(Path(i.url.removeprefix("file://")).parent for i in infos if i.step == 2)
        shard = newest / "shards-r00001.bin"
        data = bytearray(shard.read_bytes())
        data[3] ^= 0xFF
        shard.write_bytes(bytes(data))
        infos = list_checkpoints(f"file://{tmp_path}/ckpt", "sharded", verify=True)
        assert not infos[0].valid and "shards-r00001.bin" in infos[0].reason
        assert infos[1].valid
        (tmp_path / "go-2").touch()
        _wait_for([tmp_path / "2-r0.json"], procs, deadline)
        for proc in procs:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, err.decode()[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it forked
                proc.wait(10)

    def res(phase: int, rank: int) -> dict:
        return json.loads((tmp_path / f"{phase}-r{rank}.json").read_text())

    saved = res(0, 0)
    assert saved["step2"] != saved["step1"]
    for r in range(3):
        got = res(1, r)
        assert got["loaded_step"] == 2 and got["extra"] == {"step": 2}
        assert got["state"].keys() == saved["step2"].keys()
        assert all(_close(got["state"][k], saved["step2"][k]) for k in got["state"]), r
    solo = res(2, 0)
    assert solo["loaded_step"] == 1, solo
    assert any("shards-r00001.bin" in why for why in solo["skipped"]), solo["skipped"]
    assert all(_close(solo["state"][k], saved["step1"][k]) for k in solo["state"])


@pytest.mark.timeout(60)
def test_sharded_save_and_load_through_memory_fs_in_one_process():
    """fsspec's memory:// (the object-store path: one PUT per index, ranged GETs): an async
    sharded save of a 1-rank FSDP2 model and Adam, mutated right after save(), loads into a
    differently seeded model equal to the state at save()."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from elasticd.checkpoint import CheckpointManager

    sys.path.insert(0, str(WORKER.parent))
    from sharded_ckpt import full, model_on

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        model = model_on(mesh, 0)
        optim = torch.optim.Adam(model.parameters(), lr=0.05)
        model(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
        optim.step()
        want = json.loads(json.dumps(full(model, optim)))
        mgr = CheckpointManager("memory://sharded-test", job="mem", fence=None)
        mgr.save(1, {"model": model, "optim": optim})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the next step rewrites the parameters in place
        mgr.wait()
        fresh = model_on(mesh, 5)
        fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.05)
        loaded = mgr.load_latest({"model": fresh, "optim": fresh_optim})
        mgr.close()
        got = full(fresh, fresh_optim)
        assert loaded is not None and loaded.step == 1
        assert got.keys() == want.keys() and all(_close(got[k], want[k], 0) for k in want)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_a_fresh_optimizer_loads_without_a_zero_step_unless_its_state_is_shaped_otherwise(
        tmp_path, monkeypatch):
    """A fresh Adam's moments are read straight into new DTensors (its parameters stand in
    for their sharding: no zero-gradient step, which allocated and filled twice the model in
    zeros); an optimizer whose state is shaped unlike its parameters still gets its state
    created once by that step. Both load the saved values exactly."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from elasticd.checkpoint import CheckpointManager
    from elasticd.checkpoint import shards as shards_mod

    sys.path.insert(0, str(WORKER.parent))
    from sharded_ckpt import full, model_on

    class Flat(torch.optim.Optimizer):
        """Keeps each parameter's gradient sum flattened: a state tensor of another shape."""

        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if "flat" not in st:
                        st["flat"] = torch.zeros_like(p).flatten()
                    st["flat"].add_(p.grad.flatten())
                    p.sub_(group["lr"] * st["flat"].view_as(p))

    def every(model, optim) -> dict:  # full() and the Flat state
        out = full(model, optim)
        for i, p in enumerate(model.parameters()):
            if "flat" in optim.state.get(p, {}):
                out[f"o.{i}.flat"] = optim.state[p]["flat"].full_tensor().tolist()
        return out

    created = []
    real_init = shards_mod.init_optimizer_state
    monkeypatch.setattr(shards_mod, "init_optimizer_state",
                        lambda o: (created.append(type(o).__name__), real_init(o)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        for make, creates in ((lambda ps: torch.optim.Adam(ps, lr=0.05), []), (Flat, ["Flat"])):
            created.clear()
            model = model_on(mesh, 0)
            optim = make(model.parameters())
            for _ in range(2):
                model(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
                optim.step()
            want = json.loads(json.dumps(every(model, optim)))
            assert any(".flat" in k or ".exp_avg" in k for k in want)
            mgr = CheckpointManager(f"file://{tmp_path}/{type(optim).__name__}", job="fresh", fence=None)
            mgr.save(1, {"model": model, "optim": optim})
            mgr.wait()
            fresh = model_on(mesh, 5)
            fresh_optim = make(fresh.parameters())
            loaded = mgr.load_latest({"model": fresh, "optim": fresh_optim})
            mgr.close()
            assert loaded is not None and loaded.step == 1
            assert created == creates, (type(optim).__name__, created)
            got = every(fresh, fresh_optim)
            assert got.keys() == want.keys() and all(_close(got[k], want[k], 0) for k in want)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_whole_chunks_are_read_straight_into_the_new_shard_and_still_checked():
    """Two saved row blocks of one tensor loaded into a 1-rank mesh's shard (the whole
    tensor): each is read into its place in the new shard (no buffer of its own, no copy)
    and its CRC is checked there; a block whose bytes changed is refused."""
    import zlib

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from elasticd.checkpoint import shards
    from elasticd.checkpoint.api import CheckpointCorruptError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        saved = torch.arange(24, dtype=torch.float32).reshape(6, 4)
        blocks = [saved[0:2].clone(), saved[2:6].clone()]
        data = [bytes(shards.tensor_bytes(b)) for b in blocks]
        chunks = [shards.Chunk("w", "float32", (6, 4), (o, 0), tuple(b.shape), 0, len(d), zlib.crc32(d), f"f{i}")
                  for i, (o, b, d) in enumerate(zip((0, 2), blocks, data, strict=True))]
        target = distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])
        into: list[str] = []

        def read(c):
            raise AssertionError(f"{c.file} read into a buffer of its own")

        def read_into(c, buf, flip=False):
            into.append(c.file)
            buf[:] = data[int(c.file[1])]
            if flip:
                buf[1] ^= 0xFF
            shards.chunk_crc(c, buf)

        got = shards.fill(target, chunks, read, "test", read_into)
        assert into == ["f0", "f1"] and torch.equal(got.to_local(), saved)
        with pytest.raises(CheckpointCorruptError, match="f1"):
            shards.fill(target, chunks, read, "test",
                        lambda c, buf: read_into(c, buf, flip=c.file == "f1"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_blocks_copied_from_share_one_scratch_buffer_and_are_still_checked():
    """Saved column blocks (sharded on dim 1) loaded on one rank: each block's place in the
    new shard is not contiguous, so it is read whole and copied from; every block goes
    through the one reused scratch buffer (valid until the next read), the values come out
    right, and a block whose bytes changed is refused."""
    import zlib

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from elasticd.checkpoint import shards
    from elasticd.checkpoint.api import CheckpointCorruptError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        saved = torch.arange(24, dtype=torch.float32).reshape(6, 4)
        blocks = [saved[:, 0:2].contiguous(), saved[:, 2:4].contiguous()]
        data = [bytes(shards.tensor_bytes(b)) for b in blocks]
        chunks = [shards.Chunk("w", "float32", (6, 4), (0, o), tuple(b.shape), 0, len(d), zlib.crc32(d), f"f{i}")
                  for i, (o, b, d) in enumerate(zip((0, 2), blocks, data, strict=True))]
        target = distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])
        scratch = bytearray(len(data[0]))
        served: list[str] = []

        def read(c):
            raise AssertionError(f"{c.file} read into a buffer of its own")

        def read_scratch(c, flip=False):
            served.append(c.file)
            scratch[:] = data[int(c.file[1])]
            if flip:
                scratch[1] ^= 0xFF
            view = memoryview(scratch)
            shards.chunk_crc(c, view)
            return view

        got = shards.fill(target, chunks, read, "test", None, read_scratch)
        assert served == ["f0", "f1"] and torch.equal(got.to_local(), saved)
        with pytest.raises(CheckpointCorruptError, match="f1"):
            shards.fill(target, chunks, read, "test", None,
                        lambda c: read_scratch(c, flip=c.file == "f1"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_a_partial_box_reads_only_the_blocks_it_needs_and_checks_each(tmp_path):
    """A (600, 1000) float32 tensor saved as two row boxes (two ranks' data files on local
    disk, indexed by the writer's ``new_chunk``: a CRC per 64 KiB block), loaded by the real
    reader into one rank's box of two larger worlds (a fake process group: no peers needed):
    rows 200-299 of 6 ranks (inside one saved box: read straight into the new shard) and rows
    200-399, columns 0-499 of a 3 x 2 mesh (across both boxes, not contiguous in the new
    shard: copied from the scratch buffer). Each reads its rows rounded out to whole blocks,
    not the saved boxes whole; a flipped byte in a block it reads is refused even where the
    byte itself lies outside the rows it needs; an index without block CRCs (written before
    them) still loads, reading the boxes whole."""
    import dataclasses

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from elasticd.checkpoint import shards
    from elasticd.checkpoint.api import CheckpointCorruptError
    from elasticd.checkpoint.reader import ShardReads
    from elasticd.checkpoint.store import FsspecCheckpointStore

    saved = torch.randn(600, 1000, generator=torch.Generator().manual_seed(3))
    row, bb = 1000 * 4, shards.BLOCK_BYTES
    store = FsspecCheckpointStore(f"file://{tmp_path}", job="blocks")
    step, save_id = 1, "1700000000000-0123abcd"
    directory = Path(store.save_path(step, save_id))
    directory.mkdir(parents=True)
    chunks = []
    for r in range(2):
        box = saved[r * 300:(r + 1) * 300].contiguous()
        (directory / shards.data_name(r)).write_bytes(bytes(shards.tensor_bytes(box)))
        chunks.append(shards.new_chunk("w", box.dtype, (600, 1000), (r * 300, 0), (300, 1000), 0,
                                       shards.tensor_bytes(box), shards.data_name(r)))
    assert all(len(c.blocks) == -(-300 * row // bb) and shards.blocks_agree(c) for c in chunks)
    parsed, _, _ = shards.parse_index(shards.index_json(0, chunks[:1], chunks[0].length, 0),
                                      shards.index_name(0))
    assert parsed == [chunks[0]]  # the block CRCs survive the index's JSON
    read_bytes: list[int] = []
    scratch: list[int] = []  # the scratch buffer's size after each load
    real = store.read_range_into
    store.read_range_into = lambda *a: read_bytes.append(n := real(*a)) or n  # type: ignore[method-assign]

    def flip(r: int, at: int) -> None:
        path = directory / shards.data_name(r)
        data = bytearray(path.read_bytes())
        data[at] ^= 0xFF
        path.write_bytes(bytes(data))

    def load(world_shape, placements, rows, cols, use=chunks):
        mesh = init_device_mesh("cpu", world_shape)
        local = torch.zeros(rows[1] - rows[0], cols[1] - cols[0])
        target = DTensor.from_local(local, mesh, placements, run_check=False,
                                    shape=torch.Size([600, 1000]), stride=(1000, 1))
        read_bytes.clear()
        reads = ShardReads(store, step, save_id)
        got = reads.fill(target, use, "test").to_local()
        assert torch.equal(got, saved[rows[0]:rows[1], cols[0]:cols[1]])
        scratch.append(len(reads._scratch))
        return sum(read_bytes)

    def rounded(lo: int, hi: int) -> int:  # bytes of the blocks covering lo:hi
        return min(300 * row, -(-hi // bb) * bb) - lo // bb * bb

    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=6)
    try:
        # 6 ranks, rank 2: rows 200-299, all in box 0.
        assert load((6,), [Shard(0)], (200, 300), (0, 1000)) == rounded(200 * row, 300 * row)
        assert scratch[-1] <= bb  # only the partial block at the start went through it
        # 3 x 2, rank 2 = (1, 0): rows 200-399 (100 of each box), columns 0-499.
        both = load((3, 2), [Shard(0), Shard(1)], (200, 400), (0, 500))
        assert both == rounded(200 * row, 300 * row) + rounded(0, 100 * row) < 2 * 300 * row / 2
        # Written before block CRCs: each box read whole.
        old = [dataclasses.replace(c, block_bytes=0, blocks=()) for c in chunks]
        assert load((3, 2), [Shard(0), Shard(1)], (200, 400), (0, 500), old) == 2 * 300 * row
        # Row 199 of box 0 is not needed, but shares a block with row 200: refused.
        assert (199 * row) // bb == (200 * row) // bb
        flip(0, 199 * row + 7)
        for shape, placements, cols in (((6,), [Shard(0)], (0, 1000)),
                                        ((3, 2), [Shard(0), Shard(1)], (0, 500))):
            with pytest.raises(CheckpointCorruptError, match="shards-r00000.bin"):
                load(shape, placements, (200, 300 if len(shape) == 1 else 400), cols)
        flip(0, 199 * row + 7)
        flip(0, 250 * row)  # a whole block read straight into the new shard
        with pytest.raises(CheckpointCorruptError, match="shards-r00000.bin"):
            load((6,), [Shard(0)], (200, 300), (0, 1000))
        flip(0, 250 * row)
        flip(1, 50 * row)  # a whole block inside the rows of box 1 that 3 x 2 needs
        with pytest.raises(CheckpointCorruptError, match="shards-r00001.bin"):
            load((3, 2), [Shard(0), Shard(1)], (200, 400), (0, 500))
        load((6,), [Shard(0)], (200, 300), (0, 1000))  # box 1 is not read for rows 200-299
    finally:
        dist.destroy_process_group()
