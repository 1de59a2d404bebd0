"""ElasticStream: streaming (iterable) datasets over shards, resharded exactly once.

A streaming dataset is a list of shards (files or objects under an fsspec URL) read in
order; nothing is indexable at random, so :class:`~elasticd.data.sampler.ElasticSampler`
does not apply. The same model does, on the concatenation of the shards: the epoch is a
stream of global positions ``0 .. N-1`` (position ``p`` is sample ``offset`` of shard
``shard``, :func:`locate`), step ``s`` trains the global batch ``[p0 + s*G, p0 + (s+1)*G)``
and a rank trains a contiguous slice of it (:func:`~elasticd.data.sharding.rank_share`).
The state is the global position after the last *trained* sample (with its ``(shard,
offset)`` for humans), so after a resize the remaining samples are dealt again, each
exactly once, and a rank opens the shard of its first sample at that sample's offset.

A shard's format decides how that offset is reached: :class:`FixedRecordFormat` seeks
(``offset * record_bytes``, O(1)); :class:`JsonLinesFormat` reads and drops lines from
the start of the shard. Shard sizes (samples) are given up front, as a manifest would.

The last global batch of an epoch may be partial (``drop_last=False``, the default): it is
split by the same rule, so a rank may get fewer samples, or none when fewer samples than
ranks remain; every sample of the epoch is trained exactly once.

Items are whole steps: the stream yields one ``collate(samples)`` per optimizer step (use
``DataLoader(stream, batch_size=None, num_workers=k)``); DataLoader worker ``w`` of ``k``
produces steps ``w, w+k, ...`` of this rank, which the DataLoader returns in step order.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any, Protocol

import fsspec
import structlog
from torch.utils.data import IterableDataset, get_worker_info

from elasticd.data.positions import SampleKey
from elasticd.data.sampler import _world_from_torch
from elasticd.data.sharding import check_split, rank_share
from elasticd.errors import ConfigError

log = structlog.get_logger(__name__)

STATE_KIND = "elasticd.stream"
STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard: its fsspec URL and how many samples it holds."""

    url: str
    num_samples: int


class ShardFormat(Protocol):
    """How samples are laid out in a shard file (opened in binary mode)."""

    def skip(self, f: IO[bytes], count: int, *, at_start: bool) -> None:
        """Move forward ``count`` samples (``at_start``: the file was just opened)."""

    def read(self, f: IO[bytes]) -> Any:
        """Read and decode the next sample."""


@dataclasses.dataclass(frozen=True)
class FixedRecordFormat:
    """Samples of ``record_bytes`` bytes each (tokenised sequences, packed tensors): seekable.

    Attributes:
        record_bytes: Size of one sample.
        decode: ``bytes -> sample`` (default: the raw bytes).
    """

    record_bytes: int
    decode: Callable[[bytes], Any] | None = None

    def skip(self, f: IO[bytes], count: int, *, at_start: bool) -> None:
        if count:
            f.seek(count * self.record_bytes, 1)

    def read(self, f: IO[bytes]) -> Any:
        raw = f.read(self.record_bytes)
        if len(raw) != self.record_bytes:
            raise ConfigError(f"shard ended inside a record ({len(raw)} of {self.record_bytes} "
                              "bytes): its num_samples is larger than the file; fix the shard list")
        return self.decode(raw) if self.decode is not None else raw


@dataclasses.dataclass(frozen=True)
class JsonLinesFormat:
    """One JSON document per line; reaching an offset reads the lines before it."""

    def skip(self, f: IO[bytes], count: int, *, at_start: bool) -> None:
        for _ in range(count):
            f.readline()

    def read(self, f: IO[bytes]) -> Any:
        line = f.readline()
        if not line:
            raise ConfigError("shard ended before its num_samples lines; fix the shard list")
        return json.loads(line)


