"""Pure FSDP2 across nodes: a host-memory replica of one peer's shards, resharded in memory.

With a 1-D FSDP mesh across nodes nothing is replicated: a lost node takes its shards with
it. Every rank therefore keeps, in host memory, a copy of one peer's shards (a rank on the
next node of a ring over nodes, :func:`ring_holders`), refreshed every ``k`` steps. After a
single node loss the survivors re-form at the new world size and reshard *in memory*: the
sharded checkpoint's resharding load (:func:`elasticd.checkpoint.shards.fill`) runs over a
reader of the held replicas and the rank's own snapshot instead of storage
(:func:`fill_from_memory`). Storage is read only when a node and the holder of its replica
are lost together (:func:`plan_peer_recovery` says so, with the reason).

The replica reuses the sharded checkpoint's format: a JSON index of
:class:`~elasticd.checkpoint.shards.Chunk` (key, dtype, global shape, box offsets and
sizes, byte range, CRC-32) and one buffer of raw bytes. Nothing received is unpickled: the
index is parsed and validated as the checkpoint's is, the bytes are a dtype named in it.
Extra world-size-invariant state (the sampler's position, the step) travels in the index
as JSON, so a rollback to the replica's step rolls the sampler back too (exactly once).

Cost (docs/checkpoints.md "Peer-RAM replica"): host RAM per rank = its own snapshot + the
peer's (2 x the rank's shard bytes, model + optimizer); bytes on the network per refresh =
the rank's shard bytes, once; steps lost on a node loss <= k.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
import torch

from elasticd import boundedjson
from elasticd.checkpoint import shards
from elasticd.checkpoint.api import CheckpointCorruptError
from elasticd.checkpoint.manifest import checksum
from elasticd.worker.transfer import TOKEN_BYTES, TransferTicket, byte_view
from elasticd.worker.transport.api import TensorMeta
from elasticd.worker.transport.tcp import TcpStateTransport, TcpTicket

log = structlog.get_logger(__name__)

DEFAULT_EVERY_STEPS = 25  # 2.0 % blocking at 128 MiB/rank, 200 ms steps (docs/benchmarks.md)
NO_HOLDER = -1
KEY_BYTES = 32
MAX_TICKET_BYTES = shards.MAX_INDEX_BYTES + 4096
TICKET_POLL_S = 0.05  # how often a holder looks for a valid ticket after refusing one


class ReplicaTicketError(ValueError):
    """A ticket in the store this group did not write (no valid MAC under the round key),
    or one naming another rank or step, or sizes out of bounds: refused, never used."""


def ring_holders(node_of_rank: Sequence[str]) -> list[int]:
    """Who keeps each rank's replica: the rank with the same local index on the next node.

    Nodes are ordered by their first rank; a next node with fewer ranks takes the local
    index modulo its size. Pure.

    Args:
        node_of_rank: each global rank's node id.

    Returns:
        ``holders[r]``: the rank holding r's replica, ``NO_HOLDER`` on a single node.
    """
    nodes: dict[str, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        nodes.setdefault(node, []).append(rank)
    order = list(nodes)
    if len(order) < 2:
        return [NO_HOLDER] * len(node_of_rank)
    holders = [NO_HOLDER] * len(node_of_rank)
    for i, node in enumerate(order):
        nxt = nodes[order[(i + 1) % len(order)]]
        for local, rank in enumerate(nodes[node]):
            holders[rank] = nxt[local % len(nxt)]
    return holders


def held_by(holders: Sequence[int], rank: int) -> list[int]:
    """The ranks whose replica ``rank`` holds."""
    return [r for r, h in enumerate(holders) if h == rank]


# -- tickets (pure) -----------------------------------------------------------------------------
# The c10d store that carries tickets is open to every local user (docs/security.md §12). A
# ticket there therefore holds no secret: the transfer tokens are derived from a round key
# that only the group's ranks hold (agreed by a collective when the group formed), and the
# ticket (address, sizes, the index with its CRCs, rank, step) is authenticated by a MAC
# under that key. A planted or altered ticket is refused before anything is allocated.
def _mac(key: bytes, label: bytes, prefix: str, rank: int, body: bytes = b"") -> bytes:
    msg = b"\0".join((label, prefix.encode(), str(rank).encode(), body))
    return hmac.new(key, msg, hashlib.sha256).digest()


def ticket_tokens(key: bytes, prefix: str, rank: int) -> tuple[bytes, bytes]:
    """The (receive, send) tokens of ``rank``'s transfer in refresh ``prefix``."""
    return (_mac(key, b"recv", prefix, rank)[:TOKEN_BYTES],
            _mac(key, b"send", prefix, rank)[:TOKEN_BYTES])


