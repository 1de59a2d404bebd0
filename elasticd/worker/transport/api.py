"""The state-transport contract: how one rank's tensors reach the ranks that are behind.

Live re-formation moves the newest training state from one rank (the source) to the ranks
that are behind or new (the receivers). The state's structure travels once, pickled through
the process group (:mod:`elasticd.worker.transport.tree`); a :class:`StateTransport` then
moves its tensors, as one flat list in the skeleton's order. Two implementations sit beside
this module, selected by :class:`TransportKind`:

- :class:`~elasticd.worker.transport.tcp.TcpStateTransport` (``TCP``): strided CPU tensors on
  a gloo group, one TCP connection per receiver, straight into the receivers' memory;
- :class:`~elasticd.worker.transport.collective.CollectiveStateTransport` (``COLLECTIVE``):
  any tensors, through the group's broadcast (NCCL for CUDA tensors).

Every implementation must handle:

- **A peer dying mid-transfer.** A source killed after part of the bytes, a receiver that
  vanished: the surviving side raises :class:`TransferError` at once (a closed or reset
  connection, a failed collective), never waits for the deadline, never returns a state
  that is partly old and partly new. Live re-formation then falls back to the restart path.
- **A receiver missing tensors.** A receiver passes, per tensor, its own tensor at the same
  place in its state, or None (a joiner without optimizer moments, a key it lacks): the
  transport allocates only what is missing, on the tensor's home device
  (:func:`~elasticd.worker.transport.tree.home_device`).
- **dtype/shape mismatch.** A receiver's own tensor is used only where it matches
  (:func:`~elasticd.worker.transport.tree.destinations`: same place, shape and dtype, on the
  home device, strided and contiguous); anything else is allocated from the metadata. The
  source and the receivers agree on the bytes (the TCP header, the collective's buffer
  sizes); a disagreement raises :class:`TransferError` before a byte of state is used.
- **Deadlines.** ``deadline`` (``time.monotonic()``) bounds every wait of
  :meth:`StateTransport.send`, :meth:`~StateTransport.receive` and
  :meth:`~StateTransport.stand_by`: a peer that stalls (frozen, SIGSTOP) makes the others
  raise :class:`TransferError` by the deadline, not at the group's timeout.
- **In place.** A receiver's matching tensors receive the bytes in place (no allocation,
  nothing for ``load_state_dict`` to copy) on every device: the returned list holds those
  very tensors (the same memory). They are overwritten even when the transfer then fails;
  the caller falls back to a restart, which reloads them.

The call sequence, on every rank of the group (:func:`~elasticd.worker.state_broadcast.
broadcast_state` runs it): the source calls :meth:`StateTransport.offer` and publishes the
ticket with the skeleton; then the source calls :meth:`~StateTransport.send`, each receiver
:meth:`~StateTransport.receive`, every other rank :meth:`~StateTransport.stand_by`; the
source calls :meth:`~StateTransport.close` in every case.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

# Defined beside the TCP wire protocol, which raises it too; every transport raises it.
from elasticd.worker.transfer import TransferError

__all__ = ["StateTransport", "TensorMeta", "TransferError", "TransportChoice", "TransportKind",
           "TransportTicket", "TransportUnavailable", "choose_transport"]


class TransportKind(enum.Enum):
    """Which transport carries the tensors."""

    TCP = "tcp"
    COLLECTIVE = "collective"


class TransportUnavailable(TransferError):  # noqa: N818 - a kind of TransferError
    """The source cannot offer this transport (no address to listen on, a dtype without a
    byte view): nothing was published, another transport may carry the state."""


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver knows of one tensor before its bytes arrive.

    Attributes:
        shape: the tensor's shape.
        dtype: its dtype.
        device_type: the source tensor's device type (``"cpu"``, ``"cuda"``): a CPU tensor
            stays on the CPU on receivers, any other lands on the receiver's group device.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class TransportTicket(Protocol):
    """What the source publishes to the group with the skeleton (pickled through the group,
    so only members see it): which transport carries the tensors, and what receivers need
    to take part (an address and tokens for TCP; the source rank for the collective)."""

    @property
    def kind(self) -> TransportKind: ...


class StateTransport(Protocol):
    """Moves one flat list of tensors from the source rank to the receivers, once.

    One instance per transfer and rank. Every method raises :class:`TransferError` (never
    a socket's or a collective's own error) when the transfer cannot complete.
    """

    @property
    def kind(self) -> TransportKind: ...

    def offer(self, tensors: Sequence[torch.Tensor]) -> TransportTicket:
        """Source: get ready to send ``tensors`` (in the skeleton's order).

        Returns:
            The ticket to publish with the skeleton.

        Raises:
            TransportUnavailable: this transport cannot carry them; nothing was published.
        """
        ...

    def send(self, receivers: Sequence[int], deadline: float) -> None:
        """Source: send the offered tensors to every rank of ``receivers``; return once each
        has them (TCP: acknowledged; collective: the broadcast completed on this rank)."""
        ...

    def receive(self, ticket: TransportTicket, metas: Sequence[TensorMeta],
                into: Sequence[torch.Tensor | None], deadline: float) -> list[torch.Tensor]:
        """Receiver: the source's tensors, in place in ``into`` where it holds a tensor.

        Args:
            ticket: what the source published.
            metas: each tensor's shape, dtype and home device, in order.
            into: per tensor, the receiver's own tensor to receive into (it matches:
                :func:`~elasticd.worker.transport.tree.destinations`), or None to allocate.

        Returns:
            The tensors, ``into``'s own where given.
        """
        ...

    def stand_by(self, ticket: TransportTicket, metas: Sequence[TensorMeta], deadline: float) -> None:
        """A rank that neither sends nor receives: take part where the mechanism needs every
        rank of the group (a collective), else return at once."""
        ...

    def close(self) -> None:
        """Release what :meth:`offer` opened (idempotent; called by the source in every case)."""
        ...


@dataclass(frozen=True)
class TransportChoice:
    """Which transport carries a state, and why (None: none can, as asked)."""

    kind: TransportKind | None
    reason: str


def choose_transport(requested: TransportKind | None, *, backend: str, device: torch.device,
                     tensors: Sequence[torch.Tensor]) -> TransportChoice:
    """Pick the transport for ``tensors`` on a group of ``backend`` whose collectives run on
    ``device`` (the source's view; pure).

    Args:
        requested: the caller's choice; None picks: TCP when every tensor is a strided CPU
            tensor on a gloo group, else the collective.
    """
    if requested is TransportKind.COLLECTIVE:
        return TransportChoice(TransportKind.COLLECTIVE, "asked for the group's broadcast")
    cpu = device.type == "cpu" and backend == "gloo" and all(
        t.device.type == "cpu" and t.layout == torch.strided for t in tensors)
    if requested is TransportKind.TCP:
        if not cpu:
            return TransportChoice(None, "the TCP transport carries only strided CPU tensors on a "
                                         "gloo group: use the collective (or let it choose)")
        return TransportChoice(TransportKind.TCP, "asked for TCP")
    if cpu:
        return TransportChoice(TransportKind.TCP, "CPU tensors on a gloo group: TCP straight into "
                                                  "the receivers' memory")
    # CUDA tensors keep the collective: NCCL moves GPU memory at NVLink/InfiniBand speed
    # (GPUDirect), where a socket would add a device-to-host copy on the source and a
    # host-to-device copy on every receiver.
    return TransportChoice(TransportKind.COLLECTIVE, f"{backend} group on {device.type}, or "
                                                     "tensors off the CPU: the group's broadcast")
