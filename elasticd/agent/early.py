"""Start the first workers' standbys before the agent imports torch.

The agent itself imports torch (its supervisor is torch's ``LocalElasticAgent``): about
2 s before it can reach etcd. A standby imports torch and ``torch._dynamo``: about 3 s.
Started one after the other, a node joining a running job was ready to join about 5 s
after its agent started (8.7 s on the loaded 2-core benchmark box, with the standby at
the lowest priority). Started together, it is ready one standby import after the start.

This module must not import torch (``elasticd.agent.warm`` and ``elasticd.control.api``
do not). It creates the agent's runtime directory early (the standby's ready marker goes
there) and hands it, with the pool, to :func:`elasticd.agent.runner.run_node`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from elasticd.agent.warm import StandbyPool
from elasticd.control.api import ENV_AGENT_PID, ENV_CONTROL_DIR

if TYPE_CHECKING:
    from elasticd.config.model import AgentConfig


@dataclass
class EarlyStart:
    """What the agent started before importing torch: its runtime dir and standby pool."""

    control_dir: Path
    standby: StandbyPool

    def close(self) -> None:
        """Kill the standbys and remove the directory (idempotent; the runner's own
        clean-up does the same once it owns them)."""
        self.standby.close()
        shutil.rmtree(self.control_dir, ignore_errors=True)


def early_standby_env(*, agent_pid: int, control_dir: Path, user_env: Mapping[str, str],
                      local_rank: int) -> dict[str, str]:
    """The variables a first-group standby starts with, on top of the agent's environment.

    What a worker's environment holds that is read at import time is here: the operator's
    ``[workers.env]`` and ``PYTHONUNBUFFERED`` (as in ``agent_worker_env``). elasticd's
    per-agent variables are not compared with the worker's (``warm.AGENT_ENV``); only the
    two the standby itself needs are set: the agent it dies with and where it says
    "ready". Pure.
    """
    return {"PYTHONUNBUFFERED": "1", **user_env, ENV_AGENT_PID: str(agent_pid),
            ENV_CONTROL_DIR: str(control_dir), "LOCAL_RANK": str(local_rank)}


def start_early(cfg: AgentConfig) -> EarlyStart | None:
    """Start one standby per local worker now, if the config allows it.

    None when standbys are off, or when the number of workers is ``"gpu"``/``"auto"``
    (counting GPUs imports torch: nothing would be gained).

    Args:
        cfg: the validated ``AgentConfig``.
    """
    w = cfg.workers
    if not w.warm_start or not isinstance(w.nproc_per_node, int) or w.nproc_per_node < 1:
        return None
    if w.user:  # the user is checked by run_node first; the group's own standbys follow
        return None
    # The runtime directory ControlChannel would create: private, removed on exit.
    control_dir = Path(tempfile.mkdtemp(prefix="elasticd-"))
    os.chmod(control_dir, 0o700)
    pool = StandbyPool(True, control_dir)
    envs = {r: early_standby_env(agent_pid=os.getpid(), control_dir=control_dir,
                                 user_env=dict(w.env), local_rank=r)
            for r in range(w.nproc_per_node)}
    try:
        # urgent: no worker of this node runs yet; announce later (logging is not set up).
        pool.fill(envs, urgent=True, announce=False)
    except OSError:
        pool.close()
        shutil.rmtree(control_dir, ignore_errors=True)
        return None
    return EarlyStart(control_dir, pool)


def run_node_with_early_standbys(cfg: AgentConfig) -> int:
    """Start the standbys, run the boot sequence (``elasticd.agent.boot``: a stop, a drain
    or a finished job exits 0; else the node registers), then import the agent (torch)
    and run the node.

    Returns:
        ``run_node``'s exit code.
    """
    early = start_early(cfg)
    boot = None
    try:
        from elasticd.agent.boot import BootVerdict, boot_before_import, log_finished, log_refused
        from elasticd.logs import configure_logging

        configure_logging(cfg.logging.format, level=cfg.logging.level)
        # The boot sequence before torch is imported: `elasticd stop`/`drain` or a finished
        # job: exit 0 at once (the standby dies); else registered, so a node started with
        # the others holds the first round open until it joins.
        boot = boot_before_import(cfg)
        if boot.verdict is BootVerdict.STOPPED and boot.refused is not None:
            log_refused(boot.refused, cfg.node.id)
            return 0
        if boot.verdict is BootVerdict.FINISHED and boot.finished is not None:
            log_finished(boot.finished)
            return 0
        # torch is imported only now, while the standbys import it too.
        from elasticd.agent.runner import run_node
        from elasticd.agent.settings import node_spec

        return run_node(node_spec(cfg, os.environ), early=early, boot=boot)
    finally:
        if boot is not None:
            boot.close()
        if early is not None:
            early.close()
