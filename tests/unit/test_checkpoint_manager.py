"""CheckpointManager on memory://: save/load, async semantics, fencing, corruption fallback."""

from __future__ import annotations

import random
import threading
import uuid

import fsspec
import pytest
import torch
from structlog.testing import capture_logs

from elasticd.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointSaveError,
    MemoryCommitFence,
)
from elasticd.checkpoint.manifest import MANIFEST_NAME, STATE_FILE
from elasticd.checkpoint.store import FsspecCheckpointStore
from elasticd.errors import ConfigError, FencedError


@pytest.fixture
def url():
    """A fresh memory:// root, removed afterwards."""
    name = f"ckpt-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def _net(hidden: int = 8) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2))


def _trained():
    torch.manual_seed(0)
    model = _net()
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    for _ in range(3):
        optim.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        optim.step()
        sched.step()
    return model, optim, sched


def _state(model, optim, sched, step):
    return {"model": model, "optim": optim, "sched": sched,
            "sampler": {"epoch": 0, "samples_trained": step * 8}, "extra": {"loss": 0.5}}


def _fresh():
    model = _net()
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    return model, optim, sched


def _latest_save(mgr):
    return mgr.store.list_saves()[0]


def _path(mgr, save, name):
    return f"{mgr.store.save_path(save.step, save.save_id)}/{name}"


def _skips(cap):
    return [e["reason"] for e in cap if e["event"] == "checkpoint_skipped"]


def test_round_trip_restores_model_optimizer_scheduler_sampler_and_rng(url):
    """Everything saved comes back: weights, Adam moments, LR schedule, sampler, extra, RNG."""
    model, optim, sched = _trained()
    with CheckpointManager(url, job="demo") as mgr:
        torch.manual_seed(123)
        random.seed(7)
        mgr.save(30, _state(model, optim, sched, 30))
        expected_draw = (torch.rand(2), random.random())
    model2, optim2, sched2 = _fresh()
    extra = {}
    torch.manual_seed(999)
    loaded = CheckpointManager(url, job="demo").load_latest(
        {"model": model2, "optim": optim2, "sched": sched2, "extra": extra})
    assert loaded.step == 30 and loaded.world_size == 1 and loaded.skipped == ()
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(optim.state_dict()["state"][0]["exp_avg"], optim2.state_dict()["state"][0]["exp_avg"])
    assert sched2.last_epoch == 3 and optim2.param_groups[0]["lr"] == optim.param_groups[0]["lr"]
    assert loaded.state["sampler"] == {"epoch": 0, "samples_trained": 240}
    assert extra == {"loss": 0.5}
    assert torch.equal(torch.rand(2), expected_draw[0]) and random.random() == expected_draw[1]


def test_no_checkpoint_returns_none(url):
    """An empty prefix loads nothing, without error."""
    assert CheckpointManager(url, job="demo").load_latest({"model": _net()}) is None


class _Gate:
    """Blocks the writer of chosen steps until released; records write order."""

    def __init__(self, store: FsspecCheckpointStore, block_steps: set[int]) -> None:
        self.order: list[str] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self._write = store.write_file
        self._block = block_steps
        store.write_file = self.write_file  # type: ignore[method-assign]

    def write_file(self, step, save_id, name, write):
        self.order.append(f"begin {step}")
        if step in self._block:
            self.started.set()
            assert self.release.wait(10), "test never released the writer"
        entry = self._write(step, save_id, name, write)
        self.order.append(f"end {step}")
        return entry


def test_async_save_snapshots_state_before_returning(url):
    """save() returns while the upload is blocked, and later updates do not leak into it."""
    model, optim, sched = _trained()
    mgr = CheckpointManager(url, job="demo")
    gate = _Gate(mgr.store, {1})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    mgr.save(1, {"model": model})
    assert gate.started.wait(10)  # save returned, the writer is mid-upload
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)
    gate.release.set()
    result = mgr.wait()
    assert result.step == 1 and result.committed and result.blocked_s < 5
    model2 = _net()
    CheckpointManager(url, job="demo").load_latest({"model": model2})
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k])


