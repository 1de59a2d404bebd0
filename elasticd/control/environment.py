"""What an elasticd agent tells its workers through their environment, parsed in one place.

The agent writes these variables (``elasticd.agent.worker_env``, ``control.api``); the
worker API and the checkpoint manager's defaults read them through
:func:`agent_environment`, so neither the checkpoint package nor anything else needs the
worker package (and torch.distributed with it) to learn whether it runs under an agent.
Besides ``elasticd.config`` this is the one module that reads elasticd's variables from
``os.environ`` (``elasticd.worker.context`` reads torchrun's).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from elasticd.checkpoint.cadence import parse_every, parse_losses
from elasticd.control.api import (
    ENV_CHECKPOINT_EVERY,
    ENV_CONTROL_DIR,
    ENV_CONTROL_SOCKET,
    ENV_LIVE,
    ENV_LIVE_TIMEOUT,
    ENV_OBSERVED_LOSSES,
    ENV_RESUME,
    ENV_ROUND,
    ENV_RUN_AS,
    ENV_RUN_ID,
    ENV_SPARE,
    LIVE_TIMEOUT_DEFAULT_S,
)
from elasticd.errors import ConfigError


@dataclass(frozen=True)
class AgentEnvironment:
    """What an elasticd agent told this process through its environment."""

    control_dir: str
    socket_path: str
    round: int
    run_id: str | None = None  # ELASTICD_RUN_ID: this run's identity (docs/checkpoints.md)
    resume: str = "auto"  # ELASTICD_RESUME: what to do with another run's checkpoints
    live: bool = False  # ELASTICD_LIVE=1: the agent re-forms live workers in place
    # ELASTICD_LIVE_TIMEOUT_S: workers.live_reform_timeout_s, the bound on one re-formation
    live_timeout_s: float = LIVE_TIMEOUT_DEFAULT_S
    # ELASTICD_CHECKPOINT_EVERY: [checkpoint] every ("auto", steps, or None: the script's)
    checkpoint_every: int | str | None = None
    # ELASTICD_OBSERVED_LOSSES: (losses, observed seconds) from the job's goodput ledger
    observed_losses: tuple[int, float] | None = None


def agent_environment(environ: Mapping[str, str] | None = None) -> AgentEnvironment | None:
    """The agent's control channel, round and worker settings, or None without an agent.

    Args:
        environ: the environment to read (default ``os.environ``).

    Raises:
        ConfigError: ``ELASTICD_CONTROL_SOCKET`` is set (started by an agent) but
            ``ELASTICD_ROUND`` is missing or not a round number (running on would commit
            checkpoints unfenced, so a zombie could overwrite the live job's pointer), or
            ``ELASTICD_LIVE_TIMEOUT_S`` is not a positive number.
    """
    env = os.environ if environ is None else environ
    socket_path = env.get(ENV_CONTROL_SOCKET)
    if not socket_path:
        return None
    raw = env.get(ENV_ROUND, "")
    if env.get(ENV_SPARE) == "1" and not raw:
        raise ConfigError(
            f"this worker runs ahead of its round as a hot spare's ({ENV_SPARE}=1, "
            "workers.spare_prebuild), and something asked for the round before the worker API "
            "waited for it. Call elasticd.worker.init() first and reach the round only through "
            "elasticd.worker (current_context(), agent_fence(), LiveState, ElasticLoop, "
            "ShardedModel) before building a CheckpointManager, or turn workers.spare_prebuild off")
    if not raw.isdigit():
        raise ConfigError(
            f"{ENV_CONTROL_SOCKET} is set (this process was started by an elasticd agent) "
            f"but {ENV_ROUND}={raw!r} is not a round number, so checkpoint commits could not "
            "be fenced. Start workers through `elasticd run`/`elasticd agent` (which set it), "
            f"or unset {ENV_CONTROL_SOCKET} and {ENV_CONTROL_DIR} to run without an agent")
    resume = env.get(ENV_RESUME) or "auto"  # checked by the checkpoint's RunIdentity
    return AgentEnvironment(control_dir=env.get(ENV_CONTROL_DIR, ""), socket_path=socket_path,
                            round=int(raw), run_id=env.get(ENV_RUN_ID) or None, resume=resume,
                            live=env.get(ENV_LIVE) == "1", live_timeout_s=_live_timeout(env),
                            checkpoint_every=_checkpoint_every(env),
                            observed_losses=parse_losses(env.get(ENV_OBSERVED_LOSSES)))


def _checkpoint_every(env: Mapping[str, str]) -> int | str | None:
    try:
        return parse_every(env.get(ENV_CHECKPOINT_EVERY))
    except ValueError as exc:
        raise ConfigError(f"{ENV_CHECKPOINT_EVERY}: {exc}; set [checkpoint] every in the "
                          "agent's config (the agent sets this variable)") from exc


def _live_timeout(env: Mapping[str, str]) -> float:
    raw = env.get(ENV_LIVE_TIMEOUT)
    if raw in (None, ""):
        return LIVE_TIMEOUT_DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{ENV_LIVE_TIMEOUT}={raw!r} is not a positive number of seconds; "
                          "set workers.live_reform_timeout_s in the agent's config (the agent "
                          "sets this variable)")
    return value


@dataclass(frozen=True)
class RunAs:
    """The user every worker runs as (``workers.user``), as the agent resolved it."""

    name: str
    uid: int
    gid: int

    def to_env(self) -> str:
        return f"{self.name}:{self.uid}:{self.gid}"


def run_as(environ: Mapping[str, str] | None = None) -> RunAs | None:
    """``ELASTICD_RUN_AS`` (``NAME:UID:GID``), or None when unset. Pure.

    Raises:
        ConfigError: set but not ``NAME:UID:GID`` with a non-root uid (the launcher refuses
            to run training code rather than run it as root by mistake).
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_RUN_AS)
    if not raw:
        return None
    name, _, rest = raw.partition(":")
    uid, _, gid = rest.partition(":")
    if not (name and uid.isdigit() and gid.isdigit() and int(uid) != 0):
        raise ConfigError(f"{ENV_RUN_AS}={raw!r} is not NAME:UID:GID of a user other than root; "
                          "set workers.user in the agent's config (the agent sets this variable)")
    return RunAs(name=name, uid=int(uid), gid=int(gid))
