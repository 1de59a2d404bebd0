"""ElasticLoop in one process: what counts as trained, where a resume starts, batch sizes."""

from __future__ import annotations

import uuid

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from elasticd import worker
from elasticd.checkpoint import CheckpointManager
from elasticd.errors import ConfigError
from elasticd.worker.loop import (
    ElasticLoop,
    batch_len,
    check_global_batch_pipeline,
    check_share,
    check_state,
    dropped_tail,
    stale_group_error,
)

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "ELASTICD_CONTROL_DIR", "ELASTICD_CONTROL_SOCKET", "ELASTICD_CHECKPOINT_URL",
                 "ELASTICD_JOB", "ELASTICD_ROUND")


@pytest.fixture
def standalone(monkeypatch):
    """World size 1, no launcher, no agent; the worker API torn down afterwards."""
    for key in _LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    worker.init()
    yield
    worker.shutdown()


def _loop(url: str, n: int = 20):
    ds = TensorDataset(torch.arange(n, dtype=torch.float64)[:, None])
    sampler = worker.ElasticDistributedSampler(ds, 1, 0, seed=1)
    model = torch.nn.Linear(1, 1).double()
    mgr = CheckpointManager(url, job="t", rank=0, world_size=1)
    loop = ElasticLoop({"model": model}, sampler, save_every=1000, manager=mgr)
    return loop, sampler, DataLoader(ds, batch_size=4, sampler=sampler)


def test_only_finished_bodies_count_and_a_break_leaves_the_batch_uncounted(standalone):
    """Three finished bodies advance the sampler by 12; the batch broken out of does not count."""
    loop, sampler, loader = _loop(f"memory://loop-{uuid.uuid4().hex}")
    for i, _ in enumerate(loop.batches(loader)):
        if i == 3:
            break
    assert (loop.steps_done, sampler.samples_trained) == (3, 12)
    loop.save(blocking=True)
    loop.close()


def test_resume_continues_mid_epoch_and_after_a_finished_epoch_starts_the_next(standalone):
    """A checkpoint mid-epoch resumes there; one after the epoch's last step resumes at the
    next epoch's start, with the sampler already set to it."""
    url = f"memory://loop-{uuid.uuid4().hex}"
    loop, sampler, loader = _loop(url)
    for i, _ in enumerate(loop.batches(loader)):
        if i == 2:
            break
    loop.save(blocking=True)
    loop.close()
    loop, sampler, loader = _loop(url)
    assert loop.resume() == 0 and sampler.samples_trained == 8 and loop.steps_done == 2
    seen = [int(x) for (xb,) in loop.batches(loader) for x in xb[:, 0]]
    assert len(seen) == 12 and sampler.epoch == 1  # the rest of epoch 0, then set to epoch 1
    loop.close()
    # A state saved exactly at the end of epoch 0 (as a drain at its last step leaves it).
    loop, sampler, _ = _loop(url)
    sampler.set_epoch(0)
    sampler.samples_trained = 20
    loop.steps_done = 9
    loop.save(blocking=True)
    loop.close()
    loop, sampler, loader = _loop(url)
    assert loop.resume() == 1 and sampler.epoch == 1 and len(list(loader)) == 5
    loop.close()


def test_batch_len_reads_the_first_tensor_and_refuses_the_unknown():
    """Tensors, tuples, dicts and lists of samples are measured; an opaque object is refused."""
    assert batch_len(torch.zeros(5, 3)) == 5
    assert batch_len((torch.zeros(4, 2), torch.zeros(4))) == 4
    assert batch_len({"x": [torch.zeros(3, 1)]}) == 3
    assert batch_len(["a", "b"]) == 2
    with pytest.raises(ConfigError, match="step_done"):
        batch_len(object())


def test_a_stream_advances_one_global_batch_per_loader_item(standalone):
    """Over an ElasticStream each loader item is one optimizer step; a resume continues there."""
    import json

    import fsspec

    from elasticd.data import ElasticStream, Shard

    root = f"memory://loop-stream-{uuid.uuid4().hex}"
    with fsspec.open(f"{root}/s0.jsonl", "wb") as f:
        f.write("".join(json.dumps({"id": i}) + "\n" for i in range(10)).encode())
    shards = [Shard(f"{root}/s0.jsonl", 10)]

    def build():
        stream = ElasticStream(shards, global_batch_size=3, num_replicas=1, rank=0,
                               collate=lambda xs: [x["id"] for x in xs])
        mgr = CheckpointManager(f"{root}/ckpt", job="t", rank=0, world_size=1)
        return ElasticLoop({}, stream, save_every=2, manager=mgr), stream

    loop, stream = build()
    for i, _ in enumerate(loop.batches(DataLoader(stream, batch_size=None))):
        if i == 2:
            break
    assert stream.samples_trained == 6  # steps 0 and 1 finished (and saved at step 2)
    loop.close()
    loop, stream = build()
    assert loop.resume() == 0
    rest = [ids for ids in loop.batches(DataLoader(stream, batch_size=None))]
    assert rest == [[6, 7, 8], [9]] and stream.epoch == 1
    loop.close()