def test_at_most_one_save_in_flight(url):
    """A second save waits for the first to commit before its own upload starts."""
    model = _net()
    mgr = CheckpointManager(url, job="demo")
    gate = _Gate(mgr.store, {1})
    mgr.save(1, {"model": model})
    releaser = threading.Thread(target=lambda: (gate.started.wait(10), gate.release.set()))
    releaser.start()
    mgr.save(2, {"model": model})
    mgr.close()
    releaser.join()
    assert gate.order == ["begin 1", "end 1", "begin 2", "end 2"]


def test_background_error_surfaces_on_next_call_and_at_close(url):
    """A failed upload raises CheckpointSaveError from the next save and from close."""
    model = _net()
    mgr = CheckpointManager(url, job="demo")
    real = mgr.store.write_file
    mgr.store.write_file = lambda *a: (_ for _ in ()).throw(OSError("disk full"))  # type: ignore[method-assign]
    with capture_logs() as cap:
        mgr.save(1, {"model": model})
        with pytest.raises(CheckpointSaveError, match="disk full"):
            mgr.save(2, {"model": model})
    assert any(e["event"] == "checkpoint_save_failed" for e in cap)
    mgr.store.write_file = real  # type: ignore[method-assign]
    mgr.save(3, {"model": model})
    mgr.store.write_file = lambda *a: (_ for _ in ()).throw(OSError("gone"))  # type: ignore[method-assign]
    mgr.save(4, {"model": model})
    with pytest.raises(CheckpointSaveError, match="gone"):
        mgr.close()
    assert CheckpointManager(url, job="demo").load_latest().step == 3
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(5, {"model": model})


def test_blocking_save_is_committed_on_return(url):
    """blocking=True returns after the manifest is written."""
    mgr = CheckpointManager(url, job="demo")
    mgr.save(7, {"model": _net()}, blocking=True)
    assert [s.step for s in mgr.store.list_saves() if s.has_manifest] == [7]
    assert mgr.wait().step == 7


def test_fenced_out_save_raises_fenced_error_and_is_deleted(url):
    """A zombie's save is refused by the fence: FencedError next call, files removed."""
    live = MemoryCommitFence(round_=2)
    zombie = CheckpointManager(url, job="demo", fence=live.for_round(1))
    with capture_logs() as cap:
        zombie.save(50, {"model": _net()})
        with pytest.raises(FencedError, match="zombie"):
            zombie.wait()
    assert any(e["event"] == "checkpoint_commit_refused" for e in cap)
    assert zombie.store.list_saves() == []
    assert live.latest() is None


def test_refusal_of_a_save_begun_before_a_live_reformation_is_not_a_zombie(url):
    """The group re-formed in place while a save's commit was in flight: the refusal (the
    round moved) raises nothing, the state lives on in memory, and the next save commits."""
    fence = MemoryCommitFence(round_=1)
    mgr = CheckpointManager(url, job="demo", fence=fence)
    fence.current_round = 2  # the job moved on while the save below is being written
    mgr.save(4, {"model": _net()})
    mgr._inflight.thread.join(30)  # its commit was refused before the re-formation below
    mgr.regroup()  # the live re-formation (no torch group here: a group of one)
    fence.writer_round = 2
    with capture_logs() as cap:
        mgr.save(5, {"model": _net()}, blocking=True)
    assert any(e["event"] == "checkpoint_commit_superseded" for e in cap)
    assert [s.step for s in mgr.store.list_saves()] == [5]
    assert fence.latest().step == 5


