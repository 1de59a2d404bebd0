"""The checkpoint commit fence of a worker: ``elasticd.control.fence`` with the worker's client.

The fence itself lives behind the control seam (so the checkpoint package takes it
without importing the worker API); this module hands it the worker's control client.
"""

from __future__ import annotations

from elasticd.control.fence import AgentCommitFence
from elasticd.control.fence import agent_fence as _control_fence

__all__ = ["AgentCommitFence", "agent_fence"]


def agent_fence() -> AgentCommitFence | None:
    """The fence for this worker when it runs under an elasticd agent, else None.

    Does not initialise the process group.

    Raises:
        ConfigError: started by an agent without ``ELASTICD_ROUND``.
    """
    from elasticd.worker.context import control_client

    return _control_fence(control_client())
