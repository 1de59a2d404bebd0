"""The stop agreement: every rank's stop flags, all-reduced one call late.

``should_stop()`` (:mod:`elasticd.worker.context`) asks it once per step. Each call reads
the result of the previous call's asynchronous all-reduce (MAX) and starts the next one,
on a CPU (gloo) group even when training uses NCCL: the training loop never waits for it
and every rank reads the same previous result, so all ranks agree on the same call.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class StopAgreement:
    """The flags ``[any rank stops, -(every rank drains), some rank drains]`` and the
    pending all-reduce that agrees on them. Owned by the worker runtime."""

    def __init__(self) -> None:
        self._flag = torch.zeros(3, dtype=torch.int32)
        self._group: Any = None  # CPU (gloo) group for the flags; None: no group
        self._pending: Any = None  # async all-reduce work of the previous call
        self._all_drain = False  # at the last agreed stop, every rank's own node was draining
        self._any_drain = False  # at the last agreed stop, some rank's own node was draining

    @property
    def group(self) -> Any:
        """The group the flags are all-reduced on (None when there is none)."""
        return self._group

    def use(self, group: Any) -> None:
        """All-reduce on ``group`` from now on (a new round's); nothing is pending."""
        self._group, self._pending = group, None

    def agree(self, local: bool, draining: bool) -> bool:
        """The previous call's agreement (True: some rank asked to stop), and this call's
        flags sent for the next one unless it stopped. A collective on the group."""
        stop = False
        if self._pending is not None:
            self._pending.wait()  # started a whole step ago: normally already complete
            self._pending = None
            stop = int(self._flag[0].item()) > 0
            # MAX of -drain is -1 only when every rank's node drains (a whole-job stop).
            self._all_drain = stop and int(self._flag[1].item()) < 0
            self._any_drain = stop and int(self._flag[2].item()) > 0
        if not stop:
            self._flag[0] = 1 if local else 0
            self._flag[1] = -1 if draining else 0
            self._flag[2] = 1 if draining else 0
            self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group,
                                            async_op=True)
        return stop

    def alone(self, local: bool, draining: bool) -> bool:
        """A single rank's agreement with itself: no collective."""
        self._all_drain = self._any_drain = draining
        return local

    def settle(self, timeout_s: float) -> None:
        """Wait (bounded) for the pending all-reduce, or abandon it."""
        work, self._pending = self._pending, None
        if work is None:
            return
        try:
            work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError:  # a peer is gone, or it timed out: nothing to agree on any more
            pass

    def every_rank_draining(self) -> bool:
        return self._all_drain

    def some_rank_draining(self) -> bool:
        return self._any_drain

    def reset(self) -> None:
        """Forget the group, the pending work and the last agreement (shutdown)."""
        self._group, self._pending = None, None
        self._all_drain = self._any_drain = False