def seal_ticket(key: bytes, prefix: str, rank: int, step: int, ticket: TransferTicket,
                index: bytes) -> bytes:
    """The store value announcing ``rank``'s replica: a MAC, then the JSON ticket (no token)."""
    body = json.dumps({"rank": rank, "step": step, "host": ticket.host, "port": ticket.port,
                       "total": ticket.total_bytes, "count": ticket.count,
                       "index": index.decode()}, sort_keys=True).encode()
    return _mac(key, b"ticket", prefix, rank, body).hex().encode() + b"\n" + body


def open_ticket(key: bytes, prefix: str, value: bytes, *, rank: int, step: int,
                max_bytes: int) -> tuple[TransferTicket, Snapshot]:
    """Check a store value against the round key; the ticket and an empty snapshot to fill.

    Args:
        key: the round key.
        prefix: the refresh's store prefix (a ticket of another refresh does not verify).
        value: the bytes read from the store.
        rank: the peer whose replica this rank holds.
        step: the step of this refresh (every rank refreshes at the same step).
        max_bytes: the most bytes a peer's shards can hold (the whole state's size).

    Returns:
        The transfer ticket (tokens derived from the key) and the snapshot its bytes fill
        (``data`` allocated after every check).

    Raises:
        ReplicaTicketError: not sealed with the key, another rank or step, or sizes that
            disagree with the index or exceed ``max_bytes``.
    """
    mac_hex, sep, body = bytes(value).partition(b"\n")
    if not sep or len(value) > MAX_TICKET_BYTES:
        raise ReplicaTicketError(f"the ticket of rank {rank} is not a sealed ticket")
    try:
        mac = bytes.fromhex(mac_hex.decode("ascii"))
    except ValueError:
        raise ReplicaTicketError(f"the ticket of rank {rank} is not a sealed ticket") from None
    if not hmac.compare_digest(mac, _mac(key, b"ticket", prefix, rank, body)):
        raise ReplicaTicketError(f"the ticket of rank {rank} is not sealed with the round key "
                                 "(written by someone outside the group): refused")
    try:
        raw = boundedjson.loads_object(body, what="replica ticket", max_bytes=MAX_TICKET_BYTES)
        host, port, total, count = raw["host"], raw["port"], raw["total"], raw["count"]
        if not (isinstance(host, str) and all(isinstance(v, int) for v in (port, total, count))
                and isinstance(raw["index"], str)):
            raise ValueError("a field of the wrong type")
        snap = parse_snapshot(raw["index"].encode(), torch.empty(0, dtype=torch.uint8),
                              size=total)
    except (ValueError, KeyError, CheckpointCorruptError) as exc:
        raise ReplicaTicketError(f"the ticket of rank {rank} is malformed: {exc}") from None
    if raw.get("rank") != rank or snap.rank != rank or raw.get("step") != step \
            or snap.step != step:
        raise ReplicaTicketError(f"a ticket for rank {raw.get('rank')} at step "
                                 f"{raw.get('step')}, expected rank {rank} at step {step}")
    if not 0 <= total <= max_bytes or count != 1:
        raise ReplicaTicketError(f"the replica of rank {rank} claims {total} bytes in {count} "
                                 f"buffers; at most {max_bytes} bytes in 1 buffer")
    recv_token, send_token = ticket_tokens(key, prefix, rank)
    ticket = TransferTicket(host=host, port=port, recv_token=recv_token, send_token=send_token,
                            total_bytes=total, count=count)
    snap.data = torch.empty(total, dtype=torch.uint8)
    return ticket, snap


def state_bytes(chunks: Sequence[shards.Chunk]) -> int:
    """The bytes of the whole (unsharded) tensors ``chunks`` are boxes of: no peer's shards
    of the same state can be larger."""
    full = {c.key: (c.dtype, c.shape) for c in chunks}
    return sum(getattr(torch, dtype).itemsize * _numel(shape) for dtype, shape in full.values())


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class PeerPlan:
    """How the survivors rebuild the old world's shards, or why they cannot.

    Attributes:
        step: the step every rank rolls back to (the replicas' step).
        sources: old rank -> the surviving old rank whose memory holds its shards (itself,
            or its replica holder).
        fallback: why storage must be read; None when memory suffices.
    """

    step: int
    sources: Mapping[int, int] = field(default_factory=dict)
    fallback: str | None = None