def test_a_sharded_save_waiting_for_a_lost_ranks_shards_stops_at_the_live_reformation(url):
    """Rank 0's writer waits (polling storage) for every rank's shard index; a rank killed
    mid-save never writes one. Once the group re-forms, the wait ends at once (not after
    ``shard_wait_s``: the next save joined it and held the re-formed job 300 s), the save
    stays uncommitted, and that is no error of the new group."""
    from elasticd.checkpoint import manager as manager_mod

    mgr = CheckpointManager(url, job="demo", rank=0, world_size=2)
    mgr.shard_wait_s = 60.0
    errors: list[BaseException] = []

    def wait_for_rank_1() -> None:
        try:
            mgr._peer_shards(4, "s", generation=0)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    waiter = threading.Thread(target=wait_for_rank_1)
    waiter.start()
    mgr.regroup()  # the live re-formation without the lost rank
    waiter.join(5)
    assert not waiter.is_alive(), "the writer still waits for the lost rank's shards"
    assert len(errors) == 1 and isinstance(errors[0], CheckpointSaveError), errors
    assert "re-formed before rank 1 wrote its shards" in str(errors[0])
    mgr._inflight = manager_mod._InFlight(step=4, save_id="s", blocked_s=0.0, generation=0,
                                         error=errors[0])
    with capture_logs() as cap:
        mgr._finish_inflight()  # the next save's first act: nothing raised
    assert any(e["event"] == "checkpoint_commit_superseded" for e in cap)


def test_reader_trusts_pointer_over_newer_unfenced_upload(url):
    """With a pointer at step 10, a newer upload is skipped by readers but never pruned:
    its commit may still land (an UNKNOWN commit is retried)."""
    fence = MemoryCommitFence(round_=1)
    clock = [1000.0]
    live = CheckpointManager(url, job="demo", fence=fence, grace_s=60, clock=lambda: clock[0])
    good = _net()
    live.save(10, {"model": good}, blocking=True)
    # A writer that never asked the fence (crashed before its commit, or a zombie).
    stray = CheckpointManager(url, job="demo", clock=lambda: clock[0])
    stray.save(20, {"model": _net()}, blocking=True)
    with capture_logs() as cap:
        loaded = CheckpointManager(url, job="demo", fence=fence).load_latest({"model": _net()})
    assert loaded.step == 10 and "not committed by the fence" in _skips(cap)[0]
    # Without the fence (no etcd) the listing decides: step 20 is the newest.
    assert CheckpointManager(url, job="demo").load_latest().step == 20
    clock[0] += 61
    assert live.prune() == []
    assert {s.step for s in live.store.list_saves()} == {10, 20}


