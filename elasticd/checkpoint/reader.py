"""The two halves of a load: which checkpoints to try (rank 0), and reading one (every rank).

``CheckpointManager.load_latest`` runs the protocol between them: rank 0 walks
:func:`candidates` and broadcasts each; every rank runs :func:`read_state` and reports its
outcome; the worst outcome over all ranks decides (skip, list again, fail, or apply).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from elasticd.checkpoint import shards
from elasticd.checkpoint.api import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointUnreadableError,
)
from elasticd.checkpoint.identity import RunIdentity, refusal
from elasticd.checkpoint.manifest import STATE_FILE, Manifest, checksum
from elasticd.checkpoint.restore import deserialize, deserialize_file
from elasticd.checkpoint.staging import RESERVED_KEY
from elasticd.checkpoint.store import (
    CheckpointVanishedError,
    FsspecCheckpointStore,
    listing_problem,
)
from elasticd.records import CheckpointPointer

# Outcome of one rank reading one candidate, ordered so that the worst (max) wins. Only
# CORRUPT (decode, CRC, size) and UNREADABLE (one path: permission, a directory) skip to an
# older checkpoint; FAILED (storage error, out of memory) fails the load loudly.
# MISMATCH: a sharded tensor does not fit the template (a changed model): raised, not skipped.
OK, CORRUPT, UNREADABLE, VANISHED, FAILED, MISMATCH = 0, 1, 2, 3, 4, 5


def candidates(
    store: FsspecCheckpointStore,
    pointer: CheckpointPointer | None,
    skip: Callable[..., None],
    log: Any,
    identity: RunIdentity | None = None,
) -> Iterator[tuple[str, str, Manifest] | tuple[str]]:
    """Yield ``("try", manifest_url, manifest)`` newest first, skipping (``skip(url,
    reason)``; ``suspect=True`` for a save a refused restore marked) what the listing and
    the manifest alone show to be unusable.

    With a pointer, it comes first and only older checkpoints follow: anything newer, or
    another save of its step, was never committed. A pointer that is not a checkpoint of
    this job (the URL changed since) or of another run is ignored with a warning, and the
    listing decides. This run's saves come first; another run's follow only with
    ``resume="require"`` (see :mod:`elasticd.checkpoint.identity`).

    Raises:
        CheckpointMismatchError: a verified manifest belongs to another job.
        ForeignCheckpointError: ``resume="auto"`` and only another run's checkpoints exist.
        OSError: storage failed (the load fails; nothing is skipped because of it).
    """
    identity = identity or RunIdentity()
    listed = {(s.step, s.save_id): s for s in store.list_saves()}
    skipped_here = False

    def skip_one(url: str, reason: str, **how: bool) -> None:
        nonlocal skipped_here
        skipped_here = True
        skip(url, reason, **how)

    order = sorted(listed, key=lambda k: (k[0], listed[k].created_at, k[1]), reverse=True)
    if pointer is not None and identity.run_id and pointer.run_id not in ("", identity.run_id):
        log.warning("checkpoint_pointer_ignored", pointer=pointer.manifest_url,
                    reason=f"committed by run {pointer.run_id}, not this run {identity.run_id}")
        pointer = None
    if pointer is not None:
        key = store.parse_manifest_url(pointer.manifest_url)
        if key is None:
            log.warning("checkpoint_pointer_ignored", pointer=pointer.manifest_url,
                        reason=f"not a checkpoint under {store.job_url}")
        else:
            for k in order:
                if k[0] > key[0] or (k[0] == key[0] and k != key):
                    skip_one(store.manifest_url(*k), f"not committed by the fence (pointer is step "
                                                 f"{key[0]}): zombie or refused upload")
            order = [key] + [k for k in order if k[0] < key[0]]
    foreign: list[tuple[str, Manifest]] = []
    for step, save_id in order:
        url = store.manifest_url(step, save_id)
        save = listed.get((step, save_id))
        if save is None:
            skip_one(url, "pointed to by the fence but missing from storage")
            continue
        suspect = store.suspect_reason(save)
        if suspect:
            skip_one(url, suspect, suspect=True)
            continue
        try:
            problem = store.unreadable_reason(save)
            if problem:
                raise CheckpointUnreadableError(problem)
            manifest = store.read_manifest(step, save_id)
            problem = listing_problem(manifest, save)
            if problem:
                raise CheckpointCorruptError(problem)
        except (CheckpointCorruptError, CheckpointUnreadableError) as exc:
            skip_one(url, str(exc))
            continue
        if manifest.job != store.job:
            raise CheckpointMismatchError(
                f"checkpoint {url} belongs to job {manifest.job!r}, not {store.job!r}: it was "
                f"copied here or the job name changed; move it or load with job={manifest.job!r}")
        if not identity.owns(manifest.run_id):
            foreign.append((url, manifest))
            continue
        yield ("try", url, manifest)
    if foreign and identity.resume == "require":
        # Deliberate resume of another run: its newest valid save, once ours are exhausted.
        for url, manifest in foreign:
            log.info("checkpoint_resuming_other_run", url=url, run_id=manifest.run_id,
                     step=manifest.step)
            yield ("try", url, manifest)
    elif foreign and identity.resume == "auto":
        newest = foreign[0][1]
        raise refusal(store.job_url, newest.run_id, newest.step, identity.run_id)
    # Every candidate was unusable. If the listing changed meanwhile (a concurrent prune
    # deleted what we were about to read, or a new save landed), look again rather than
    # report "no checkpoint": a reader must never start from scratch because of a prune.
    if skipped_here and {(x.step, x.save_id) for x in store.list_saves()} != set(listed):
        yield ("relist",)


def read_shard_index(store: FsspecCheckpointStore,
                     manifest: Manifest) -> dict[str, list[shards.Chunk]]:
    """Every rank's shard index of a sharded checkpoint, checked against the manifest's
    sizes and CRCs, and its coverage (every element stored exactly once).

    Raises:
        CheckpointCorruptError: an index or the coverage is wrong (names the file).
        CheckpointVanishedError: an index is gone.
    """
    entries = {f.name: f for f in manifest.files}
    chunks: list[shards.Chunk] = []
    for name in manifest.shards:
        entry = entries[name]
        try:
            data = store.read_small(manifest.step, manifest.save_id, name, shards.MAX_INDEX_BYTES)
        except FileNotFoundError:
            raise CheckpointVanishedError(f"shard index {name} disappeared while reading") from None
        if len(data) != entry.size or checksum(data) != entry.crc32:
            raise CheckpointCorruptError(f"shard index {name} does not match its checksum")
        found, size, crc = shards.parse_index(data, name)
        bin_entry = entries.get(found[0].file if found else "")
        if found and (bin_entry is None or (bin_entry.size, bin_entry.crc32) != (size, crc)):
            raise CheckpointCorruptError(f"shard index {name} and the manifest disagree on its data file")
        chunks += found
    return shards.check_coverage(chunks, {f.name: f.size for f in manifest.files})


class ShardReads:
    """The ranged reads of one sharded checkpoint's data files, each checked against the
    CRCs its index gives, in the forms ``shards.fill`` takes.

    A chunk copied from, not kept, is read into one buffer reused for every such chunk, so
    that only its first use pays the first touch of new memory (~2 GB/s here, against ~10
    GB/s once touched). One only partly inside the new box is read by its blocks (its rows
    that overlap, rounded out to whole blocks) when it has block CRCs, else whole, since
    then its one CRC covers all of it.
    """

    def __init__(self, store: FsspecCheckpointStore, step: int, save_id: str) -> None:
        self._store, self._step, self._save_id = store, step, save_id
        self._scratch = bytearray()

    def _range_into(self, c: shards.Chunk, at: int, buf: memoryview) -> int:
        return self._store.read_range_into(self._step, self._save_id, c.file, c.start + at, buf)

    def _scratch_view(self, n: int) -> memoryview:
        if len(self._scratch) < n:
            self._scratch = bytearray(n)
        return memoryview(self._scratch)[:n]

    def read(self, c: shards.Chunk) -> bytearray:
        """The chunk's bytes in a buffer of their own (kept: the new shard)."""
        data = self._store.read_range(self._step, self._save_id, c.file, c.start, c.length)
        shards.chunk_crc(c, data)
        return data

    def read_into(self, c: shards.Chunk, buf: memoryview) -> None:
        """The chunk's bytes into ``buf`` (its length), checked there."""
        shards.chunk_crc(c, buf[:self._range_into(c, 0, buf)])

    def read_scratch(self, c: shards.Chunk) -> memoryview:
        """The chunk's bytes in the scratch buffer (valid until the next read)."""
        view = self._scratch_view(c.length)
        self.read_into(c, view)
        return view

    def read_span(self, c: shards.Chunk, lo: int, hi: int) -> memoryview:
        """Bytes ``lo:hi`` of a chunk with block CRCs, read and checked by whole blocks
        through the scratch buffer (valid until the next read)."""
        first, stop = lo // c.block_bytes, -(-hi // c.block_bytes)
        a, b = first * c.block_bytes, min(c.length, stop * c.block_bytes)
        view = self._scratch_view(b - a)
        n = self._range_into(c, a, view)
        shards.blocks_crc(c, first, stop - first, view[:n])
        return view[lo - a:hi - a]

    def read_span_into(self, c: shards.Chunk, lo: int, hi: int, buf: memoryview) -> None:
        """Bytes ``lo:hi`` of a chunk with block CRCs into ``buf``: the whole blocks inside
        straight into it, the partial one at each end through the scratch buffer (its CRC
        needs all of it)."""
        bb, at = c.block_bytes, lo
        while at < hi:
            block = at // bb
            end = min(hi, (block + 1) * bb)
            if at == block * bb and (end - at == bb or end == c.length):
                stop = len(c.blocks) if hi == c.length else hi // bb
                end = min(c.length, stop * bb)
                part = buf[at - lo:end - lo]
                shards.blocks_crc(c, block, stop - block, part[:self._range_into(c, at, part)])
            else:
                buf[at - lo:end - lo] = self.read_span(c, at, end)
            at = end

    def fill(self, target: Any, chunks: list[shards.Chunk], where: str) -> Any:
        """``shards.fill`` of ``target`` with these reads."""
        return shards.fill(target, chunks, self.read, where, self.read_into, self.read_scratch,
                           self.read_span, self.read_span_into)


