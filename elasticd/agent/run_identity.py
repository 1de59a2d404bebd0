"""Where a run id is born: ``/elasticd/<job>/run_id``, created once by the first agent.

Every agent of a job reads the same id (a create-if-absent transaction, so two agents
starting together agree), stamps it on the checkpoint pointer and hands it to its workers
as ``ELASTICD_RUN_ID``. The key is not leased: the run outlives any one node, and a job
still known in etcd keeps its run id across agent restarts. A fresh etcd (every
``--standalone`` start) means a new run, which resumes another run's checkpoints only
when asked (``--resume``; see elasticd.checkpoint.identity).
"""

from __future__ import annotations

import dataclasses
import time

import structlog

from elasticd.agent.supervision import SupervisionSettings
from elasticd.checkpoint.identity import RunIdentity, new_run_id
from elasticd.checkpoint.manifest import RUN_ID_RE
from elasticd.control.api import ENV_RESUME, ENV_RUN_ID
from elasticd.errors import ConfigError
from elasticd.etcd.client import EtcdClient
from elasticd.keys import JobKeys
from elasticd.retry import call_with_retry

log = structlog.get_logger(__name__)


def ensure_run_id(client: EtcdClient, keys: JobKeys, *, deadline_s: float = 30.0,
                  proposed: str | None = None) -> str:
    """This job's run id, creating it if the job has none yet.

    Args:
        proposed: the id to create when there is none (a standalone job continuing its
            last run, elasticd.agent.standalone_runs); None: a fresh one.

    Returns:
        16 lowercase hex digits.

    Raises:
        ConfigError: the key holds something that is not a run id (names the key).
        TransientError: etcd stayed unreachable for ``deadline_s``.
    """
    key = keys.run_id

    def once() -> str:
        fresh = proposed or new_run_id()
        created = client.put_if(key, fresh, mod_revision=0)
        if created:
            log.debug("run_id_created", run_id=fresh)
            return fresh
        kv = client.get(key)
        if kv is None:  # deleted between the two calls: try again
            raise _Retry()
        return kv.value.decode("utf-8", "replace") if isinstance(kv.value, bytes) else str(kv.value)

    for _ in range(3):
        try:
            value = call_with_retry(once, what="run id", deadline=time.monotonic() + deadline_s)
        except _Retry:
            continue
        if not RUN_ID_RE.fullmatch(value):
            raise ConfigError(f"etcd key {key} holds {value[:40]!r}, not a run id (16 hex digits); "
                              f"delete it (etcdctl del {key}) to start a new run")
        return value
    raise ConfigError(f"etcd key {key} keeps disappearing; is another tool deleting /elasticd/?")


def check_resume(settings: SupervisionSettings, job: str, run_id: str,
                 resume: str) -> SupervisionSettings:
    """Refuse to start over another run's checkpoints; hand the identity to the workers.

    Args:
        settings: the agent's ``SupervisionSettings`` (``checkpoint_url``, ``worker_env``).
        job: job name.
        run_id: from :func:`ensure_run_id`.
        resume: ``auto``, ``require`` or ``never``.

    Returns:
        ``settings`` with ``ELASTICD_RUN_ID`` and ``ELASTICD_RESUME`` in ``worker_env``.

    Raises:
        ConfigError: a bad resume mode, or (ForeignCheckpointError) the checkpoints under
            ``--checkpoint-url`` belong to another run and ``--resume`` was not given.
    """
    identity = RunIdentity(run_id, resume)
    if settings.checkpoint_url:
        from elasticd.checkpoint.catalog import check_resume as check_stored

        try:
            step = check_stored(settings.checkpoint_url, job, identity)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - storage down: workers check again on load
            log.warning("checkpoint_resume_check_failed", url=settings.checkpoint_url,
                        error=repr(exc))
        else:
            log.debug("checkpoint_resume_checked", run_id=run_id, resume=resume, step=step)
    env = {**settings.worker_env, ENV_RUN_ID: run_id, ENV_RESUME: resume}
    return dataclasses.replace(settings, worker_env=env)


class _Retry(Exception):
    """The run id key vanished between the create and the read."""
