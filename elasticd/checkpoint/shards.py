"""Sharded (DTensor) state: each rank's shards as raw bytes, described by JSON, resharded on load.

FSDP2 and HSDP keep every parameter and optimizer moment as a ``DTensor``: each rank holds
one box (offsets, sizes) of the global tensor. A save writes, per rank, one data file of
raw tensor bytes (``shards-r<rank>.bin``) and a JSON index (``shards-r<rank>.json``) that
says, for each box, which tensor it belongs to (its path in the state), the tensor's
global shape and dtype, the box's offsets and sizes, its byte range in the data file and
its CRC-32. Replicated mesh dimensions (HSDP's ``replicate``) are written once: only the
rank at coordinate 0 of every ``Replicate`` dimension writes its box, which is what DCP's
save planner dedups too.

A load at any world size or mesh shape takes each DTensor of the new template, asks it
for its own box (``__create_chunk_list__``, the hook DCP's planners use), and copies in
the overlap of every saved box that intersects it, after checking that box's CRC. Nothing
read from storage is unpickled: the index is JSON (validated field by field), the data
raw bytes of a dtype named in the index.

Coverage (``check_coverage``) is what makes a sharded checkpoint whole: every saved
tensor's boxes lie inside its shape, never overlap, and their element counts sum to the
tensor's, so every element is stored exactly once.
"""

from __future__ import annotations

import bisect
import heapq
import json
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import torch

from elasticd import boundedjson, codec
from elasticd.checkpoint import skeleton
from elasticd.checkpoint.api import CheckpointCorruptError, CheckpointMismatchError
from elasticd.checkpoint.manifest import block_checksums, checksum, combine_blocks

try:  # DTensor is torch.distributed's; a CPU build without distributed has no sharded state.
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]

INDEX_FORMAT = "elasticd-shards"
# A state file holds None where a DTensor was; its boxes' index entries name the place
# (``Chunk.key``, a skeleton path). Files written before carry this one-key dict there.
_OLD_PLACEHOLDER_KEY = "__elasticd_shard__"
MAX_INDEX_BYTES = 64 << 20
# A rank's index lists one chunk per tensor it holds (model and optimizer state): 131,072
# is far above any model's tensor count, and keeps a hostile index (the 64 MiB cap allows
# ~500,000 chunks) from costing more than a second to check.
MAX_CHUNKS_PER_INDEX = 1 << 17
# Coverage of boxes that are not the cells of one grid (no DTensor layout makes such) is
# checked pair by pair within a sweep; beyond this many pairs it is refused, not computed.
MAX_SWEEP_PAIRS = 1 << 18
# A saved box over one block gets a CRC per block (``Chunk.blocks``). 64 KiB: a partial read
# reads at most 128 KiB it does not need; the index grows by 11 bytes per block (176 per MiB).
BLOCK_BYTES = 64 << 10
MIN_BLOCK_BYTES, MAX_BLOCK_BYTES = 4096, 1 << 30
_INDEX_RE = re.compile(r"shards-r([0-9]{5})\.json")
# dtypes by name; only these are read back (a name from storage never reaches getattr).
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
}


def data_name(rank: int) -> str:
    """``shards-r00003.bin``: rank 3's data file."""
    return f"shards-r{rank:05d}.bin"


def index_name(rank: int) -> str:
    """``shards-r00003.json``: rank 3's index."""
    return f"shards-r{rank:05d}.json"