def _fill_shards(store: FsspecCheckpointStore, manifest: Manifest, state: Any,
                 targets: shards.ShardTargets | None) -> Any:
    """Put the saved DTensors back in the state, in the template's sharding."""
    by_key = read_shard_index(store, manifest)
    where = f"checkpoint step {manifest.step}"
    reads = ShardReads(store, manifest.step, manifest.save_id)
    filled = {}
    for key, chunks in by_key.items():
        target = None if targets is None else targets.get(key, chunks[0].shape, shards.DTYPES[chunks[0].dtype])
        if target is not None:
            filled[key] = reads.fill(target, chunks, where)
    return shards.place_shards(state, by_key.keys(), filled)


def read_state(store: FsspecCheckpointStore, manifest: Manifest,
               mapped: bool, targets: shards.ShardTargets | None = None) -> tuple[int, str | None, Any]:
    """Verify every file of ``manifest`` and deserialize the state.

    Args:
        store: where the checkpoint is.
        manifest: the candidate (already verified by rank 0).
        mapped: verify by streaming, then memory-map the state file (local disks, when a
            template will take the tensors); else read each file whole, load from memory.
        targets: the template's DTensors (``shards.ShardTargets``): a sharded checkpoint's tensors are read
            into their sharding (only the saved boxes that overlap this rank's, each checked
            against its own CRC; other ranks' files are not read whole).

    Returns:
        (outcome, reason or None, state or None); never raises.
    """
    state = None
    skip = {e.name for e in manifest.files if e.name.startswith("shards-r")} if manifest.shards else set()
    try:
        for entry in manifest.files:
            if entry.name in skip:
                continue
            if mapped:
                store.verify_file(manifest.step, manifest.save_id, entry)
            else:
                data = store.read_verified(manifest.step, manifest.save_id, entry)
                if entry.name == STATE_FILE:
                    state = deserialize(data, entry.name)
        state_entry = next((e for e in manifest.files if e.name == STATE_FILE), None)
        path = store.local_path(manifest.step, manifest.save_id, state_entry) if state_entry else None
        if mapped and path is not None:
            state = deserialize_file(path, STATE_FILE)
        if not isinstance(state, dict) or not isinstance(state.get(RESERVED_KEY), dict):
            raise CheckpointCorruptError(f"{STATE_FILE} is missing or is not a checkpoint state")
        if manifest.shards:
            state = _fill_shards(store, manifest, state, targets)
    except (CheckpointVanishedError, FileNotFoundError) as exc:
        return VANISHED, str(exc) or "a data file disappeared while reading", None
    except CheckpointMismatchError as exc:
        return MISMATCH, str(exc), None
    except CheckpointCorruptError as exc:
        return CORRUPT, str(exc), None
    except CheckpointUnreadableError as exc:
        return UNREADABLE, str(exc), None
    except Exception as exc:  # noqa: BLE001 - storage errors, MemoryError: report, don't skip
        # (ConfigError from a too-old torch lands here too and fails the load, as it must.)
        return FAILED, repr(exc), None
    return OK, None, state