def plan_peer_recovery(holders: Sequence[int], lost: frozenset[int],
                       own_steps: Mapping[int, int], replica_steps: Mapping[int, int],
                       committed_step: int = -1) -> PeerPlan:
    """Decide an in-memory recovery after ranks were lost (the same on every survivor). Pure.

    Args:
        holders: the old world's :func:`ring_holders`.
        lost: old ranks that are gone.
        own_steps: survivor (old rank) -> the step of its own snapshot.
        replica_steps: old rank -> the step of its replica as its holder has it (only
            replicas held by survivors are present).
        committed_step: the newest committed checkpoint's step (-1: none).

    Returns:
        A plan; ``fallback`` names why the replicas cannot be used.
    """
    sources: dict[int, int] = {}
    steps: set[int] = set()
    for rank in range(len(holders)):
        if rank not in lost:
            sources[rank] = rank
            steps.add(own_steps.get(rank, -1))
            continue
        holder = holders[rank]
        if holder != NO_HOLDER and holder in lost:
            return PeerPlan(step=-1, fallback=(
                f"rank {rank} and the holder of its replica (rank {holder}) were lost together: "
                "the shards are resharded from the checkpoint"))
        if holder == NO_HOLDER or rank not in replica_steps:
            return PeerPlan(step=-1, fallback=(
                f"no survivor holds a replica of rank {rank}: the shards are resharded from "
                "the checkpoint"))
        sources[rank] = holder
        steps.add(replica_steps[rank])
    if len(steps) != 1 or -1 in steps:
        return PeerPlan(step=-1, fallback=(
            f"the replicas are of different steps ({sorted(steps)}): a refresh was in flight; "
            "the shards are resharded from the checkpoint"))
    (step,) = steps
    if committed_step > step:
        return PeerPlan(step=step, fallback=(
            f"the committed checkpoint (step {committed_step}) is newer than the replicas "
            f"(step {step}): it is loaded instead"))
    return PeerPlan(step=step, sources=sources)


@dataclass
class Snapshot:
    """One rank's shards at one step, in the sharded checkpoint's format, in host memory.

    Attributes:
        rank: the rank whose shards these are (old world).
        step: the step they are of.
        chunks: one per box, byte ranges into ``data``.
        data: the raw bytes (uint8, CPU).
        extra: world-size-invariant JSON state (the sampler's position) of that step.
    """

    rank: int
    step: int
    chunks: list[shards.Chunk]
    data: torch.Tensor
    extra: dict[str, Any]

    def index(self) -> bytes:
        """The JSON that travels with the bytes (the checkpoint's index plus step and extra).

        Its whole-buffer CRC is left 0: every chunk carries its own CRC, checked when it is
        read (a refresh computes one CRC pass, not three: on a busy CPU the refresh thread
        competes with the step).
        """
        body = json.loads(shards.index_json(self.rank, self.chunks, int(self.data.numel()), 0))
        body.update(step=self.step, extra=self.extra)
        return json.dumps(body, sort_keys=True).encode()


def take_snapshot(rank: int, step: int, tensors: Mapping[str, Any], extra: dict[str, Any], *,
                  crc: bool = True) -> Snapshot:
    """Copy this rank's boxes of ``tensors`` (key -> DTensor) to one host buffer.

    The loop is blocked for this copy only; the transfer runs later (:class:`PeerReplica`).
    With ``crc=False`` the CRCs are left 0 for :func:`seal` to compute off the loop.
    """
    locals_ = []
    chunks: list[shards.Chunk] = []
    start = 0
    for key, t in tensors.items():
        offsets, sizes = shards.box_of(t)
        local = t.to_local().detach().to("cpu").contiguous()
        raw = local.reshape(-1).view(torch.uint8)
        chunks.append(shards.Chunk(key, str(t.dtype).removeprefix("torch."), tuple(t.shape), offsets,
                                   sizes, start, int(raw.numel()), checksum(byte_view(raw)) if crc else 0,
                                   shards.data_name(rank)))
        locals_.append(raw)
        start += int(raw.numel())
    data = torch.cat(locals_) if locals_ else torch.empty(0, dtype=torch.uint8)
    return Snapshot(rank, step, chunks, data, extra)


def seal(snap: Snapshot) -> Snapshot:
    """``snap`` with every chunk's CRC-32 computed (in the refresh thread, not the loop)."""
    snap.chunks = [replace(c, crc32=checksum(byte_view(snap.data[c.start:c.start + c.length])))
                   for c in snap.chunks]
    return snap


