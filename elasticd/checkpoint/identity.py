"""Run identity: which stored checkpoints belong to this run, and what to do about others'.

Two runs that share a checkpoint URL and a job name (every ``--standalone`` job used to be
called ``local``) would otherwise resume from and prune each other's saves. Each run has a
run id (16 hex digits, born in the agent as ``/elasticd/<job>/run_id``, handed to workers as
``ELASTICD_RUN_ID``), recorded in every manifest it writes and in the fence pointer. A run
loads and prunes only its own saves; another run's are resumed only on purpose:

- ``auto`` (default): this run's newest valid checkpoint; if there is none but another
  run's exists, refuse (exit 78) naming that run, its newest step and the way out.
- ``require``: this run's newest, else the newest of any run (deliberate resume);
  refuse if there is no checkpoint at all.
- ``never``: this run's own checkpoints only; other runs' are ignored (never loaded,
  never pruned).

A manager without a run id (plain torchrun, library use) is anonymous: it loads any save,
as before run ids existed, and prunes only anonymous saves.

Pure functions; no I/O.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from elasticd.checkpoint.api import CheckpointMismatchError
from elasticd.checkpoint.manifest import RUN_ID_RE
from elasticd.errors import ConfigError

RESUME_MODES = ("auto", "require", "never")


def new_run_id() -> str:
    """A fresh run id: 16 random lowercase hex digits."""
    return secrets.token_hex(8)


class ForeignCheckpointError(CheckpointMismatchError):
    """The job's checkpoints belong to another run and resuming was not asked for (exit 78)."""


@dataclass(frozen=True)
class RunIdentity:
    """Who is loading and pruning, and whether another run's checkpoints may be resumed.

    Attributes:
        run_id: this run's id, or None (anonymous: loads any save, prunes anonymous ones).
        resume: ``"auto"``, ``"require"`` or ``"never"`` (see the module docstring).

    Raises:
        ConfigError: a malformed run id or an unknown resume mode (names the fix).
    """

    run_id: str | None = None
    resume: str = "auto"

    def __post_init__(self) -> None:
        if self.run_id is not None and not RUN_ID_RE.fullmatch(self.run_id):
            raise ConfigError(f"run_id {self.run_id!r} is not 16 lowercase hex digits; omit it "
                              "to take the agent's (ELASTICD_RUN_ID) or use new_run_id()")
        if self.resume not in RESUME_MODES:
            raise ConfigError(f"checkpoint resume mode {self.resume!r} is not one of "
                              f"{', '.join(RESUME_MODES)} (flag --resume, env ELASTICD_RESUME)")

    def owns(self, manifest_run_id: str) -> bool:
        """True if a save written by ``manifest_run_id`` ("" = anonymous) is this run's own."""
        if self.run_id is None:
            return True  # anonymous: the behaviour before run ids (loads anything)
        return manifest_run_id == self.run_id

    def may_prune(self, manifest_run_id: str) -> bool:
        """True if this run may delete a committed save of ``manifest_run_id``."""
        return manifest_run_id == (self.run_id or "")


def refusal(job_url: str, run_id: str, step: int, ours: str | None) -> ForeignCheckpointError:
    """The error for ``auto`` finding only another run's checkpoints.

    Args:
        job_url: where the checkpoints are.
        run_id: the other run ("" for a save written before run ids or anonymously).
        step: its newest step.
        ours: this run's id.
    """
    who = f"run {run_id}" if run_id else "an earlier run (no run id recorded)"
    return ForeignCheckpointError(
        f"checkpoints under {job_url} belong to {who} (newest step {step}), not to this run "
        f"({ours}). To continue that run pass --resume require (ELASTICD_RESUME=require, "
        "CheckpointManager(resume='require')); to start afresh beside it pass --resume never; "
        "or use another --checkpoint-url or --job")