def test_progress_reports_cumulative_samples_across_epochs_and_resumes(standalone, monkeypatch):
    """Each step reports the job's samples so far (all ranks, never reset by an epoch or a
    resume), so the agent's samples/s is not 0.0."""
    import elasticd.worker.loop as loop_module

    reports: list[tuple[int, int]] = []
    monkeypatch.setattr(loop_module, "report_progress",
                        lambda step, *, epoch=0, samples=0, loss=None, force=False, cadence=None:
                        reports.append((step, samples)))
    url = f"memory://loop-{uuid.uuid4().hex}"
    loop, sampler, loader = _loop(url)  # 20 samples, batches of 4: 5 steps an epoch
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for _ in loop.batches(loader):
            pass
    assert reports == [(s, 4 * (s + 1)) for s in range(10)]
    loop.close()
    reports.clear()
    loop, sampler, loader = _loop(url)
    assert loop.resume() == 2
    for i, _ in enumerate(loop.batches(loader)):
        if i == 1:
            break
    assert reports == [(10, 44)]  # continues from the checkpoint's 40 samples
    loop.close()


def test_checkpoint_step_is_the_last_trained_step_as_reported(standalone, monkeypatch):
    """After 3 steps (0, 1, 2) the loop's checkpoint is step 2, the step it last reported:
    `step-N` holds steps 0..N, as in examples/train.py and for the agent and status."""
    import elasticd.worker.loop as loop_module

    reported: list[int] = []
    monkeypatch.setattr(loop_module, "report_progress",
                        lambda step, **kw: reported.append(step))
    url = f"memory://loop-{uuid.uuid4().hex}"
    loop, _, loader = _loop(url)
    for i, _ in enumerate(loop.batches(loader)):
        if i == 3:
            break
    loop.save(blocking=True)
    loop.close()
    with CheckpointManager(url, job="t", rank=0, world_size=1) as mgr:
        latest = mgr.load_latest()
    assert (latest.step, reported[-1], loop.steps_done) == (2, 2, 3)
    loop, sampler, loader = _loop(url)
    assert loop.resume() == 0 and loop.steps_done == 3 and sampler.samples_trained == 12
    loop.close()


def test_sharded_must_name_a_module_the_state_holds(standalone):
    """ElasticLoop(sharded=...) refuses a state without sharded.module (nothing would be
    re-meshed or checkpointed) and exposes the sharded module as loop.model otherwise."""
    from types import SimpleNamespace

    ds = TensorDataset(torch.arange(8, dtype=torch.float64)[:, None])
    sampler = worker.ElasticDistributedSampler(ds, 1, 0, seed=1)
    model = torch.nn.Linear(1, 1).double()
    mgr = CheckpointManager(f"memory://loop-{uuid.uuid4().hex}", job="t", rank=0, world_size=1)
    with pytest.raises(ConfigError, match="sharded.module"):
        ElasticLoop({"model": torch.nn.Linear(1, 1)}, sampler, manager=mgr,
                    sharded=SimpleNamespace(module=model))  # type: ignore[arg-type]
    loop = ElasticLoop({"model": model}, sampler, manager=mgr,
                       sharded=SimpleNamespace(module=model, mesh_kind="fsdp"))  # type: ignore[arg-type]
    assert loop.model is model
    loop.close()


def _global(world=2, rank=0, n=64, g=16):
    return worker.ElasticSampler(n, global_batch_size=g, num_replicas=world, rank=rank, seed=1)


def test_live_global_batch_pipelines_are_the_one_step_plan_or_refused():
    """Under live=True an ElasticSampler is counted right only through an ElasticBatchSampler
    whose plan is one micro-batch per step at every world size: a plain batch_size, a
    memory-bound or even plan, or another sampler's batch sampler is a ConfigError naming
    that form; the restart path accepts a batch size (checked per batch)."""
    ds = TensorDataset(torch.arange(64))
    sampler = _global()
    good = worker.plan_global_batch(16, 2, 16, allow_uneven=True)
    check_global_batch_pipeline(sampler, DataLoader(ds, batch_sampler=worker.ElasticBatchSampler(
        sampler, good)), live=True)
    plain = DataLoader(ds, batch_size=8, sampler=sampler)
    check_global_batch_pipeline(sampler, plain, live=False)
    with pytest.raises(ConfigError, match="batch_sampler=ElasticBatchSampler"):
        check_global_batch_pipeline(sampler, plain, live=True)
    for plan, says in ((worker.plan_global_batch(16, 2, 8, allow_uneven=True), "every world size"),
                       (worker.plan_global_batch(16, 2, 16), "allow_uneven=False"),
                       (worker.plan_global_batch(16, 2, 4), "2 micro-steps")):
        loader = DataLoader(ds, batch_sampler=worker.ElasticBatchSampler(sampler, plan))
        with pytest.raises(ConfigError, match=says):
            check_global_batch_pipeline(sampler, loader, live=True)
    other = DataLoader(ds, batch_sampler=worker.ElasticBatchSampler(_global(), good))
    with pytest.raises(ConfigError, match="another sampler"):
        check_global_batch_pipeline(sampler, other, live=False)


