"""One checkpoint contract suite against file://, memory:// and a real S3 API (moto)."""

from __future__ import annotations

import threading
import uuid

import fsspec
import pytest
import torch
from integration.s3_fixture import moto_s3, s3_root  # noqa: F401 - fixtures
from structlog.testing import capture_logs

from elasticd.checkpoint import CheckpointManager, list_checkpoints
from elasticd.checkpoint.manifest import MANIFEST_NAME, STATE_FILE

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["file", "memory", "s3"])
def store(request, tmp_path):
    """(url, storage_options) of a fresh checkpoint root on each backend."""
    if request.param == "file":
        yield f"file://{tmp_path}/ckpt", {}
    elif request.param == "memory":
        name = f"it-{uuid.uuid4().hex[:8]}"
        yield f"memory://{name}", {}
        fsspec.filesystem("memory").rm(f"/{name}", recursive=True)
    else:
        yield request.getfixturevalue("s3_root")


def _mgr(store, **kw) -> CheckpointManager:
    url, options = store
    return CheckpointManager(url, job=kw.pop("job", "demo"), storage_options=options, **kw)


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def _file(mgr, save, name):
    return f"{mgr.store.save_path(save.step, save.save_id)}/{name}"


def test_round_trip_and_cli_listing(store):
    """A model and optimizer saved asynchronously load back bit-exact; the listing verifies."""
    torch.manual_seed(0)
    model = _net()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    with _mgr(store) as mgr:
        mgr.save(1, {"model": model, "optim": optim})
        mgr.save(2, {"model": model, "optim": optim})
    model2 = _net()
    optim2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    loaded = _mgr(store).load_latest({"model": model2, "optim": optim2})
    assert loaded.step == 2
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    infos = list_checkpoints(store[0], None, storage_options=store[1], verify=True)  # every job
    assert [(i.job, i.step, i.valid, i.world_size) for i in infos] == [
        ("demo", 2, True, 1), ("demo", 1, True, 1)]


def test_torn_and_corrupt_checkpoints_fall_back_with_logged_reasons(store):
    """Flipped data bytes, a truncated manifest and a deleted data file are each skipped."""
    mgr = _mgr(store, keep_last=10)
    for step in (1, 2, 3, 4):
        mgr.save(step, {"w": torch.full((4096,), float(step))}, blocking=True)
    fs = mgr.store.fs
    saves = {s.step: s for s in mgr.store.list_saves()}
    data = bytearray(fs.cat_file(_file(mgr, saves[4], STATE_FILE)))
    data[-2000] ^= 0x5A
    fs.pipe_file(_file(mgr, saves[4], STATE_FILE), bytes(data))
    manifest = fs.cat_file(_file(mgr, saves[3], MANIFEST_NAME))
    fs.pipe_file(_file(mgr, saves[3], MANIFEST_NAME), manifest[:50])
    fs.rm_file(_file(mgr, saves[2], STATE_FILE))
    with capture_logs() as cap:
        w = torch.zeros(4096)
        loaded = _mgr(store).load_latest({"w": w})
    assert loaded.step == 1 and torch.equal(w, torch.ones(4096))
    reasons = [e["reason"] for e in cap if e["event"] == "checkpoint_skipped"]
    assert len(reasons) == 3
    assert "checksum mismatch" in reasons[0]
    assert "not valid JSON" in reasons[1]
    assert "missing" in reasons[2]


def test_two_saves_of_one_step_never_interleave(store):
    """Two writers saving the same step (zombie and live job) get separate, valid directories."""
    a, b = _mgr(store), _mgr(store)
    a.save(7, {"w": torch.zeros(1000)})
    b.save(7, {"w": torch.ones(1000)})
    a.close()
    b.close()
    # Each writer prunes after its commit, so the older copy may be gone already.
    infos = list_checkpoints(store[0], "demo", storage_options=store[1], verify=True)
    assert infos and all(i.step == 7 and i.valid for i in infos)
    w = torch.full((1000,), 5.0)
    _mgr(store).load_latest({"w": w})
    assert torch.equal(w, torch.zeros(1000)) or torch.equal(w, torch.ones(1000))
    # Step 7 is the newest committed step: both copies stay (retention never deletes at or
    # above it). Once step 8 commits, "superseded" removes the older copy of 7.
    _mgr(store).save(8, {"w": torch.ones(1000)}, blocking=True)
    assert sorted(s.step for s in _mgr(store).store.list_saves()) == [7, 8]


def test_retention_under_a_concurrent_reader(store):
    """While a writer saves and prunes (keep_last=2), every concurrent load is a consistent
    checkpoint: data matching its step, steps never going backwards, no load failing."""
    steps = 12 if store[0].startswith("s3") else 30
    writer = _mgr(store, keep_last=2)
    writer.save(0, {"w": torch.zeros(20000)}, blocking=True)
    errors: list[BaseException] = []
    seen: list[int] = []
    done = threading.Event()

    def read() -> None:
        reader = _mgr(store)
        try:
            while not done.is_set():
                w = torch.empty(20000)
                loaded = reader.load_latest({"w": w})
                assert torch.all(w == float(loaded.step)), f"step {loaded.step} holds other data"
                seen.append(loaded.step)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for step in range(1, steps + 1):
            writer.save(step, {"w": torch.full((20000,), float(step))})
        writer.close()
    finally:
        done.set()
        thread.join(30)
    assert not errors, errors[0]
    assert seen and seen == sorted(seen)
    assert sorted(s.step for s in writer.store.list_saves()) == [steps - 1, steps]
