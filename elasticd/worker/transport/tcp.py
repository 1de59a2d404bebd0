"""The TCP state transport: strided CPU tensors, straight into the receivers' memory.

The wire protocol, the listener and its checks live in :mod:`elasticd.worker.transfer`;
this module fits them to the :class:`~elasticd.worker.transport.api.StateTransport`
contract. Why TCP and not gloo's broadcast for CPU tensors: gloo moves a large tensor in
chunks through its own buffers (42 % of a raw socket copy on loopback); here each receiver
``recv_into``\\s its destination tensors' own memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elasticd.worker.transfer import TransferSource, TransferTicket, byte_view, receive
from elasticd.worker.transport.api import (
    TensorMeta,
    TransferError,
    TransportKind,
    TransportTicket,
    TransportUnavailable,
)


@dataclass(frozen=True)
class TcpTicket:
    """The source's listener address and tokens (:class:`~elasticd.worker.transfer.TransferTicket`)."""

    endpoint: TransferTicket

    @property
    def kind(self) -> TransportKind:
        return TransportKind.TCP


class TcpStateTransport:
    """One transfer over TCP, on one rank.

    Args:
        rank: this rank (a receiver names itself in its hello).
        host: the address this rank's process group uses (the source listens there); None
            when unknown (a group not created through ``elasticd.worker``): no offer.
        peers: addresses a receiver may connect from (the group's peers); None admits any
            (the tokens still decide).
        tokens: ``(recv_token, send_token)`` for the source to use instead of fresh random
            ones (the peer-RAM replica derives them from its round key, so its sealed
            tickets carry none); None: fresh ones.
    """

    def __init__(self, rank: int, host: str | None, peers: frozenset[str] | None, *,
                 tokens: tuple[bytes, bytes] | None = None) -> None:
        self._rank = rank
        self._host = host
        self._peers = peers
        self._tokens = tokens
        self._source: TransferSource | None = None

    @property
    def kind(self) -> TransportKind:
        return TransportKind.TCP

    def offer(self, tensors: Sequence[torch.Tensor]) -> TcpTicket:
        if self._host is None:
            raise TransportUnavailable("no address of this process group is known to listen on")
        try:
            views = [byte_view(t) for t in tensors]  # copies a non-contiguous tensor
        except (RuntimeError, TypeError, ValueError) as exc:  # a dtype with no byte view
            raise TransportUnavailable(f"a tensor has no byte view: {exc!r}"[:200]) from exc
        try:
            self._source = TransferSource(self._host, views, allowed_peers=self._peers, tokens=self._tokens)
        except TransferError as exc:
            raise TransportUnavailable(str(exc)) from exc
        return TcpTicket(self._source.ticket)

    def send(self, receivers: Sequence[int], deadline: float) -> None:
        if self._source is None:
            raise TransferError("send() before offer()")
        self._source.serve(receivers, deadline)

    def receive(self, ticket: TransportTicket, metas: Sequence[TensorMeta],
                into: Sequence[torch.Tensor | None], deadline: float) -> list[torch.Tensor]:
        if not isinstance(ticket, TcpTicket):
            raise TransferError(f"a TCP receiver got a {type(ticket).__name__}")
        if len(into) != len(metas):
            raise TransferError(f"{len(into)} destinations for {len(metas)} tensors")
        tensors = [own if own is not None else torch.empty(m.shape, dtype=m.dtype)
                   for own, m in zip(into, metas, strict=True)]
        views = [byte_view(t) for t in tensors]
        total = sum(v.nbytes for v in views)
        if total != ticket.endpoint.total_bytes:
            raise TransferError(f"the metadata describes {total} bytes, the source sends "
                                f"{ticket.endpoint.total_bytes}")
        receive(ticket.endpoint, self._rank, views, deadline)
        return tensors

    def stand_by(self, ticket: TransportTicket, metas: Sequence[TensorMeta], deadline: float) -> None:
        """Nothing to do: TCP reaches only the receivers."""

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
