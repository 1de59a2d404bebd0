"""Live re-formation's state transfer over plain TCP: one rank's CPU tensors, straight into
the memory of the ranks that are behind or new.

Why not the process group's broadcast: gloo's broadcast of a large CPU tensor moves it in
chunks through its own buffers (0.86 s for 1 GiB on loopback, 42 % of a raw socket copy of
the same bytes). Here the source listens on an ephemeral port of the address its process
group already uses, publishes that address with two fresh random tokens through the group
itself (only members receive them), and every receiver connects, authenticates, and
``recv_into``\\s the destination tensors' own memory: no copy on either side. Several
receivers are served in parallel, one thread each.

CUDA tensors keep the collective path (``elasticd.worker.live``): NCCL moves GPU memory
over NVLink/InfiniBand with GPUDirect at many times a host socket's speed, and sending it
here would cost a device-to-host copy on the source and host-to-device on every receiver.

Protocol on one connection (all integers big-endian)::

    receiver -> source  HELLO   "EDX1", receiver rank (u32), receive token (32 bytes)
    source   -> receiver HEADER "EDX1", send token (32 bytes), total bytes (u64), tensors (u32)
    source   -> receiver the tensors' bytes, in the order both sides know from the metadata
    receiver -> source  ACK     "EDX1", bytes received (u64)

The ticket also carries the CRC-32 of every byte, computed on the source before it is
published: a receiver checks the bytes it got against it before it acknowledges them, and a
transfer that delivered a wrong byte raises (the state is never used; the caller falls back
to the next tier, the checkpoint).

The source closes a connection whose HELLO does not carry the receive token (or names a
rank that is not expected, or one already served) without sending a byte; a receiver
whose peer does not prove the send token raises before it reads any state. Every wait is
bounded by the caller's deadline; a closed, reset or late connection raises
:class:`TransferError` (a ``RuntimeError``: live re-formation falls back to a restart).
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import select
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import structlog
import torch

log = structlog.get_logger(__name__)

MAGIC = b"EDX1"
TOKEN_BYTES = 32
HELLO = struct.Struct("!4sI32s")
HEADER = struct.Struct("!4s32sQI")
ACK = struct.Struct("!4sQ")
IOV_BATCH = 512  # buffers per sendmsg/recvmsg_into call (Linux allows 1024)
ACCEPT_POLL_S = 0.02  # how often the accept loop also looks at its senders' failures
# A connection that has not said who it is holds a thread: at most this many at once (a
# connect flood made 575 threads and pushed a join onto the restart path), each for at
# most HELLO_TIMEOUT_S (a receiver sends its hello right after connecting).
MAX_UNIDENTIFIED = 64
HELLO_TIMEOUT_S = 2.0


class TransferError(RuntimeError):
    """The state transfer failed: a peer closed, reset, refused or missed its deadline."""


@dataclass(frozen=True)
class TransferTicket:
    """What the source publishes to the group: where to connect and how to prove membership.

    Attributes:
        host: the source's address (the one its process group uses).
        port: the ephemeral port it listens on for this transfer only.
        recv_token: a receiver sends it first; the source serves nobody else.
        send_token: the source sends it back; a receiver accepts state from nobody else.
        total_bytes: bytes of all tensors (both sides check they agree).
        count: number of tensors.
        crc32: CRC-32 of all tensors' bytes in order (the receiver checks it before use);
            None where the payload carries checks of its own (peer-RAM replica chunks).
    """

    host: str
    port: int
    recv_token: bytes
    send_token: bytes
    total_bytes: int
    count: int
    crc32: int | None = None


def new_ticket(host: str, port: int, views: Sequence[memoryview],
               tokens: tuple[bytes, bytes] | None = None) -> TransferTicket:
    """A ticket for one transfer of ``views``: two fresh random tokens, or the caller's
    ``(recv_token, send_token)`` (derived from a key only the group holds), and the CRC-32
    of the bytes the receiver checks before use."""
    recv_token, send_token = tokens or (secrets.token_bytes(TOKEN_BYTES),
                                        secrets.token_bytes(TOKEN_BYTES))
    return TransferTicket(host=host, port=port, recv_token=recv_token, send_token=send_token,
                          total_bytes=sum(v.nbytes for v in views), count=len(views),
                          crc32=views_crc(views))


def views_crc(views: Iterable[memoryview]) -> int:
    """CRC-32 of the views' bytes, in order."""
    crc = 0
    for v in views:
        crc = zlib.crc32(v, crc)
    return crc


