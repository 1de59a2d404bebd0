"""The checkpoint subsystem's contract: result records, errors and the commit-fence seam.

A checkpoint is a directory ``<url>/<job>/step-<step:012d>/<save_id>/`` holding data
files and a ``manifest.json`` written last. The manifest is the commit point on stores
without atomic rename (S3, GCS); readers list, take the newest manifest that verifies and
fall back to older ones. With a :class:`CommitFence` (etcd in production) a checkpoint
becomes the job's newest only when the fence accepts a compare-and-swap of the ``latest``
pointer, so a zombie from an old round can upload bytes that are never pointed to.

This module holds no I/O; ``manager.py`` is the training-side implementation and
``store.py`` the fsspec storage beneath it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from elasticd.control.api import CommitOutcome
from elasticd.errors import ConfigError, ElasticdError, TransientError
from elasticd.records import CheckpointPointer

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointPointer",
    "CheckpointReadError",
    "CheckpointReporter",
    "CheckpointSaveError",
    "CheckpointSuspectError",
    "CheckpointUnreadableError",
    "CommitFence",
    "CommitOutcome",
    "LoadedCheckpoint",
    "SaveResult",
    "SkippedCheckpoint",
]


class CheckpointError(ElasticdError):
    """Base class of checkpoint errors."""


class CheckpointCorruptError(CheckpointError):
    """A stored checkpoint is torn, truncated, tampered with or unreadable.

    Readers never raise this to the caller: they log it as the reason the checkpoint was
    skipped and fall back to the one before it.
    """


class CheckpointUnreadableError(CheckpointError):
    """One path of one save cannot be read: permission denied, or a directory where a file
    should be. Not corruption (the bytes may be fine) and not an outage (retrying will not
    help): readers skip that save with the path named, and retention never deletes it.
    """


class CheckpointMismatchError(CheckpointError, ConfigError):
    """A valid checkpoint does not belong to this job or does not fit the model given.

    An operator error (wrong URL or job, changed model), so it exits 78 like a bad config
    instead of silently restarting training from scratch.
    """


class CheckpointSaveError(CheckpointError, TransientError):
    """A background save failed; raised on the next call to the manager (or at close)."""


class CheckpointSuspectError(CheckpointError, ConfigError):
    """Every checkpoint that would load is marked suspect: the first loss after loading
    each was NaN or infinite (:mod:`elasticd.checkpoint.first_loss`).

    Raised instead of starting from scratch; exits 78. The loss diverges from any saved
    state, so the cause is the model, the data or the learning rate, not a restore.
    """


class CheckpointReadError(CheckpointError, TransientError):
    """Storage failed while reading (not a corrupt checkpoint: the bytes never arrived).

    Raised rather than falling back, so a storage outage does not silently resume from
    an older checkpoint; the worker fails and the agent retries.
    """


@runtime_checkable
class CommitFence(Protocol):
    """Decides whether a written checkpoint becomes the job's newest.

    The etcd implementation (in the agent) does a compare-and-swap of
    ``/elasticd/<job>/checkpoint/latest``; :class:`elasticd.checkpoint.MemoryCommitFence`
    is the in-memory one for tests and single-process use.

    Contract for implementations: ``commit`` succeeds only if the writer's round is the
    current round and the pointer moves forward, where "forward" means a higher round, or
    the same round and a higher step. (A new round may point at a lower step than the old
    pointer: that is the live job resuming from an older checkpoint after the newest turned
    out corrupt. Requiring a strictly higher step would refuse every save of that job.)
    """

    def commit(self, step: int, manifest_url: str, world_size: int) -> CommitOutcome:
        """Point ``latest`` at ``manifest_url``.

        Returns:
            ``COMMITTED``; ``REFUSED`` only when the fence compared and said no (stale
            round, not newer); ``UNKNOWN`` when it could not tell (never raise for that).
            A plain ``bool`` is accepted from older implementations (True/False =
            committed/refused).
        """
        ...

    def latest(self) -> CheckpointPointer | None:
        """The current pointer, or None when nothing was ever committed through the fence."""
        ...


@runtime_checkable
class CheckpointReporter(Protocol):
    """Told of each save and load, for the agent's metrics; a fence may also be one.

    The agent's fence (``elasticd.worker.AgentCommitFence``) is: under an agent every
    manager that commits through it reports its saves and loads over the control channel,
    and the agent's ``elasticd_checkpoint_*`` series observe them. Both calls must return
    at once (fire-and-forget) and never raise.
    """

    def saved(self, step: int, seconds: float, nbytes: int) -> None:
        """The writing rank wrote checkpoint ``step`` (``nbytes``) and had the commit answered,
        ``seconds`` after ``save`` was called."""
        ...

    def loaded(self, step: int, seconds: float, nbytes: int) -> None:
        """This rank loaded checkpoint ``step`` (``nbytes`` read) in ``seconds``."""
        ...


@dataclass(frozen=True)
class SaveResult:
    """What one save wrote (returned by ``CheckpointManager.wait`` on the writing rank).

    Attributes:
        step: training step saved.
        save_id: unique id of this save (``<unix ms>-<8 hex>``), the directory name.
        manifest_url: URL of the manifest (what the fence points at).
        nbytes: bytes of data written (manifest excluded).
        blocked_s: seconds the caller of ``save`` was blocked (copying state, waiting for
            the previous save).
        write_s: seconds the background write took, manifest and fence commit included.
        committed: True once the manifest is written and, with a fence, the fence accepted.
        outcome: the fence's answer (``UNKNOWN``: the bytes are kept and the agent keeps
            trying to commit them; see :class:`CommitOutcome`).
    """

    step: int
    save_id: str
    manifest_url: str
    nbytes: int
    blocked_s: float
    write_s: float
    committed: bool = True
    outcome: CommitOutcome = CommitOutcome.COMMITTED


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint a reader passed over, and why (also logged as ``checkpoint_skipped``)."""

    url: str
    reason: str
    suspect: bool = False  # marked suspect by a refused restore (its first loss not finite)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """The checkpoint ``load_latest`` restored.

    Attributes:
        step: training step of the checkpoint.
        world_size: world size that saved it (not necessarily today's).
        manifest_url: which checkpoint was loaded.
        save_id: its save id.
        created_at: Unix time the save started.
        state: the loaded values of the top-level keys the template did not cover (all
            of them without a template), CPU tensors; template keys were applied in place.
        skipped: newer checkpoints passed over, newest first, with reasons.
        nbytes: bytes of the checkpoint's data files (what this rank read).
    """

    step: int
    world_size: int
    manifest_url: str
    save_id: str
    created_at: float
    state: dict[str, Any]
    skipped: tuple[SkippedCheckpoint, ...] = field(default_factory=tuple)
    nbytes: int = 0


@dataclass(frozen=True)
class CheckpointInfo:
    """One stored checkpoint as ``elasticd checkpoints`` and ``list_checkpoints`` see it.

    Attributes:
        job: job name.
        step: step, from the directory name.
        save_id: save id, from the directory name.
        url: manifest URL.
        created_at: Unix time the save started (from the save id, writer's clock).
        committed_at: Unix time the manifest was written, None without a valid manifest.
        world_size: saving world size, 0 when unknown.
        size: bytes stored (data and manifest, from the listing).
        valid: True if the manifest verifies and every listed file is present with its
            size (and, after ``--verify``, its checksum).
        reason: why it is not valid (None when valid).
        run_id: the run that wrote it ("" when unknown or written before run ids).
    """

    job: str
    step: int
    save_id: str
    url: str
    created_at: float
    committed_at: float | None
    world_size: int
    size: int
    valid: bool
    reason: str | None = None
    run_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (for ``--json``)."""
        return {
            "job": self.job,
            "step": self.step,
            "save_id": self.save_id,
            "url": self.url,
            "created_at": self.created_at,
            "committed_at": self.committed_at,
            "world_size": self.world_size,
            "size": self.size,
            "valid": self.valid,
            "reason": self.reason,
            "run_id": self.run_id,
        }