def is_dtensor(value: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``."""
    return DTensor is not None and isinstance(value, DTensor)


def writes_box(t: Any) -> bool:
    """Does this rank write its box of ``t``? Only at coordinate 0 of every replicated
    mesh dimension (the others hold the same bytes).

    Raises:
        CheckpointMismatchError: a placement other than Shard/Replicate (Partial sums are
            not state; reduce them first).
    """
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return False  # this rank is not on the tensor's mesh
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            if coord[dim] != 0:
                return False
        elif not isinstance(placement, Shard):
            raise CheckpointMismatchError(
                f"cannot checkpoint a DTensor with placement {placement}: only Shard and "
                "Replicate placements are state; reduce a Partial tensor before saving")
    return True


def box_of(t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of this rank's box of DTensor ``t`` in the global tensor."""
    chunks = t.__create_chunk_list__()
    if len(chunks) != 1:
        raise CheckpointMismatchError(f"a DTensor with {len(chunks)} local chunks is not supported")
    return tuple(int(x) for x in chunks[0].offsets), tuple(int(x) for x in chunks[0].sizes)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def iter_dtensors(obj: Any, path: str = skeleton.ROOT) -> Iterator[tuple[str, Any]]:
    """(path, DTensor) of every DTensor in a state tree, with the paths the stager uses."""
    return ((p, leaf) for p, leaf in skeleton.leaves_with_paths(obj, plain=True, root=path)
            if is_dtensor(leaf))


@dataclass(frozen=True)
class Chunk:
    """One saved box of one tensor, as its rank's index describes it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int
    length: int
    crc32: int
    file: str = ""
    # CRC-32 of each ``block_bytes`` piece of the box's bytes (the last may be shorter),
    # so that a load that needs part of the box reads and checks only the pieces it
    # needs. Empty for a box of at most one block and in indexes written before them.
    block_bytes: int = 0
    blocks: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def to_dict(self) -> dict[str, Any]:
        out = {"key": self.key, "dtype": self.dtype, "shape": list(self.shape),
               "offsets": list(self.offsets), "sizes": list(self.sizes),
               "start": self.start, "length": self.length, "crc32": f"{self.crc32:08x}"}
        if self.blocks:
            out.update(block_bytes=self.block_bytes, block_crc32=[f"{c:08x}" for c in self.blocks])
        return out


@dataclass
class StagedShard:
    """A box this rank writes: its description and the host copy of its bytes."""

    key: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: torch.Tensor  # contiguous, CPU (pinned for CUDA sources)


def index_json(rank: int, chunks: list[Chunk], size: int, crc: int) -> bytes:
    """A rank's index file: its data file's name, size and CRC, and every box in it."""
    return json.dumps({"format": INDEX_FORMAT, "rank": rank, "data": data_name(rank),
                       "data_size": size, "data_crc32": f"{crc:08x}",
                       "chunks": [c.to_dict() for c in chunks]}, sort_keys=True).encode()


def parse_index(data: bytes, name: str) -> tuple[list[Chunk], int, int]:
    """Parse and validate one rank's index (untrusted JSON from storage).

    Returns:
        (its chunks, its data file's size, that file's CRC-32).

    Raises:
        CheckpointCorruptError: not JSON, wrong format, or a field of the wrong type or range.
    """
    m = _INDEX_RE.fullmatch(name)
    if m is None:
        raise CheckpointCorruptError(f"{name} is not a shard index name")
    try:
        raw = boundedjson.loads(data, what="shard index", max_bytes=MAX_INDEX_BYTES)
    except boundedjson.BoundedJSONError as exc:
        raise CheckpointCorruptError(f"shard index {name} is not valid JSON: {exc}") from None
    return _index_of(raw, name, int(m.group(1)))


def _index_of(raw: object, name: str, rank: int) -> tuple[list[Chunk], int, int]:
    """:func:`parse_index` of the decoded JSON ``raw`` of rank ``rank``'s index ``name``."""
    if not isinstance(raw, dict) or raw.get("format") != INDEX_FORMAT:
        raise CheckpointCorruptError(f"shard index {name} is not an {INDEX_FORMAT} index")
    if raw.get("rank") != rank or raw.get("data") != data_name(rank):
        raise CheckpointCorruptError(f"shard index {name} names rank {raw.get('rank')!r}, "
                                     f"file {raw.get('data')!r}: copied or tampered with")
    chunks = raw.get("chunks")
    if not isinstance(chunks, list):
        raise CheckpointCorruptError(f"shard index {name} has no chunk list")
    if len(chunks) > MAX_CHUNKS_PER_INDEX:
        raise CheckpointCorruptError(
            f"shard index {name} lists {len(chunks)} chunks, over the cap of "
            f"{MAX_CHUNKS_PER_INDEX} (MAX_CHUNKS_PER_INDEX, one per tensor a rank holds): "
            "not an index elasticd wrote; the checkpoint is skipped")
    try:
        rec = codec.from_dict(_IndexRecord, raw, what=f"shard index {name}")
    except codec.RecordDecodeError as exc:
        raise CheckpointCorruptError(f"a chunk is invalid: {exc}") from None
    return [_chunk(c, data_name(rank)) for c in rec.chunks], rec.data_size, int(rec.data_crc32, 16)


def parse_peer_index(data: bytes, what: str) -> tuple[int, int, list[Chunk], int, dict[str, Any]]:
    """A peer's in-memory shard index: a rank's index plus the ``step`` it holds and the
    ``extra`` (non-tensor) state (untrusted JSON from a peer).

    Returns:
        (old rank, step, chunks, data size, extra).

    Raises:
        CheckpointCorruptError: malformed (the field named).
    """
    try:
        body = boundedjson.loads_object(data, what=what, max_bytes=MAX_INDEX_BYTES)
        head = codec.from_dict(_PeerIndexHead, body, what=what)
    except boundedjson.BoundedJSONError as exc:
        raise CheckpointCorruptError(str(exc)) from None
    chunks, size, _ = _index_of(body, index_name(head.rank), head.rank)
    return head.rank, head.step, chunks, size, head.extra


Dim = Annotated[int, codec.Range(0, 1 << 48)]  # a size, offset or byte position
Crc = Annotated[str, codec.Length(8, least=8)]  # 8 lowercase hex digits (checked in __post_init__)
_HEX8 = re.compile(r"[0-9a-f]{8}")


@dataclass(frozen=True)
class _ChunkRecord:
    """A ``chunks`` entry as written (CRCs as hex)."""

    key: Annotated[str, codec.Length(4096)]
    dtype: str
    shape: tuple[Dim, ...]
    offsets: tuple[Dim, ...]
    sizes: tuple[Dim, ...]
    start: Dim
    length: Dim
    crc32: Crc
    block_bytes: Annotated[int, codec.Range(MIN_BLOCK_BYTES, MAX_BLOCK_BYTES, closed=True)] | None = None
    block_crc32: tuple[Crc, ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one elasticd reads")
        if len(self.shape) > 16 or not len(self.shape) == len(self.offsets) == len(self.sizes):
            raise ValueError(f"{self.key}: shape, offsets and sizes differ in rank (or exceed 16)")
        for crc in (self.crc32, *(self.block_crc32 or ())):
            if not _HEX8.fullmatch(crc):
                raise ValueError(f"{self.key}: crc32 {crc!r} is malformed")


@dataclass(frozen=True)
class _IndexRecord:
    """A rank's index file as written (``format``, ``rank`` and ``data`` are checked first)."""

    data_size: Dim
    data_crc32: Crc
    chunks: tuple[_ChunkRecord, ...]

    def __post_init__(self) -> None:
        if not _HEX8.fullmatch(self.data_crc32):
            raise ValueError(f"data_crc32 {self.data_crc32!r} is malformed")


@dataclass(frozen=True)
class _PeerIndexHead:
    """What a peer's in-memory index adds to a rank's index."""

    rank: Annotated[int, codec.Range(0, 1 << 20)]
    step: int
    extra: dict[str, Any]


def _chunk(rec: _ChunkRecord, file: str) -> Chunk:
    key, length = rec.key, rec.length
    if any(o + s > d for o, s, d in zip(rec.offsets, rec.sizes, rec.shape, strict=True)):
        raise CheckpointCorruptError(f"a chunk is invalid: {key}: box {rec.offsets}+{rec.sizes} "
                                     f"lies outside shape {rec.shape}")
    block_bytes = 0
    blocks: tuple[int, ...] = ()
    if rec.block_crc32 is not None:  # per-block CRCs (indexes before them have none)
        need = -(-length // rec.block_bytes) if rec.block_bytes else -1
        if len(rec.block_crc32) != need:
            raise CheckpointCorruptError(f"a chunk is invalid: {key}: block_crc32 is not {need} "
                                         f"CRCs of block_bytes {rec.block_bytes!r}")
        block_bytes, blocks = rec.block_bytes or 0, tuple(int(c, 16) for c in rec.block_crc32)
    chunk = Chunk(key, rec.dtype, rec.shape, rec.offsets, rec.sizes, rec.start, length,
                  int(rec.crc32, 16), file, block_bytes, blocks)
    if length != chunk.numel * DTYPES[rec.dtype].itemsize:
        raise CheckpointCorruptError(f"a chunk is invalid: {key}: {length} bytes for "
                                     f"{chunk.numel} elements of {rec.dtype}")
    return chunk


def check_coverage(chunks: list[Chunk], sizes: Mapping[str, int]) -> dict[str, list[Chunk]]:
    """Group chunks by tensor and check each tensor is covered exactly once.

    Args:
        chunks: every chunk of every rank.
        sizes: data file name -> its size in bytes (byte ranges must lie inside).

    Returns:
        tensor path -> its chunks.

    Raises:
        CheckpointCorruptError: a byte range outside its file, two ranks disagreeing on a
            tensor's shape or dtype, overlapping boxes, or elements no box covers.
    """
    by_key: dict[str, list[Chunk]] = {}
    for c in chunks:
        if c.start + c.length > sizes.get(c.file, -1):
            raise CheckpointCorruptError(f"{c.file}: chunk of {c.key} ends past the file")
        by_key.setdefault(c.key, []).append(c)
    for key, group in by_key.items():
        first = group[0]
        if any(c.shape != first.shape or c.dtype != first.dtype for c in group):
            raise CheckpointCorruptError(f"ranks disagree on the shape or dtype of {key}")
        _check_disjoint(key, [c for c in group if c.numel])
        total = 1
        for d in first.shape:
            total *= d
        covered = sum(c.numel for c in group)
        if covered != total:
            raise CheckpointCorruptError(
                f"{key}: shards cover {covered} of {total} elements (a shard is missing)")
    return by_key


def _check_disjoint(key: str, boxes: list[Chunk]) -> None:
    """Refuse two boxes of one tensor that overlap, in O(n log n) for the grids DTensor makes.

    Every DTensor layout cuts each dimension into intervals and gives each rank one cell of
    that grid: then each box spans two consecutive cut points in every dimension, and two
    boxes overlap exactly when they are the same cell. Anything else is swept along its
    most divided dimension (sorted by start, boxes that ended dropped from a heap), each box
    compared with those still open, at most ``MAX_SWEEP_PAIRS`` pairs. (The old all-pairs
    check took 64 s for 8,000 chunks.)

    Raises:
        CheckpointCorruptError: two boxes overlap, or a non-grid layout too large to check.
    """
    if len(boxes) < 2:
        return
    ndim = len(boxes[0].shape)
    cuts = [sorted({c.offsets[d] for c in boxes} | {c.offsets[d] + c.sizes[d] for c in boxes})
            for d in range(ndim)]
    cells: dict[tuple[int, ...], Chunk] = {}
    for c in boxes:
        cell = tuple(bisect.bisect_left(cuts[d], c.offsets[d]) for d in range(ndim))
        if any(cuts[d][i + 1] != c.offsets[d] + c.sizes[d] for d, i in enumerate(cell)):
            break  # not one grid cell: sweep instead
        if cell in cells:
            raise CheckpointCorruptError(
                f"{key}: boxes in {cells[cell].file} and {c.file} overlap (stored twice)")
        cells[cell] = c
    else:
        return
    _sweep_disjoint(key, boxes, max(range(ndim), key=lambda d: len(cuts[d])))


def _sweep_disjoint(key: str, boxes: list[Chunk], dim: int) -> None:
    pairs = 0
    open_: list[tuple[int, int]] = []  # (end along dim, index), a heap
    ordered = sorted(boxes, key=lambda c: c.offsets[dim])
    for i, b in enumerate(ordered):
        while open_ and open_[0][0] <= b.offsets[dim]:
            heapq.heappop(open_)
        pairs += len(open_)
        if pairs > MAX_SWEEP_PAIRS:
            raise CheckpointCorruptError(
                f"{key}: {len(boxes)} boxes that are not the cells of one grid, too many to "
                f"check (over {MAX_SWEEP_PAIRS} pairs): not a layout elasticd wrote")
        for _, j in open_:
            a = ordered[j]
            if overlap(a.offsets, a.sizes, b.offsets, b.sizes):
                raise CheckpointCorruptError(
                    f"{key}: boxes in {a.file} and {b.file} overlap (stored twice)")
        heapq.heappush(open_, (b.offsets[dim] + b.sizes[dim], i))


def overlap(ao: tuple[int, ...], asz: tuple[int, ...], bo: tuple[int, ...],
             bsz: tuple[int, ...]) -> tuple[tuple[int, int], ...] | None:
    """Per dimension (start, stop) of the intersection of two boxes, None if empty."""
    out = []
    for a0, an, b0, bn in zip(ao, asz, bo, bsz, strict=True):
        lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def fill(target: Any, chunks: list[Chunk], read: Any, where: str, read_into: Any = None,
         read_scratch: Any = None, read_span: Any = None, read_span_into: Any = None) -> Any:
    """A DTensor like ``target`` (same mesh and placements) holding the saved values of
    its box, assembled from every saved chunk that overlaps it.

    Args:
        target: the template DTensor (the new sharding).
        chunks: the saved chunks of this tensor.
        read: ``read(chunk) -> bytes`` (checks the chunk's CRC).
        where: names the checkpoint in errors.
        read_into: optional ``read_into(chunk, buffer)``: the chunk's bytes straight into a
            writable buffer of its length, CRC checked there. Used for a chunk that lies
            whole inside the new box where its place in the box is contiguous (a shard
            along dim 0 gathered by fewer ranks): one read into the new shard, no buffer
            of its own and no copy. The new shard is a fresh tensor, so a corrupt chunk
            written into it harms nothing.
        read_scratch: optional ``read_scratch(chunk) -> buffer`` (CRC checked) valid only
            until its next call: for a chunk that is copied from, not kept.
        read_span: optional ``read_span(chunk, lo, hi) -> buffer``: bytes ``lo:hi`` of a
            chunk with per-block CRCs, read and checked by whole blocks, valid only until
            the next call. Used for a chunk only partly inside the new box: only its rows
            (along dim 0) that overlap the box are read, not the whole chunk.
        read_span_into: optional ``read_span_into(chunk, lo, hi, buffer)``: the same bytes
            straight into a writable buffer of their length (checked there). Used when
            those rows are whole rows of the new box too, contiguous in it (a shard along
            dim 0 regrouped at any world size): no copy.

    Raises:
        CheckpointMismatchError: the saved tensor's shape or dtype differs from the template's.
        CheckpointCorruptError: as ``read``.
    """
    first = chunks[0]
    if tuple(target.shape) != first.shape or DTYPES[first.dtype] != target.dtype:
        raise CheckpointMismatchError(
            f"{where}: {first.key} is {first.dtype}{list(first.shape)} in the checkpoint, "
            f"{str(target.dtype).removeprefix('torch.')}{list(target.shape)} in the model")
    offsets, sizes = box_of(target)
    same = [c for c in chunks if (c.offsets, c.sizes) == (offsets, sizes)]
    if same and same[0].numel:
        # The sharding did not change for this box: the bytes read are the new shard.
        local = _as_tensor(read(same[0]), same[0])
    else:
        local = torch.empty(sizes, dtype=target.dtype)
        for c in chunks if local.numel() else ():
            inter = overlap(offsets, sizes, c.offsets, c.sizes) if c.numel else None
            if inter is None:
                continue
            dst = local[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, offsets, strict=True))]
            if read_into is not None and _whole(inter, c) and dst.is_contiguous():
                read_into(c, tensor_bytes(dst))
                continue
            origin = c.offsets
            if read_span is not None and c.blocks and c.sizes and inter[0][1] - inter[0][0] < c.sizes[0]:
                # Only the rows that overlap: a contiguous run of the box's bytes.
                (lo0, hi0), row = inter[0], c.length // c.sizes[0]
                lo_b, hi_b = (lo0 - c.offsets[0]) * row, (hi0 - c.offsets[0]) * row
                if read_span_into is not None and _whole(inter[1:], c, 1) and dst.is_contiguous():
                    read_span_into(c, lo_b, hi_b, tensor_bytes(dst))
                    continue
                span = read_span(c, lo_b, hi_b)
                saved = _as_tensor(span, c, (hi0 - lo0, *c.sizes[1:]))
                origin = (lo0, *c.offsets[1:])
            else:
                saved = _as_tensor((read_scratch or read)(c), c)
            dst.copy_(saved[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, origin, strict=True))])
    local = local.to(target.to_local().device)
    return DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,
                              shape=target.shape, stride=target.stride())


