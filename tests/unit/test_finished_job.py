"""The finished-job notice (elasticd.rendezvous.finished): what an agent arriving after the
finish says, from the records etcd holds (untrusted)."""

from __future__ import annotations

from elasticd.records import ClosedRecord, Progress
from elasticd.rendezvous.finished import FinishedJob, finished_job, finished_notice


def test_notice_names_step_time_round_and_the_command_that_reopens():
    """The line says the job finished, at which step, when (UTC), who closed it in which
    round, that this node does not run it, and that `elasticd start --job J` reopens it."""
    closed = ClosedRecord(finished_at=1764626584.0, node="n0", round=3).to_json().encode()
    progress = Progress(round=3, step=1200).to_json().encode()
    reason, fix = finished_notice(finished_job("llm", closed, progress))
    assert reason == ("job 'llm' finished at step 1200 on 2025-12-01 22:03:04 UTC (round 3, "
                      "closed by n0); this node does not run it again")
    assert "`elasticd start --job llm` reopens it" in fix and "new job name" in fix


def test_an_old_or_bad_close_is_still_a_close_with_less_said():
    """An older agent's `1`, a close that is not a record, or an unreadable progress record
    still mean "finished": the line leaves out what it cannot know."""
    for closed in (b"1", b"{}", b'{"finished_at": "soon"}', b"\xff"):
        f = finished_job("j", closed, b"not json")
        assert f == FinishedJob("j"), closed
        reason, _ = finished_notice(f)
        assert reason == "job 'j' finished; this node does not run it again"


def test_a_plain_script_reports_no_step():
    """No progress record (a plain script reports no steps): no step in the line."""
    closed = ClosedRecord(finished_at=0.0, node="a", round=0).to_json().encode()
    reason, _ = finished_notice(finished_job("j", closed, None))
    assert reason.startswith("job 'j' finished on 1970-01-01 00:00:00 UTC (round 0, closed by a)")
