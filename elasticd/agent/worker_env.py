"""What a worker's environment holds, and what it must never hold.

torch's ``LocalElasticAgent`` starts each worker with a copy of the agent's ``os.environ``
plus the worker's own variables (ranks, master address, ...). elasticd adds its variables
(job, node, round, control channel, checkpoint URL) through that public path: the agent
sets them in its environment for the duration of the spawn (:func:`spawn_environment`),
instead of overriding a private torch hook.

Workers run arbitrary user code, so they never hold etcd credentials: every
``ELASTICD_ETCD_*`` variable (endpoints, user, password, password file, CA/cert/key
paths), the agent's config file path (it may hold the password), any other ``ELASTICD_*``
variable whose name looks secret, and etcdctl's ``ETCDCTL_*`` are removed from what
workers and warm standbys inherit (:func:`is_secret`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping, MutableMapping

from elasticd.agent.supervision import SupervisionSettings
from elasticd.control.api import (
    ENV_AGENT_PID,
    ENV_CHECKPOINT_EVERY,
    ENV_CHECKPOINT_URL,
    ENV_JOB,
    ENV_NODE,
    ENV_OBSERVED_LOSSES,
    live_worker_env,
)

# The agent's own configuration that would let a worker talk to etcd as the agent.
_SECRET_PREFIXES = ("ELASTICD_ETCD_", "ETCDCTL_")
_SECRET_NAMES = frozenset({"ELASTICD_CONFIG"})
_SECRET_WORDS = re.compile(r"PASS|SECRET|TOKEN|CREDENTIAL|PRIVATE|(^|_)KEY($|_)|(^|_)CERT", re.I)


def is_secret(name: str) -> bool:
    """True for a variable a worker must not inherit from the agent. Pure."""
    if name.startswith(_SECRET_PREFIXES) or name in _SECRET_NAMES:
        return True
    return name.startswith("ELASTICD_") and bool(_SECRET_WORDS.search(name[len("ELASTICD_"):]))


def scrub(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the variables :func:`is_secret` names. Pure."""
    return {k: v for k, v in env.items() if not is_secret(k)}


def agent_worker_env(*, job: str, node: str, agent_pid: int, control_env: Mapping[str, str],
                     user_env: Mapping[str, str], checkpoint_url: str | None) -> dict[str, str]:
    """What every worker of an agent gets on top of torch's per-worker variables. Pure.

    Args:
        job, node: the job name and this node's id.
        agent_pid: the agent's pid (workers watch it).
        control_env: the control channel's variables (``ControlChannel.env()``).
        user_env: the operator's ``[workers.env]``, applied over elasticd's own.
        checkpoint_url: the job's checkpoint root, if configured.

    Returns:
        The variables, without any secret (:func:`scrub`): workers never hold etcd
        credentials, even from ``[workers.env]``.
    """
    extra = {
        ENV_JOB: job,
        ENV_NODE: node,
        ENV_AGENT_PID: str(agent_pid),
        "PYTHONUNBUFFERED": "1",
        **control_env,
        **user_env,
    }
    if checkpoint_url:
        extra[ENV_CHECKPOINT_URL] = checkpoint_url
    return scrub(extra)


def supervised_worker_env(settings: SupervisionSettings, *, job: str, node: str, agent_pid: int,
                          control_env: Mapping[str, str],
                          losses: tuple[int, float] | None = None) -> dict[str, str]:
    """What every worker of an agent with ``settings`` gets: :func:`agent_worker_env` with
    the worker-side settings (live re-formation and its bound, the checkpoint cadence; the
    run identity is in ``settings.worker_env`` once ``check_resume`` ran). Pure.

    Every worker-side setting travels this way (parsed by ``elasticd.control.environment``).

    Args:
        losses: the job's rollbacks and observed seconds (``JobRecorder.observed_losses``),
            for ``[checkpoint] every = "auto"``; None: not known.
    """
    live = live_worker_env(settings.live_reform, settings.live_reform_timeout_s)
    cadence = {ENV_CHECKPOINT_EVERY: settings.checkpoint_every} if settings.checkpoint_every else {}
    if settings.checkpoint_every and losses is not None:
        cadence[ENV_OBSERVED_LOSSES] = f"{losses[0]}/{losses[1]:.0f}"
    return agent_worker_env(job=job, node=node, agent_pid=agent_pid,
                            control_env={**control_env, **live, **cadence},
                            user_env=settings.worker_env, checkpoint_url=settings.checkpoint_url)


@contextlib.contextmanager
def spawn_environment(extra: Mapping[str, str],
                      environ: MutableMapping[str, str] = os.environ) -> Iterator[None]:
    """While active, ``environ`` holds ``extra`` and no secret; restored afterwards.

    torch copies the agent's environment into each worker it starts (and elasticd's warm
    standby hand-over passes the same copy), so this is how every worker of a group gets
    the group's variables. Only the agent's main thread spawns workers; the restore keeps
    the agent's own environment (and what later children inherit) unchanged.

    Args:
        extra: variables to set (secrets among them are dropped too).
        environ: the environment to patch (tests pass a dict).
    """
    add = scrub(extra)
    touched = {n for n in environ if is_secret(n)} | set(add)
    saved = {n: environ[n] for n in touched if n in environ}
    try:
        for name in touched - set(add):
            del environ[name]
        environ.update(add)
        yield
    finally:
        # Only what we touched is put back: other threads never see an empty environment.
        for name in touched:
            if name in saved:
                environ[name] = saved[name]
            else:
                environ.pop(name, None)
