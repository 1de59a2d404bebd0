"""The few collectives the checkpoint manager needs, with a no-op single-process twin.

Saving gathers each rank's RNG state to the writer (group rank 0). Loading has group
rank 0 choose each candidate and broadcast it, and every rank report whether it could
read it, so all ranks always load the same checkpoint: ranks listing storage on their
own could see different newest checkpoints while a save commits or a prune runs.

All collectives run on the caller's thread (never the background writer's), so they
cannot interleave with the training loop's own collectives on the same group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from elasticd.errors import ConfigError


class SoloGroup:
    """One process, no process group: every collective is local."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank = rank
        self.size = size

    def gather(self, obj: Any) -> list[Any] | None:
        """Objects of every rank at rank 0, None elsewhere."""
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank."""
        return [obj]


class TorchGroup:
    """Collectives over a torch.distributed process group (gloo or NCCL).

    Args:
        pg: the group; None means the default (WORLD) group.
    """

    def __init__(self, pg: Any = None) -> None:
        group: Any = pg if pg is not None else dist.group.WORLD
        self.pg = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0)
        # Object collectives travel as byte tensors: on the GPU for NCCL, else the CPU.
        backend = str(dist.get_backend(self.pg)).lower()
        self._device = (torch.device("cuda", torch.cuda.current_device())
                        if "nccl" in backend else torch.device("cpu"))

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self._root, group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._root, group=self.pg, device=self._device)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out


def make_group(process_group: Any, rank: int | None, world_size: int | None) -> SoloGroup | TorchGroup:
    """The group to coordinate through: ``process_group``, else the initialised default
    group, else a single process of ``rank``/``world_size``.

    Raises:
        ConfigError: ``rank``/``world_size`` disagree with the process group.
    """
    if process_group is not None or (dist.is_available() and dist.is_initialized()):
        group = TorchGroup(process_group)
        for name, given, actual in (("rank", rank, group.rank), ("world_size", world_size, group.size)):
            if given is not None and given != actual:
                raise ConfigError(
                    f"CheckpointManager {name}={given} but the process group says {actual}; "
                    f"omit {name} to take it from the group"
                )
        return group
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ConfigError(f"CheckpointManager rank={rank} is outside world_size={world_size}")
    return SoloGroup(rank, world_size)
