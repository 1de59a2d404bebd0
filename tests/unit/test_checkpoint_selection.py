"""Which checkpoint is loaded and which are pruned: transient errors, the high-water step,
unreadable saves, bounded manifest reads, typed manifest fields, run identity, old torch.

Real storage: fsspec memory:// and local files (tmp_path); faults are injected into the
real filesystem objects, not into elasticd.
"""

from __future__ import annotations

import json
import os
import tracemalloc
import uuid

import fsspec
import pytest
import torch
from structlog.testing import capture_logs

from elasticd.checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointReadError,
    MemoryCommitFence,
    list_checkpoints,
)
from elasticd.checkpoint.catalog import check_resume
from elasticd.checkpoint.identity import ForeignCheckpointError, RunIdentity, new_run_id
from elasticd.checkpoint.manifest import MANIFEST_NAME, Manifest, checksum
from elasticd.checkpoint.restore import torch_problem
from elasticd.errors import ConfigError

RUN_A, RUN_B = "a" * 16, "b" * 16


@pytest.fixture
def url():
    """A fresh memory:// root, removed afterwards."""
    name = f"sel-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def _net() -> torch.nn.Module:
    return torch.nn.Linear(4, 2)


def _steps(mgr: CheckpointManager) -> list[int]:
    return sorted(s.step for s in mgr.store.list_saves())


def _manifest_path(mgr: CheckpointManager, step: int) -> str:
    save = next(s for s in mgr.store.list_saves() if s.step == step)
    return f"{mgr.store.save_path(save.step, save.save_id)}/{MANIFEST_NAME}"


# A. transient errors, high water, unreadable saves ------------------------------------
def test_memory_error_while_loading_fails_the_load_instead_of_resuming_older(url, monkeypatch):
    """MemoryError in torch.load is not corruption: the load fails, no older save is chosen."""
    mgr = CheckpointManager(url, job="j", keep_last=5)
    for step in (1, 2):
        mgr.save(step, {"model": _net()}, blocking=True)
    real = torch.load
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("cannot allocate")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", flaky)
    with pytest.raises(CheckpointReadError, match="MemoryError"):
        CheckpointManager(url, job="j").load_latest({"model": _net()})
    assert CheckpointManager(url, job="j").load_latest({"model": _net()}).step == 2


def test_pointer_moved_back_never_prunes_the_intact_newer_checkpoint(url):
    """Round 1 commits 100 and 200; round 2 resumes from 100 and commits 150: 200 survives."""
    clock = [1000.0]
    fence = MemoryCommitFence(round_=1)
    old = CheckpointManager(url, job="j", fence=fence, keep_last=1, grace_s=10, clock=lambda: clock[0])
    old.save(100, {"model": _net()}, blocking=True)
    old.save(200, {"model": _net()}, blocking=True)
    fence.current_round = 2
    new = CheckpointManager(url, job="j", fence=fence.for_round(2), keep_last=1, grace_s=10,
                            clock=lambda: clock[0])
    new.save(150, {"model": _net()}, blocking=True)
    assert fence.latest().step == 150 and fence.latest().highest_step == 200
    clock[0] += 3600
    new.prune()
    assert 200 in _steps(new)


def test_commit_that_may_still_land_is_never_pruned(url):
    """An upload newer than the pointer (commit UNKNOWN, to be retried) survives pruning."""
    clock = [1000.0]
    fence = MemoryCommitFence(round_=1)
    live = CheckpointManager(url, job="j", fence=fence, grace_s=10, clock=lambda: clock[0])
    live.save(10, {"model": _net()}, blocking=True)
    unknown = CheckpointManager(url, job="j", clock=lambda: clock[0])  # wrote, commit unanswered
    unknown.save(20, {"model": _net()}, blocking=True)
    clock[0] += 3600
    assert live.prune() == []
    assert _steps(live) == [10, 20]


def test_manifest_that_is_a_directory_is_skipped_named_and_never_pruned(tmp_path):
    """A directory where manifest.json belongs: load falls back, prune keeps it, the CLI names it."""
    url = f"file://{tmp_path}"
    clock = [1000.0]
    mgr = CheckpointManager(url, job="j", keep_last=2, grace_s=0, clock=lambda: clock[0])
    mgr.save(1, {"model": _net()}, blocking=True)
    mgr.save(2, {"model": _net()}, blocking=True)
    path = _manifest_path(mgr, 2)
    os.remove(path)
    os.makedirs(os.path.join(path, "oops"))
    loaded = CheckpointManager(url, job="j").load_latest({"model": _net()})
    assert loaded.step == 1
    assert any(path in s.reason for s in loaded.skipped), loaded.skipped
    clock[0] += 3600
    with capture_logs() as cap:
        mgr.prune()
    assert _steps(mgr) == [1, 2]
    assert any(e["event"] == "checkpoint_unreadable" and path in e["reason"] for e in cap)
    infos = {i.step: i for i in list_checkpoints(url, "j")}
    assert infos[1].valid and not infos[2].valid and path in (infos[2].reason or "")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("plant", ["fifo", "deep"])
