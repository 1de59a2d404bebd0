"""Live re-formation over the control directory: the agent's order and the workers' reports.

The agent and its live workers talk through small files in the private runtime directory
(the same place as the drain and stopped markers). Every file holds one typed message of
``messages.py`` (:class:`~elasticd.control.messages.LiveRegistration`,
:class:`~elasticd.control.messages.ParkedReport`,
:class:`~elasticd.control.messages.ReformedReport`, :class:`ReformOrder`), written
atomically (rename) and parsed and validated on read (a torn or hostile file reads as
absent):

- ``live-<local_rank>`` (worker, ``LiveRegistration``): this worker re-forms in place; the
  agent does not kill it on a membership change.
- ``park`` (agent): leave the process group at the next agreed step (a node joins).
- ``parked-<local_rank>`` (worker, ``ParkedReport``): it left its group (``reason``) after
  step ``step`` of round ``round`` and waits for an order.
- ``reform.json`` (agent): a :class:`ReformOrder`.
- ``reformed-<local_rank>`` (worker, ``ReformedReport``): it is training in the order's round.

Why files and not the control socket: the order must stay where a blocked worker finds
it. A worker stuck in a collective with a frozen peer (its main thread in C++, no Python
handler runs) is woken by its watcher thread, which finds ``reform.json`` by one read and
aborts the old group; a worker that parks later, or restarts its wait, reads the same
order again: a message on a socket would be consumed once, by whichever thread read it.
The workers' reports are state, not events (the agent's tick asks "are all parked?"
whenever it runs, across its own restarts of the round), so they are files too, one per
local rank, replaced atomically.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from elasticd import boundedjson
from elasticd.control.api import LIVE_PREFIX, PARKED_PREFIX, REFORM_FILE, REFORMED_PREFIX
from elasticd.control.messages import (
    LiveRegistration,
    LiveReport,
    MessageError,
    ParkedReport,
    ReformedReport,
    parse_live_report,
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

    round: int
    world_size: int
    master_addr: str
    master_port: int
    ranks: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"round": self.round, "world_size": self.world_size,
                           "master_addr": self.master_addr, "master_port": self.master_port,
                           "ranks": {str(k): v for k, v in self.ranks.items()}})

    @classmethod
    def from_json(cls, text: str | bytes) -> ReformOrder:
        """Parse and validate an order.

        Raises:
            ValueError: not an order (a field missing, of the wrong type or out of bounds).
        """
        obj = boundedjson.loads_object(text, what="re-formation order", max_bytes=MAX_FILE_BYTES)

        def whole(v: object, lo: int, hi: int, name: str) -> int:
            if type(v) is not int or not lo <= v < hi:
                raise ValueError(f"{name} = {v!r} is not an int in [{lo}, {hi})")
            return v

        world = whole(obj.get("world_size"), 1, MAX_WORLD, "world_size")
        ranks_raw = obj.get("ranks")
        if not isinstance(ranks_raw, dict):
            raise ValueError("ranks must be an object")
        ranks = {whole(int(k), 0, MAX_WORLD, "local rank"): whole(v, 0, world, "rank")
                 for k, v in ranks_raw.items()}
        addr = obj.get("master_addr")
        if not isinstance(addr, str) or not 0 < len(addr) <= 255:
            raise ValueError("master_addr must be a host name")
        return cls(round=whole(obj.get("round"), 0, 2**62, "round"), world_size=world,
                   master_addr=addr, master_port=whole(obj.get("master_port"), 1, 65536, "master_port"),
                   ranks=ranks)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.rename(path)


def write_order(control_dir: Path, order: ReformOrder) -> None:
    """Publish ``order`` to the node's live workers (atomic)."""
    _write_atomic(control_dir / REFORM_FILE, order.to_json())


def read_order(control_dir: Path) -> ReformOrder | None:
    """The current order, or None (absent, torn, or invalid)."""
    try:
        return ReformOrder.from_json(boundedjson.read_file(control_dir / REFORM_FILE,
                                                           max_bytes=MAX_FILE_BYTES))
    except (OSError, ValueError):
        return None


def write_marker(control_dir: Path, prefix: str, local_rank: int, **fields: object) -> None:
    """Write ``<prefix><local_rank>`` with ``fields`` as JSON (atomic): the stopped marker."""
    _write_atomic(control_dir / f"{prefix}{local_rank}", json.dumps(fields))


_PREFIX: dict[type, str] = {LiveRegistration: LIVE_PREFIX, ParkedReport: PARKED_PREFIX,
                            ReformedReport: REFORMED_PREFIX}
R = TypeVar("R", LiveRegistration, ParkedReport, ReformedReport)


def write_report(control_dir: Path, report: LiveReport) -> None:
    """Publish a worker's report as ``<kind>-<local_rank>`` (atomic, replaces the last one)."""
    _write_atomic(control_dir / f"{_PREFIX[type(report)]}{report.local_rank}",
                  serialise(report).decode())


def clear_report(control_dir: Path, kind: type[LiveReport], local_rank: int) -> None:
    """Withdraw one worker's report of ``kind`` (absent already is fine)."""
    (control_dir / f"{_PREFIX[kind]}{local_rank}").unlink(missing_ok=True)


def clear_reports(control_dir: Path, kind: type[LiveReport]) -> None:
    """Withdraw every report of ``kind`` (a new worker group, a finished re-formation)."""
    for p in control_dir.glob(_PREFIX[kind] + "*"):
        p.unlink(missing_ok=True)


def read_reports(control_dir: Path, kind: type[R]) -> dict[int, R]:
    """``{local_rank: report}`` of every valid report of ``kind``; a file that does not
    parse, is of another kind, or names another local rank than its file reads as absent."""
    prefix = _PREFIX[kind]
    out: dict[int, R] = {}
    for p in control_dir.glob(prefix + "*"):
        suffix = p.name[len(prefix):]
        if not suffix.isdigit():
            continue  # e.g. a temporary file of an atomic write
        try:
            raw = boundedjson.read_file(p, max_bytes=MAX_FILE_BYTES)
            boundedjson.loads(raw, what=p.name, max_bytes=MAX_FILE_BYTES)  # size, depth
            report = parse_live_report(raw)
        except (OSError, ValueError, MessageError):
            continue
        if isinstance(report, kind) and report.local_rank == int(suffix):
            out[report.local_rank] = report
    return out


def live_workers(control_dir: Path) -> dict[int, LiveRegistration]:
    """Workers registered for live re-formation."""
    return read_reports(control_dir, LiveRegistration)


def parked(control_dir: Path) -> dict[int, ParkedReport]:
    """Parked workers."""
    return read_reports(control_dir, ParkedReport)


def reformed(control_dir: Path) -> dict[int, ReformedReport]:
    """Re-formed workers."""
    return read_reports(control_dir, ReformedReport)