def check_crc(views: Sequence[memoryview], ticket: TransferTicket) -> None:
    """Raises TransferError if the received bytes do not match the source's CRC-32."""
    if ticket.crc32 is None:
        return
    got = views_crc(views)
    if got != ticket.crc32:
        raise TransferError(f"the state from {ticket.host}:{ticket.port} arrived corrupt "
                            f"(CRC-32 {got:#010x}, the source's {ticket.crc32:#010x}): refusing "
                            "it; falling back to the next tier")


# -- framing (pure) ---------------------------------------------------------------------------
def encode_hello(rank: int, token: bytes) -> bytes:
    """The receiver's first message: its rank and the receive token."""
    return HELLO.pack(MAGIC, rank, token)


def check_hello(data: bytes, ticket: TransferTicket, expected: Iterable[int]) -> int:
    """The receiver rank a HELLO names, if it proves the receive token.

    Raises:
        TransferError: wrong length, magic or token, or a rank not expected.
    """
    if len(data) != HELLO.size:
        raise TransferError(f"hello of {len(data)} bytes, expected {HELLO.size}")
    magic, rank, token = HELLO.unpack(data)
    if magic != MAGIC:
        raise TransferError("not an elasticd state transfer (bad magic)")
    if not hmac.compare_digest(token, ticket.recv_token):
        raise TransferError("wrong token: not a member of this group")
    if rank not in set(expected):
        raise TransferError(f"rank {rank} is not a receiver of this transfer")
    return int(rank)


def encode_header(ticket: TransferTicket) -> bytes:
    """The source's answer to a valid HELLO: the send token and the sizes."""
    return HEADER.pack(MAGIC, ticket.send_token, ticket.total_bytes, ticket.count)


def check_header(data: bytes, ticket: TransferTicket) -> None:
    """Check the source's HEADER against the ticket the group published.

    Raises:
        TransferError: wrong magic or token (not the group's source), or sizes that
            disagree with the metadata.
    """
    if len(data) != HEADER.size:
        raise TransferError(f"the source closed the connection before its header "
                            f"({len(data)} of {HEADER.size} bytes): it refused us or died")
    magic, token, total, count = HEADER.unpack(data)
    if magic != MAGIC or not hmac.compare_digest(token, ticket.send_token):
        raise TransferError(f"the peer at {ticket.host}:{ticket.port} did not prove it is the "
                            "group's source (wrong token): refusing its state")
    if (total, count) != (ticket.total_bytes, ticket.count):
        raise TransferError(f"the source sends {count} tensors, {total} bytes; the metadata "
                            f"says {ticket.count}, {ticket.total_bytes}")


def encode_ack(nbytes: int) -> bytes:
    """The receiver's last message: every byte arrived."""
    return ACK.pack(MAGIC, nbytes)


