"""Random number generator state of one rank: captured at save, restored at load.

Each rank's RNG is saved (gathered to the writer), because dropout and augmentation draw
from per-rank streams. At a different world size, rank ``r`` restores saved rank
``r % saved_world_size``: every rank gets a state that existed, and a run at the same
world size restores exactly. Only types ``weights_only`` loading reads back are stored
(uint8 tensors, tuples and lists of ints).
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch


def capture() -> dict[str, Any]:
    """This process's RNG states: torch CPU, CUDA (initialised devices), Python, NumPy."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _python_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    np = sys.modules.get("numpy")
    if np is not None:
        # Only if the program imported NumPy: importing it here would cost every worker.
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (str(name), [int(k) for k in keys], int(pos), int(has_gauss),
                          float(cached))
    return state


def restore(states: list[dict[str, Any]], rank: int) -> int:
    """Restore saved rank ``rank % len(states)``'s RNG state into this process.

    Returns:
        The saved rank whose state was restored (-1 when nothing was saved).
    """
    if not states:
        return -1
    source = rank % len(states)
    state = states[source]
    if isinstance(state.get("torch"), torch.Tensor):
        torch.set_rng_state(state["torch"])
    py = state.get("python")
    if isinstance(py, (tuple, list)) and len(py) == 3:
        random.setstate((py[0], tuple(py[1]), py[2]))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        for device, value in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(value, device)
    np_state = state.get("numpy")
    np = sys.modules.get("numpy")
    if np_state and np is not None:
        name, keys, pos, has_gauss, cached = np_state
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    return source


def _python_state() -> tuple[Any, ...]:
    version, internal, gauss = random.getstate()
    return (version, tuple(internal), gauss)
