"""The three-valued commit on the worker side: UNKNOWN keeps the save and raises nothing."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch

from elasticd.checkpoint import CheckpointManager, CommitOutcome, MemoryCommitFence
from elasticd.checkpoint.manager import AUTO_FENCE
from elasticd.errors import ConfigError, FencedError


@pytest.fixture
def url():
    """A fresh memory:// root, removed afterwards."""
    name = f"ckpt-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def _w(v: float) -> dict:
    return {"w": torch.full((4,), v)}


def test_unknown_outcome_keeps_the_upload_and_training_goes_on(url):
    """etcd unreachable: every save during the outage is kept, no FencedError, and the next
    save after the outage commits and moves the pointer past them."""
    fence = MemoryCommitFence(round_=3)
    mgr = CheckpointManager(url, job="demo", fence=fence)
    mgr.save(1, _w(1.0), blocking=True)
    fence.unreachable = True
    for step in (2, 3, 4):
        mgr.save(step, _w(float(step)))
        result = mgr.wait()  # raises nothing
        assert result is not None and result.outcome is CommitOutcome.UNKNOWN and not result.committed
    assert {s.step for s in mgr.store.list_saves() if s.has_manifest} >= {4}
    assert fence.latest().step == 1
    fence.unreachable = False
    mgr.save(5, _w(5.0), blocking=True)
    assert fence.latest().step == 5 and mgr.wait().outcome is CommitOutcome.COMMITTED
    mgr.close()


def test_refused_outcome_still_deletes_and_raises(url):
    """A real zombie (REFUSED) is still fenced: FencedError and its upload deleted."""
    live = MemoryCommitFence(round_=2)
    zombie = CheckpointManager(url, job="demo", fence=live.for_round(1))
    zombie.save(9, _w(9.0))
    with pytest.raises(FencedError):
        zombie.wait()
    assert zombie.store.list_saves() == []


def test_legacy_boolean_fences_still_work(url):
    """A fence returning bool (the old contract) maps True/False to committed/refused."""
    class Old:
        def __init__(self) -> None:
            self.ok = True

        def commit(self, step, manifest_url, world_size):
            return self.ok

        def latest(self):
            return None

    old = Old()
    mgr = CheckpointManager(url, job="demo", fence=old)
    mgr.save(1, _w(1.0), blocking=True)
    old.ok = False
    mgr.save(2, _w(2.0))
    with pytest.raises(FencedError):
        mgr.wait()


def test_outcome_truthiness_matches_the_old_boolean():
    """Only COMMITTED is truthy, so `if fence.commit(...)` keeps meaning "committed"."""
    assert CommitOutcome.COMMITTED and not CommitOutcome.REFUSED and not CommitOutcome.UNKNOWN
    assert CommitOutcome.of(True) is CommitOutcome.COMMITTED
    assert CommitOutcome.of(False) is CommitOutcome.REFUSED


def test_auto_fence_is_off_without_an_agent(url, monkeypatch):
    """Outside an agent the default fence resolves to none (the listing decides)."""
    monkeypatch.delenv("ELASTICD_CONTROL_SOCKET", raising=False)
    assert CheckpointManager(url, job="demo").fence is None


def test_auto_fence_is_on_under_an_agent(url, monkeypatch, tmp_path):
    """Under an agent (control socket and round set) the default is the agent's fence."""
    from elasticd.worker.fence import AgentCommitFence

    monkeypatch.setenv("ELASTICD_CONTROL_SOCKET", str(tmp_path / "control.sock"))
    monkeypatch.setenv("ELASTICD_ROUND", "7")
    fence = CheckpointManager(url, job="demo", fence=AUTO_FENCE).fence
    assert isinstance(fence, AgentCommitFence) and fence.round == 7
    # No agent listening: a commit is UNKNOWN (never refused), a pointer read is None.
    assert fence.commit(1, "u", 1) is CommitOutcome.UNKNOWN
    assert fence.latest() is None
    assert CheckpointManager(url, job="demo", fence=None).fence is None  # explicit opt-out


@pytest.mark.parametrize("value", [None, "", "x", "-1"])
def test_under_an_agent_without_a_round_is_a_clear_error(url, monkeypatch, tmp_path, value):
    """A worker started by an agent (control socket set) but without ELASTICD_ROUND refuses
    to run unfenced, naming the variable and the fix."""
    monkeypatch.setenv("ELASTICD_CONTROL_SOCKET", str(tmp_path / "control.sock"))
    if value is None:
        monkeypatch.delenv("ELASTICD_ROUND", raising=False)
    else:
        monkeypatch.setenv("ELASTICD_ROUND", value)
    with pytest.raises(ConfigError, match="ELASTICD_ROUND"):
        CheckpointManager(url, job="demo")
    from elasticd import worker

    with pytest.raises(ConfigError, match="ELASTICD_ROUND"):
        worker.init()
