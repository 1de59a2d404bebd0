"""Live re-formation's state broadcast: the structure once, the tensors without copies.

The rank that holds the newest state sends it to the ranks that are behind or new. The
nested state dict is split into a pytree skeleton (:mod:`elasticd.worker.transport.tree`:
pickled, sent through the process group) and its tensors, which a
:class:`~elasticd.worker.transport.api.StateTransport` moves: CPU tensors on a gloo group
over plain TCP straight into the receivers' memory (:mod:`elasticd.worker.transport.tcp`),
CUDA tensors through the group's own broadcast (NCCL), in place in the receivers' own
tensors (:mod:`elasticd.worker.transport.collective`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

import elasticd.worker.context as wctx
from elasticd.worker.sockets import group_endpoints
from elasticd.worker.transport.api import (
    StateTransport,
    TransferError,
    TransportKind,
    TransportTicket,
    TransportUnavailable,
    choose_transport,
)
from elasticd.worker.transport.collective import CollectiveStateTransport, group_device
from elasticd.worker.transport.tcp import TcpStateTransport
from elasticd.worker.transport.tree import (
    StateSkeleton,
    destinations,
    flatten_state,
    unflatten_state,
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StateHeader:
    """What the source publishes through the group before any tensor moves.

    Attributes:
        skeleton: the state's structure and tensor metadata.
        ticket: how to take part in the transfer; None when it was refused.
        refused: why no transport can carry the state as asked (every rank raises it).
    """

    skeleton: StateSkeleton
    ticket: TransportTicket | None
    refused: str | None = None


def make_transport(kind: TransportKind, device: torch.device) -> StateTransport:
    """This rank's side of a transfer by ``kind``."""
    if kind is TransportKind.TCP:
        hosts, peers = group_endpoints(wctx.group_sockets())
        # A group not created through elasticd.worker: its sockets are unknown (no offer).
        return TcpStateTransport(dist.get_rank(), hosts[0] if hosts else None, peers)
    return CollectiveStateTransport(device)


def _offer(skeleton: StateSkeleton, tensors: list[torch.Tensor], requested: TransportKind | None,
           device: torch.device) -> tuple[StateTransport | None, StateHeader]:
    """The source's transport, offered, and the header to publish (a refusal is published
    too: raising here would leave the other ranks waiting in the header's broadcast)."""
    choice = choose_transport(requested, backend=str(dist.get_backend()), device=device,
                              tensors=tensors)
    if choice.kind is None:
        return None, StateHeader(skeleton, None, refused=choice.reason)
    if choice.kind is TransportKind.TCP:
        tcp = make_transport(TransportKind.TCP, device)
        try:
            return tcp, StateHeader(skeleton, tcp.offer(tensors))
        except TransportUnavailable as exc:
            if requested is TransportKind.TCP:
                return None, StateHeader(skeleton, None, refused=f"TCP transport unavailable: {exc}")
            log.warning("live_transfer_unavailable", reason=str(exc))
    collective = make_transport(TransportKind.COLLECTIVE, device)
    return collective, StateHeader(skeleton, collective.offer(tensors))


def broadcast_state(sd: dict[str, object] | None, src: int, device: torch.device, *,
                    receivers: list[int] | None = None, timeout_s: float = 60.0,
                    transport: TransportKind | None = None,
                    into: object = None) -> dict[str, object] | None:
    """Send a nested state dict from ``src`` to ``receivers``: the structure once (pickled,
    through the group), the tensors' bytes without copies.

    A collective: every rank of the group calls it with the same ``src``, ``receivers`` and
    ``transport``.

    Args:
        sd: the state on ``src`` (ignored elsewhere).
        src: global rank that holds it.
        device: where this rank's collectives run (its GPU for NCCL, the CPU for gloo).
        receivers: the ranks that need the state (default: every other rank).
        timeout_s: bound on the tensors' transfer (TCP: connecting, sending, the acks;
            collective: every broadcast).
        transport: the transport; None picks (:func:`~elasticd.worker.transport.api.
            choose_transport`): TCP for strided CPU tensors on a gloo group, else the
            collective; TCP falls back to the collective when the source cannot listen.
        into: a receiver's own state of the same structure: its tensors that match in
            place, shape, dtype and device receive the bytes in place, on either transport
            (they are overwritten even if the transfer then fails; the caller falls back
            to a restart).

    Returns:
        The state on ``src`` and on every receiver (a receiver's own tensors where they
        matched, others allocated on their home device); None on every other rank.

    Raises:
        TransferError: the transfer failed (a peer died, refused, or timed out), or no
            transport can carry the state as asked.
    """
    rank = dist.get_rank()
    device = group_device(device)
    wanted = sorted(set(range(dist.get_world_size()) if receivers is None else receivers) - {src})
    sender: StateTransport | None = None
    tensors: list[torch.Tensor] = []
    box: list[object] = [None]
    if rank == src:
        skeleton, tensors = flatten_state(sd)
        sender, box[0] = _offer(skeleton, tensors, transport, device)
    try:
        dist.broadcast_object_list(box, src=src)
        header = box[0]
        if not isinstance(header, StateHeader):
            raise TransferError(f"the source published a {type(header).__name__}, not a state header")
        if header.ticket is None:
            raise TransferError(header.refused or "the source offered no transport")
        deadline = time.monotonic() + timeout_s
        metas = header.skeleton.metas()
        if sender is not None:
            sender.send(wanted, deadline)
            got = tensors
        else:
            here = make_transport(header.ticket.kind, device)
            if rank not in wanted:
                here.stand_by(header.ticket, metas, deadline)
                return None
            own = destinations(header.skeleton, into, device)
            got = here.receive(header.ticket, metas, own, deadline)
    finally:
        if sender is not None:
            sender.close()
    state = unflatten_state(header.skeleton, got)
    if not isinstance(state, dict):
        raise TransferError(f"the state is a {type(state).__name__}, not a dict")
    return state