def locate(cumulative: Sequence[int], position: int) -> tuple[int, int]:
    """``(shard, offset)`` of a global position, given the shards' cumulative ends.

    Args:
        cumulative: ``cumulative[i]`` = samples in shards ``0..i`` (non-decreasing).
        position: ``0 <= position < cumulative[-1]``.

    Returns:
        The shard holding it (empty shards are skipped) and the sample's offset in it.
    """
    shard = bisect.bisect_right(cumulative, position)
    return shard, position - (cumulative[shard - 1] if shard else 0)


def step_slices(total: int, global_batch_size: int, start: int, world_size: int, rank: int,
                drop_last: bool) -> Iterator[tuple[int, int]]:
    """This rank's ``[a, b)`` position range for each remaining step from ``start``.

    Full global batches are split by :func:`rank_share`; the partial last one (kept unless
    ``drop_last``) is split by the same rule over its actual size.
    """
    pos = start
    while pos < total:
        size = min(global_batch_size, total - pos)
        if size < global_batch_size and drop_last:
            return
        off, share = rank_share(size, world_size, rank)
        yield pos + off, pos + off + share
        pos += size


class _Cursor:
    """Reads positions in increasing order, reusing the open shard when moving forward."""

    def __init__(self, shards: Sequence[Shard], cumulative: Sequence[int], fmt: ShardFormat,
                 storage_options: Mapping[str, Any]) -> None:
        self._shards, self._cum, self._fmt = shards, cumulative, fmt
        self._options = storage_options
        self._shard = -1
        self._next = 0
        self._byte = 0
        self._file: Any = None

    def read(self, a: int, b: int) -> Iterator[tuple[int, Any]]:
        pos = a
        while pos < b:
            shard, offset = locate(self._cum, pos)
            if shard != self._shard or offset < self._next:
                self.close()
                self._file = fsspec.open(self._shards[shard].url, "rb", **self._options).open()
                self._file.seek(0)
                self._shard, self._next = shard, 0
                self._fmt.skip(self._file, offset, at_start=True)
            else:
                # Some filesystems (memory://) hand every opener the same file object, so
                # another reader may have moved it: return to where this cursor stopped.
                self._file.seek(self._byte)
                self._fmt.skip(self._file, offset - self._next, at_start=False)
            end = min(b, self._cum[shard])
            for p in range(pos, end):
                yield p, self._fmt.read(self._file)
            self._next = offset + (end - pos)
            self._byte = self._file.tell()
            pos = end

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._shard = -1