def test_corrupt_checkpoints_are_skipped_with_reasons(url):
    """Flipped bytes, a truncated manifest and a deleted data file each fall back one step."""
    model = _net()
    mgr = CheckpointManager(url, job="demo", keep_last=10)
    for step in (1, 2, 3, 4):
        mgr.save(step, {"model": model}, blocking=True)
    fs = mgr.store.fs
    saves = {s.step: s for s in mgr.store.list_saves()}
    data = bytearray(fs.cat_file(_path(mgr, saves[4], STATE_FILE)))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(_path(mgr, saves[4], STATE_FILE), bytes(data))
    manifest = fs.cat_file(_path(mgr, saves[3], MANIFEST_NAME))
    fs.pipe_file(_path(mgr, saves[3], MANIFEST_NAME), manifest[: len(manifest) // 3])
    fs.rm_file(_path(mgr, saves[2], STATE_FILE))
    with capture_logs() as cap:
        loaded = CheckpointManager(url, job="demo").load_latest({"model": _net()})
    assert loaded.step == 1
    reasons = _skips(cap)
    assert len(reasons) == 3 and [s.reason for s in loaded.skipped] == reasons
    assert "checksum mismatch" in reasons[0]
    assert "not valid JSON" in reasons[1]
    assert "state.pt is missing" in reasons[2]


def test_checkpoint_of_another_job_fails_clearly(url):
    """A checkpoint copied under another job's prefix raises a mismatch naming both jobs."""
    mgr = CheckpointManager(url, job="alpha")
    mgr.save(5, {"model": _net()}, blocking=True)
    save = _latest_save(mgr)
    src = mgr.store.save_path(save.step, save.save_id)
    fs = mgr.store.fs
    for name in (STATE_FILE, MANIFEST_NAME):
        fs.pipe_file(src.replace("/alpha/", "/beta/") + f"/{name}", fs.cat_file(f"{src}/{name}"))
    with pytest.raises(CheckpointMismatchError, match="belongs to job 'alpha', not 'beta'"):
        CheckpointManager(url, job="beta").load_latest({"model": _net()})


def test_incompatible_model_fails_clearly(url):
    """Loading into a different architecture names the mismatching keys, touching nothing."""
    CheckpointManager(url, job="demo").save(5, {"model": _net(hidden=8)}, blocking=True)
    target = _net(hidden=16)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match="does not fit the model under 'model'.*shape"):
        CheckpointManager(url, job="demo").load_latest({"model": target})
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


def test_torn_save_is_skipped_then_pruned_after_grace(url):
    """A save with data but no manifest is skipped by readers and pruned once older than grace."""
    clock = [5000.0]
    mgr = CheckpointManager(url, job="demo", grace_s=100, clock=lambda: clock[0])
    mgr.save(1, {"model": _net()}, blocking=True)
    mgr.store.write_file(2, "0000005000000-deadbeef", STATE_FILE, lambda w: w.write(b"partial"))
    with capture_logs() as cap:
        assert CheckpointManager(url, job="demo").load_latest().step == 1
    assert "no manifest" in _skips(cap)[0]
    assert mgr.prune() == []
    clock[0] += 101
    assert [d.save.step for d in mgr.prune()] == [2]


def test_retention_keeps_last_k_and_every_n(url):
    """keep_last=2, keep_every=4 leaves the two newest and the multiples of 4."""
    mgr = CheckpointManager(url, job="demo", keep_last=2, keep_every=4)
    model = _net()
    for step in range(1, 10):
        mgr.save(step, {"model": model})
    mgr.close()
    assert sorted(s.step for s in mgr.store.list_saves()) == [4, 8, 9]


def test_bad_arguments_are_config_errors(url):
    """Invalid job names, retention values, steps and rank/world_size are ConfigErrors."""
    with pytest.raises(ConfigError, match="invalid job name"):
        CheckpointManager(url, job="../escape")
    with pytest.raises(ConfigError, match="keep_last"):
        CheckpointManager(url, job="demo", keep_last=0)
    with pytest.raises(ConfigError, match="outside world_size"):
        CheckpointManager(url, job="demo", rank=2, world_size=2)
    with pytest.raises(ConfigError, match="step"):
        CheckpointManager(url, job="demo").save(-1, {})
    with pytest.raises(ConfigError, match="cannot be opened"):
        CheckpointManager("nosuchproto://x", job="demo")


def test_non_writer_rank_without_group_writes_nothing(url):
    """Without a process group, only rank 0 writes; rank 1's save is a no-op."""
    mgr = CheckpointManager(url, job="demo", rank=1, world_size=2)
    mgr.save(3, {"model": _net()})
    assert mgr.wait() is None and mgr.store.list_saves() == []


def _mapped_ranges(path_part: str) -> list[tuple[int, int]]:
    with open("/proc/self/maps") as maps:
        return [tuple(int(x, 16) for x in line.split()[0].split("-"))
                for line in maps if path_part in line]


def _mapped_tensors(obj, ranges) -> int:
    if isinstance(obj, torch.Tensor):
        return int(any(lo <= obj.data_ptr() < hi for lo, hi in ranges))
    if isinstance(obj, dict):
        return sum(_mapped_tensors(v, ranges) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_mapped_tensors(v, ranges) for v in obj)
    return 0


def test_local_load_leaves_no_tensor_mapped_to_the_checkpoint_file(tmp_path):
    """On file:// the state file is memory-mapped to load fast, but no tensor handed to the
    caller (optimizer state, dict values, returned state) keeps pointing into it."""
    model, optim, sched = _trained()
    url = f"file://{tmp_path}"
    CheckpointManager(url, job="demo").save(
        3, {"model": model, "optim": optim, "extra": {"t": torch.ones(4)}, "other": {"u": torch.ones(2)}},
        blocking=True)
    model2, optim2, _ = _fresh()
    extra: dict = {}
    mgr = CheckpointManager(url, job="demo")
    probe = mgr.store.list_saves()[0]
    path = f"{mgr.store.save_path(probe.step, probe.save_id)}/{STATE_FILE}"
    raw = torch.load(path, mmap=True, weights_only=True)  # control: this one is mapped
    assert _mapped_tensors(raw, _mapped_ranges(path)) > 0
    loaded = mgr.load_latest({"model": model2, "optim": optim2, "extra": extra})
    ranges = _mapped_ranges(path)
    assert set(loaded.state) == {"other"}
    assert torch.equal(optim2.state_dict()["state"][0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])
    for obj in (optim2.state_dict(), extra, loaded.state, dict(model2.state_dict())):
        assert _mapped_tensors(obj, ranges) == 0


def test_corrupt_pointed_checkpoint_falls_back_below_the_pointer(url):
    """If the pointed-to checkpoint is corrupt, the one before it loads (never a newer stray)."""
    fence = MemoryCommitFence(round_=1)
    mgr = CheckpointManager(url, job="demo", fence=fence, keep_last=5)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((8,), float(step))}, blocking=True)
    CheckpointManager(url, job="demo").save(3, {"w": torch.full((8,), 3.0)}, blocking=True)  # stray
    pointed = mgr.store.list_saves()[1]
    assert pointed.step == 2
    mgr.store.fs.rm_file(_path(mgr, pointed, STATE_FILE))
    w = torch.zeros(8)
    with capture_logs() as cap:
        loaded = CheckpointManager(url, job="demo", fence=fence).load_latest({"w": w})
    assert loaded.step == 1 and torch.all(w == 1.0)
    assert [r.split(":")[0] for r in _skips(cap)] == ["not committed by the fence (pointer is step 2)",
                                                      "data file state.pt is missing"]


