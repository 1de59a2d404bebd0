"""Checkpoint commits whose outcome was *unknown*, retried by the agent until etcd answers.

Why in the agent: it owns the fencing token (its round, the round state's revision, its
lease) and outlives worker restarts, so a commit a worker handed over during an etcd
outage is not lost when the worker moves on, saves again, or exits after a drain.

Rules (docs/architecture.md, "Checkpoint commit protocol"):

- Only the newest pending commit matters (the pointer only moves forward): a newer one
  supersedes an older one.
- While a commit is pending, new requests are queued at once (answer ``UNKNOWN``)
  instead of each waiting out an etcd timeout: training is never slowed by the outage
  more than once.
- Retries use jittered exponential backoff until ``deadline_s`` after the first attempt;
  ``REFUSED`` drops the commit (its round is over: the bytes age out with retention).
- Before the next rendezvous and before leaving after a drain, the agent waits (bounded)
  for the pending commit, because a new round changes the round state and would refuse it.
- What is still pending when the agent exits is written to its state directory as an
  *intent*; the next agent for the job retries it before joining, with the same fence
  minus the lease (the round state's revision must be unchanged: nobody re-formed the job
  since), see :func:`write_intent` and ``JobRecorder.commit_intent``.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from elasticd import boundedjson
from elasticd.control.api import CommitOutcome

log = structlog.get_logger(__name__)

DEFAULT_DEADLINE_S = 600.0
INTENT_PREFIX = "pending-commit-"
MAX_INTENT_BYTES = 64 * 1024  # an intent is a few hundred bytes


@dataclass(frozen=True)
class PendingCommit:
    """One commit to retry: what to point at, and the fencing token it was made under."""

    step: int
    manifest_url: str
    world_size: int
    round: int
    state_rev: int  # mod_revision of the round state when the round formed
    job: str = ""

    def newer_than(self, other: PendingCommit) -> bool:
        return (self.round, self.step) > (other.round, other.step)


CommitFn = Callable[[PendingCommit], tuple[CommitOutcome, str]]


def backoff_s(attempt: int, initial_s: float, max_s: float, rng: random.Random) -> float:
    """Full-jitter exponential backoff for retry ``attempt`` (1-based). Pure but for ``rng``."""
    cap = min(max_s, initial_s * (2 ** max(attempt - 1, 0)))
    return rng.uniform(cap / 2, cap)


class CommitRetrier:
    """Tries each commit once; queues and retries the ones whose outcome was ``UNKNOWN``.

    Args:
        commit: does one attempt; returns (outcome, reason). An exception is ``UNKNOWN``.
        deadline_s: give up on a pending commit this long after it was first queued.
        initial_s, max_s: backoff bounds between retries.
        on_committed: called after a retry committed (metrics).
        clock, rng: injectable for tests.
    """

    def __init__(self, commit: CommitFn, *, deadline_s: float = DEFAULT_DEADLINE_S,
                 initial_s: float = 0.2, max_s: float = 3.0,
                 on_committed: Callable[[PendingCommit], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self._commit = commit
        self.deadline_s = deadline_s
        self.initial_s, self.max_s = initial_s, max_s
        self._on_committed = on_committed
        self._clock = clock
        self._rng = rng or random.Random()
        self._cond = threading.Condition()
        self._pending: PendingCommit | None = None
        self._queued_at = 0.0
        self._attempt_lock = threading.Lock()  # one etcd attempt at a time, in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the request path (control socket threads) --------------------------------------
    def submit(self, req: PendingCommit) -> tuple[CommitOutcome, str]:
        """Commit ``req`` now, or queue it; the outcome for the worker.

        Returns:
            ``COMMITTED`` or ``REFUSED`` when etcd answered; ``UNKNOWN`` when it did not
            (or a commit is already pending behind an outage): the agent keeps trying.
        """
        with self._cond:
            if self._pending is not None:
                self._queue_locked(req)
                return CommitOutcome.UNKNOWN, ("etcd has not answered a pending commit yet; "
                                               "queued, the agent keeps retrying")
        outcome, reason = self._attempt(req)
        if outcome is CommitOutcome.UNKNOWN:
            with self._cond:
                self._queue_locked(req)
            reason += "; queued, the agent keeps retrying"
        return outcome, reason

    def _attempt(self, req: PendingCommit) -> tuple[CommitOutcome, str]:
        with self._attempt_lock:
            try:
                return self._commit(req)
            except Exception as exc:  # noqa: BLE001 - any error is "unknown", never "refused"
                return CommitOutcome.UNKNOWN, f"commit attempt failed: {exc!r}"

    def _queue_locked(self, req: PendingCommit) -> None:
        if self._pending is None:
            self._pending, self._queued_at = req, self._clock()
            log.warning("checkpoint_commit_queued", step=req.step, round=req.round)
        elif req.newer_than(self._pending):
            self._pending = req  # the deadline still counts from the first queued commit
        self._ensure_thread()
        self._cond.notify_all()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="commit-retry", daemon=True)
            self._thread.start()

    # -- the retry loop ------------------------------------------------------------------
    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            with self._cond:
                while self._pending is None and not self._stop.is_set():
                    self._cond.wait(1.0)
                req, queued_at = self._pending, self._queued_at
            if req is None:
                return
            attempt += 1
            if self._stop.wait(backoff_s(attempt, self.initial_s, self.max_s, self._rng)):
                return
            outcome, reason = self._attempt(req)
            done = self._settle(req, outcome, reason, queued_at)
            if done:
                attempt = 0

    def _settle(self, req: PendingCommit, outcome: CommitOutcome, reason: str, queued_at: float) -> bool:
        """Record one retry's outcome. Returns True when the pending slot moved on."""
        if outcome is CommitOutcome.UNKNOWN:
            if self._clock() - queued_at <= self.deadline_s:
                return False
            with self._cond:  # the outage outlasted the deadline: give up on it
                self._pending = None
                self._cond.notify_all()
            log.error("checkpoint_commit_abandoned", step=req.step, round=req.round,
                      deadline_s=self.deadline_s, reason=reason)
            return True
        with self._cond:
            if self._pending is req:
                self._pending = None
            # else a newer commit superseded this one meanwhile: it stays pending, tried next
            self._cond.notify_all()
        if outcome is CommitOutcome.COMMITTED:
            log.info("checkpoint_commit_caught_up", step=req.step, round=req.round)
            if self._on_committed is not None:
                self._on_committed(req)
        else:
            log.warning("checkpoint_commit_refused", step=req.step, round=req.round, reason=reason)
        return True

    # -- the agent's control points --------------------------------------------------------
    def pending(self) -> PendingCommit | None:
        with self._cond:
            return self._pending

    def flush(self, timeout_s: float, stop: threading.Event | None = None) -> bool:
        """Wait until no commit is pending (for a drain, before a rendezvous).

        Args:
            timeout_s: the most to wait.
            stop: waiting ends (within 0.5 s) once it is set: the agent passes its lease
                loss, after which the commit can only be refused, and waiting on would
                keep the agent from re-registering in time (soak seed 777002).

        Returns:
            True if nothing is pending (any more); False when ``timeout_s`` passed or
            ``stop`` was set.
        """
        end = self._clock() + timeout_s
        with self._cond:
            while self._pending is not None:
                left = end - self._clock()
                if left <= 0 or (stop is not None and stop.is_set()):
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    def close(self) -> PendingCommit | None:
        """Stop retrying; returns what was still pending (to write as an intent)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            pending, self._pending = self._pending, None
        if self._thread is not None:
            self._thread.join(timeout=10)
        return pending


# -- intents: a pending commit that outlives its agent -------------------------------------
def write_intent(state_dir: str | os.PathLike[str], node: str, req: PendingCommit) -> Path:
    """Persist ``req`` so that the next agent of this job retries it before joining.

    Returns:
        The file written (``<state_dir>/pending-commit-<node>.json``, mode 0600).
    """
    root = Path(state_dir)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = root / f"{INTENT_PREFIX}{node}.json"
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(asdict(req), fh)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.rename(path)
    log.warning("checkpoint_commit_intent_written", path=str(path), step=req.step, round=req.round)
    return path


def read_intents(state_dir: str | os.PathLike[str], job: str) -> list[tuple[Path, PendingCommit]]:
    """Valid intents of ``job`` in ``state_dir``, newest (round, step) first; others skipped."""
    root = Path(state_dir)
    out: list[tuple[Path, PendingCommit]] = []
    if not root.is_dir():
        return out
    for path in root.glob(f"{INTENT_PREFIX}*.json"):
        try:
            raw = boundedjson.loads_object(boundedjson.read_file(path, max_bytes=MAX_INTENT_BYTES),
                                           what=path.name, max_bytes=MAX_INTENT_BYTES)
            req = PendingCommit(step=raw["step"], manifest_url=raw["manifest_url"],
                                world_size=raw["world_size"], round=raw["round"],
                                state_rev=raw["state_rev"], job=raw.get("job", ""))
            if not all(type(v) is int and v >= 0 for v in (req.step, req.world_size, req.round,
                                                            req.state_rev)):
                raise ValueError("negative or non-integer field")
            if not isinstance(req.manifest_url, str):
                raise ValueError("manifest_url is not a string")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("checkpoint_commit_intent_skipped", path=str(path), reason=repr(exc))
            continue
        if req.job == job:
            out.append((path, req))
    out.sort(key=lambda pr: (pr[1].round, pr[1].step), reverse=True)
    return out
