"""The agent's retry of commits whose outcome was unknown (elasticd.agent.commits)."""

from __future__ import annotations

import json
import random
import threading

from elasticd.agent.commits import (
    CommitRetrier,
    PendingCommit,
    backoff_s,
    read_intents,
    write_intent,
)
from elasticd.checkpoint.api import CommitOutcome

U, C, R = CommitOutcome.UNKNOWN, CommitOutcome.COMMITTED, CommitOutcome.REFUSED


def _req(step: int, round_: int = 1) -> PendingCommit:
    return PendingCommit(step=step, manifest_url=f"u{step}", world_size=2, round=round_,
                         state_rev=10, job="j")


class FakeEtcd:
    """Answers commits from a script of outcomes; records what was attempted."""

    def __init__(self, outcomes: list[CommitOutcome], then: CommitOutcome = C) -> None:
        self.outcomes, self.then = list(outcomes), then
        self.tried: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, req: PendingCommit) -> tuple[CommitOutcome, str]:
        with self.lock:
            self.tried.append(req.step)
            return (self.outcomes.pop(0) if self.outcomes else self.then), "scripted"


def _retrier(etcd, **kw) -> CommitRetrier:
    return CommitRetrier(etcd, initial_s=0.001, max_s=0.002, **kw)


def test_answered_commits_are_not_queued():
    """COMMITTED and REFUSED are final: nothing pending, no retry."""
    etcd = FakeEtcd([C, R])
    r = _retrier(etcd)
    assert r.submit(_req(1))[0] is C
    assert r.submit(_req(2))[0] is R
    assert r.pending() is None and etcd.tried == [1, 2]
    r.close()


def test_unknown_is_queued_superseded_by_newer_and_retried_until_committed():
    """During an outage the newest commit wins; queued requests do not wait on etcd again."""
    etcd = FakeEtcd([U], then=U)
    r = _retrier(etcd)
    assert r.submit(_req(1))[0] is U
    for step in (2, 3, 4):
        outcome, reason = r.submit(_req(step))
        assert outcome is U and "queued" in reason
    assert r.submit(_req(0))[0] is U  # older: does not replace the newer pending one
    assert r.pending() == _req(4)
    etcd.then = C  # etcd is back
    assert r.flush(10)
    assert etcd.tried[-1] == 4 and r.pending() is None
    assert 0 not in etcd.tried[1:]
    r.close()


def test_exception_is_unknown_and_refusal_on_retry_drops_it():
    """An error is UNKNOWN (never REFUSED); a later REFUSED (round over) drops the commit."""
    calls = []

    def commit(req):
        calls.append(req.step)
        if len(calls) == 1:
            raise TimeoutError("deadline exceeded")
        return R, "stale round"

    r = _retrier(commit)
    assert r.submit(_req(5))[0] is U
    assert r.flush(10) and r.pending() is None and calls[-1] == 5
    r.close()


def test_deadline_abandons_a_pending_commit():
    """Past the deadline the retrier gives up (logged), so it cannot retry forever."""
    now = [0.0]
    r = _retrier(FakeEtcd([], then=U), deadline_s=5.0, clock=lambda: now[0])
    r.submit(_req(1))
    now[0] = 6.0
    assert r.flush(10) and r.pending() is None
    r.close()


def test_close_returns_what_is_still_pending():
    """close() hands back the pending commit (the runner writes it as an intent)."""
    r = _retrier(FakeEtcd([], then=U))
    r.submit(_req(3))
    assert not r.flush(0.01)
    assert r.close() == _req(3)


def test_flush_ends_at_once_when_its_stop_is_set():
    """Soak seed 777002: a flush stops waiting once the agent's lease is lost (the commit
    can only be refused then), instead of blocking the agent's re-registration."""
    r = _retrier(FakeEtcd([], then=U))
    r.submit(_req(3))
    lost = threading.Event()
    lost.set()
    assert not r.flush(3600, stop=lost)
    assert r.pending() == _req(3), "the commit stays pending (the next round refuses it)"
    r.close()


def test_backoff_is_jittered_and_capped():
    """Backoff grows exponentially, stays within [cap/2, cap] and never exceeds max_s."""
    rng = random.Random(1)
    for attempt in range(1, 20):
        cap = min(3.0, 0.2 * 2 ** (attempt - 1))
        assert cap / 2 <= backoff_s(attempt, 0.2, 3.0, rng) <= cap


def test_intents_round_trip_and_skip_garbage(tmp_path):
    """Intents are written 0600, read back newest first, and invalid or foreign ones skipped."""
    p1 = write_intent(tmp_path, "n1", _req(10, round_=2))
    write_intent(tmp_path, "n2", _req(12, round_=2))
    assert p1.stat().st_mode & 0o777 == 0o600
    (tmp_path / "pending-commit-bad.json").write_text("{not json")
    (tmp_path / "pending-commit-neg.json").write_text(json.dumps({**_req(1).__dict__, "step": -5}))
    (tmp_path / "pending-commit-other.json").write_text(json.dumps({**_req(99).__dict__, "job": "other"}))
    got = [req.step for _, req in read_intents(tmp_path, "j")]
    assert got == [12, 10]
    assert read_intents(tmp_path / "missing", "j") == []