def _whole(inter: tuple[tuple[int, int], ...], chunk: Chunk, first_dim: int = 0) -> bool:
    """The overlap is the whole chunk (in its dimensions from ``first_dim`` on)."""
    return all(lo == o and hi == o + n for (lo, hi), o, n in
               zip(inter, chunk.offsets[first_dim:], chunk.sizes[first_dim:], strict=True))


def _as_tensor(data: bytes | bytearray | memoryview, chunk: Chunk,
               sizes: tuple[int, ...] | None = None) -> torch.Tensor:
    """The chunk's bytes (or ``sizes`` of them) as a tensor of its box (no copy of a
    bytearray or a writable view)."""
    writable = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
    buf = data if writable else bytearray(data)
    return torch.frombuffer(buf, dtype=DTYPES[chunk.dtype]).view(chunk.sizes if sizes is None else sizes)


def new_chunk(key: str, dtype: torch.dtype, shape: tuple[int, ...], offsets: tuple[int, ...],
              sizes: tuple[int, ...], start: int, data: memoryview, file: str = "") -> Chunk:
    """The index entry of a box about to be written at ``start``: its CRC and, for a box
    over one block, its per-block CRCs (one pass over the bytes for both)."""
    name = str(dtype).removeprefix("torch.")
    if data.nbytes <= BLOCK_BYTES:
        return Chunk(key, name, shape, offsets, sizes, start, data.nbytes, checksum(data), file)
    blocks, whole = block_checksums(data, BLOCK_BYTES)
    return Chunk(key, name, shape, offsets, sizes, start, data.nbytes, whole, file,
                 BLOCK_BYTES, tuple(blocks))


