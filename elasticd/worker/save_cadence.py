"""The automatic checkpoint cadence in the training loop: measure, agree, report.

Why: the best interval between saves depends on what a save costs the loop (measured
here, at every save) and how often the job loses everything since its last checkpoint
(the goodput ledger's count, handed over by the agent at worker start). The choice itself
is pure (:func:`elasticd.checkpoint.cadence.choose_save_every`); this module measures its
inputs, and makes every rank agree on the result, because a save is a collective: at each
save the ranks all-reduce their proposals (MAX: the longest honours every rank's overhead
cap and write time), and the agreed steps travel in the loop's progress dict with the
state, so joiners and restarts save on the same steps.
"""

from __future__ import annotations

import time

import structlog
import torch
import torch.distributed as dist

from elasticd.checkpoint.api import SaveResult
from elasticd.checkpoint.cadence import SaveCadence, choose_save_every

log = structlog.get_logger(__name__)

# The loop's progress key that holds the agreed steps between saves.
PROGRESS_KEY = "save_every"


class AutoSaveCadence:
    """``[checkpoint] every = "auto"`` for one ``ElasticLoop``.

    Args:
        progress: the loop's progress dict (travels with the state).
        first_every: steps between saves until a save has been measured.
        losses: (losses, observed seconds) from the agent's goodput ledger; None: unknown
            (one loss is assumed over the time this worker has seen).
    """

    def __init__(self, progress: dict[str, int], first_every: int,
                 losses: tuple[int, float] | None) -> None:
        self._progress = progress
        self._first_every = first_every
        self._losses, self._observed_s = losses if losses is not None else (0, 0.0)
        self._started = time.monotonic()
        self._last_step_at: float | None = None
        self._step_time_s = 0.0
        self._blocking_s: float | None = None
        self.chosen = SaveCadence(first_every, 0.0, f"every {first_every} steps until a save "
                                                    "has measured its cost")

    def every(self) -> int:
        """The steps between saves all ranks agreed on."""
        return int(self._progress.get(PROGRESS_KEY, self._first_every))

    def step_done(self) -> None:
        """After each optimizer step: the step time (a moving average)."""
        now = time.perf_counter()
        if self._last_step_at is not None:
            dt = now - self._last_step_at
            self._step_time_s = dt if not self._step_time_s else 0.9 * self._step_time_s + 0.1 * dt
        self._last_step_at = now

    def saved(self, blocked_s: float, last: SaveResult | None) -> SaveCadence:
        """After a save started (``blocked_s``: how long the call blocked the loop; ``last``:
        the newest finished save on this rank): choose and agree on the next interval (a
        collective with more than one rank)."""
        self._blocking_s = blocked_s
        self._last_step_at = time.perf_counter()  # a save's own time is not step time
        write_s = last.write_s if last is not None else 0.0
        observed = self._observed_s + (time.monotonic() - self._started)
        mine = choose_save_every(blocking_s=self._blocking_s, write_s=write_s,
                                 step_time_s=self._step_time_s, losses=self._losses,
                                 observed_s=observed, first_every=self._first_every)
        agreed = _max_over_ranks(mine.every_steps)
        if agreed != mine.every_steps:
            mine = SaveCadence(agreed, agreed * self._step_time_s,
                               f"{agreed * self._step_time_s:.1f} s: the longest any rank proposed "
                               f"(this rank: {mine.reason})")
        if self.chosen.every_steps != agreed:
            log.info("checkpoint_cadence_chosen", every_steps=agreed,
                     interval_s=round(mine.interval_s, 3), reason=mine.reason)
        self._progress[PROGRESS_KEY] = agreed
        self.chosen = mine
        return mine


def _max_over_ranks(value: int) -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    device = (torch.device("cpu") if dist.get_backend() == "gloo"
              else torch.device("cuda", torch.cuda.current_device()))
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
