"""The one reader of untrusted JSON: bounded in size, nesting depth and top-level type.

Why: ``json.loads`` recurses once per nesting level; ``'[' * 100000 + ']' * 100000`` at
``/elasticd/<job>/history`` raised ``RecursionError`` (not a ``ValueError``) out of the rank-0
agent's loop, and the same shape under the size cap broke manifests, the control socket and
the config reader. Every byte elasticd reads from etcd, storage, sockets and its own state
files goes through :func:`loads` (or :func:`loads_object`): the size is checked first, the
depth is measured by a linear scan before anything recursive runs, and the top-level type
is checked after. TOML goes through :func:`check_depth` (the parser has no pre-scan).

Every refusal is a :class:`BoundedJSONError`, a ``ValueError``, so a caller's existing
``except ValueError`` (skip the record, refuse the message) handles it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

DEFAULT_MAX_DEPTH = 32  # elasticd's own documents nest at most 5 deep
# A JSON string (escapes included); brackets inside strings are not structure. The loop is
# possessive and an unterminated string runs to the end of the text, so every match attempt
# that starts at a quote succeeds without backtracking: one linear pass. The backtracking
# form (``"(?:[^"\\]|\\.)*"``) rescanned to the end from every quote of an unterminated
# run of escaped quotes: ``'"' + '\\"' * 32000`` (64 KB) took 23 s of CPU, holding the GIL.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # open: +1, close: -1 (after -1)


class BoundedJSONError(ValueError):
    """Not JSON, or over a bound (size, depth), or of another top-level type."""


class NotRegularFileError(BoundedJSONError):
    """A path to read is a FIFO, a device or a directory (reading it could block forever)."""


def _as_bytes(data: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8", "surrogatepass")
    return bytes(data)


def depth_of(data: bytes) -> int:
    """The deepest container nesting of a JSON text (1 for ``{}``), in one linear scan.

    Brackets inside strings do not count. For invalid JSON the number is an upper bound.
    """
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    opens = len(brackets) - brackets.count(b"]") - brackets.count(b"}")
    if opens <= 1:
        return opens
    return max(accumulate(v - 1 for v in brackets.translate(_STEP)))


def loads(data: bytes | bytearray | memoryview | str, *, what: str, max_bytes: int,
          max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Decode one untrusted JSON document within bounds.

    Args:
        data: the bytes (or text) as read.
        what: what it is, for the error (``"history record"``, ``"manifest"``).
        max_bytes: the most bytes accepted (UTF-8 length for text).
        max_depth: the deepest container nesting accepted.

    Returns:
        The decoded value.

    Raises:
        BoundedJSONError: larger than ``max_bytes``, nested deeper than ``max_depth``, not
            UTF-8 or not JSON.
    """
    raw = _as_bytes(data)
    if len(raw) > max_bytes:
        raise BoundedJSONError(f"{what}: {len(raw)} bytes, over the {max_bytes}-byte limit")
    depth = depth_of(raw)
    if depth > max_depth:
        raise BoundedJSONError(f"{what}: nested {depth} deep, deeper than {max_depth}")
    try:
        return json.loads(raw)
    except RecursionError:  # not reachable within max_depth; kept as a ValueError anyway
        raise BoundedJSONError(f"{what}: nested too deep") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise BoundedJSONError(f"{what}: not JSON ({exc})") from None


def read_file(path: str | os.PathLike[str], *, max_bytes: int,
              follow_symlinks: bool = True) -> bytes:
    """Read a regular file of at most ``max_bytes`` without blocking on a FIFO or a device.

    The file is opened non-blocking and checked with ``fstat`` before any read: a FIFO as a
    config file or a ``manifest.json`` used to hang its reader forever.

    Raises:
        OSError: it cannot be opened or read (missing, no permission, a directory:
            ``IsADirectoryError``).
        NotRegularFileError: not a regular file.
        BoundedJSONError: larger than ``max_bytes``.
    """
    # follow_symlinks=False: a file another user may plant (the control dir's markers
    # under workers.user) is read only if it is itself a regular file (ELOOP otherwise).
    nofollow = 0 if follow_symlinks else os.O_NOFOLLOW
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | nofollow)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "Is a directory", os.fspath(path))
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(f"{os.fspath(path)!r} is not a regular file (a FIFO, a "
                                      "socket or a device); point at a regular file")
        if st.st_size > max_bytes:
            raise BoundedJSONError(f"{os.fspath(path)!r} is {st.st_size} bytes, over the "
                                   f"{max_bytes}-byte limit")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise BoundedJSONError(f"{os.fspath(path)!r} is larger than {max_bytes} bytes")
    return data


def load_file(path: str | os.PathLike[str], *, what: str, max_bytes: int,
              max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """:func:`loads` of a file read with :func:`read_file`.

    Raises:
        OSError: as :func:`read_file`.
        BoundedJSONError: as :func:`read_file` and :func:`loads`.
    """
    return loads(read_file(path, max_bytes=max_bytes), what=what, max_bytes=max_bytes,
                 max_depth=max_depth)


def loads_object(data: bytes | bytearray | memoryview | str, *, what: str, max_bytes: int,
                 max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    """:func:`loads`, and the document must be a JSON object.

    Raises:
        BoundedJSONError: as :func:`loads`, or the value is not an object.
    """
    value = loads(data, what=what, max_bytes=max_bytes, max_depth=max_depth)
    if not isinstance(value, dict):
        raise BoundedJSONError(f"{what}: a JSON {type(value).__name__}, not an object")
    return value


def check_depth(value: object, *, what: str, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
    """Refuse a decoded value (e.g. parsed TOML) nested deeper than ``max_depth``.

    Walks iteratively, so a deep value cannot overflow the stack here.

    Raises:
        BoundedJSONError: a container nested deeper than ``max_depth``.
    """
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterator[object]
        if isinstance(item, dict):
            children = iter(item.values())
        elif isinstance(item, (list, tuple)):
            children = iter(item)
        else:
            continue
        if depth > max_depth:
            raise BoundedJSONError(f"{what}: nested deeper than {max_depth}")
        stack.extend((child, depth + 1) for child in children)
