"""Live re-formation's protocol pieces: the agent's order, the workers' reports, the stopped file.

- ``reform.json`` (agent, :class:`ReformOrder`, written atomically): the new round's ranks
  and bootstrap address. A file, because the order must stay where a blocked worker finds
  it: a worker stuck in a collective with a frozen peer (its main thread in C++, no Python
  handler runs) is woken by its watcher thread, which reads the order and aborts the old
  group; a worker that parks later, or restarts its wait, reads the same order again. The
  socket only says *when* to read it (:class:`OrderBoard`, ``AwaitOrder``), so no worker
  polls the file.
- The workers' live reports (``LiveRegistration``, ``ParkedReport``, ``ReformedReport``)
  are typed messages over the control socket, each acknowledged; the agent keeps the
  latest of each kind per local rank (:class:`WorkerReports`): they are state, asked by
  every tick ("are all parked?"), across the agent's own restarts of the round.
- ``park`` (agent): leave the process group at the next agreed step (a node joins); one
  ``stat`` per step, beside the drain file.
- ``stopped-<rank>`` (worker, :class:`~elasticd.control.messages.StoppedReport`): see there.

Every file is parsed and validated on read (a torn or hostile file reads as absent).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, TypeVar

from elasticd import boundedjson, codec
from elasticd.control.api import REFORM_FILE, STOPPED_PREFIX
from elasticd.control.messages import (
    LiveRegistration,
    LiveReport,
    MessageError,
    ParkedReport,
    ReformedReport,
    StoppedReport,
    parse_stopped,
    serialise,
)

MAX_WORLD = 2**20
MAX_FILE_BYTES = 1 << 20  # an order or a marker is a few hundred bytes


@dataclass(frozen=True)
class ReformOrder:
    """The new round, as one node's agent tells its live workers.

    Attributes:
        round: the rendezvous round the workers re-form into.
        world_size: global world size of the new round.
        master_addr: host of the new round's TCPStore (hosted by the new global rank 0).
        master_port: its port.
        ranks: global rank of each local rank of this node.
    """

    round: Annotated[int, codec.Range(0, 2**62)]
    world_size: Annotated[int, codec.Range(1, MAX_WORLD)]
    master_addr: Annotated[str, codec.Length(255, least=1)]
    master_port: Annotated[int, codec.Range(1, 65536)]
    ranks: dict[Annotated[int, codec.Range(0, MAX_WORLD)], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = {local: rank for local, rank in self.ranks.items() if not 0 <= rank < self.world_size}
        if bad:
            raise ValueError(f"ranks {bad} are outside [0, world_size={self.world_size})")

    def to_json(self) -> str:
        # The wire form since the first release: local ranks as decimal-string keys.
        return json.dumps(codec.encode(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> ReformOrder:
        """Parse and validate an order (elasticd.codec: the field types are the schema).

        Raises:
            ValueError: not an order (a field missing, of the wrong type or out of bounds,
                named).
        """
        return codec.decode(cls, text, what="re-formation order", max_bytes=MAX_FILE_BYTES)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, safe in a directory workers may write.

    The control directory is shared with the workers' group under ``workers.user``
    (``ControlChannel.share_with``): the temporary file is a fresh random name created
    with ``O_EXCL`` (``mkstemp``: a name planted in advance, a symlink included, is never
    opened), and ``rename`` replaces the name without following what it names. Readable by
    the workers (0644 in a directory only the agent and that group can enter).
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), 0o644)
            fh.write(text)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_order(control_dir: Path, order: ReformOrder) -> None:
    """Publish ``order`` to the node's live workers (atomic)."""
    write_atomic(control_dir / REFORM_FILE, order.to_json())


def read_order(control_dir: Path) -> ReformOrder | None:
    """The current order, or None (absent, torn, or invalid)."""
    try:
        return ReformOrder.from_json(boundedjson.read_file(control_dir / REFORM_FILE,
                                                           max_bytes=MAX_FILE_BYTES))
    except (OSError, ValueError):
        return None


def write_stopped(control_dir: Path, report: StoppedReport) -> None:
    """Write ``stopped-<rank>`` (atomic): this worker exits 0 without finishing its script."""
    write_atomic(control_dir / f"{STOPPED_PREFIX}{report.rank}", serialise(report).decode())


def clear_stopped(control_dir: Path, rank: int) -> None:
    """Withdraw this worker's stopped report (it stays: a live re-formation)."""
    (control_dir / f"{STOPPED_PREFIX}{rank}").unlink(missing_ok=True)


def read_stopped(control_dir: Path) -> dict[int, StoppedReport]:
    """``{rank: report}`` of every valid stopped report; a file that does not parse, or
    names another rank than its file, reads as absent."""
    out: dict[int, StoppedReport] = {}
    for p in control_dir.glob(STOPPED_PREFIX + "*"):
        suffix = p.name[len(STOPPED_PREFIX):]
        if not suffix.isdigit():
            continue  # e.g. a temporary file of an atomic write
        try:
            raw = boundedjson.read_file(p, max_bytes=MAX_FILE_BYTES, follow_symlinks=False)
            boundedjson.loads(raw, what=p.name, max_bytes=MAX_FILE_BYTES)  # size, depth
            report = parse_stopped(raw)
        except (OSError, ValueError, MessageError):
            continue
        if report.rank == int(suffix):
            out[report.rank] = report
    return out


R = TypeVar("R", LiveRegistration, ParkedReport, ReformedReport)


class WorkerReports:
    """The latest live report of each kind per local rank, as the workers sent them (thread-safe).

    A worker is parked or re-formed, not both: a ``ReformedReport`` withdraws its rank's
    ``ParkedReport`` and a ``ParkedReport`` its ``ReformedReport``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_kind: dict[type, dict[int, LiveReport]] = {}

    def put(self, report: LiveReport) -> None:
        with self._lock:
            self._by_kind.setdefault(type(report), {})[report.local_rank] = report
            other = {ParkedReport: ReformedReport, ReformedReport: ParkedReport}.get(type(report))
            if other is not None:
                self._by_kind.get(other, {}).pop(report.local_rank, None)

    def get(self, kind: type[R]) -> dict[int, R]:
        """``{local_rank: report}`` of ``kind``."""
        with self._lock:
            return {r: rep for r, rep in self._by_kind.get(kind, {}).items() if isinstance(rep, kind)}

    def clear(self, kind: type[LiveReport]) -> None:
        """Forget every report of ``kind`` (a new worker group, a finished re-formation)."""
        with self._lock:
            self._by_kind.pop(kind, None)


class OrderBoard:
    """The newest re-formation order's round, and a wait for a newer one (thread-safe)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._round = -1

    def published(self, rnd: int) -> None:
        """An order for ``rnd`` is in ``reform.json``: wake every wait for an older one."""
        with self._cond:
            self._round = max(self._round, rnd)
            self._cond.notify_all()

    def reset(self) -> None:
        """A new worker group: no order (``reform.json`` removed)."""
        with self._cond:
            self._round = -1

    def wait_newer(self, after_round: int, timeout_s: float) -> int:
        """The newest order's round once it is after ``after_round``, or at the timeout."""
        with self._cond:
            self._cond.wait_for(lambda: self._round > after_round, timeout=timeout_s)
            return self._round
