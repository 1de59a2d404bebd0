"""Which node hangs the job: a pure decision over the per-step progress the nodes report.

Why: when one node's workers stop making progress while its agent is alive (a worker
SIGSTOPped, a GIL-holding loop, a collective stuck on that node), every other rank
blocks in its next collective, so "no progress" alone is true of *every* node and names
nobody; torch would wait out the collective timeout (30 min) and NCCL's watchdog 480 s.
The culprit differs in two facts the agents can know: its last reported step is behind
the others' (it stopped before finishing the step they finished), or, when the steps are
equal, its workers are not blocked waiting in a collective -- stopped (``T`` in
``/proc``) or busy on a CPU -- while the others' wait idle.

:func:`find_hung` is the decision; the agent that acts on it (a fenced ejection from the
round, a live shrink of the others, the culprit killing its workers and rejoining cold)
is not wired yet (docs/failure-model.md, "Not handled (yet)").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum


class WorkerActivity(Enum):
    """What a node's workers do while the job makes no progress (from its agent)."""

    WAITING = "waiting"  # blocked, idle: in a collective, waiting for a peer
    STOPPED = "stopped"  # a worker is stopped (SIGSTOP, ``T`` in /proc/<pid>/stat)
    BUSY = "busy"  # a worker burns CPU without finishing its step (a GIL-holding loop)
    UNKNOWN = "unknown"  # not reported


@dataclass(frozen=True)
class NodeProgress:
    """One member's progress as its agent reports it."""

    step: int  # the newest step its workers finished (-1: none yet)
    # When the deciding agent *saw* that step reported (its own clock, never the reporter's:
    # clock skew must not decide an ejection).
    advanced_at: float
    activity: WorkerActivity = WorkerActivity.UNKNOWN


@dataclass(frozen=True)
class HangVerdict:
    """``node`` to eject (None: nobody), and why, in one line."""

    node: str | None
    reason: str


def find_hung(progress: Mapping[str, NodeProgress], *, now: float, stall_s: float,
              min_nodes: int = 1) -> HangVerdict:
    """Name the node that hangs the job, if the facts name exactly one. Pure.

    Args:
        progress: every member of the current round -> its progress.
        now: the same clock as ``advanced_at``.
        stall_s: how long the whole job must have made no progress (seconds; a few
            step times, far below the collective timeout).
        min_nodes: the job's minimum; an ejection never goes below it.

    Returns:
        The node and the reason; ``node`` is None when the job progresses, when it has
        not stalled for ``stall_s``, when the facts do not single one node out, or when
        ejecting it would leave fewer than ``min_nodes``.
    """
    if len(progress) < 2:
        return HangVerdict(None, "fewer than two members: nobody to tell apart")
    latest = max(p.advanced_at for p in progress.values())
    if now - latest < stall_s:
        return HangVerdict(None, "the job makes progress")
    if len(progress) - 1 < min_nodes:
        return HangVerdict(None, f"stalled {now - latest:.1f}s, but ejecting a node would "
                           f"leave fewer than min_nodes={min_nodes}")
    top = max(p.step for p in progress.values())
    behind = sorted(n for n, p in progress.items() if p.step < top)
    if len(behind) == 1:
        node = behind[0]
        return HangVerdict(node, f"no progress for {now - latest:.1f}s; {node} is behind at step "
                           f"{progress[node].step} (the others finished {top})")
    if behind:
        return HangVerdict(None, f"no progress for {now - latest:.1f}s; several nodes behind "
                           f"({','.join(behind)}): no single culprit")
    odd = sorted(n for n, p in progress.items()
                 if p.activity in (WorkerActivity.STOPPED, WorkerActivity.BUSY))
    waiting = [n for n, p in progress.items() if p.activity is WorkerActivity.WAITING]
    if len(odd) == 1 and len(waiting) == len(progress) - 1:
        node = odd[0]
        return HangVerdict(node, f"no progress for {now - latest:.1f}s at step {top}; {node}'s "
                           f"workers are {progress[node].activity.value} while the others wait")
    return HangVerdict(None, f"no progress for {now - latest:.1f}s at step {top}; no single "
                       "node stands out (the hang timeout decides)")