def parse_snapshot_index(raw: bytes) -> tuple[int, int, list[shards.Chunk], int, dict[str, Any]]:
    """A peer's snapshot index (untrusted JSON, :meth:`Snapshot.index`'s form): (old rank,
    step, chunks, data size, extra).

    The one parser of it: the replica exchange (:func:`parse_snapshot`) and the in-memory
    reshard's index exchange through the round's store both read an index here.

    Raises:
        CheckpointCorruptError: malformed or oversized JSON, no rank, step or extra, or a
            chunk table the checkpoint's index parser refuses.
    """
    return shards.parse_peer_index(raw, "a peer's shard index")


def parse_snapshot(index: bytes, data: torch.Tensor, *, size: int | None = None) -> Snapshot:
    """A received replica: the index validated as a checkpoint's, its size checked (each
    chunk's bytes are checked against its CRC when a recovery reads them).

    ``size``: the buffer size to check against (default: ``data``'s), for an index checked
    before its bytes are allocated.

    Raises:
        CheckpointCorruptError: a malformed index, or bytes of another size.
    """
    rank, step, chunks, index_size, extra = shards.parse_peer_index(index, "peer replica index")
    expected = int(data.numel()) if size is None else size
    if index_size != expected or any(c.start + c.length > index_size for c in chunks):
        raise CheckpointCorruptError(f"the replica of rank {rank} does not match its index")
    return Snapshot(rank, step, chunks, data, extra)


def fill_from_memory(targets: Mapping[str, Any], snapshots: Sequence[Snapshot]) -> dict[str, Any]:
    """The sharded checkpoint's resharding load over host memory instead of storage.

    Args:
        targets: key -> template DTensor of the new sharding.
        snapshots: the old world's shards, one per old rank (own and held replicas).

    Returns:
        key -> DTensor of the new sharding holding the old values.

    Raises:
        CheckpointCorruptError: the snapshots do not cover every element exactly once.
    """
    return fill_boxes(targets, {s.rank: s.chunks for s in snapshots},
                      {s.rank: int(s.data.numel()) for s in snapshots}, {s.rank: s.data for s in snapshots})


def fill_boxes(targets: Mapping[str, Any], chunks_of: Mapping[int, Sequence[shards.Chunk]],
               sizes: Mapping[int, int], data: Mapping[int, torch.Tensor]) -> dict[str, Any]:
    """Each target's new box, assembled from the old ranks' bytes this rank holds.

    The coverage check runs over every old rank's index (each element exactly once);
    bytes are read only from the ranks in ``data`` (those whose boxes overlap this rank's),
    each chunk checked against its CRC.

    Args:
        targets: key -> template DTensor of the new sharding.
        chunks_of: old rank -> its chunks (every old rank).
        sizes: old rank -> the size of its byte buffer.
        data: old rank -> its bytes (uint8, CPU), for the ranks this rank reads from.

    Raises:
        CheckpointCorruptError: a gap or overlap in the old shards, a bad CRC, a needed
            rank's bytes missing, a target no old rank holds.
    """
    chunks = [c for cs in chunks_of.values() for c in cs]
    by_key = shards.check_coverage(chunks, {shards.data_name(o): n for o, n in sizes.items()})
    by_file = {shards.data_name(o): o for o in chunks_of}

    def read(c: shards.Chunk) -> bytearray:
        old = by_file[c.file]
        if old not in data:
            raise CheckpointCorruptError(f"the bytes of old rank {old} did not arrive")
        raw = bytearray(byte_view(data[old][c.start:c.start + c.length].contiguous()))
        shards.chunk_crc(c, raw)
        return raw

    missing = sorted(set(targets) - set(by_key))
    if missing:
        raise CheckpointCorruptError(f"the old shards hold no {missing[0]!r}")
    return {key: shards.fill(targets[key], by_key[key], read, "peer-RAM replica") for key in targets}