def blocks_agree(chunk: Chunk) -> bool:
    """Do the chunk's block CRCs add up to its CRC (true when it has none)?"""
    return not chunk.blocks or combine_blocks(chunk.blocks, chunk.block_bytes, chunk.length) == chunk.crc32


def blocks_crc(chunk: Chunk, first: int, count: int, data: memoryview) -> None:
    """Check ``data``, read as the chunk's blocks ``first`` to ``first + count``, against
    their CRCs.

    Raises:
        CheckpointCorruptError: the bytes are short or a block's CRC is wrong (names the file).
    """
    bb = chunk.block_bytes
    end = min(chunk.length, (first + count) * bb)
    if first + count > len(chunk.blocks) or data.nbytes != end - first * bb or any(
            checksum(data[i * bb:(i + 1) * bb]) != chunk.blocks[first + i] for i in range(count)):
        raise CheckpointCorruptError(
            f"shard file {chunk.file}: the bytes of {chunk.key} do not match their checksum "
            "(changed after commit)")


def chunk_crc(chunk: Chunk, data: bytes | bytearray | memoryview) -> None:
    """Check a chunk's bytes against its index entry.

    Raises:
        CheckpointCorruptError: wrong length or CRC (names the file).
    """
    if len(data) != chunk.length or checksum(data) != chunk.crc32:
        raise CheckpointCorruptError(
            f"shard file {chunk.file}: the bytes of {chunk.key} do not match their checksum "
            "(changed after commit)")


