"""The first loss after a restore (elasticd/checkpoint/first_loss.py): the check itself, and
a refused checkpoint marked suspect, skipped by every reader, never a fresh start."""

from __future__ import annotations

import math

import pytest
import torch

from elasticd.checkpoint import CheckpointManager, first_loss, list_checkpoints
from elasticd.checkpoint.api import CheckpointSuspectError
from elasticd.checkpoint.catalog import check_resume
from elasticd.checkpoint.first_loss import FirstLossCheck, Restore, RestoreRefusedError
from elasticd.checkpoint.identity import RunIdentity


@pytest.fixture
def check(monkeypatch) -> FirstLossCheck:
    fresh = FirstLossCheck()
    monkeypatch.setattr(first_loss, "CHECK", fresh)
    return fresh


def test_only_the_first_loss_after_a_restore_is_judged(check):
    refused: list[str] = []
    check.saw_loss(0, math.nan)  # no restore: the model's own NaN is not ours to judge
    check.restored(Restore("checkpoint step 4", refused.append))
    check.saw_loss(5, None)  # no loss reported: still pending
    assert check.pending is not None
    check.saw_loss(5, 0.25)  # finite: settled
    assert check.pending is None
    check.saw_loss(6, math.inf)  # later: the model's own
    assert refused == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_without_a_live_state_a_non_finite_first_loss_marks_the_source_and_raises(check, bad):
    refused: list[str] = []
    check.restored(Restore("checkpoint step 9 (file:///x)", refused.append))
    with pytest.raises(RestoreRefusedError, match="first loss after restoring checkpoint step 9"):
        check.saw_loss(10, bad)
    assert len(refused) == 1 and f"was {bad} at step 10" in refused[0]


def test_with_a_live_state_the_verdict_waits_for_the_agreement(check):
    """saw_loss only records; agree() (every rank, in step_done) settles it, once."""
    check.agreed_by_live = True
    refused: list[str] = []
    check.restored(Restore("the state rank 2 sent at step 41", refused.append))
    check.saw_loss(42, math.nan)  # no raise here
    why = check.agree(42)
    assert "was nan at step 42" in why and refused == [why]
    assert check.agree(43) == ""  # settled: no second verdict, no collective
    check.restored(Restore("checkpoint step 44"))
    check.saw_loss(45, 1.0)
    assert check.agree(45) == "" and check.pending is None


def _saves(url: str, steps: list[int]) -> CheckpointManager:
    mgr = CheckpointManager(url, job="j", keep_last=5)
    for step in steps:
        mgr.save(step, {"w": torch.full((4,), float(step))}, blocking=True)
    return mgr


def test_a_refused_checkpoint_is_marked_skipped_listed_and_the_one_before_loads(check, tmp_path):
    url = f"file://{tmp_path}/ckpt"
    mgr = _saves(url, [4, 9])
    state = {"w": torch.zeros(4)}
    assert mgr.load_latest(state).step == 9
    with pytest.raises(RestoreRefusedError):
        check.saw_loss(10, math.inf)
    marker = list((tmp_path / "ckpt" / "j").glob("step-000000000009/*/suspect.json"))
    assert len(marker) == 1 and "checkpoint step 9" in marker[0].read_text()

    again = CheckpointManager(url, job="j", keep_last=5)
    loaded = again.load_latest(state)
    assert loaded is not None and loaded.step == 4 and float(state["w"][0]) == 4.0
    assert [s.suspect for s in loaded.skipped] == [True]
    assert "marked suspect" in loaded.skipped[0].reason
    infos = {i.step: i for i in list_checkpoints(url, "j")}
    assert not infos[9].valid and "marked suspect" in (infos[9].reason or "")
    assert infos[4].valid
    assert check_resume(url, "j", RunIdentity()) == 4  # the agent's pre-start look agrees
    mgr.close()
    again.close()


def test_when_every_checkpoint_is_suspect_the_load_raises_instead_of_starting_afresh(check, tmp_path):
    url = f"file://{tmp_path}/ckpt"
    mgr = _saves(url, [4, 9])
    for step in (9, 4):
        assert mgr.load_latest({"w": torch.zeros(4)}).step == step
        with pytest.raises(RestoreRefusedError):
            check.saw_loss(step + 1, math.nan)
    with pytest.raises(CheckpointSuspectError, match="every checkpoint of job 'j' .* marked suspect") as err:
        mgr.load_latest({"w": torch.zeros(4)})
    assert err.value.exit_code == 78
    mgr.close()
