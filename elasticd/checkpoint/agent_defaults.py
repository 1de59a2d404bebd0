"""What a ``CheckpointManager`` takes from the elasticd agent it runs under, by default.

Under an agent the manager's fence is the agent's (commits go through the control
socket) and its run identity is the agent's run id and resume mode: nothing for the
training script to remember. Outside an agent both default to none. The worker package
is imported lazily: the CLI's checkpoint listing never needs torch.distributed.
"""

from __future__ import annotations

from elasticd.checkpoint.api import CommitFence


class AutoFence:
    """The default of ``CheckpointManager(fence=...)``: the agent's fence under an agent."""

    def __repr__(self) -> str:
        return "AUTO_FENCE"


AUTO_FENCE = AutoFence()


def resolve_fence(fence: CommitFence | None | AutoFence) -> CommitFence | None:
    """The fence a manager uses: ``AUTO_FENCE`` means the agent's under an agent, else none.

    Raises:
        ConfigError: started by an agent but without ``ELASTICD_ROUND`` (see
            ``elasticd.worker.agent_fence``): a commit must never go out unfenced.
    """
    if not isinstance(fence, AutoFence):
        return fence
    # Imported here: the worker package imports torch.distributed machinery the CLI's
    # checkpoint listing never needs.
    from elasticd.worker.fence import agent_fence

    return agent_fence()


def agent_identity(resume: str) -> tuple[str | None, str]:
    """The run id and resume mode the agent handed its workers (None, ``resume`` without one)."""
    from elasticd.worker.context import agent_environment

    env = agent_environment()
    if env is None:
        return None, resume
    return env.run_id, env.resume if resume == "auto" else resume