def test_a_batch_that_is_not_the_whole_share_is_never_counted():
    """A loader batch of another size than the rank's share (a batch size or plan made for
    another world) is a ConfigError before it could be counted as a global batch."""
    sampler = _global()
    check_share(sampler, (torch.zeros(8, 3),))
    sampler.regroup(1, 0)
    with pytest.raises(ConfigError, match="share of a global batch of 16 at world size 1 is 16"):
        check_share(sampler, (torch.zeros(8, 3),))
    check_share(sampler, object())  # unmeasurable: trusted


def test_drop_last_loader_tail_is_trained_not_dropped(standalone, tmp_path):
    """A DataLoader(drop_last=True) over an ElasticDistributedSampler: the partial last batch
    the loader drops is trained as one smaller batch, so the epoch trains every sample once
    (after a resize mid-epoch a rank's share rarely fills its last batch)."""
    ds = TensorDataset(torch.arange(10))
    sampler = worker.ElasticDistributedSampler(ds, 1, 0, seed=1)
    mgr = CheckpointManager(f"file://{tmp_path}", job="t", rank=0, world_size=1)
    loop = ElasticLoop({"model": torch.nn.Linear(1, 1)}, sampler, save_every=1000, manager=mgr)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, drop_last=True)
    sizes, seen = [], []
    for (idx,) in loop.batches(loader):
        sizes.append(len(idx))
        seen += idx.tolist()
    loop.close()
    assert sizes == [4, 4, 2] and sorted(seen) == list(range(10))
    assert loop.steps_done == 3 and sampler.epoch == 1
    assert dropped_tail(sampler, DataLoader(ds, batch_size=4, sampler=sampler)) == []


def test_close_saves_the_last_step_of_a_job_that_stops_at_a_step_limit(standalone):
    """A loop left with ``break`` at a step limit between saves: close() commits the last
    trained step, and a resume continues after it."""
    url = f"memory://loop-{uuid.uuid4().hex}"
    loop, sampler, loader = _loop(url)
    for _ in loop.batches(loader):
        if loop.steps_done == 3:
            break  # the step limit: this batch is not trained, the 3 before it are
    loop.close()
    loop, sampler, _ = _loop(url)
    assert loop.resume() == 0 and loop.steps_done == 3 and sampler.samples_trained == 12
    loop.close()


def test_a_scheduler_left_out_of_the_state_is_refused_and_no_optimizer_is_warned():
    """An LR scheduler attached to a state optimizer but not in the state is a ConfigError
    naming the fix (torch marks the optimizer it wraps); a state without any optimizer gets
    a warning; a state with both is accepted."""
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.AdamW(model.parameters())
    assert check_state({"model": model, "optimizer": opt}) is None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 16))
    with pytest.raises(ConfigError, match='"scheduler": scheduler'):
        check_state({"model": model, "optimizer": opt})
    assert check_state({"model": model, "optimizer": opt, "sched": sched}) is None
    assert "no torch.optim.Optimizer" in (check_state({"model": model}) or "")


def test_torch_refusing_a_destroyed_group_is_recognised(monkeypatch, tmp_path):
    """A process group destroyed (as a re-formation destroys the old one) and then used gives
    torch's 'not initialized in the world group map' error, which the loop names as a stale
    handle; other errors are not."""
    import torch.distributed as dist

    for key in _LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = dist.new_group([0])
    dist.destroy_process_group(group)
    try:
        with pytest.raises(ValueError) as info:
            dist.get_backend(group)
    finally:
        dist.destroy_process_group()
    assert stale_group_error(info.value)
    assert not stale_group_error(RuntimeError("Connection closed by peer"))


