"""The first loss after a restore: a state that loads but trains to NaN is refused.

Why: every byte of a restore is checked on the way in (the checkpoint's CRCs, a transfer's
CRCs, no NaN or infinity in what arrived), yet a state can pass all of that and still be
unusable: an exploded weight that is finite but overflows the next forward pass, an
optimizer moment that turns the first update into NaN, a model that does not match the
data any more. Megatron users report a replica-restored checkpoint giving NaN a few
iterations later and a job looping through restarts on it. The first loss trained from a
restored state is the cheapest end-to-end check there is.

The worker remembers where its state came from (:meth:`FirstLossCheck.restored`: a
checkpoint ``CheckpointManager.load_latest`` loaded, or a transfer of a live re-formation)
until the next loss it reports (``report_progress(loss=...)``, which ``ElasticLoop`` calls
every step with ``loop.loss``). If that loss is NaN or infinite, the restore is refused,
one tier down:

- from a checkpoint: the save is marked suspect (a ``suspect.json`` beside its manifest,
  with the reason: no reader loads it again, ``elasticd checkpoints`` shows why, retention
  treats it as any other save) and the workers restart, so they load the one before it;
- from a peer: the workers restart and load the newest checkpoint.

With :class:`~elasticd.worker.live.LiveState` the ranks agree on the verdict in
``step_done`` (one small all-reduce after each restore, every rank at the same step) and
all leave together through the live link's fall back; without it the rank that saw the
loss raises :class:`RestoreRefusedError` and the agent restarts the group. Never a loop:
each refusal marks one more save, and a load that finds only suspect saves raises
``CheckpointSuspectError`` (exit 78) instead of starting from scratch. Only the first loss
is judged: a loss that turns NaN later is the model's own, not the restore's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

from elasticd.errors import TransientError

log = structlog.get_logger("elasticd.checkpoint")


class RestoreRefusedError(TransientError):
    """The first loss after a restore was NaN or infinite: the workers restart and the next
    tier (the checkpoint before, or the newest checkpoint after a transfer) is loaded."""


@dataclass(frozen=True)
class Restore:
    """Where the state came from.

    Attributes:
        what: for the log, e.g. ``checkpoint step 40 (file://...)`` or ``the state rank 1
            sent at step 40``.
        refuse: marks the source so that nothing loads it again (a checkpoint's
            ``suspect.json``); None for a transfer (the restart reads the checkpoint).
    """

    what: str
    refuse: Callable[[str], None] | None = None


class FirstLossCheck:
    """This process's pending check: set by a restore, settled by the next loss."""

    def __init__(self) -> None:
        self._pending: Restore | None = None
        self._bad: str = ""  # why the loss refuses the pending restore ("": not seen / fine)
        self.agreed_by_live = False  # a LiveState settles the verdict in step_done (all ranks)

    @property
    def pending(self) -> Restore | None:
        return self._pending

    def restored(self, restore: Restore) -> None:
        """The state was just restored from ``restore``: judge the next loss."""
        self._pending, self._bad = restore, ""

    def forget(self) -> None:
        """No judgement pending: a live re-formation that moved no state. Every rank of the
        new group forgets alike (a step interrupted by a lost peer may have cleared the
        check on some ranks and not on others), so the agreement stays a collective of all."""
        self._pending, self._bad = None, ""

    def saw_loss(self, step: int, loss: float | None) -> None:
        """A reported loss. The first one after a restore settles it: on this rank alone
        without a LiveState (raising), else in the LiveState's agreement."""
        restore = self._pending
        if restore is None or loss is None or self._bad:
            return
        if math.isfinite(loss):
            if not self.agreed_by_live:
                self._pending = None
            return
        self._bad = (f"the first loss after restoring {restore.what} was {loss} at step {step}: "
                     "the restored state is not usable; the next tier is used")
        if not self.agreed_by_live:
            self._refuse(restore, step, self._bad, writer=True)
            raise RestoreRefusedError(self._bad)

    def agree(self, step: int, device: torch.device | None = None) -> str:
        """With a LiveState, on every rank at the first ``step_done`` after a restore: did
        any rank see a non-finite first loss? Returns the reason ("" when none); the
        writer rank marks a refused checkpoint. A collective on the default group when
        there is one (``device``: its tensors' device, a GPU under NCCL)."""
        restore, bad = self._pending, self._bad
        self._pending, self._bad = None, ""
        if restore is None:
            return ""
        flag = torch.tensor([1 if bad else 0], dtype=torch.int32, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag.item()):
            return ""
        why = bad or (f"another rank's first loss after restoring {restore.what} was not finite "
                      f"at step {step}: the next tier is used")
        writer = not dist.is_initialized() or dist.get_rank() == 0
        self._refuse(restore, step, why, writer=writer)
        return why

    @staticmethod
    def _refuse(restore: Restore, step: int, why: str, *, writer: bool) -> None:
        log.warning("restore_refused", step=step, restored_from=restore.what, reason=why)
        if writer and restore.refuse is not None:
            restore.refuse(why)


CHECK = FirstLossCheck()
