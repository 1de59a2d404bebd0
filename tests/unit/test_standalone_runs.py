"""What a ``--standalone`` start does about its job's last run (elasticd.agent.standalone_runs)."""

from __future__ import annotations

import pytest

from elasticd.agent.standalone_runs import (
    RunRecord,
    plan_standalone_run,
    read_record,
    write_record,
)

URL = "file:///home/u/proj/checkpoints"
RUN = "0123456789abcdef"
FRESH = "fedcba9876543210"


def _plan(outcome: str | None, *, resume: str = "auto", url: str = URL, was: str = "auto"):
    record = None if outcome is None else RunRecord(RUN, URL, outcome, was)
    return plan_standalone_run(record, job="train-1a2b", checkpoint_url=url, resume=resume,
                               fresh_run_id=FRESH)


@pytest.mark.parametrize("outcome", ["drained", "failed", "running"])
def test_a_run_that_did_not_finish_is_continued_and_said_so(outcome):
    """A stop, a drain, Ctrl-C, a failure or a killed agent: the next start keeps the run id."""
    plan = _plan(outcome)
    assert plan.run_id == RUN and not plan.anew
    assert plan.message.startswith(f"elasticd: continuing run {RUN} of job train-1a2b")
    assert "--resume never" in plan.message and "\n" not in plan.message


@pytest.mark.parametrize("outcome", ["finished", "closed"])
def test_a_finished_run_is_followed_by_a_new_run_beside_its_checkpoints(outcome):
    """A finished job run again trains again: a new run id, --resume never (the finished
    run's checkpoints neither loaded nor pruned), and one line saying so."""
    plan = _plan(outcome)
    assert plan.run_id == FRESH and plan.resume == "never" and plan.anew
    assert plan.message.startswith(f"elasticd: job train-1a2b finished before (run {RUN}): "
                                   f"starting new run {FRESH}")
    assert "kept untouched" in plan.message and URL in plan.message
    assert "--resume require" in plan.message and "\n" not in plan.message


def test_a_continued_new_run_keeps_ignoring_the_finished_runs_checkpoints():
    """A run started anew (resume never) then stopped: continued still as never, so the
    finished run's saves stay out of it; --resume require overrides."""
    plan = _plan("drained", was="never")
    assert plan.run_id == RUN and plan.resume == "never" and not plan.anew
    assert _plan("drained", was="never", resume="require").resume == "require"
    assert _plan("drained").resume == "auto"


def test_resume_require_continues_even_a_finished_run():
    """--resume require trains on from a finished run's last checkpoint (on purpose)."""
    plan = _plan("finished", resume="require")
    assert plan.run_id == RUN and not plan.anew and "continuing" in plan.message


@pytest.mark.parametrize("outcome", ["drained", "finished"])
def test_resume_never_always_starts_a_new_run(outcome):
    """--resume never: a new run id, whatever the last run did."""
    plan = _plan(outcome, resume="never")
    assert plan.run_id is None and plan.resume == "never" and plan.message == ""


def test_no_record_or_another_checkpoint_url_is_a_new_run():
    """No record, or a record of another checkpoint URL: a new run (the checkpoint check decides)."""
    assert _plan(None).run_id is None
    other = _plan("drained", url="file:///elsewhere/checkpoints")
    assert other.run_id is None and not other.anew and other.message == ""


def test_records_round_trip_and_bad_ones_are_ignored(tmp_path):
    """A record reads back as written; a torn, foreign or malformed one reads as none."""
    write_record(str(tmp_path), "job", RunRecord(RUN, URL, "drained", "never"))
    assert read_record(str(tmp_path), "job") == RunRecord(RUN, URL, "drained", "never")
    assert read_record(str(tmp_path), "other") is None
    (tmp_path / "torn.json").write_text('{"run_id": "01')
    (tmp_path / "bad.json").write_text('{"run_id": "../../x", "checkpoint_url": "u", "outcome": "drained"}')
    assert read_record(str(tmp_path), "torn") is None
    assert read_record(str(tmp_path), "bad") is None


def test_the_status_command_of_a_private_etcd_is_ready_to_paste():
    """Endpoint, the three TLS files and the job, quoted for a shell."""
    from elasticd.agent.standalone_runs import status_command
    from elasticd.etcd.endpoints import TLSFiles

    cmd = status_command("train-1a2b", "127.0.0.1:40001",
                         TLSFiles("/tmp/e d/ca.pem", "/tmp/c.pem", "/tmp/k.pem"))
    assert cmd == ("elasticd status --etcd 127.0.0.1:40001 --etcd-ca '/tmp/e d/ca.pem' "
                   "--etcd-cert /tmp/c.pem --etcd-key /tmp/k.pem --job train-1a2b")
    assert status_command("j", "127.0.0.1:1", None) == "elasticd status --etcd 127.0.0.1:1 --job j"