def test_fifo_or_deeply_nested_manifest_is_skipped_without_hanging(tmp_path, plant):
    """A FIFO as the newest manifest.json (which blocked the reader forever), or a manifest
    nested 100,000 deep under the 1 MiB cap: load falls back to the older save at once."""
    url = f"file://{tmp_path}"
    mgr = CheckpointManager(url, job="j", keep_last=5)
    mgr.save(1, {"model": _net()}, blocking=True)
    mgr.save(2, {"model": _net()}, blocking=True)
    path = _manifest_path(mgr, 2)
    os.remove(path)
    if plant == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "wb") as fh:
            fh.write(b"[" * 100_000 + b"]" * 100_000)
    loaded = CheckpointManager(url, job="j").load_latest({"model": _net()})
    assert loaded.step == 1
    assert loaded.skipped and "step-000000000002" in loaded.skipped[0].url, loaded.skipped


def test_permission_denied_manifest_is_skipped_not_fatal(url, monkeypatch):
    """PermissionError on one manifest: load uses the older save, prune and listing go on."""
    clock = [1000.0]
    mgr = CheckpointManager(url, job="j", keep_last=2, grace_s=0, clock=lambda: clock[0])
    for step in (1, 2):
        mgr.save(step, {"model": _net()}, blocking=True)
    denied = _manifest_path(mgr, 2)
    fs = mgr.store.fs
    real = type(fs).cat_file

    def cat_file(self, path, *args, **kwargs):
        if self._strip_protocol(path) == denied:
            raise PermissionError(13, "Permission denied")
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(type(fs), "cat_file", cat_file)
    loaded = CheckpointManager(url, job="j").load_latest({"model": _net()})
    assert loaded.step == 1 and "Permission" in loaded.skipped[0].reason
    assert denied.lstrip("/") in loaded.skipped[0].reason
    clock[0] += 3600
    mgr._pruner.manifests.clear()
    mgr.prune()
    assert _steps(mgr) == [1, 2]
    assert not {i.step: i for i in list_checkpoints(url, "j")}[2].valid


def test_storage_error_on_a_manifest_fails_the_load(url, monkeypatch):
    """A generic storage error (not one bad path) fails the load instead of skipping."""
    mgr = CheckpointManager(url, job="j")
    for step in (1, 2):
        mgr.save(step, {"model": _net()}, blocking=True)
    fs = mgr.store.fs
    real = type(fs).cat_file

    def cat_file(self, path, *args, **kwargs):
        if path.endswith(MANIFEST_NAME):
            raise ConnectionError("storage unreachable")
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(type(fs), "cat_file", cat_file)
    with pytest.raises(CheckpointReadError, match="unreachable"):
        CheckpointManager(url, job="j").load_latest()


# C. size bounds and typed fields -------------------------------------------------------
def test_huge_manifest_is_refused_without_reading_it_whole(tmp_path):
    """A 1 GiB manifest.json is corrupt (path named) and at most ~1 MiB of it is read."""
    url = f"file://{tmp_path}"
    mgr = CheckpointManager(url, job="j")
    mgr.save(1, {"model": _net()}, blocking=True)
    path = _manifest_path(mgr, 1)
    os.remove(path)
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: costs no disk
    save = mgr.store.list_saves()[0]
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointCorruptError) as info:
            mgr.store.read_manifest(save.step, save.save_id)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert path in str(info.value) and "limit" in str(info.value)
    assert peak < 16 << 20, f"read {peak} bytes of a 1 GiB manifest"


