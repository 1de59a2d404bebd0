"""When :class:`~elasticd.worker.loop.ElasticLoop` checkpoints, and the save and load themselves.

Every rank must agree on which steps save (a save is a collective), so what decides it
travels with the state: the loop's progress record holds the steps done and the step of the
last save, and an ``"auto"`` cadence (:mod:`elasticd.worker.save_cadence`) keeps its
chosen interval there too. This collaborator owns that bookkeeping and the
:class:`~elasticd.checkpoint.manager.CheckpointManager`; the loop owns the steps.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from typing import Any

from elasticd.checkpoint.cadence import AUTO
from elasticd.checkpoint.manager import CheckpointManager
from elasticd.control.environment import AgentEnvironment
from elasticd.worker.save_cadence import AutoSaveCadence

# save_every="auto": steps between saves until a save has measured its cost.
DEFAULT_FIRST_SAVE_EVERY = 50


class LoopSaves:
    """The loop's checkpoint cadence, saves and loads.

    Args:
        state: everything the loop checkpoints (the progress record included).
        progress: the loop's progress record (``steps_done``, ``saved_at``, ...).
        manager: the checkpoint manager (closed by :meth:`close`).
        save_every: steps between saves, or ``"auto"`` (validated by the caller).
        agent: the agent's environment (its ``[checkpoint] every`` wins), None without one.

    Attributes:
        saved_at: ``steps_done`` as of the last save or load.
    """

    def __init__(self, state: MutableMapping[str, Any], progress: dict[str, int], manager: CheckpointManager,
                 save_every: int | str, agent: AgentEnvironment | None) -> None:
        self.state = state
        self.progress = progress
        self.manager = manager
        # Until a save has measured its cost, "auto" saves every the script's own steps.
        first_every = save_every if isinstance(save_every, int) else DEFAULT_FIRST_SAVE_EVERY
        if agent is not None and agent.checkpoint_every is not None:
            save_every = agent.checkpoint_every  # the agent's [checkpoint] every wins
        self.save_every = first_every if save_every == AUTO else int(save_every)
        self.cadence = (AutoSaveCadence(progress, self.save_every,
                                        agent.observed_losses if agent is not None else None)
                        if save_every == AUTO else None)
        self.saved_at = 0

    def load_latest(self) -> int | None:
        """Load the newest checkpoint into the state (restart path); its ``steps_done``, None if none."""
        if self.manager.load_latest(self.state) is None:
            return None
        self.saved_at = int(self.progress["steps_done"])
        return self.saved_at

    def load(self) -> int:
        """Load the newest checkpoint into the state (live path); the last completed step, -1 if none."""
        if self.manager.load_latest(self.state) is None:
            return -1
        self.progress["saved_at"] = int(self.progress["steps_done"])  # it was saved there
        return int(self.progress["steps_done"]) - 1

    def adopt(self, steps_done: int) -> None:
        """The state was replaced (a load or a live transfer): take its last save."""
        self.saved_at = int(self.progress.get("saved_at", steps_done))

    def due(self, steps_done: int) -> bool:
        """Is this step a save step? The same answer on every rank (a save is a collective)."""
        if self.cadence is not None:  # the agreed steps since the last save (both travel)
            return steps_done - self.saved_at >= self.cadence.every()
        return steps_done % self.save_every == 0

    def save(self, steps_done: int, *, blocking: bool = False) -> None:
        """Checkpoint the state as of step ``steps_done - 1`` (a collective)."""
        if steps_done == self.saved_at:
            return  # this step is saved already; a second save would be refused as not newer
        self.progress["saved_at"] = steps_done
        t0 = time.perf_counter()
        self.manager.save(steps_done - 1, self.state, blocking=blocking)
        self.saved_at = steps_done
        if self.cadence is not None and not blocking:  # a blocking save's time includes the write
            self.cadence.saved(time.perf_counter() - t0, self.manager.last_saved)
