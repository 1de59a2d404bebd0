"""JSON records elasticd keeps in etcd, shared by the agent (writer) and `elasticd status` (reader).

Each record is a frozen dataclass with ``to_json``/``from_json``. Unknown fields are
ignored on read so an older CLI can read a newer agent's records. Times are Unix
seconds (float) in etcd; the status CLI renders them as RFC 3339 UTC.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T", bound="_Record")

# Node states, as written by the agent into its node record.
NODE_STATES = ("joining", "training", "restarting", "draining", "stopped", "failed")
# Round phases of the rendezvous state record.
ROUND_PHASES = ("open", "final")
# Event kinds appended to /elasticd/<job>/events/.
EVENT_KINDS = (
    "join",  # a node joined a round
    "leave",  # a node left explicitly (drain)
    "lost",  # a node's lease expired (killed, frozen, partitioned)
    "failure",  # a worker failed (exit code or signal)
    "restart",  # a node restarted its worker group (cause in detail)
    "drain",  # a drain started (reason: signal, notice)
    "resize",  # a join: members drain their workers at a step boundary, then re-form
    "notice",  # a spot/preemption notice was received
    "hang",  # no progress for hang_timeout
    "round",  # a round completed (world size in detail)
    "lease_lost",  # this node found its own lease gone (zombie) and is rejoining
    "finished",  # the job's workers all succeeded
)


class _Record:
    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)  # type: ignore[call-overload]

    @classmethod
    def from_json(cls: type[T], data: bytes | str) -> T:
        raw = json.loads(data)
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in raw.items() if k in known})


@dataclass(frozen=True)
class NodeRecord(_Record):
    """``/elasticd/<job>/nodes/<node>``: one per live agent, on its lease."""

    node: str
    host: str
    pid: int
    version: str
    started_at: float
    state: str = "joining"
    round: int = -1
    ranks: list[int] = field(default_factory=list)
    restarts: int = 0
    heartbeat_at: float = 0.0
    local_world_size: int = 0
    last_exit: str | None = None


@dataclass(frozen=True)
class RoundState(_Record):
    """``/elasticd/<job>/rdzv/state``: the current round, changed only by txn on mod_revision."""

    round: int
    phase: str  # "open" | "final"
    members: list[str] = field(default_factory=list)  # rank order once final
    min_nodes: int = 1
    max_nodes: int = 1
    opened_at: float = 0.0
    completed_at: float | None = None


@dataclass(frozen=True)
class Progress(_Record):
    """``/elasticd/<job>/progress``: written by the agent of group rank 0, fenced by round."""

    round: int
    step: int
    epoch: int = 0
    samples_trained: int = 0
    samples_per_s: float = 0.0
    world_size: int = 0
    updated_at: float = 0.0


@dataclass(frozen=True)
class CheckpointPointer(_Record):
    """``/elasticd/<job>/checkpoint/latest``: the newest committed checkpoint (fenced CAS).

    ``high_water`` is the highest step ever committed for the job: the pointer may move
    back to a lower step (a new round resuming from an older checkpoint), and retention
    must never delete a save at or above it. ``run_id`` is the run that committed it.
    Both are carried forward by :meth:`successor`, inside the same compare-and-swap.
    """

    step: int
    round: int
    manifest_url: str
    committed_at: float
    world_size: int = 0
    high_water: int = -1
    run_id: str = ""

    @property
    def highest_step(self) -> int:
        """The highest step ever committed (records written before ``high_water``: step)."""
        return max(self.high_water, self.step)

    @classmethod
    def successor(cls, previous: CheckpointPointer | None, *, step: int, round_: int,
                  manifest_url: str, committed_at: float, world_size: int = 0,
                  run_id: str = "") -> CheckpointPointer:
        """The pointer a commit writes over ``previous``, with the high-water step carried.

        Args:
            previous: the pointer read for the compare-and-swap (None: first commit).
            step, round_, manifest_url, committed_at, world_size: the new commit.
            run_id: the committing run ("" if unknown).
        """
        high = step if previous is None else max(previous.highest_step, step)
        return cls(step=step, round=round_, manifest_url=manifest_url,
                   committed_at=committed_at, world_size=world_size, high_water=high,
                   run_id=run_id)


@dataclass(frozen=True)
class Event(_Record):
    """``/elasticd/<job>/events/<seq>``: one entry of the bounded event history."""

    time: float
    kind: str
    node: str
    round: int
    message: str
    detail: dict[str, Any] = field(default_factory=dict)
