"""fsspec storage of one job's checkpoints: the thin I/O layer under the manager and the CLI.

Layout (``<url>`` any fsspec URL)::

    <url>/<job>/step-<step:012d>/<save_id>/state.pt        data (torch.save, weights_only-loadable)
    <url>/<job>/step-<step:012d>/<save_id>/manifest.json   written last: the commit

Only names that parse (``step-<12 digits>``, ``<13 digits>-<8 hex>``, plain file names
listed in a verified manifest) are ever turned back into paths, and always below the
job's directory, so nothing read from storage can point a read or a delete elsewhere.

Object stores have no atomic rename, so there is none here: each save owns a fresh
directory, the manifest is created with ``mode="xb"`` (create-only; S3 If-None-Match)
after every data file, and a reader that finds no verifying manifest skips the directory.
Checksums (CRC-32) are computed while writing and checked while reading, in one pass.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elasticd import boundedjson
from elasticd.checkpoint.api import CheckpointCorruptError, CheckpointUnreadableError
from elasticd.checkpoint.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    checksum,
    parse_save_id,
    parse_step_dir,
    step_dir_name,
)
from elasticd.errors import ConfigError
from elasticd.keys import JOB_NAME_RE, validate_job_name
from elasticd.sensitive import redact_url

READ_CHUNK = 16 << 20
# Local (file://) checkpoints are private to the agent's user: the model and the optimizer
# are the job's most valuable bytes (docs/security.md, shared filesystems).
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
# A write the storage refused for good (a config error), not one it failed to answer.
REFUSED_WRITES = (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                  FileExistsError)
REFUSED_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT})
# Errors that name a problem with one path, not with the storage as a whole: retrying does
# not help, so readers skip that save (path named) instead of failing the whole load.
_PATH_ERRORS = (PermissionError, IsADirectoryError, NotADirectoryError)


# Beside a save's manifest: the first loss after a restore from it was not finite
# (elasticd/checkpoint/first_loss.py). Readers skip the save; retention treats it as any other.
SUSPECT_NAME = "suspect.json"


class CheckpointVanishedError(CheckpointCorruptError):
    """A file disappeared while being read: most likely pruned under a slow reader.

    Readers list again instead of falling back, since a newer checkpoint exists.
    """


@dataclass(frozen=True)
class ListedSave:
    """A save directory as listed: names parsed, file sizes from the listing.

    ``dirs`` are entries of the save directory that are directories where only files
    belong (``manifest.json/``): such a save cannot be read, and is never pruned.
    """

    step: int
    save_id: str
    created_at: float
    files: Mapping[str, int]
    dirs: frozenset[str] = frozenset()

    @property
    def has_manifest(self) -> bool:
        return MANIFEST_NAME in self.files

    @property
    def size(self) -> int:
        return sum(self.files.values())


class _HashingWriter:
    """File-like writer that counts and CRCs every byte on its way to ``f``.

    ``torch.save`` writes each tensor's storage in one call, so the checksum costs one
    pass over memory that is already in cache and never a re-read of the file.
    """

    def __init__(self, f: Any) -> None:
        self._f = f
        self.size = 0
        self.crc = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.crc = checksum(view, self.crc)
        self._f.write(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


def open_filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """Open ``url`` with fsspec: (filesystem, root path without a trailing slash).

    Raises:
        ConfigError: unknown protocol, or its fsspec backend is not installed.
    """
    if "://" in url and "@" in urlsplit(url).netloc:
        raise ConfigError(f"checkpoint URL {redact_url(url)!r} has credentials in it "
                          "(user:secret@); pass them through the storage's own configuration "
                          "(AWS_* variables, ~/.aws, an instance role, or storage_options)")
    opts = dict(storage_options or {})
    protocol = fsspec.utils.get_protocol(url)
    if protocol in ("file", "local"):
        # Local writes into a new directory need auto_mkdir, object stores have no dirs.
        opts.setdefault("auto_mkdir", True)
    try:
        fs, root = fsspec.core.url_to_fs(url, **opts)
    except (ImportError, ValueError) as exc:
        raise ConfigError(
            f"checkpoint URL {url!r} cannot be opened ({exc}); use file://, memory://, "
            "s3:// (pip install 'elasticd[s3]') or gs:// (pip install gcsfs)"
        ) from exc
    return fs, root.rstrip("/")


def list_jobs(url: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Names of the jobs with a directory under ``url`` (names that are valid job names)."""
    fs, root = open_filesystem(url, storage_options)
    fs.invalidate_cache(root)
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return []
    names = (e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")
    return sorted(n for n in names if JOB_NAME_RE.fullmatch(n) and n not in (".", ".."))


class FsspecCheckpointStore:
    """Reads, writes, lists and deletes the checkpoints of one job through fsspec.

    Args:
        url: root URL (``file:///shared/ckpt``, ``s3://bucket/ckpt``, ``memory://t``).
        job: job name; checkpoints live under ``<url>/<job>/``.
        storage_options: passed to the fsspec filesystem (e.g. ``endpoint_url``).

    Raises:
        ConfigError: bad job name or URL.
    """

    def __init__(self, url: str, job: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.job = validate_job_name(job)
        self.fs, self.root = open_filesystem(url, storage_options)
        self.job_path = f"{self.root}/{job}"
        # Canonical URLs (what the fence pointer holds) come from fsspec, so "/x" and
        # "file:///x" name the same checkpoint.
        self.job_url = f"{self.fs.unstrip_protocol(self.root).rstrip('/')}/{job}"
        self.is_local = isinstance(self.fs, LocalFileSystem)

    # names ---------------------------------------------------------------------------
    def save_path(self, step: int, save_id: str) -> str:
        return f"{self.job_path}/{step_dir_name(step)}/{save_id}"

    def save_url(self, step: int, save_id: str) -> str:
        return f"{self.job_url}/{step_dir_name(step)}/{save_id}"

    def manifest_url(self, step: int, save_id: str) -> str:
        return f"{self.save_url(step, save_id)}/{MANIFEST_NAME}"

    def parse_manifest_url(self, url: str) -> tuple[int, str] | None:
        """(step, save_id) of a manifest URL of this job, None for anything else."""
        prefix = f"{self.job_url}/"
        if not url.startswith(prefix):
            return None
        parts = url[len(prefix):].split("/")
        if len(parts) != 3 or parts[2] != MANIFEST_NAME:
            return None
        step = parse_step_dir(parts[0])
        if step is None or parse_save_id(parts[1]) is None:
            return None
        return step, parts[1]

    # writing -------------------------------------------------------------------------
    def write_file(self, step: int, save_id: str, name: str,
                   write: Callable[[_HashingWriter], None]) -> FileEntry:
        """Create ``name`` in the save's directory; ``write`` streams the bytes into it.

        Returns:
            The file's entry (size and CRC computed while writing).
        """
        path = f"{self.save_path(step, save_id)}/{name}"
        if not self.is_local:
            with self.fs.open(path, "wb") as f:
                writer = _HashingWriter(f)
                write(writer)
            return FileEntry(name=name, size=writer.size, crc32=writer.crc)
        self._make_private_dirs(self.save_path(step, save_id))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            writer = _HashingWriter(f)
            write(writer)
            f.flush()
            os.fsync(f.fileno())
        return FileEntry(name=name, size=writer.size, crc32=writer.crc)

    def _make_private_dirs(self, path: str) -> None:
        """Create the missing directories down to ``path``, each 0700 (local storage).

        Why: under umask 022 the step directories were 0755 and the files 0644, and another
        local user read a running job's model and optimizer. Existing directories (the
        root an operator made) are left as they are.
        """
        missing = []
        while not os.path.isdir(path):
            missing.append(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        for level in reversed(missing):
            try:
                os.mkdir(level, PRIVATE_DIR_MODE)
            except FileExistsError:
                pass  # another rank made it at the same moment

    def probe_writable(self) -> None:
        """Create and remove one small file in the job's directory: can this job save here?

        Why: an unwritable checkpoint URL used to be found at the first save, after the
        workers had trained (every attempt wasted); the agent probes it before any starts.

        Raises:
            ConfigError: the storage refused the write (permissions, a read-only file
                system, a path through a file, a missing bucket): one line naming the URL.
            Exception: anything else (a storage that does not answer) is the caller's to
                judge: it may be transient.
        """
        path = f"{self.job_path}/.elasticd-probe-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            if self.is_local:
                self._make_private_dirs(self.job_path)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                             PRIVATE_FILE_MODE)
                os.close(fd)
                os.unlink(path)
            else:
                with self.fs.open(path, "wb") as f:
                    f.write(b"elasticd write probe\n")
                self.fs.rm(path)
        except OSError as exc:
            if not (isinstance(exc, REFUSED_WRITES) or exc.errno in REFUSED_ERRNOS):
                raise
            raise ConfigError(
                f"checkpoint URL {redact_url(self.job_url)} is not writable: creating "
                f"{redact_url(path)} failed ({type(exc).__name__}: {exc.strerror or exc}); make "
                "it writable for the workers' user or pass --checkpoint-url to a place that "
                "is") from exc

    def publish_file(self, step: int, save_id: str, name: str, data: bytes) -> FileEntry:
        """Write a small file so that a reader sees it whole or not at all (a shard index,
        which the writing rank waits for), as the manifest is written.

        Returns:
            Its entry (size, CRC).
        """
        save_path = self.save_path(step, save_id)
        final = f"{save_path}/{name}"
        entry = FileEntry(name=name, size=len(data), crc32=checksum(data))
        if not self.is_local:
            with self.fs.open(final, "wb") as f:  # one PUT: whole or absent
                f.write(data)
            return entry
        self._make_private_dirs(save_path)
        tmp = f"{final}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        return entry

    def read_small(self, step: int, save_id: str, name: str, max_bytes: int) -> bytes:
        """Read a small file of a save whole (at most ``max_bytes``).

        Raises:
            FileNotFoundError: not there (yet).
            CheckpointCorruptError: over ``max_bytes``.
            CheckpointUnreadableError: permission denied, or a directory.
        """
        path = f"{self.save_path(step, save_id)}/{name}"
        try:
            if self.is_local:
                data = boundedjson.read_file(path, max_bytes=max_bytes)
            else:
                data = self.fs.cat_file(path, start=0, end=max_bytes + 1)
        except boundedjson.BoundedJSONError as exc:
            raise CheckpointCorruptError(f"{name}: {exc}") from None
        except _PATH_ERRORS as exc:
            raise self._unreadable(path, exc) from None
        if len(data) > max_bytes:
            raise CheckpointCorruptError(f"{name} is over {max_bytes} bytes: not one elasticd wrote")
        return bytes(data)

    def read_range(self, step: int, save_id: str, name: str, start: int, length: int) -> bytearray:
        """``length`` bytes of data file ``name`` from ``start`` (one ranged GET), writable
        (the loaded tensor keeps the buffer: no second copy); shorter at the file's end.

        Raises:
            CheckpointVanishedError: the file is gone (pruned while we read).
            CheckpointUnreadableError: permission denied, or a directory.
        """
        buf = bytearray(length)
        n = self.read_range_into(step, save_id, name, start, memoryview(buf))
        return buf if n == length else buf[:n]

    def read_range_into(self, step: int, save_id: str, name: str, start: int, buf: memoryview) -> int:
        """Up to ``len(buf)`` bytes of data file ``name`` from ``start``, into ``buf`` (local
        files straight from the page cache; remote ones through one ranged GET and a copy).
        Returns how many were read: fewer at the file's end, the rest of ``buf`` as it was
        (a chunk's CRC then fails).

        Raises:
            CheckpointVanishedError: the file is gone (pruned while we read).
            CheckpointUnreadableError: permission denied, or a directory.
        """
        path = f"{self.save_path(step, save_id)}/{name}"
        try:
            if self.is_local:
                with open(path, "rb", buffering=0) as f:
                    f.seek(start)
                    at = 0
                    while at < len(buf) and (n := f.readinto(buf[at:])):
                        at += n
                return at
            data = self.fs.cat_file(path, start=start, end=start + len(buf))
            at = min(len(data), len(buf))
            buf[:at] = data[:at]
            return at
        except FileNotFoundError:
            raise CheckpointVanishedError(f"data file {name} disappeared while reading") from None
        except _PATH_ERRORS as exc:
            raise self._unreadable(path, exc) from None

    def write_manifest(self, manifest: Manifest) -> str:
        """Write the manifest (create-only) after all data: this commits the checkpoint.

        Returns:
            The manifest URL.

        Raises:
            FileExistsError: a manifest already exists for this save id (never by design).
        """
        save_path = self.save_path(manifest.step, manifest.save_id)
        final = f"{save_path}/{MANIFEST_NAME}"
        if not self.is_local:
            # One PUT: an object appears whole or not at all; "xb" is If-None-Match on S3.
            with self.fs.open(final, "xb") as f:
                f.write(manifest.to_json())
            return self.manifest_url(manifest.step, manifest.save_id)
        # A local file is visible while being written; a hard link publishes it whole and,
        # like "xb", fails if the name exists. Readers would skip a torn one anyway, but
        # this keeps their logs free of half-written manifests.
        tmp = f"{final}.{os.getpid()}.tmp"
        self._make_private_dirs(save_path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, final)
        finally:
            os.unlink(tmp)
        # The directory entry must reach the disk too, or a crash could lose the manifest
        # of a checkpoint the fence already points at.
        fd = os.open(save_path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return self.manifest_url(manifest.step, manifest.save_id)

    # reading -------------------------------------------------------------------------
    def list_saves(self) -> list[ListedSave]:
        """Every save directory of the job, newest step first (one recursive listing).

        Paths that do not parse as ``step-*/<save_id>/<file>`` are ignored.
        """
        self.fs.invalidate_cache(self.job_path)
        try:
            found = self.fs.find(self.job_path, detail=True, withdirs=True)
        except FileNotFoundError:
            return []
        groups: dict[tuple[int, str], dict[str, int]] = {}
        dirs: dict[tuple[int, str], set[str]] = {}
        prefix = f"{self.job_path}/"
        for path, info in found.items():
            if not path.startswith(prefix):
                continue
            parts = path.rstrip("/")[len(prefix):].split("/")
            if len(parts) != 3:
                continue
            step = parse_step_dir(parts[0])
            if step is None or parse_save_id(parts[1]) is None:
                continue
            files = groups.setdefault((step, parts[1]), {})
            if info.get("type") == "directory":
                dirs.setdefault((step, parts[1]), set()).add(parts[2])
            else:
                files[parts[2]] = int(info.get("size") or 0)
        saves = [ListedSave(step, sid, parse_save_id(sid) or 0.0, files,
                            frozenset(dirs.get((step, sid), ())))
                 for (step, sid), files in groups.items()]
        saves.sort(key=lambda s: (s.step, s.created_at, s.save_id), reverse=True)
        return saves

    def read_manifest(self, step: int, save_id: str) -> Manifest:
        """Read and verify one manifest, and check it names its own directory and job.

        At most ``MAX_MANIFEST_BYTES + 1`` bytes are read (one ranged GET on object
        stores), so an oversized object is refused without being fetched whole.

        Raises:
            CheckpointCorruptError: missing, oversized, undecodable, or not this directory's
                manifest.
            CheckpointUnreadableError: permission denied, or the manifest is a directory.
            OSError: the storage failed (transient: callers fail the load, never skip).
        """
        path = f"{self.save_path(step, save_id)}/{MANIFEST_NAME}"
        try:
            if isinstance(self.fs, LocalFileSystem):
                # Not fsspec's open: a FIFO planted as manifest.json blocked it forever.
                data = boundedjson.read_file(path, max_bytes=MAX_MANIFEST_BYTES)
            else:
                data = self.fs.cat_file(path, start=0, end=MAX_MANIFEST_BYTES + 1)
        except boundedjson.BoundedJSONError as exc:  # not a regular file, or oversized
            raise CheckpointCorruptError(f"{MANIFEST_NAME}: {exc}; not one elasticd wrote") from None
        except FileNotFoundError:
            raise CheckpointCorruptError("no manifest (save torn or still in flight)") from None
        except _PATH_ERRORS as exc:
            raise self._unreadable(path, exc) from None
        manifest = Manifest.from_json(data, where=self.fs.unstrip_protocol(path))
        if manifest.step != step or manifest.save_id != save_id:
            raise CheckpointCorruptError(
                f"manifest is for step {manifest.step} save {manifest.save_id}, not its "
                f"directory (step {step} save {save_id}): copied or tampered with"
            )
        return manifest

    def read_verified(self, step: int, save_id: str, entry: FileEntry) -> bytes:
        """Read a data file whole (one GET on object stores), checking its size and CRC.

        Raises:
            CheckpointVanishedError: the file is gone (pruned while we read).
            CheckpointCorruptError: wrong size or checksum.
        """
        path = self._data_path(step, save_id, entry)
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            raise CheckpointVanishedError(f"data file {entry.name} disappeared while reading") from None
        except _PATH_ERRORS as exc:
            raise self._unreadable(path, exc) from None
        _check(entry, len(data), checksum(data))
        return data

    def verify_file(self, step: int, save_id: str, entry: FileEntry) -> None:
        """Stream a data file through the CRC without keeping it in memory.

        Reading the next chunk overlaps the CRC of the previous one (zlib releases the
        GIL), so a cold read costs about max(disk, CRC) rather than their sum.

        Raises:
            CheckpointVanishedError, CheckpointCorruptError: as :meth:`read_verified`.
        """
        chunk = min(READ_CHUNK, max(entry.size, 1))
        buffers = (bytearray(chunk), bytearray(chunk))
        crc = [0]
        size, turn = 0, 0
        pending: threading.Thread | None = None

        def crc_of(view: memoryview) -> None:
            crc[0] = checksum(view, crc[0])

        try:
            with self.fs.open(self._data_path(step, save_id, entry), "rb") as f:
                while True:
                    view = memoryview(buffers[turn])
                    n = f.readinto(view)
                    if pending is not None:
                        pending.join()  # CRCs stay in file order; frees the other buffer
                    if not n:
                        break
                    pending = threading.Thread(target=crc_of, args=(view[:n],), daemon=True)
                    pending.start()
                    size += n
                    turn = 1 - turn
        except FileNotFoundError:
            raise CheckpointVanishedError(f"data file {entry.name} disappeared while reading") from None
        except _PATH_ERRORS as exc:
            raise self._unreadable(self._data_path(step, save_id, entry), exc) from None
        finally:
            if pending is not None:
                pending.join()
        _check(entry, size, crc[0])

    def unreadable_reason(self, save: ListedSave) -> str | None:
        """Why the listing alone shows ``save`` cannot be read (a directory where a file
        belongs), naming the path; None otherwise."""
        if not save.dirs:
            return None
        name = sorted(save.dirs)[0]
        return (f"{self.save_url(save.step, save.save_id)}/{name} is a directory where a file "
                "belongs: skipped and never pruned; remove or rename it")

    def suspect_reason(self, save: ListedSave) -> str | None:
        """Why ``save`` is not loaded when a refused restore marked it suspect, else None."""
        if SUSPECT_NAME not in save.files:
            return None
        return (f"marked suspect: the first loss after loading it was not finite (see "
                f"{self.save_url(save.step, save.save_id)}/{SUSPECT_NAME}); delete that file "
                "to load it again")

    def mark_suspect(self, step: int, save_id: str, reason: str) -> None:
        """Mark a save suspect (``suspect.json`` with ``reason``): no reader loads it again."""
        data = json.dumps({"reason": reason[:2000], "at": time.time()}).encode()
        self.publish_file(step, save_id, SUSPECT_NAME, data)

    def _unreadable(self, path: str, exc: OSError) -> CheckpointUnreadableError:
        return CheckpointUnreadableError(
            f"{self.fs.unstrip_protocol(path)} cannot be read ({type(exc).__name__}: "
            f"{exc.strerror or exc}): skipped and never pruned; fix its permissions or move it")

    def local_path(self, step: int, save_id: str, entry: FileEntry) -> str | None:
        """The OS path of a data file on a local (or mounted shared) disk, else None."""
        return self._data_path(step, save_id, entry) if self.is_local else None

    def _data_path(self, step: int, save_id: str, entry: FileEntry) -> str:
        # entry.name passed Manifest's plain-file-name check: it cannot leave the directory.
        return f"{self.save_path(step, save_id)}/{entry.name}"

    # deleting ------------------------------------------------------------------------
    def delete_save(self, step: int, save_id: str) -> None:
        """Delete a save: the manifest first (the checkpoint vanishes from readers at once),
        then its data. Missing files are not an error (another pruner got there first)."""
        save_path = self.save_path(step, save_id)
        try:
            self.fs.rm_file(f"{save_path}/{MANIFEST_NAME}")
        except FileNotFoundError:
            pass
        try:
            self.fs.rm(save_path, recursive=True)
        except FileNotFoundError:
            pass
        if self.is_local:
            try:
                os.rmdir(f"{self.job_path}/{step_dir_name(step)}")
            except OSError:
                pass  # another save of this step still lives there


def _check(entry: FileEntry, size: int, crc: int) -> None:
    if size != entry.size:
        raise CheckpointCorruptError(
            f"data file {entry.name} is {size} bytes, manifest says {entry.size} (truncated?)")
    if crc != entry.crc32:
        raise CheckpointCorruptError(
            f"data file {entry.name} checksum mismatch (crc32 {crc:08x}, manifest "
            f"{entry.crc32:08x}): bytes changed after commit")


def listing_problem(manifest: Manifest, listed: ListedSave) -> str | None:
    """Why a committed manifest cannot be loaded judging by the listing alone, else None.

    Catches deleted and truncated data files without reading them.
    """
    for entry in manifest.files:
        size = listed.files.get(entry.name)
        if size is None:
            return f"data file {entry.name} is missing"
        if size != entry.size:
            return f"data file {entry.name} is {size} bytes, manifest says {entry.size} (truncated?)"
    return None

