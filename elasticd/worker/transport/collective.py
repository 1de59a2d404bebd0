"""The collective state transport: the process group's own broadcast, in place on receivers.

For CUDA tensors on an NCCL group (GPUDirect over NVLink/InfiniBand moves GPU memory many
times faster than a host socket), and for any group whose sockets are unknown. A receiver's
own tensor that matches (:func:`~elasticd.worker.transport.tree.destinations`) is the
broadcast's buffer itself: no allocation and no copy through the host. Large tensors go one
by one; small ones as one flat buffer per dtype (one collective instead of hundreds),
copied into their destinations on the device afterwards.

A tensor whose home is the CPU on a group whose collectives run on a GPU (Adam's ``step``
counters under NCCL) is staged through a device buffer: NCCL cannot read host memory. The
broadcast reaches every rank of the group, so ranks that need nothing take part with
scratch buffers (:meth:`CollectiveStateTransport.stand_by`).

Each broadcast is issued asynchronously and waited for with what is left of the deadline
(``Work.wait(timeout)``: gloo honours it; NCCL's wait with a timeout blocks the CPU until
the kernel completes or the time runs out). A failed or late broadcast raises
:class:`~elasticd.worker.transport.api.TransferError`; the group is unusable afterwards and
live re-formation falls back to a restart.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elasticd.worker.transport.api import TensorMeta, TransferError, TransportKind, TransportTicket
from elasticd.worker.transport.tree import home_device, meta_of

BIG_TENSOR_BYTES = 1 << 20  # tensors this large are broadcast alone; smaller ones per dtype, flat


@dataclass(frozen=True)
class CollectiveTicket:
    """The group rank that broadcasts."""

    src: int

    @property
    def kind(self) -> TransportKind:
        return TransportKind.COLLECTIVE


def broadcast_plan(metas: Sequence[TensorMeta]) -> tuple[list[int], list[list[int]]]:
    """The order of the broadcasts, which source and receivers derive alike from the metadata.

    Returns:
        (indices of the tensors broadcast alone, in order; groups of indices sent as one
        flat buffer, one group per dtype, by the dtype's name).
    """
    alone: list[int] = []
    by_dtype: dict[str, list[int]] = {}
    for i, m in enumerate(metas):
        if m.nbytes >= BIG_TENSOR_BYTES:
            alone.append(i)
        else:
            by_dtype.setdefault(str(m.dtype), []).append(i)
    return alone, [by_dtype[k] for k in sorted(by_dtype)]


def group_device(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` names the current CUDA device): tensors compare
    equal to it only then."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class CollectiveStateTransport:
    """One transfer through the group's broadcast, on one rank.

    Args:
        device: where this rank's collectives run (``cuda:<local_rank>`` for NCCL, the CPU
            for gloo).
    """

    def __init__(self, device: torch.device) -> None:
        self._device = group_device(device)
        self._tensors: list[torch.Tensor] = []
        self._src = -1

    @property
    def kind(self) -> TransportKind:
        return TransportKind.COLLECTIVE

    def offer(self, tensors: Sequence[torch.Tensor]) -> CollectiveTicket:
        self._tensors = list(tensors)
        self._src = dist.get_rank()
        return CollectiveTicket(self._src)

    def send(self, receivers: Sequence[int], deadline: float) -> None:
        """The broadcast reaches every rank; ``receivers`` is the caller's business."""
        alone, flat_groups = broadcast_plan([meta_of(t) for t in self._tensors])
        for i in alone:
            self._broadcast(self._tensors[i].to(self._device).contiguous(), deadline)
        for idx in flat_groups:
            flat = torch.cat([self._tensors[i].reshape(-1).to(self._device) for i in idx])
            self._broadcast(flat, deadline)

    def receive(self, ticket: TransportTicket, metas: Sequence[TensorMeta],
                into: Sequence[torch.Tensor | None], deadline: float) -> list[torch.Tensor]:
        if len(into) != len(metas):
            raise TransferError(f"{len(into)} destinations for {len(metas)} tensors")
        return self._take(ticket, metas, into, deadline, keep=True)

    def stand_by(self, ticket: TransportTicket, metas: Sequence[TensorMeta], deadline: float) -> None:
        self._take(ticket, metas, [None] * len(metas), deadline, keep=False)

    def close(self) -> None:
        self._tensors = []

    def _take(self, ticket: TransportTicket, metas: Sequence[TensorMeta],
              into: Sequence[torch.Tensor | None], deadline: float, *, keep: bool) -> list[torch.Tensor]:
        if not isinstance(ticket, CollectiveTicket):
            raise TransferError(f"a collective receiver got a {type(ticket).__name__}")
        self._src = ticket.src
        out: list[torch.Tensor | None] = [None] * len(metas)
        alone, flat_groups = broadcast_plan(metas)
        for i in alone:
            m, own = metas[i], into[i]
            # The receiver's own tensor is the buffer when it lives where the collective runs.
            buf = own if own is not None and own.device == self._device else \
                torch.empty(m.shape, dtype=m.dtype, device=self._device)
            self._broadcast(buf, deadline)
            if not keep:
                continue
            if own is not None and own is not buf:
                own.copy_(buf)  # a CPU-homed tensor on a GPU group: staged, copied back
                out[i] = own
            else:
                out[i] = buf.to(home_device(m, self._device))
        for idx in flat_groups:
            flat = torch.empty(sum(metas[i].numel for i in idx), dtype=metas[idx[0]].dtype,
                               device=self._device)
            self._broadcast(flat, deadline)
            if not keep:
                continue
            offset = 0
            for i in idx:
                m, own = metas[i], into[i]
                piece = flat[offset:offset + m.numel].view(m.shape)
                offset += m.numel
                if own is not None:
                    own.copy_(piece)
                    out[i] = own
                else:
                    # A copy, not a view: a view would keep (and torch.save would write)
                    # the whole flat buffer.
                    home = home_device(m, self._device)
                    out[i] = piece.clone() if home == self._device else piece.to(home)
        if not keep:
            return []
        got = [t for t in out if t is not None]
        if len(got) != len(metas):
            raise TransferError(f"{len(metas) - len(got)} tensors missing after the broadcasts")
        return got

    def _broadcast(self, t: torch.Tensor, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError("timed out in the group's broadcast of the state")
        try:
            work = dist.broadcast(t, src=self._src, async_op=True)
            if work is not None:
                work.wait(timeout=datetime.timedelta(seconds=left))
        except (RuntimeError, ValueError) as exc:  # DistError is a RuntimeError
            raise TransferError(f"the group's broadcast of the state failed: {exc}"[:500]) from exc
