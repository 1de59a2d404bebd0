"""In-memory commit fence: the etcd ``latest``-pointer semantics without etcd.

Used by tests and by single-process runs that want zombie protection within one process
tree. The agent's etcd fence implements the same :class:`CommitFence` contract with a
compare-and-swap on ``/elasticd/<job>/checkpoint/latest``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from elasticd.checkpoint.api import CommitOutcome
from elasticd.records import CheckpointPointer


@dataclass
class _Shared:
    current_round: int
    pointer: CheckpointPointer | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class MemoryCommitFence:
    """A :class:`CommitFence` holding the pointer and the current round in memory.

    ``writer_round`` is the round this writer belongs to; ``current_round`` is the job's
    round (shared by every fence made with :meth:`for_round`). A commit succeeds only if
    ``writer_round == current_round`` and the pointer moves forward: a higher round, or
    the same round and a higher step.

    Example (a zombie from round 1 and the live job in round 2)::

        live = MemoryCommitFence(round_=2)
        zombie = live.for_round(1)
        zombie.commit(500, url, 4)   # REFUSED: round 1 is not current

    ``unreachable = True`` makes every commit answer ``UNKNOWN`` without changing the
    pointer (an etcd outage, for tests of the three-valued commit).
    """

    def __init__(self, round_: int = 0, *, _shared: _Shared | None = None) -> None:
        self.writer_round = round_
        self._shared = _shared or _Shared(current_round=round_)
        self.unreachable = False

    def for_round(self, round_: int) -> MemoryCommitFence:
        """A fence for a writer of ``round_`` sharing this one's pointer and current round."""
        return MemoryCommitFence(round_, _shared=self._shared)

    @property
    def current_round(self) -> int:
        return self._shared.current_round

    @current_round.setter
    def current_round(self, value: int) -> None:
        with self._shared.lock:
            self._shared.current_round = value

    def commit(self, step: int, manifest_url: str, world_size: int) -> CommitOutcome:
        """Point ``latest`` at ``manifest_url`` if this writer's round is current and the
        pointer moves forward (``COMMITTED``); ``REFUSED`` otherwise; ``UNKNOWN`` while
        ``unreachable`` is set."""
        if self.unreachable:
            return CommitOutcome.UNKNOWN
        with self._shared.lock:
            if self.writer_round != self._shared.current_round:
                return CommitOutcome.REFUSED
            old = self._shared.pointer
            if old is not None and (self.writer_round, step) <= (old.round, old.step):
                return CommitOutcome.REFUSED
            self._shared.pointer = CheckpointPointer.successor(
                old, step=step, round_=self.writer_round, manifest_url=manifest_url,
                committed_at=time.time(), world_size=world_size)
            return CommitOutcome.COMMITTED

    def latest(self) -> CheckpointPointer | None:
        """The current pointer."""
        with self._shared.lock:
            return self._shared.pointer
