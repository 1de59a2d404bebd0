"""The state's skeleton for the transports: a nested state split into its structure and tensors.

Walked by :mod:`elasticd.checkpoint.skeleton` (torch's pytree: dicts, lists, tuples, named
tuples and ordered dicts), the walk checkpoints use too. The skeleton that travels is the state itself with every tensor replaced by its
:class:`~elasticd.worker.transport.api.TensorMeta`: plain containers and values that
pickle as they are (a pickled ``TreeSpec`` warns on load in torch 2.13), re-flattened on
each side into the same leaf order.

Pure: no I/O, no process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elasticd.checkpoint import skeleton as tree_walk
from elasticd.worker.transport.api import TensorMeta, TransferError


@dataclass(frozen=True)
class StateSkeleton:
    """A state's structure and non-tensor values, its tensors as metadata (picklable).

    Attributes:
        tree: the state with each tensor replaced by its :class:`TensorMeta`.
    """

    tree: object

    def metas(self) -> list[TensorMeta]:
        """Each tensor's metadata, in the order the transports move the tensors."""
        return [leaf for _, leaf in tree_walk.leaves_with_paths(self.tree)
                if isinstance(leaf, TensorMeta)]


def meta_of(t: torch.Tensor) -> TensorMeta:
    """What a receiver needs to know of ``t`` before its bytes."""
    return TensorMeta(shape=tuple(t.shape), dtype=t.dtype, device_type=t.device.type)


def flatten_state(state: object) -> tuple[StateSkeleton, list[torch.Tensor]]:
    """Split ``state`` into its skeleton and its tensors (detached, in the skeleton's order)."""
    tensors: list[torch.Tensor] = []

    def take(_path: str, leaf: object) -> object:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        tensors.append(leaf.detach())
        return meta_of(leaf)

    return StateSkeleton(tree_walk.map_leaves(state, take)), tensors


def unflatten_state(skeleton: StateSkeleton, tensors: Sequence[torch.Tensor]) -> object:
    """The state again: ``skeleton`` with its tensors put back, in order.

    Raises:
        TransferError: ``tensors`` does not match the skeleton's metadata (count, shape, dtype).
    """
    supply = iter(tensors)

    def put(_path: str, leaf: object) -> object:
        if not isinstance(leaf, TensorMeta):
            return leaf
        t = next(supply, None)
        if t is None or tuple(t.shape) != leaf.shape or t.dtype != leaf.dtype:
            raise TransferError(f"received {_describe(t)} where the skeleton has "
                                f"{leaf.dtype} {list(leaf.shape)}")
        return t

    state = tree_walk.map_leaves(skeleton.tree, put)
    if next(supply, None) is not None:
        raise TransferError("received more tensors than the skeleton has")
    return state


def home_device(meta: TensorMeta, device: torch.device) -> torch.device:
    """Where a receiver keeps a tensor: on the CPU if the source's was, else on ``device``
    (the receiver's group device: ``cuda:<local_rank>`` with NCCL)."""
    return torch.device("cpu") if meta.device_type == "cpu" else device


def destinations(skeleton: StateSkeleton, local: object,
                 device: torch.device) -> list[torch.Tensor | None]:
    """Per tensor of ``skeleton``, the receiver's own tensor to receive it into, or None.

    A tensor of ``local`` (the receiver's state, of the same structure) takes the state in
    place when it sits at the same place (skeleton path), has the same shape and dtype,
    lives on the tensor's :func:`home_device`, and is strided and contiguous; each one
    once (tied weights share memory). Receiving into it costs no allocation (a fresh page
    costs more than its bytes on the wire) and leaves nothing for ``load_state_dict`` to copy.
    """
    own: dict[str, torch.Tensor] = {
        path: leaf for path, leaf in tree_walk.leaves_with_paths(local)
        if isinstance(leaf, torch.Tensor)}
    used: set[int] = set()
    out: list[torch.Tensor | None] = []
    for path, leaf in tree_walk.leaves_with_paths(skeleton.tree):
        if not isinstance(leaf, TensorMeta):
            continue
        mine = own.get(path)
        if (mine is not None and mine.layout == torch.strided and mine.is_contiguous()
                and tuple(mine.shape) == leaf.shape and mine.dtype == leaf.dtype
                and mine.device == home_device(leaf, device)
                and (mine.numel() == 0 or mine.data_ptr() not in used)):
            if mine.numel():
                used.add(mine.data_ptr())
            out.append(mine.detach())
        else:
            out.append(None)
    return out


def _describe(t: torch.Tensor | None) -> str:
    return "nothing" if t is None else f"{t.dtype} {list(t.shape)}"
