"""Checkpoints through fsspec, committed by a manifest written last, loaded at any world size.

Public API (see docs/checkpoints.md)::

    from elasticd.checkpoint import CheckpointManager

    mgr = CheckpointManager("s3://bucket/ckpt", job="demo", keep_last=3)
    loaded = mgr.load_latest({"model": model, "optim": optim, "sampler": sampler})
    start = loaded.step + 1 if loaded else 0
    ...
    mgr.save(step, {"model": model, "optim": optim, "sampler": sampler})  # async
    ...
    mgr.close()  # drain: waits for the in-flight save to commit
"""

from elasticd.checkpoint.api import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointInfo,
    CheckpointMismatchError,
    CheckpointPointer,
    CheckpointReadError,
    CheckpointSaveError,
    CheckpointUnreadableError,
    CommitFence,
    CommitOutcome,
    LoadedCheckpoint,
    SaveResult,
    SkippedCheckpoint,
)
from elasticd.checkpoint.catalog import list_checkpoints
from elasticd.checkpoint.fence import MemoryCommitFence
from elasticd.checkpoint.identity import ForeignCheckpointError, RunIdentity, new_run_id
from elasticd.checkpoint.retention import RetentionPolicy

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointPointer",
    "CheckpointReadError",
    "CheckpointSaveError",
    "CheckpointUnreadableError",
    "CommitFence",
    "ForeignCheckpointError",
    "CommitOutcome",
    "LoadedCheckpoint",
    "MemoryCommitFence",
    "RetentionPolicy",
    "RunIdentity",
    "SaveResult",
    "SkippedCheckpoint",
    "list_checkpoints",
    "new_run_id",
]


def __getattr__(name: str) -> object:
    # CheckpointManager needs torch (seconds to import); the CLI's listing does not.
    if name == "CheckpointManager":
        from elasticd.checkpoint.manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
