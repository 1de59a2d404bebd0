"""The checkpoint commit fence as seen from a worker: ask the agent over the control socket.

Only the agent knows whether its round is still the job's current round, so rank 0 asks
it to compare-and-swap ``/elasticd/<job>/checkpoint/latest``. A frozen or partitioned
agent never answers in time, so a zombie's checkpoint is never pointed to.
"""

from __future__ import annotations

from elasticd.agent.control import ControlClient
from elasticd.records import CheckpointPointer


class AgentCommitFence:
    """``elasticd.checkpoint.CommitFence`` implemented through this node's agent.

    Args:
        client: the control channel client (``elasticd.worker.control_client()``).
        round_: the round this worker was started in (``ELASTICD_ROUND``).
    """

    def __init__(self, client: ControlClient, round_: int) -> None:
        self.client = client
        self.round = round_

    def commit(self, step: int, manifest_url: str, world_size: int) -> bool:
        try:
            reply = self.client.request({"op": "commit", "step": step, "manifest_url": manifest_url,
                                         "world_size": world_size, "round": self.round})
        except OSError:
            return False  # no answer from the agent: never point at what we cannot vouch for
        return bool(reply.get("ok"))

    def latest(self) -> CheckpointPointer | None:
        try:
            reply = self.client.request({"op": "latest"})
        except OSError:
            return None
        pointer = reply.get("pointer") if reply.get("ok") else None
        return CheckpointPointer(**pointer) if pointer else None


def agent_fence() -> AgentCommitFence | None:
    """The fence for this worker when it runs under an elasticd agent, else None."""
    from elasticd.worker.context import context, control_client

    client, ctx = control_client(), context()
    if client is None or ctx.round is None:
        return None
    return AgentCommitFence(client, ctx.round)