class ElasticStream(IterableDataset[Any]):
    """This rank's steps of a sharded stream, from the last trained position on.

    Loop duties as with ``ElasticSampler``: iterate a fresh ``iter()`` per epoch (and after
    ``load_state_dict``), call :meth:`step` after every optimizer step, save
    :meth:`state_dict` with the checkpoint.

    Args:
        shards: The shards in reading order, with their sample counts.
        global_batch_size: Samples per optimizer step over all ranks.
        num_replicas: World size (default: torch.distributed's, else 1).
        rank: This rank (default: torch.distributed's, else 0).
        format: A :class:`ShardFormat` (default :class:`JsonLinesFormat`).
        collate: ``list of samples -> batch`` for one step's share (default: the list).
        transform: Optional ``transform(sample, key)`` with the sample's
            :class:`~elasticd.data.positions.SampleKey` (index = position), for per-sample
            seeds (``key.generator()``).
        seed: Seed for ``transform``'s keys.
        drop_last: Drop a partial last global batch instead of splitting it.
        storage_options: Passed to fsspec.

    Raises:
        ConfigError: No samples, a negative shard size, or a global batch smaller than the
            world size.
    """

    def __init__(self, shards: Sequence[Shard], *, global_batch_size: int,
                 num_replicas: int | None = None, rank: int | None = None,
                 format: ShardFormat | None = None,
                 collate: Callable[[list[Any]], Any] | None = None,
                 transform: Callable[[Any, SampleKey], Any] | None = None, seed: int = 0,
                 drop_last: bool = False, storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        if any(s.num_samples < 0 for s in shards):
            raise ConfigError("a shard has a negative num_samples; fix the shard list")
        self.shards = list(shards)
        self.cumulative: list[int] = []
        total = 0
        for s in self.shards:
            total += s.num_samples
            self.cumulative.append(total)
        if total == 0:
            raise ConfigError("ElasticStream needs at least one sample; the shard list is empty")
        self.total = total
        self.num_replicas, self.rank = _world_from_torch(num_replicas, rank)
        check_split(global_batch_size, self.num_replicas)
        self.global_batch_size = global_batch_size
        self.format: ShardFormat = format or JsonLinesFormat()
        self.collate = collate
        self.transform = transform
        self.seed = seed
        self.drop_last = drop_last
        self.storage_options = dict(storage_options or {})
        self.epoch = 0
        self.samples_trained = 0

    @property
    def steps_remaining(self) -> int:
        """Optimizer steps left in the epoch."""
        left = self.total - self.samples_trained
        if left <= 0:
            return 0
        return left // self.global_batch_size if self.drop_last else -(-left // self.global_batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; the current one keeps its (possibly resumed) position."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self.samples_trained = epoch, 0

    def step(self, num_steps: int = 1) -> None:
        """Record ``num_steps`` trained global batches.

        Raises:
            RuntimeError: Fewer steps left in the epoch.
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if num_steps > self.steps_remaining:
            raise RuntimeError(f"stream.step({num_steps}) with {self.steps_remaining} step(s) "
                               f"left in epoch {self.epoch}; set_epoch(next) starts the next")
        self.samples_trained = min(self.total, self.samples_trained + num_steps * self.global_batch_size)

    def iter_steps(self) -> Iterator[list[Any]]:
        """Every remaining step's samples for this rank (all DataLoader workers' steps)."""
        return self._steps(worker=0, num_workers=1)

    def __iter__(self) -> Iterator[Any]:
        """This rank's remaining steps, one collated item per step, split over workers."""
        info = get_worker_info()
        worker, count = (info.id, info.num_workers) if info is not None else (0, 1)
        collate = self.collate
        for samples in self._steps(worker, count):
            yield collate(samples) if collate is not None else samples

    def _steps(self, worker: int, num_workers: int) -> Iterator[list[Any]]:
        cursor = _Cursor(self.shards, self.cumulative, self.format, self.storage_options)
        slices = step_slices(self.total, self.global_batch_size, self.samples_trained,
                             self.num_replicas, self.rank, self.drop_last)
        try:
            for i, (a, b) in enumerate(slices):
                if i % num_workers != worker:
                    continue
                out = []
                for pos, sample in cursor.read(a, b):
                    if self.transform is not None:
                        sample = self.transform(sample, SampleKey(pos, pos, self.epoch, self.seed))
                    out.append(sample)
                yield out
        finally:
            cursor.close()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: the position after the last trained sample."""
        last = self.samples_trained - 1
        shard, offset = locate(self.cumulative, last) if last >= 0 else (None, None)
        return {"kind": STATE_KIND, "version": STATE_VERSION, "epoch": self.epoch,
                "samples_trained": self.samples_trained, "last_trained_shard": shard,
                "last_trained_offset": offset, "shard_sizes": [s.num_samples for s in self.shards],
                "global_batch_size": self.global_batch_size, "world_size": self.num_replicas}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after the saved position at this world size.

        Raises:
            ConfigError: Not a stream state, or another shard layout (the position would
                name other samples).
        """
        if not isinstance(state, Mapping) or state.get("kind") != STATE_KIND:
            raise ConfigError("state is not an ElasticStream state_dict(); pass the entry it saved")
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"stream state version {state.get('version')!r} is not supported")
        sizes = [s.num_samples for s in self.shards]
        if list(state.get("shard_sizes") or []) != sizes:
            raise ConfigError("stream state was saved over another shard list (sizes differ); "
                              "resume with the same shards in the same order")
        self.epoch, self.samples_trained = int(state["epoch"]), int(state["samples_trained"])
        log.info("stream_state_loaded", epoch=self.epoch, samples_trained=self.samples_trained,
                 last_trained_shard=state.get("last_trained_shard"),
                 last_trained_offset=state.get("last_trained_offset"),
                 saved_world_size=state.get("world_size"), world_size=self.num_replicas,
                 rank=self.rank)