class PeerReplica:
    """This rank's side of the replica: its own snapshot, the held peer's, the refresh.

    A refresh (every ``every_steps`` steps, at the same step on every rank) takes the own
    snapshot (the only blocking part), then a background thread serves it to its holder
    over the :class:`~elasticd.worker.transport.api.StateTransport` seam (its TCP
    implementation, :class:`~elasticd.worker.transport.tcp.TcpStateTransport`) and
    receives the held peer's the same way. Tickets travel through the c10d store, sealed
    with the round key (:func:`seal_ticket`): the store (open to local users) sees
    addresses, sizes and indexes, never a token; a ticket not sealed with the key is
    refused and the holder waits for the real one. Tickets and indexes are JSON, read with
    the bounded reader; nothing is pickled.

    Args:
        rank: this rank.
        holders: :func:`ring_holders` of the world.
        store: the process group's store (sealed tickets are published there).
        host: the address this rank listens on.
        key: the round key (:data:`KEY_BYTES` bytes), the same on every rank of the group
            and known to nobody else (agreed through the group's own collective).
        allowed_peers: addresses the holder may connect from (the group's peers).
        every_steps: k.
        timeout_s: bound on one refresh's transfer.
        prefix: of the store keys (one per group: a round's replicas never meet another's).
    """

    def __init__(self, rank: int, holders: Sequence[int], store: Any, host: str, *,
                 key: bytes, allowed_peers: frozenset[str] | None = None,
                 every_steps: int = DEFAULT_EVERY_STEPS, timeout_s: float = 60.0,
                 prefix: str = "peer-replica") -> None:
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, not {every_steps}")
        if len(key) < KEY_BYTES:
            raise ValueError(f"the round key must be at least {KEY_BYTES} bytes, not {len(key)}")
        self.rank, self.holders, self.every_steps = rank, list(holders), every_steps
        self._store, self._host, self._timeout_s = store, host, timeout_s
        self._key, self._allowed = bytes(key), allowed_peers
        self.refused_tickets = 0  # tickets in the store not sealed by the group (for tests, logs)
        self._prefix = prefix
        self._seq = 0  # refreshes so far: every rank refreshes in the same order
        self.own: Snapshot | None = None
        self.held: dict[int, Snapshot] = {}
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0

    def refresh(self, step: int, tensors: Mapping[str, Any], extra: dict[str, Any]) -> None:
        """Snapshot now; send and receive in the background (waits for the previous one)."""
        self.wait()
        snap = take_snapshot(self.rank, step, tensors, extra, crc=False)
        self._seq += 1
        self._thread = threading.Thread(target=self._exchange, args=(snap, self._seq), daemon=True,
                                        name=f"peer-replica-{step}")
        self._thread.start()

    def wait(self) -> None:
        """Join the refresh in flight (if any)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _exchange(self, snap: Snapshot, seq: int = 0) -> None:
        deadline = time.monotonic() + self._timeout_s
        prefix = f"{self._prefix}/{seq}"
        try:
            if any(c.crc32 == 0 for c in snap.chunks):
                seal(snap)
            holder = self.holders[self.rank]
            source = None
            if holder != NO_HOLDER:
                # The StateTransport seam's TCP implementation, its tokens derived from the
                # round key: the sealed ticket in the (open) store carries none.
                source = TcpStateTransport(self.rank, self._host, self._allowed,
                                           tokens=ticket_tokens(self._key, prefix, self.rank))
                offered = source.offer([snap.data])
                self._store.set(f"{prefix}/{self.rank}", seal_ticket(
                    self._key, prefix, self.rank, snap.step, offered.endpoint, snap.index()))
            serving = threading.Thread(target=source.send, args=([holder], deadline),
                                       daemon=True) if source else None
            if serving:
                serving.start()
            bound = state_bytes(snap.chunks)
            held = {peer: self._receive(prefix, peer, snap.step, bound, deadline)
                    for peer in held_by(self.holders, self.rank)}
            if serving:
                serving.join()
            if source:
                source.close()
            # Both at once: a recovery reads one refresh's own snapshot and held replicas,
            # never one of each (a refresh cut short by a loss leaves the previous pair).
            self.own, self.held = snap, held
        except BaseException as exc:  # kept for the loop: a refresh failure is not fatal
            self.error = exc

    def _receive(self, prefix: str, peer: int, step: int, bound: int,
                 deadline: float) -> Snapshot:
        """``peer``'s replica: its sealed ticket from the store, then its bytes over TCP.

        A value that does not verify (planted by someone outside the group) is refused and
        the store is polled until the peer's own ticket replaces it, up to ``deadline``.
        """
        key = f"{prefix}/{peer}"
        value = bytes(self._store.get(key))
        while True:
            try:
                ticket, snap = open_ticket(self._key, prefix, value, rank=peer, step=step,
                                           max_bytes=bound)
                break
            except ReplicaTicketError as exc:
                self.refused_tickets += 1
                log.warning("peer_replica_ticket_refused", peer=peer, step=step,
                            error=str(exc)[:200])
            refused = value
            while value == refused:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no valid replica ticket of rank {peer} by the deadline "
                                       f"(refused {self.refused_tickets})")
                time.sleep(TICKET_POLL_S)
                value = bytes(self._store.get(key))
        meta = TensorMeta((int(snap.data.numel()),), snap.data.dtype, "cpu")
        TcpStateTransport(self.rank, None, None).receive(TcpTicket(ticket), [meta], [snap.data], deadline)
        return snap
