"""The I/O half of checkpoint retention: list the store, classify each save, delete.

The decision is the pure ``retention.plan_prune``; this reads what it needs (the listing,
each save's manifest, cached since a verified manifest never changes, and the fence's
pointer) and deletes what it returns. Nothing is deleted on a guess: a storage error
abandons the prune until the next save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elasticd.checkpoint.api import CheckpointCorruptError, CheckpointUnreadableError, CommitFence
from elasticd.checkpoint.identity import RunIdentity
from elasticd.checkpoint.manifest import Manifest
from elasticd.checkpoint.retention import PruneDecision, RetentionPolicy, StoredSave, plan_prune
from elasticd.checkpoint.store import FsspecCheckpointStore, ListedSave, listing_problem


class CheckpointPruner:
    """Applies a :class:`RetentionPolicy` to one job's store (the writer rank's).

    Args:
        store: the job's checkpoint store.
        policy: what to keep.
        identity: this run's identity (another run's saves are pruned only if it may).
        fence: the commit fence, whose pointer (and high-water step) is never pruned.
        clock: Unix-time source.
        log: a bound structlog logger.
    """

    def __init__(self, store: FsspecCheckpointStore, policy: RetentionPolicy,
                 identity: RunIdentity, fence: CommitFence | None, clock: Callable[[], float],
                 log: Any) -> None:
        self.store = store
        self.policy = policy
        self.identity = identity
        self.fence = fence
        self._clock = clock
        self._log = log
        self.manifests: dict[tuple[int, str], Manifest] = {}  # verified, by (step, save_id)
        # Never pruned by this process, by role ("saved", "pending", "loaded").
        self.protect: dict[str, tuple[int, str]] = {}

    def remember(self, manifest: Manifest) -> None:
        """Cache a manifest this process wrote (no read needed to classify its save)."""
        self.manifests[(manifest.step, manifest.save_id)] = manifest

    def prune(self) -> list[PruneDecision]:
        """Delete the saves the retention policy no longer keeps.

        Never raises: a failed prune is logged and retried after the next save.

        Returns:
            What was deleted, with reasons.
        """
        try:
            listed = self.store.list_saves()
            saves = [self._classify(s) for s in listed]
            self.manifests = {k: v for k, v in self.manifests.items()
                               if k in {(s.step, s.save_id) for s in listed}}
            pointer = self.fence.latest() if self.fence is not None else None
            mine = self.identity.run_id
            if pointer is not None and mine and pointer.run_id not in ("", mine):
                pointer = None  # another run's pointer says nothing about our saves
            pointed = self.store.parse_manifest_url(pointer.manifest_url) if pointer else None
            decisions = plan_prune(saves, self.policy, now=self._clock(), pointer=pointed,
                                   protect=frozenset(self.protect.values()),
                                   high_water=pointer.highest_step if pointer else None)
        except Exception as exc:  # noqa: BLE001 - retention must never stop training
            self._log.warning("checkpoint_prune_failed", error=repr(exc))
            return []
        for decision in decisions:
            self.delete(decision.save, decision.reason)
        return decisions

    def _classify(self, save: ListedSave) -> StoredSave:
        """What retention needs to know of one listed save (reads its manifest, cached).

        Storage errors other than one unreadable path propagate: the prune is abandoned
        and retried later, since nothing is deleted on a guess.
        """
        def stored(committed: bool, **flags: bool) -> StoredSave:
            return StoredSave(save.step, save.save_id, save.created_at, committed, **flags)

        problem = self.store.unreadable_reason(save)
        if problem is not None:
            self._log.warning("checkpoint_unreadable", reason=problem)
            return stored(False, unreadable=True)
        if not save.has_manifest:
            return stored(False)
        key = (save.step, save.save_id)
        manifest = self.manifests.get(key)
        if manifest is None:
            # Verified manifests are cached (they never change); failures are not, since
            # a local manifest can be caught half-written.
            try:
                manifest = self.manifests[key] = self.store.read_manifest(*key)
            except CheckpointCorruptError:
                return stored(False)
            except CheckpointUnreadableError as exc:
                self._log.warning("checkpoint_unreadable", reason=str(exc))
                return stored(False, unreadable=True)
        return stored(listing_problem(manifest, save) is None,
                      foreign=not self.identity.may_prune(manifest.run_id))

    def delete(self, save: StoredSave, reason: str) -> None:
        """Delete one save (logged; a failure is retried at the next prune)."""
        try:
            self.store.delete_save(save.step, save.save_id)
        except Exception as exc:  # noqa: BLE001 - logged, retried at the next prune
            self._log.warning("checkpoint_prune_failed", step=save.step, save_id=save.save_id,
                              error=repr(exc))
            return
        self.manifests.pop((save.step, save.save_id), None)
        self._log.info("checkpoint_pruned", step=save.step, save_id=save.save_id, reason=reason)