def test_pointer_outside_the_job_prefix_is_ignored(url):
    """A pointer naming another URL (the job moved) is not followed; the listing decides."""
    fence = MemoryCommitFence(round_=1)
    fence.commit(99, "s3://elsewhere/demo/step-000000000099/0000000000001-aaaaaaaa/manifest.json", 1)
    CheckpointManager(url, job="demo").save(4, {"w": torch.ones(2)}, blocking=True)
    with capture_logs() as cap:
        loaded = CheckpointManager(url, job="demo", fence=fence).load_latest()
    assert loaded.step == 4
    assert any(e["event"] == "checkpoint_pointer_ignored" for e in cap)


class _ReportingFence(MemoryCommitFence):
    """A fence that is also a CheckpointReporter, as the agent's is."""

    def __init__(self) -> None:
        super().__init__(0)
        self.reports: list[tuple[str, int, int]] = []

    def saved(self, step: int, seconds: float, nbytes: int) -> None:
        assert seconds >= 0
        self.reports.append(("save", step, nbytes))

    def loaded(self, step: int, seconds: float, nbytes: int) -> None:
        assert seconds >= 0
        self.reports.append(("load", step, nbytes))


def test_saves_and_loads_are_reported_to_a_reporting_fence(url):
    """A committed save and a load are reported (step and data bytes) to a fence that is a
    CheckpointReporter; a refused save is not (its upload is deleted)."""
    fence = _ReportingFence()
    state = {"w": torch.arange(64.0)}
    with CheckpointManager(url, job="j", fence=fence, rank=0, world_size=1) as m:
        m.save(3, state, blocking=True)
        nbytes = m.wait().nbytes
        m.load_latest({"w": torch.zeros(64)})
    assert fence.reports == [("save", 3, nbytes), ("load", 3, nbytes)] and nbytes > 0
    zombie = _ReportingFence()
    zombie.current_round = 1  # this writer's round 0 is over: refused
    with CheckpointManager(url, job="j", fence=zombie, rank=0, world_size=1) as m:
        m.save(4, state, blocking=False)
        with pytest.raises(FencedError):
            m.wait()
    assert zombie.reports == []
