"""Listing and verifying stored checkpoints without a training process (for the CLI).

Validity here is what a reader would decide: a manifest that verifies, belongs to the job
and names files that are all present with their sizes; ``verify=True`` also reads every
file and checks its CRC, which is what catches flipped bits, and loads the state file as
the loader does (weights_only), which is what catches a pickle the loader refuses. For a
sharded save it also reads every rank's JSON shard index and checks coverage: every
element of every tensor stored exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from elasticd.checkpoint.api import (
    CheckpointCorruptError,
    CheckpointInfo,
    CheckpointUnreadableError,
)
from elasticd.checkpoint.identity import ForeignCheckpointError, RunIdentity, refusal
from elasticd.checkpoint.manifest import MANIFEST_NAME, STATE_FILE, Manifest
from elasticd.checkpoint.store import (
    CheckpointVanishedError,
    FsspecCheckpointStore,
    ListedSave,
    list_jobs,
    listing_problem,
)


def list_checkpoints(
    url: str,
    job: str | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    verify: bool = False,
) -> list[CheckpointInfo]:
    """Every checkpoint under ``url`` (of ``job``, or of every job found), newest first.

    Args:
        url: checkpoint root URL.
        job: one job, or None for all job directories under ``url``.
        storage_options: passed to fsspec.
        verify: also read every data file and check its checksum.

    Returns:
        One entry per save directory, sorted by job, then newest step first.

    Raises:
        ConfigError: bad URL or job name.
    """
    jobs = [job] if job is not None else list_jobs(url, storage_options)
    infos: list[CheckpointInfo] = []
    for name in jobs:
        store = FsspecCheckpointStore(url, name, storage_options)
        # A save pruned while we read it (retention of a running job) is not listed.
        infos.extend(i for save in store.list_saves() if (i := _inspect(store, save, verify)))
    return infos


def check_resume(url: str, job: str, identity: RunIdentity, *,
                 storage_options: Mapping[str, Any] | None = None) -> int | None:
    """Before any worker starts: may this run start, given the checkpoints already there?

    The agent calls it so that a run meeting another run's checkpoints stops at once with
    exit 78, instead of every worker failing and being restarted.

    Returns:
        The newest step this run will resume from when it is its own (or, with
        ``resume="require"``, another run's); None when it starts afresh.

    Raises:
        ForeignCheckpointError: ``auto`` and only another run's checkpoints exist, or
            ``require`` and there is no checkpoint at all.
        ConfigError: bad URL or job name.
        OSError: storage failed (callers decide; workers check again when loading).
    """
    store = FsspecCheckpointStore(url, job, storage_options)
    foreign: Manifest | None = None
    for save in store.list_saves():  # newest first
        if store.unreadable_reason(save) or store.suspect_reason(save):
            continue
        try:
            manifest = store.read_manifest(save.step, save.save_id)
        except (CheckpointCorruptError, CheckpointUnreadableError):
            continue
        if listing_problem(manifest, save) is not None or manifest.job != job:
            continue
        if identity.owns(manifest.run_id):
            return manifest.step
        foreign = foreign or manifest
    if foreign is not None:
        if identity.resume == "require":
            return foreign.step
        if identity.resume == "auto":
            raise refusal(store.job_url, foreign.run_id, foreign.step, identity.run_id)
        return None
    if identity.resume == "require":
        raise ForeignCheckpointError(
            f"--resume require but job {job!r} has no loadable checkpoint under "
            f"{store.job_url}; check --checkpoint-url and --job, or drop --resume")
    return None


def _check_loadable(store: FsspecCheckpointStore, save: ListedSave, manifest: Manifest) -> None:
    """Load the state file as the loader does (``torch.load(weights_only=True)``).

    Why: a ``state.pt`` with valid CRCs that holds a pickle the loader refuses was listed
    as valid by ``--verify``, and then no training process could resume from it.

    Raises:
        CheckpointCorruptError: the loader would refuse it.
    """
    from elasticd.checkpoint.restore import deserialize, deserialize_file

    for entry in manifest.files:
        if entry.name != STATE_FILE:
            continue
        path = f"{store.save_path(save.step, save.save_id)}/{entry.name}"
        if store.is_local:
            try:
                deserialize_file(path, entry.name)
            except FileNotFoundError as exc:
                raise CheckpointVanishedError(f"{path} vanished while it was verified") from exc
        else:
            deserialize(store.read_verified(save.step, save.save_id, entry), entry.name)


def _inspect(store: FsspecCheckpointStore, save: ListedSave, verify: bool) -> CheckpointInfo | None:
    """One save's entry, or None when it vanished while we read it (pruned)."""
    base: dict[str, Any] = {"job": store.job, "step": save.step, "save_id": save.save_id,
            "url": store.manifest_url(save.step, save.save_id),
            "created_at": save.created_at, "size": save.size}
    try:
        problem = store.unreadable_reason(save)
        if problem:
            raise CheckpointUnreadableError(problem)
        if not save.has_manifest:
            # Why: the listing's sizes are those of a save still being written; reading a
            # manifest committed since then and judging it by them reported a fresh
            # checkpoint as "truncated" (a job that commits every step races every listing).
            raise CheckpointCorruptError("no manifest when listed (save torn or still in flight)")
        manifest = store.read_manifest(save.step, save.save_id)
    except CheckpointVanishedError:
        return None
    except (CheckpointCorruptError, CheckpointUnreadableError) as exc:
        if save.has_manifest and not store.fs.exists(
                f"{store.save_path(save.step, save.save_id)}/{MANIFEST_NAME}"):
            return None  # listed with its manifest, deleted since: pruned while we read
        return CheckpointInfo(**base, committed_at=None, world_size=0, valid=False, reason=str(exc))
    base["run_id"] = manifest.run_id
    reason = listing_problem(manifest, save) or store.suspect_reason(save)
    if reason is None and manifest.job != store.job:
        reason = f"belongs to job {manifest.job!r}"
    if reason is None and verify:
        try:
            for entry in manifest.files:
                store.verify_file(save.step, save.save_id, entry)
            _check_loadable(store, save, manifest)
            if manifest.shards:
                # Every element of every sharded tensor stored exactly once, and every
                # box's block CRCs (what a partial read checks) adding up to its CRC.
                from elasticd.checkpoint import shards
                from elasticd.checkpoint.reader import read_shard_index

                for chunks in read_shard_index(store, manifest).values():
                    for c in chunks:
                        if not shards.blocks_agree(c):
                            raise CheckpointCorruptError(
                                f"shard index of {c.file}: the block CRCs of {c.key} do not add "
                                "up to its CRC")
        except CheckpointVanishedError:
            if not store.fs.exists(f"{store.save_path(save.step, save.save_id)}/{MANIFEST_NAME}"):
                return None  # pruned while we verified it: it is not there any more
            reason = "a file vanished while it was verified, yet the manifest is still there"
        except (CheckpointCorruptError, CheckpointUnreadableError) as exc:
            reason = str(exc)
    return CheckpointInfo(**base, committed_at=manifest.committed_at,
                          world_size=manifest.world_size, valid=reason is None, reason=reason)