def check_ack(data: bytes, nbytes: int) -> None:
    """Raises TransferError unless ``data`` acknowledges ``nbytes``."""
    if len(data) != ACK.size or ACK.unpack(data) != (MAGIC, nbytes):
        raise TransferError(f"the receiver did not acknowledge {nbytes} bytes (got {data!r})")


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, as a writable view of its own memory when contiguous.

    A non-contiguous tensor is copied first (the source only; receivers allocate
    contiguous tensors). ``view(torch.uint8)`` works for every dtype, bfloat16 and bool
    included, which numpy alone does not.
    """
    flat = t.detach().reshape(-1)  # a view when contiguous
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def advance(views: Sequence[memoryview], nbytes: int) -> list[memoryview]:
    """``views`` less their first ``nbytes`` bytes (after a partial send or receive)."""
    out = list(views)
    while nbytes and out:
        head = out[0]
        if nbytes >= head.nbytes:
            nbytes -= head.nbytes
            out.pop(0)
        else:
            out[0] = head[nbytes:]
            nbytes = 0
    return out


# -- I/O ----------------------------------------------------------------------------------------
def _remaining(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError(f"timed out {what}")
    return left


def _send_views(sock: socket.socket, views: Sequence[memoryview], deadline: float) -> None:
    pending = [v for v in views if v.nbytes]
    while pending:
        sock.settimeout(_remaining(deadline, "sending the state"))
        pending = advance(pending, sock.sendmsg(pending[:IOV_BATCH]))


def _recv_views(sock: socket.socket, views: Sequence[memoryview], deadline: float) -> int:
    """Fill ``views`` from ``sock``; returns the bytes received (short: the peer closed)."""
    pending = [v for v in views if v.nbytes]
    got = 0
    while pending:
        sock.settimeout(_remaining(deadline, "receiving the state"))
        n = sock.recvmsg_into(pending[:IOV_BATCH])[0]
        if n == 0:
            break
        got += n
        pending = advance(pending, n)
    return got


def _recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    buf = bytearray(size)
    n = _recv_views(sock, [memoryview(buf)], deadline)
    return bytes(buf[:n])


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it; close alone does not
    except OSError:
        pass
    sock.close()


class TransferSource:
    """The source's listener for one transfer: bind, publish :attr:`ticket`, :meth:`serve`.

    Args:
        host: the address to listen on: the one the process group already uses.
        views: the tensors' bytes (:func:`byte_view`), in the metadata's order.
        allowed_peers: addresses a receiver may connect from (the group's peers); None
            admits any (the tokens still decide).
        tokens: ``(recv_token, send_token)`` to use instead of fresh random ones.
    """

    def __init__(self, host: str, views: Sequence[memoryview], *,
                 allowed_peers: frozenset[str] | None = None,
                 tokens: tuple[bytes, bytes] | None = None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.bind((host, 0))
            self._listener.listen(64)
        except OSError as exc:
            self._listener.close()
            raise TransferError(f"cannot listen on {host}: {exc}") from exc
        self._views = list(views)
        self._allowed = allowed_peers
        self.ticket = new_ticket(host, int(self._listener.getsockname()[1]), self._views, tokens)
        self.refused = 0  # connections refused (strangers), for logs and tests
        self.refused_crowded = 0  # silent connections dropped for a newer one (over the cap)
        self.refused_silent = 0  # connections closed without a hello (timed out or dropped)

    def close(self) -> None:
        """Stop listening (idempotent)."""
        self._listener.close()

    def serve(self, receivers: Iterable[int], deadline: float) -> None:
        """Send the tensors to every rank of ``receivers``, in parallel; wait for their acks.

        Args:
            receivers: the ranks that must each connect once.
            deadline: ``time.monotonic()`` bound on the whole transfer.

        Raises:
            TransferError: a receiver did not connect, failed or vanished before its ack.
        """
        expected = frozenset(receivers)
        lock = threading.Lock()
        served: dict[int, threading.Thread] = {}
        failures: dict[int, BaseException] = {}
        conns: list[socket.socket] = []
        # Connections whose hello is not checked yet, oldest first (under lock).
        unidentified: dict[socket.socket, None] = {}

        def serve_one(conn: socket.socket, peer: str) -> None:
            rank = -1
            try:
                try:
                    try:
                        hello = _recv_exact(conn, HELLO.size,
                                            min(deadline, time.monotonic() + HELLO_TIMEOUT_S))
                    except (OSError, TransferError):  # silent, closed or dropped: counted, logged once
                        with lock:
                            self.refused += 1
                            self.refused_silent += 1
                        return
                    try:
                        rank = check_hello(hello, self.ticket, expected)
                    except TransferError as exc:
                        with lock:
                            self.refused += 1
                        log.warning("live_transfer_refused", peer=peer, reason=str(exc))
                        return
                finally:
                    with lock:
                        unidentified.pop(conn, None)
                with lock:
                    if rank in served:
                        self.refused += 1
                        log.warning("live_transfer_refused", peer=peer,
                                    reason=f"rank {rank} already connected")
                        return
                    served[rank] = threading.current_thread()
                conn.sendall(encode_header(self.ticket))
                _send_views(conn, self._views, deadline)
                check_ack(_recv_exact(conn, ACK.size, deadline), self.ticket.total_bytes)
            except (OSError, TransferError) as exc:
                if rank >= 0:
                    with lock:
                        failures[rank] = exc
            finally:
                _close(conn)

        try:
            while True:
                with lock:
                    if failures or set(served) >= expected:
                        break
                left = _remaining(deadline, f"waiting for receivers {sorted(expected - set(served))} "
                                            "to connect")
                ready, _, _ = select.select([self._listener], [], [], min(left, ACCEPT_POLL_S))
                if not ready:
                    continue
                conn, addr = self._listener.accept()
                if self._allowed is not None and addr[0] not in self._allowed:
                    self.refused += 1
                    log.warning("live_transfer_refused", peer=addr[0], reason="not a group peer")
                    conn.close()
                    continue
                with lock:
                    # Full: drop the oldest silent one, not the newcomer (a receiver sends
                    # its hello at once, so a flood cannot starve it of a slot).
                    oldest = next(iter(unidentified)) if len(unidentified) >= MAX_UNIDENTIFIED else None
                    if oldest is not None:
                        del unidentified[oldest]
                        self.refused_crowded += 1
                    unidentified[conn] = None
                if oldest is not None:
                    with contextlib.suppress(OSError):
                        oldest.shutdown(socket.SHUT_RDWR)  # its thread's recv ends now
                conns.append(conn)
                threading.Thread(target=serve_one, args=(conn, addr[0]), daemon=True,
                                 name="elasticd-live-send").start()
            with lock:
                threads = list(served.values())
            for th in threads:
                th.join(max(deadline - time.monotonic(), 0.0))
            with lock:
                if failures:
                    rank, exc = sorted(failures.items())[0]
                    raise TransferError(f"sending the state to rank {rank} failed: {exc}") from exc
            if any(th.is_alive() for th in threads):
                raise TransferError("timed out sending the state")
        finally:
            self.close()
            for conn in conns:  # a stranger's stalled hello, a timed-out receiver
                _close(conn)
            if self.refused_silent:
                log.warning("live_transfer_refused", peer=None, reason=(
                    f"{self.refused_silent} connection(s) sent no hello within "
                    f"{HELLO_TIMEOUT_S:g} s or were dropped over the cap of {MAX_UNIDENTIFIED}"))


def receive(ticket: TransferTicket, rank: int, views: Sequence[memoryview], deadline: float) -> None:
    """Receive the source's tensors into ``views`` (the destination tensors' own memory).

    Raises:
        TransferError: the source refused us, is not the group's source, closed the
            connection early (it died), or the deadline passed.
    """
    try:
        conn = socket.create_connection((ticket.host, ticket.port),
                                        timeout=_remaining(deadline, "connecting to the source"))
    except OSError as exc:
        raise TransferError(f"cannot connect to the source {ticket.host}:{ticket.port}: {exc}") from exc
    try:
        conn.sendall(encode_hello(rank, ticket.recv_token))
        check_header(_recv_exact(conn, HEADER.size, deadline), ticket)
        got = _recv_views(conn, views, deadline)
        if got != ticket.total_bytes:
            raise TransferError(f"the source closed the connection after {got} of "
                                f"{ticket.total_bytes} bytes (it died or gave up)")
        check_crc(views, ticket)
        conn.settimeout(_remaining(deadline, "acknowledging the state"))
        conn.sendall(encode_ack(got))
    except OSError as exc:
        raise TransferError(f"receiving the state from {ticket.host}:{ticket.port} failed: {exc}") from exc
    finally:
        conn.close()