@dataclass(frozen=True)
class UnfilledShard:
    """In a loaded state, the place of a saved DTensor the template had none for."""

    path: str


def _old_placeholder(keys: list[Any]) -> bool:
    return keys == [_OLD_PLACEHOLDER_KEY]


def place_shards(state: Any, saved: Collection[str], filled: Mapping[str, Any]) -> Any:
    """``state`` (as loaded) with the leaf at each saved DTensor's path replaced by its
    filled DTensor from ``filled``, or by an :class:`UnfilledShard` when there is none."""
    def place(path: str, leaf: Any) -> Any:
        return filled.get(path, UnfilledShard(path)) if path in saved else leaf

    return skeleton.map_leaves(state, place, plain=True, stop_keys=_old_placeholder)


def unfilled(state: Any) -> list[str]:
    """Paths of the saved DTensors still missing from a loaded state (no template DTensor)."""
    return [path for path, leaf in skeleton.leaves_with_paths(state, plain=True)
            if isinstance(leaf, UnfilledShard)]


class ShardTargets:
    """Where each saved DTensor is read into: the template's DTensors by path and, for a
    fresh optimizer (no state yet) over DTensor parameters, its parameters in place of the
    moments it does not have yet.

    A load needs a DTensor of the new sharding for every saved tensor (its box, mesh and
    placements). A fresh optimizer has none for its state; creating it (a step with zero
    gradients, :func:`init_optimizer_state`) allocates and fills twice the model in zeros
    only to be overwritten, most of a resharding load's time on a CPU. A moment shaped and
    typed like its parameter (Adam's, SGD's momentum) has the parameter's sharding, so the
    parameter stands in: the box read becomes the new state tensor, and the optimizer's
    ``load_state_dict`` takes it as its state. A saved state tensor shaped otherwise (a
    factored second moment) creates the optimizer's state the old way, once.

    Args:
        template: the caller's objects by key (as ``CheckpointManager.load_latest``'s).
        resolve: the template -> its state tree (``staging.resolve``).
    """

    def __init__(self, template: Mapping[str, Any], resolve: Any) -> None:
        self._template = template
        self._resolve = resolve
        # A fresh optimizer over DTensors by key, with its parameters in state-dict order.
        self._fresh: dict[str, tuple[torch.optim.Optimizer, list[Any]]] = {}
        for key, value in template.items():
            if isinstance(value, torch.optim.Optimizer) and not value.state:
                params = [p for g in value.param_groups for p in g["params"]]
                if any(is_dtensor(p) for p in params):
                    self._fresh[key] = (value, params)
        self._real = dict(iter_dtensors(resolve(template)))

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        """The DTensor to read the saved tensor ``key`` (of ``shape`` and ``dtype``) into,
        or None when the template has no place for it."""
        target = self._real.get(key)
        if target is not None:
            return target
        for name, (optim, params) in self._fresh.items():
            prefix = f"state[{name!r}]['state']["
            if not key.startswith(prefix):
                continue
            index = key[len(prefix):].split("]", 1)[0]
            if index.isdigit() and int(index) < len(params):
                param = params[int(index)]
                if is_dtensor(param) and tuple(param.shape) == tuple(shape) and param.dtype == dtype:
                    return param
            # Not shaped like its parameter: give this optimizer its real state once.
            init_optimizer_state(optim)
            del self._fresh[name]
            self._real = dict(iter_dtensors(self._resolve(self._template)))
            return self._real.get(key)
        return None


def init_optimizer_state(optim: torch.optim.Optimizer) -> None:
    """Create the state of a fresh optimizer over DTensor parameters (a step with zero
    gradients at learning rate 0, which moves no parameter), so that its state dict holds
    DTensors of the current sharding to load a checkpoint into. No-op when it has state."""
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g["params"] if p.requires_grad]
    if not any(is_dtensor(p) for p in params):
        return
    lrs = [g["lr"] for g in optim.param_groups]
    grads = [p.grad for p in params]
    try:
        for g in optim.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        optim.step()
    finally:
        for g, lr in zip(optim.param_groups, lrs, strict=True):
            g["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
