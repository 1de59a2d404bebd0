"""What a ``CheckpointManager`` takes from the elasticd agent it runs under, by default.

Under an agent the manager's fence is the agent's (commits go through the control
socket) and its run identity is the agent's run id and resume mode: nothing for the
training script to remember. Outside an agent both default to none. Both come from the
control seam (``elasticd.control``), never from the worker API: the checkpoint package
does not import ``elasticd.worker`` (and torch.distributed with it); a unit test keeps it so.
"""

from __future__ import annotations

from elasticd.checkpoint.api import CommitFence
from elasticd.control.environment import agent_environment
from elasticd.control.fence import agent_fence


class AutoFence:
    """The default of ``CheckpointManager(fence=...)``: the agent's fence under an agent."""

    def __repr__(self) -> str:
        return "AUTO_FENCE"


AUTO_FENCE = AutoFence()


def resolve_fence(fence: CommitFence | None | AutoFence) -> CommitFence | None:
    """The fence a manager uses: ``AUTO_FENCE`` means the agent's under an agent, else none.

    Raises:
        ConfigError: started by an agent but without ``ELASTICD_ROUND`` (see
            ``elasticd.control.fence.agent_fence``): a commit must never go out unfenced.
    """
    if not isinstance(fence, AutoFence):
        return fence
    return agent_fence()


def agent_identity(resume: str) -> tuple[str | None, str]:
    """The run id and resume mode the agent handed its workers (None, ``resume`` without one)."""
    env = agent_environment()
    if env is None:
        return None, resume
    return env.run_id, env.resume if resume == "auto" else resume