def _signed(body: dict) -> bytes:
    body = dict(body)
    body.pop("manifest_crc32", None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["manifest_crc32"] = f"{checksum(canonical):08x}"
    return json.dumps(body).encode()


@pytest.mark.parametrize("field,value", [
    ("sampler", [1, 2]), ("parts", [1]), ("torch_version", 5), ("run_id", "not-hex"),
    ("step", -1), ("world_size", 1.5), ("created_at", float("nan")), ("elasticd_version", {}),
])
def test_manifest_fields_are_validated_by_type(field, value):
    """A well-signed manifest with a field of the wrong type or range is corrupt, not coerced."""
    good = Manifest(job="j", step=3, save_id="0000000001000-0000abcd", world_size=2,
                    created_at=1.0, committed_at=2.0, files=())
    body = json.loads(good.to_json())
    assert Manifest.from_json(_signed(body)) == good
    body[field] = value
    with pytest.raises(CheckpointCorruptError, match="invalid|malformed"):
        Manifest.from_json(_signed(body))


# D. torch version contract -------------------------------------------------------------
def test_torch_version_floor():
    """weights_only is trusted from torch 2.10 on; older and unparsable versions are refused."""
    assert torch_problem("2.13.0+cpu") is None
    assert torch_problem("2.10.0a0+git1234") is None
    assert torch_problem("2.14.1+cu130") is None
    assert "too old" in (torch_problem("2.9.1+cu121") or "")
    assert "too old" in (torch_problem("2.4.0") or "")
    assert torch_problem("garbage") is not None


def test_load_refused_on_too_old_torch(url, monkeypatch):
    """A forced install of torch < 2.10 cannot load from storage: a ConfigError says why."""
    mgr = CheckpointManager(url, job="j")
    mgr.save(1, {"model": _net()}, blocking=True)
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(ConfigError, match=r"torch 2\.5\.1 is too old.*torch>=2\.10"):
        CheckpointManager(url, job="j").load_latest()


# B. run identity ------------------------------------------------------------------------
def test_new_run_refuses_another_runs_checkpoints_naming_run_step_and_flags(url):
    """auto: only another run's saves exist -> exit-78 error naming the run, step and flags."""
    CheckpointManager(url, job="j", run_id=RUN_A).save(7, {"model": _net()}, blocking=True)
    with pytest.raises(ForeignCheckpointError) as info:
        CheckpointManager(url, job="j", run_id=RUN_B).load_latest({"model": _net()})
    msg = str(info.value)
    assert RUN_A in msg and "step 7" in msg and "--resume require" in msg and "--checkpoint-url" in msg
    assert info.value.exit_code == 78
    with pytest.raises(ForeignCheckpointError):
        check_resume(url, "j", RunIdentity(RUN_B))


def test_same_run_resumes_its_own_and_ignores_anothers(url):
    """A run loads its own newest save even when another run saved a newer step."""
    CheckpointManager(url, job="j", run_id=RUN_A).save(5, {"model": _net()}, blocking=True)
    CheckpointManager(url, job="j", run_id=RUN_B).save(9, {"model": _net()}, blocking=True)
    assert CheckpointManager(url, job="j", run_id=RUN_A).load_latest().step == 5
    assert CheckpointManager(url, job="j", run_id=RUN_B).load_latest().step == 9
    assert check_resume(url, "j", RunIdentity(RUN_A)) == 5


def test_deliberate_resume_loads_another_run_but_never_prunes_it(url):
    """require: B resumes A's step 7, saves on, and prunes only its own saves."""
    clock = [1000.0]
    CheckpointManager(url, job="j", run_id=RUN_A, clock=lambda: clock[0]).save(
        7, {"model": _net()}, blocking=True)
    b = CheckpointManager(url, job="j", run_id=RUN_B, resume="require", keep_last=1, grace_s=0,
                          clock=lambda: clock[0])
    assert b.load_latest({"model": _net()}).step == 7
    for step in (8, 9, 10):
        clock[0] += 1
        b.save(step, {"model": _net()}, blocking=True)
    clock[0] += 3600
    b.prune()
    assert _steps(b) == [7, 10]
    manifests = {s.step: b.store.read_manifest(s.step, s.save_id) for s in b.store.list_saves()}
    assert manifests[7].run_id == RUN_A and manifests[10].run_id == RUN_B


def test_never_ignores_other_runs_and_require_needs_a_checkpoint(url):
    """never: starts afresh beside another run; require with nothing stored is refused."""
    with pytest.raises(ForeignCheckpointError, match="no loadable checkpoint"):
        CheckpointManager(url, job="j", run_id=RUN_B, resume="require").load_latest()
    CheckpointManager(url, job="j", run_id=RUN_A).save(3, {"model": _net()}, blocking=True)
    assert CheckpointManager(url, job="j", run_id=RUN_B, resume="never").load_latest() is None
    assert check_resume(url, "j", RunIdentity(RUN_B, "never")) is None


def test_pointer_of_another_run_is_ignored(url):
    """A fence pointer committed by another run neither picks our checkpoint nor guards pruning."""
    fence = MemoryCommitFence(round_=1)
    CheckpointManager(url, job="j", run_id=RUN_A).save(3, {"model": _net()}, blocking=True)
    CheckpointManager(url, job="j", run_id=RUN_B, fence=fence).save(4, {"model": _net()},
                                                                     blocking=True)
    # The in-memory fence stamps no run id; a pointer naming run B must not steer run A.
    pointer = fence.latest()
    object.__setattr__(pointer, "run_id", RUN_B)
    assert CheckpointManager(url, job="j", run_id=RUN_A, fence=fence).load_latest().step == 3


def test_run_identity_validation():
    """Malformed run ids and unknown resume modes are ConfigErrors naming the fix."""
    assert len(new_run_id()) == 16
    with pytest.raises(ConfigError, match="16 lowercase hex"):
        RunIdentity("xyz")
    with pytest.raises(ConfigError, match="auto, require, never"):
        RunIdentity(RUN_A, "sometimes")


def test_a_save_pruned_while_verify_reads_it_is_not_listed(tmp_path, monkeypatch):
    """`--verify` of a running job: a save that retention deletes between its CRC check and
    its load check is left out of the listing (it is gone), not reported as broken and not
    a traceback (the etcd outage chaos test listed a running job and crashed on it)."""
    import shutil

    from elasticd.checkpoint import restore

    url = f"file://{tmp_path}"
    mgr = CheckpointManager(url, job="j", keep_last=5)
    for step in (1, 2):
        mgr.save(step, {"model": _net()}, blocking=True)
    real = restore.deserialize_file

    def pruned_under_us(path, name):
        if "step-000000000001" in path:
            shutil.rmtree(os.path.dirname(os.path.dirname(path)))  # retention, meanwhile
        return real(path, name)

    monkeypatch.setattr(restore, "deserialize_file", pruned_under_us)
    infos = list_checkpoints(url, "j", verify=True)
    assert [(i.step, i.valid) for i in infos] == [(2, True)]


def _listed_before(mgr: CheckpointManager, monkeypatch, edit) -> None:
    """Make the catalog's listing the one ``edit`` makes of the listing now (a listing
    taken at another moment of the same running job)."""
    from elasticd.checkpoint.store import FsspecCheckpointStore

    stale = [edit(s) for s in mgr.store.list_saves()]
    monkeypatch.setattr(FsspecCheckpointStore, "list_saves", lambda self: list(stale))


def test_a_save_committed_after_the_listing_is_not_reported_committed_and_truncated(
        tmp_path, monkeypatch):
    """`--verify` of a job that commits every step: a save listed while its state file was
    still being written (no manifest yet) and committed before its manifest is read is
    listed as not committed, never as a committed checkpoint that is "truncated"."""
    import dataclasses

    mgr = CheckpointManager(f"file://{tmp_path}", job="j", keep_last=5)
    for step in (1, 2):
        mgr.save(step, {"model": _net()}, blocking=True)

    def in_flight(save):
        if save.step != 2:
            return save
        half = {n: size // 2 for n, size in save.files.items() if n != MANIFEST_NAME}
        return dataclasses.replace(save, files=half)

    _listed_before(mgr, monkeypatch, in_flight)
    infos = {i.step: i for i in list_checkpoints(f"file://{tmp_path}", "j", verify=True)}
    assert infos[1].valid and infos[1].committed_at
    assert infos[2].committed_at is None and "in flight" in (infos[2].reason or "")


def test_a_save_pruned_between_listing_and_manifest_read_is_not_listed(tmp_path, monkeypatch):
    """`--verify` of a running job: a save listed with its manifest that retention deletes
    before the manifest is read is left out (it is gone), not reported as torn."""
    mgr = CheckpointManager(f"file://{tmp_path}", job="j", keep_last=5)
    for step in (1, 2):
        mgr.save(step, {"model": _net()}, blocking=True)
    _listed_before(mgr, monkeypatch, lambda save: save)
    gone = next(s for s in mgr.store.list_saves() if s.step == 1)
    mgr.store.delete_save(gone.step, gone.save_id)  # retention, after the listing
    infos = list_checkpoints(f"file://{tmp_path}", "j", verify=True)
    assert [(i.step, i.valid) for i in infos] == [(2, True)]
