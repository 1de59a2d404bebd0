"""What a live re-formation keeps, and how it is read from and written back to the job.

:class:`~elasticd.worker.live.LiveState` (the replicated path) and
:class:`~elasticd.worker.live_sharded.ShardedResync` (FSDP2 / HSDP) move the same entries:
objects with ``state_dict``/``load_state_dict`` (a module, an optimizer, a sampler) or
plain dicts updated in place. The protocols and the whole-state copy in and out live here,
beside neither, so both paths read one definition of "the state".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from elasticd.checkpoint import rng


@runtime_checkable
class Stateful(Protocol):
    """An object whose state a live re-formation moves (a module, an optimizer, a sampler)."""

    def state_dict(self) -> Mapping[str, object]: ...

    def load_state_dict(self, state_dict: Mapping[str, object], /) -> object: ...


class Regroupable(Protocol):
    """What moves to the new group after a re-formation (``CheckpointManager.regroup``)."""

    def regroup(self) -> None: ...


# What LiveState keeps: objects with state_dict/load_state_dict, or plain dicts.
LiveEntry = Stateful | MutableMapping[str, object]


@dataclass(frozen=True)
class Synced:
    """The outcome of one state agreement: every rank now holds a state of ``step``.

    Attributes:
        step: the last completed step the group agreed on (-1: none).
        agreed_in_memory: True when the ranks agreed on a state in memory (every rank
            holds the same one); False when each loaded it (a DDP wrapper must sync).
        transferred: what was sent to the ranks behind, for the first-loss check
            (:mod:`elasticd.checkpoint.first_loss`); "" when nothing was. The same on every
            rank (it follows from the plan every rank computed).
    """

    step: int
    agreed_in_memory: bool
    transferred: str = ""


def load_fresh(load: Callable[[], int] | None) -> Synced:
    """Nobody holds a state (a fresh start or a full restart): every rank loads it.

    Raises:
        RuntimeError: there is no loader (a re-formation where no rank holds a state).
    """
    if load is None:
        raise RuntimeError("no rank holds a usable state")
    return Synced(load(), agreed_in_memory=False)


def optimizers_in(state: Mapping[str, LiveEntry]) -> list[torch.optim.Optimizer]:
    """The optimizers among the kept entries, in the state's order."""
    return [o for o in state.values() if isinstance(o, torch.optim.Optimizer)]


def abandon_step(state: Mapping[str, LiveEntry]) -> None:
    """Drop the gradients of a step that will never be applied."""
    for obj in state.values():
        if isinstance(obj, (torch.optim.Optimizer, torch.nn.Module)):
            obj.zero_grad(set_to_none=True)


def load_entry(obj: LiveEntry, entry: Mapping[str, object]) -> None:
    """Write one received entry back: ``load_state_dict``, or a dict updated in place."""
    if isinstance(obj, Stateful):
        obj.load_state_dict(entry)
    else:
        obj.clear()
        obj.update(entry)


def restore_rng(sd: Mapping[str, object]) -> None:
    """Restore the RNG state a peer sent with its state.

    Raises:
        TypeError: the received RNG state is not a mapping.
    """
    rng_state = sd["__rng__"]
    if not isinstance(rng_state, dict):
        raise TypeError("received RNG state is not a mapping")
    rng.restore([rng_state], 0)


def collect(state: Mapping[str, LiveEntry], step: int) -> dict[str, object]:
    """The whole kept state of a replicated job as one tree (what a source broadcasts)."""
    out: dict[str, object] = {"__rng__": rng.capture(), "__step__": step}
    for name, obj in state.items():
        out[name] = obj.state_dict() if isinstance(obj, Stateful) else dict(obj)
    return out


def apply(state: Mapping[str, LiveEntry], sd: Mapping[str, object]) -> None:
    """Write a received tree (:func:`collect`'s form) into the kept state.

    Raises:
        TypeError: an entry or the RNG state is not a mapping.
    """
    for name, obj in state.items():
        entry = sd[name]
        if not isinstance(entry, Mapping):
            raise TypeError(f"received state {name!r} is a {type(entry).__name__}, not a mapping")
        load_entry(obj, entry)
    restore_rng(sd)
