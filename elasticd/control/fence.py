"""The checkpoint commit fence as seen from a worker: ask the agent over the control socket.

Only the agent knows whether its round is still the job's current round, so rank 0 asks
it to compare-and-swap ``/elasticd/<job>/checkpoint/latest``. The answer has three values
(``CommitOutcome``): committed; refused (the compare failed: this worker is a zombie);
unknown. No answer in time (a frozen agent, a busy etcd) is *unknown*: the checkpoint is
not pointed to, but neither is it deleted, and the agent retries the commit on its own.

It lives here, behind the control seam, so that ``elasticd.checkpoint`` takes its default
fence without importing the worker API. The worker API tells it the round the worker
trains in now (:func:`set_round_source`): after a live re-formation that is a later round
than the environment's, and only the worker API re-forms live.
"""

from __future__ import annotations

from collections.abc import Callable

from elasticd.control.api import CommitOutcome
from elasticd.control.client import ControlClient
from elasticd.control.environment import agent_environment
from elasticd.control.messages import (
    MAX_SECONDS,
    CheckpointIo,
    CheckpointIoKind,
    CommitReply,
    CommitRequest,
    LatestReply,
)
from elasticd.records import CheckpointPointer

RoundSource = Callable[[], "int | None"]


def _no_live_round() -> int | None:
    return None


_round_source: list[RoundSource] = [_no_live_round]


def set_round_source(source: RoundSource) -> None:
    """Where fences read the round this worker trains in now (the worker API sets it)."""
    _round_source[0] = source


class AgentCommitFence:
    """``elasticd.checkpoint.CommitFence`` implemented through this node's agent.

    Also a ``CheckpointReporter``: the manager's saves and loads are reported to the agent
    (fire-and-forget ``checkpoint_io`` messages) for its ``elasticd_checkpoint_*`` metrics.

    Args:
        client: the control channel client (``elasticd.worker.control_client()``).
        round_: the round this worker was started in (``ELASTICD_ROUND``).
        current_round: the round it trains in now (None: the one it was started in);
            default: the source the worker API set (:func:`set_round_source`).
    """

    def __init__(self, client: ControlClient, round_: int,
                 current_round: RoundSource | None = None) -> None:
        self.client = client
        self.round = round_
        self._current_round = current_round

    def commit(self, step: int, manifest_url: str, world_size: int) -> CommitOutcome:
        """Ask the agent to commit; ``UNKNOWN`` when it did not answer or could not tell."""
        try:
            reply = self.client.commit(CommitRequest(step=step, manifest_url=manifest_url,
                                                     world_size=max(world_size, 1), round=self._round()))
        except OSError:
            return CommitOutcome.UNKNOWN  # no answer is not a no: never delete on a guess
        if isinstance(reply, CommitReply):
            return reply.outcome
        return CommitOutcome.UNKNOWN  # the agent rejected the request itself: not a fence verdict

    def _round(self) -> int:
        # After a live re-formation the worker trains in a later round than it started in;
        # its commits must be fenced by that round, not the one in its environment.
        live = (self._current_round or _round_source[0])()
        return live if live is not None and live > self.round else self.round

    def saved(self, step: int, seconds: float, nbytes: int) -> None:
        """Report a save to the agent's metrics (never blocks, never raises)."""
        self._report(CheckpointIoKind.SAVE, step, seconds, nbytes)

    def loaded(self, step: int, seconds: float, nbytes: int) -> None:
        """Report a load to the agent's metrics (never blocks, never raises)."""
        self._report(CheckpointIoKind.LOAD, step, seconds, nbytes)

    def _report(self, kind: CheckpointIoKind, step: int, seconds: float, nbytes: int) -> None:
        self.client.send(CheckpointIo(kind=kind, step=max(step, 0),
                                      seconds=min(max(seconds, 0.0), MAX_SECONDS),
                                      nbytes=max(nbytes, 0)))

    def latest(self) -> CheckpointPointer | None:
        """The committed pointer; None when nothing is committed or the agent cannot tell."""
        try:
            reply = self.client.latest()
        except OSError:
            return None
        return reply.pointer if isinstance(reply, LatestReply) and reply.ok else None


def agent_fence(client: ControlClient | None = None) -> AgentCommitFence | None:
    """The fence for this process when it runs under an elasticd agent, else None.

    ``CheckpointManager`` calls this by default, so under an agent fencing is on without
    a ``fence=`` argument. Does not initialise the process group.

    Args:
        client: the control client to use (default: a new one on the agent's socket).

    Raises:
        ConfigError: started by an agent without ``ELASTICD_ROUND``.
    """
    env = agent_environment()
    if env is None:
        return None
    return AgentCommitFence(client or ControlClient(env.socket_path), env.round)
