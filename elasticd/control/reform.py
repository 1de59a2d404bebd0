"""Live re-formation over the control directory: the agent's order and the workers' answers.

The agent and its live workers talk through small files in the private runtime directory
(the same place as the drain and stopped markers), because a worker waiting for a new
round must find the order even if it was stuck in a collective when it was written, and
the agent must see a parked worker without a socket round trip per tick:

- ``live-<rank>`` (worker): this worker re-forms in place; the agent does not kill it on a
  membership change.
- ``park`` (agent): leave the process group at the next agreed step (a node joins).
- ``parked-<local_rank>`` (worker): it left its group (``reason``: ``collective_failed`` or
  ``agreed_stop``) after step ``step`` of round ``round`` and waits for an order.
- ``reform.json`` (agent): a :class:`ReformOrder`, written atomically (rename).
- ``reformed-<local_rank>`` (worker): it is training in the order's round.

Every file is validated on read (a torn or hostile file reads as absent).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticd import boundedjson
from elasticd.control.api import PARKED_PREFIX, REFORM_FILE, REFORMED_PREFIX

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

        def whole(v: Any, lo: int, hi: int, name: str) -> int:
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


def write_marker(control_dir: Path, prefix: str, local_rank: int, **fields: Any) -> None:
    """Write ``<prefix><local_rank>`` with ``fields`` as JSON (atomic)."""
    _write_atomic(control_dir / f"{prefix}{local_rank}", json.dumps(fields))


def read_markers(control_dir: Path, prefix: str) -> dict[int, dict[str, Any]]:
    """``{local_rank: fields}`` of every valid ``<prefix><n>`` marker."""
    out: dict[int, dict[str, Any]] = {}
    for p in control_dir.glob(prefix + "*"):
        suffix = p.name[len(prefix):]
        if not suffix.isdigit():
            continue
        try:
            data = boundedjson.read_file(p, max_bytes=MAX_FILE_BYTES) or b"{}"
            fields = boundedjson.loads(data, what=p.name, max_bytes=MAX_FILE_BYTES)
        except (OSError, ValueError):
            continue
        if isinstance(fields, dict):
            out[int(suffix)] = fields
    return out


def parked(control_dir: Path) -> dict[int, dict[str, Any]]:
    """Parked workers: ``{local_rank: {"round", "step", "reason"}}``."""
    return read_markers(control_dir, PARKED_PREFIX)


def reformed(control_dir: Path) -> dict[int, dict[str, Any]]:
    """Re-formed workers: ``{local_rank: {"round"}}``."""
    return read_markers(control_dir, REFORMED_PREFIX)