def test_auto_cadence_saves_at_first_every_then_at_the_measured_interval(standalone, monkeypatch):
    """save_every="auto": the first save comes at 50 steps and measures its cost; the loop
    then keeps the interval chosen from it (in the progress that travels with the state)
    and reports it with each step; a bad value is a ConfigError naming the forms."""
    import elasticd.worker.loop as loop_module

    cadences = []
    monkeypatch.setattr(loop_module, "report_progress",
                        lambda step, *, cadence=None, **kw: cadences.append(cadence))
    ds = TensorDataset(torch.arange(240, dtype=torch.float64)[:, None])
    sampler = worker.ElasticDistributedSampler(ds, 1, 0, seed=1)
    model = torch.nn.Linear(1, 1).double()
    mgr = CheckpointManager(f"memory://loop-{uuid.uuid4().hex}", job="t", rank=0, world_size=1)
    with pytest.raises(ConfigError, match='"auto" or a number of steps'):
        ElasticLoop({"model": model}, sampler, save_every="sometimes", manager=mgr)
    loop = ElasticLoop({"model": model}, sampler, save_every="auto", manager=mgr)
    saved: list[int] = []
    real_save = mgr.save
    monkeypatch.setattr(mgr, "save", lambda step, state, **kw: (saved.append(step),
                                                                real_save(step, state, **kw)))
    for i, _ in enumerate(loop.batches(DataLoader(ds, batch_size=4, sampler=sampler))):
        if i == 49:
            assert loop.cadence is not None and loop.cadence.every() == 50
    assert saved == [49, 59]  # step 49 at 50 steps, then the epoch's end (60 steps)
    chosen = loop.cadence.chosen
    assert loop._progress["save_every"] == chosen.every_steps != 50
    assert "MTBF" in chosen.reason and chosen.interval_s > 0
    assert cadences[0].every_steps == 50 and cadences[-1] == chosen
    loop.close()


def test_reform_epoch_action_ends_the_epoch_only_when_the_adopted_state_is_later():
    """An adopted state in a later epoch ends batches(); the same or an earlier one goes on."""
    from elasticd.worker.loop import EpochAction, reform_epoch_action

    assert reform_epoch_action(0, 1) is EpochAction.END
    assert reform_epoch_action(0, 3) is EpochAction.END
    assert reform_epoch_action(1, 1) is EpochAction.CONTINUE
    assert reform_epoch_action(2, 1) is EpochAction.CONTINUE


class _AdoptingKeeper:
    """Stands in for LiveState: at step ``at`` the step's collective "fails" and the rank
    adopts ``peer`` (a newer rank's sampler state and progress), as a thawed rank does."""

    def __init__(self, loop, at: int, peer: dict, peer_steps: int) -> None:
        self.loop, self.at, self.peer, self.peer_steps = loop, at, peer, peer_steps
        self.agreed_in_memory = False

    def step_done(self, step: int) -> bool:
        return False

    def refresh_replica(self) -> None:
        pass

    def guard(self):
        import contextlib

        from elasticd.worker.live import Reformed

        @contextlib.contextmanager
        def cm():
            yield
            if self.loop.steps_done == self.at and self.peer is not None:
                self.loop.sampler.load_state_dict(self.peer)
                self.loop._progress.update(steps_done=self.peer_steps, saved_at=self.peer_steps)
                self.peer = None
                raise Reformed("adopted a newer state")
        return cm()


@pytest.mark.parametrize("ahead", [1, 2])
def test_a_rank_that_adopts_a_later_epoch_trains_it_under_that_epoch(standalone, ahead):
    """A rank frozen in epoch 0 that adopts the group's state ``ahead`` epochs later ends
    epoch 0's batches(), skips the epochs the group trained, and trains the rest of the
    adopted epoch under that epoch number (not under its stale loop variable)."""
    url = f"memory://loop-{uuid.uuid4().hex}"
    ahead_loop, ahead_sampler, _ = _loop(url)
    ahead_sampler.set_epoch(ahead)
    ahead_sampler.samples_trained = 8  # the group is 2 batches into epoch ``ahead``
    peer = ahead_sampler.state_dict()
    ahead_loop.close()

    loop, sampler, loader = _loop(url)
    loop.ddp(loop._state["model"])
    loop._keeper = _AdoptingKeeper(loop, at=2, peer=peer, peer_steps=5 * ahead + 2)
    trained: dict[int, list[int]] = {}
    for epoch in range(0, ahead + 2):
        sampler.set_epoch(epoch)
        for (xb,) in loop.batches(loader):
            with loop.guard():
                trained.setdefault(epoch, []).extend(int(x) for x in xb[:, 0])
    ref, ref_sampler, _ = _loop(url)
    order = {}
    for e in (0, ahead):
        ref_sampler.set_epoch(e)
        order[e] = [int(i) for i in ref_sampler]
    ref.close()
    # Epoch 0: only its batches up to the failed step (whose body ran), nothing after it.
    assert set(trained) == {0, ahead, ahead + 1}
    assert trained[0] == order[0][:8]
    assert trained[ahead] == order[ahead][8:]  # the adopted epoch's rest, under its own number
    assert sorted(trained[ahead + 1]) == list(range(20))
    loop._keeper = None
    loop.close()
