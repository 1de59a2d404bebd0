"""Retention policy: which stored saves to delete. Pure functions, no I/O.

Pruning deletes only what is certainly garbage; when in doubt it keeps. Rules, in order
(each deletion carries its reason, which the pruner logs):

1. Never delete a protected save (the fence's pointer, the save this process just
   committed, the one it loaded), a save that cannot be read (permission denied, a
   directory where a file belongs: named in the log, left for the operator), or another
   run's save (:mod:`elasticd.checkpoint.identity`).
2. A save without a usable manifest (torn upload, killed writer, corrupt manifest,
   missing files) is deleted once older than the grace period: it was never committed (the
   manifest comes before the fence) and the grace covers an upload still in flight.
3. Never delete a committed save at or above the job's high-water step: the highest step ever
   committed (``high_water`` of the fence pointer; without a fence, the newest committed
   save in the listing). The pointer can move back (a new round resumes from an older
   checkpoint), so "newer than the pointer" does not mean "never committed".
4. Never delete a committed save newer than the pointer: its commit may still land (an
   etcd outage makes a commit UNKNOWN; the writer keeps the upload and retries), or it was
   committed before the pointer moved back.
5. Below the high-water step, another save of the pointer's own step (a zombie's or a
   refused upload) is deleted once older than the grace period.
6. Of the remaining committed saves (older than the pointer), the newest ``keep_last``
   steps stay, and so does every step that is a multiple of ``keep_every``. Older copies
   of a step that has a newer committed copy are deleted.

Deleting the manifest first (done by the store) makes a checkpoint invisible before its
data goes, so a reader never picks a half-deleted one; a reader already loading it sees a
missing file and lists again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RetentionPolicy:
    """How many checkpoints to keep.

    Attributes:
        keep_last: newest committed steps kept (>= 1).
        keep_every: also keep every step that is a multiple of this (None: off).
        grace_s: age after which an uncommitted or unreferenced save is deleted.
    """

    keep_last: int = 3
    keep_every: int | None = None
    grace_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1 (got {self.keep_last!r}): "
                             "the newest checkpoint is never deleted")
        if self.keep_every is not None and (not isinstance(self.keep_every, int)
                                            or self.keep_every < 1):
            raise ValueError(f"keep_every must be None or an int >= 1 (got {self.keep_every!r})")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0 (got {self.grace_s!r})")


@dataclass(frozen=True)
class StoredSave:
    """One save directory as the listing saw it.

    Attributes:
        step: step from the directory name.
        save_id: save id from the directory name.
        created_at: Unix time from the save id.
        committed: True if its manifest verifies and every file it lists is present with
            the listed size.
        unreadable: a path of it cannot be read (permission, a directory): never deleted.
        foreign: it belongs to another run: never deleted.
    """

    step: int
    save_id: str
    created_at: float
    committed: bool
    unreadable: bool = False
    foreign: bool = False

    @property
    def key(self) -> tuple[int, str]:
        return (self.step, self.save_id)


@dataclass(frozen=True)
class PruneDecision:
    """Delete ``save`` because of ``reason``."""

    save: StoredSave
    reason: str


def plan_prune(
    saves: list[StoredSave],
    policy: RetentionPolicy,
    *,
    now: float,
    pointer: tuple[int, str] | None = None,
    protect: frozenset[tuple[int, str]] = frozenset(),
    high_water: int | None = None,
) -> list[PruneDecision]:
    """Decide which saves to delete.

    Args:
        saves: every save directory listed under the job.
        policy: the retention policy.
        now: current Unix time (injected for tests).
        pointer: (step, save_id) the fence points at, if any.
        protect: (step, save_id) pairs never to delete.
        high_water: highest step ever committed for the job (the fence pointer's
            ``high_water``); None: the newest committed, own save in ``saves``.

    Returns:
        The saves to delete with reasons, newest first. Never includes a protected,
        unreadable or foreign save, the pointed-to save, a save at or above the high-water
        step, or a committed save newer than the pointer.
    """
    protected = set(protect)
    if pointer is not None:
        protected.add(pointer)
    own_committed = [s.step for s in saves if s.committed and not s.foreign and not s.unreadable]
    if pointer is not None:
        own_committed.append(pointer[0])
    top = max([*own_committed, high_water if high_water is not None else -1])
    decisions: list[PruneDecision] = []

    def old(save: StoredSave) -> bool:
        return now - save.created_at > policy.grace_s

    committed: list[StoredSave] = []
    for save in saves:
        if save.key in protected or save.unreadable or save.foreign:
            continue
        if not save.committed:
            # Torn: no manifest, so never committed and never will be (the manifest comes
            # before the fence); the grace period covers an upload still in flight.
            if old(save):
                decisions.append(PruneDecision(save, f"no valid manifest after {policy.grace_s:g}s "
                                                     "(torn, killed or corrupt save)"))
            continue
        if save.step >= top:
            # At or above the highest step ever committed: may be the newest. Without a
            # pointer it is the newest committed save, and counts towards keep_last.
            if pointer is None:
                protected.add(save.key)
            continue
        if pointer is not None and save.step > pointer[0]:
            continue  # its commit may still land, or it was committed before the pointer moved back
        if pointer is not None and save.step == pointer[0]:
            if old(save):
                decisions.append(PruneDecision(save, "another save of the pointed step, never "
                                                     "committed by the fence (zombie or refused)"))
            continue
        committed.append(save)

    # Committed saves the pointer allows, plus protected committed ones, newest first.
    eligible = committed + [s for s in saves if s.key in protected and s.committed]
    eligible.sort(key=lambda s: (s.step, s.created_at, s.save_id), reverse=True)
    kept_steps: list[int] = []
    seen_steps: set[int] = set()
    for save in eligible:
        if save.key in protected:
            seen_steps.add(save.step)
            if save.step not in kept_steps:
                kept_steps.append(save.step)
            continue
        if save.step in seen_steps:
            decisions.append(PruneDecision(save, "superseded by a newer save of the same step"))
            continue
        seen_steps.add(save.step)
        if len(kept_steps) < policy.keep_last:
            kept_steps.append(save.step)
            continue
        if policy.keep_every is not None and save.step % policy.keep_every == 0:
            continue
        decisions.append(PruneDecision(save, f"older than the newest keep_last={policy.keep_last}"))
    decisions.sort(key=lambda d: (d.save.step, d.save.created_at), reverse=True)
    return decisions
