"""JSON records elasticd keeps in etcd, shared by the agent (writer) and `elasticd status` (reader).

Each record is a frozen dataclass with ``to_json``/``from_json``. Unknown fields are
ignored on read so an older CLI can read a newer agent's records. Times are Unix
seconds (float) in etcd; the status CLI renders them as RFC 3339 UTC.

Every record read from etcd is untrusted input (training code or another tenant may hold
etcd credentials): ``from_json`` decodes it with the one validating codec
(:mod:`elasticd.codec`): the value is a JSON object and every known field has its
declared type (``bool`` is not a number; ints are accepted for floats, which must be
finite), and raises :class:`RecordError` (naming the record and the field) otherwise. ``RecordError`` is a ``ValueError``, so
callers that skip unreadable records with ``except (ValueError, TypeError)`` keep working,
and nothing downstream sees a list where it expects a record or a dict where it expects a
node name.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, TypeVar

from elasticd import boundedjson, codec
from elasticd.codec import Finite

T = TypeVar("T", bound="_Record")
# A record is a few hundred bytes; anything much larger is not one of ours.
MAX_RECORD_BYTES = 1024 * 1024


class RecordError(ValueError):
    """A value read from etcd is not a valid record (not JSON, not an object, a field of
    the wrong type, a required field missing). The message names the field, not the value."""


# A float field of a record: finite (NaN and infinities are no time, rate or ratio).
FiniteFloat = Annotated[float, Finite()]


# Node states, as written by the agent into its node record.
# "spare": registered and joined, waiting for room in a full job (rendezvous.protocol.is_spare).
NODE_STATES = ("joining", "spare", "training", "re-forming", "restarting", "draining", "stopped",
               "failed")
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
    "hung",  # the coordinator ejected the node: its workers hung the job
    "straggler",  # the coordinator flagged the node a straggler (ratio in detail)
    "straggler_ejected",  # ... and ejected it: it waits as a spare until its probation ends
    "diverged",  # a rank's replica fingerprint differed from the majority's (rank, source in detail)
    "quarantined",  # ... twice within a window on one node: it waits out a probation as a spare
)


class _Record:
    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)  # type: ignore[call-overload]

    @classmethod
    def from_json(cls: type[T], data: bytes | str) -> T:
        """Decode and type-check one record.

        Raises:
            RecordError: not JSON, not an object, too large, a field of the wrong type,
                or a required field missing.
        """
        if len(data) > MAX_RECORD_BYTES:
            raise RecordError(f"{cls.__name__}: {len(data)} bytes, larger than any record")
        try:
            return codec.decode(cls, data, what=cls.__name__, max_bytes=MAX_RECORD_BYTES)
        except boundedjson.BoundedJSONError as exc:  # codec.RecordDecodeError included
            raise RecordError(str(exc)) from None


@dataclass(frozen=True)
class NodeRecord(_Record):
    """``/elasticd/<job>/nodes/<node>``: one per live agent, on its lease."""

    node: str
    host: str
    pid: int
    version: str
    started_at: FiniteFloat
    state: str = "joining"
    round: int = -1
    ranks: list[int] = field(default_factory=list)
    restarts: int = 0
    heartbeat_at: FiniteFloat = 0.0
    local_world_size: int = 0
    last_exit: str | None = None
    log_dir: str | None = None  # where this node's worker logs are (shown by status --json)
    # The agent's liveness probe (elasticd.rendezvous.liveness): a refused connection to
    # it proves the agent gone before its lease expires. Port 0: not probed (opted out).
    probe_host: str | None = None
    probe_port: int = 0
    # The digest of the job fingerprint this agent runs (elasticd.agent.admission): a
    # stored fingerprint binds while a live record carries its digest. "": none.
    fingerprint: str = ""
    # Why this node waits as a spare (meaningful while state is "spare"): the job is full,
    # or one more node would be an invalid world size (rendezvous.sizes).
    spare_reason: str = ""


@dataclass(frozen=True)
class JobFingerprint(_Record):
    """``/elasticd/<job>/fingerprint``: what every agent of the job must match
    (elasticd.agent.admission: what is in it, and why)."""

    version: str
    command: list[str]  # as given on the publishing node (shown, not compared)
    program: str  # "sha256:<hex>" of the script, or "module:<name>" for ``-m``
    args: list[str]
    min_nodes: int
    max_nodes: int
    checkpoint_url: str  # redacted; "" when none
    live_reform: bool
    node: str = ""  # who published it (shown)
    published_at: FiniteFloat = 0.0
    digest: str = ""  # of the compared fields; see :func:`make_fingerprint`
    extra: dict[str, Any] = field(default_factory=dict)  # reserved for later settings

    def compared(self) -> dict[str, Any]:
        """The fields that must agree, by name (the digest is over exactly these)."""
        return {"version": self.version, "program": self.program, "args": list(self.args),
                "min_nodes": self.min_nodes, "max_nodes": self.max_nodes,
                "checkpoint_url": self.checkpoint_url, "live_reform": self.live_reform,
                **{f"extra.{k}": v for k, v in sorted(self.extra.items())}}


@dataclass(frozen=True)
class RoundState(_Record):
    """``/elasticd/<job>/rdzv/state``: the current round, changed only by txn on mod_revision."""

    round: int
    phase: str  # "open" | "final"
    members: list[str] = field(default_factory=list)  # rank order once final
    min_nodes: int = 1
    max_nodes: int = 1
    opened_at: FiniteFloat = 0.0
    completed_at: FiniteFloat | None = None
    # Why an open round was opened (a ``MembershipChange`` value, "" = a re-rendezvous) and
    # the nodes concerned: nodes that do not watch ``nodes/`` and every join (all but the
    # coordinator, at scale) learn what changed from this one key.
    cause: str = ""
    changed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class WaitingRecord(_Record):
    """``/elasticd/<job>/rdzv/waiting``: late joiners the coordinator saw waiting for ``round``."""

    round: int
    nodes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ProbationRecord(_Record):
    """``/elasticd/<job>/rdzv/probation/<node>``: the coordinator ejected ``node`` as a
    straggler; it waits as a spare until the key's lease (``probation_s``) expires, then
    it is admitted again (rendezvous/stragglers.py, docs/failure-model.md "Stragglers")."""

    node: str
    ratio: FiniteFloat  # its own step time over the members' median when it was ejected
    probation_s: FiniteFloat
    ejections: int = 1  # how often the deciding coordinator ejected it (doubles probation)
    round: int = -1  # the round it was ejected from
    since: FiniteFloat = 0.0  # wall clock at the ejection (shown, never compared)
    # Why: "straggler" (the coordinator's ejection) or "diverged" (the node's own agent
    # quarantined it: its ranks diverged from their replicas twice, agent/integrity.py).
    cause: str = "straggler"


@dataclass(frozen=True)
class AttributionRecord(_Record):
    """``/elasticd/<job>/rdzv/attribution``: every member of ``round`` reported a worker
    failure; ``reporters`` in the order etcd created the reports (the first is the root
    cause). Written by the coordinator, so a job-wide failure costs O(N) watch events."""

    round: int
    reporters: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Progress(_Record):
    """``/elasticd/<job>/progress``: written by the agent of group rank 0, fenced by round."""

    round: int
    step: int
    epoch: int = 0
    samples_trained: int = 0
    samples_per_s: FiniteFloat = 0.0
    world_size: int = 0
    updated_at: FiniteFloat = 0.0
    # [checkpoint] every = "auto": the workers' agreed steps between saves, the interval in
    # seconds and why (checkpoint.cadence); 0/"": the script's fixed save_every.
    save_every: int = 0
    save_interval_s: FiniteFloat = 0.0
    cadence: str = ""


@dataclass(frozen=True)
class Beat(_Record):
    """``/elasticd/<job>/beats/<node>``: a node's liveness and its own newest step.

    Written by every agent every few seconds on its lease (and on a change of its step or
    activity, at most once a second), watched by no agent (the coordinator reads them
    with one range read a second, `elasticd status` too), so a beat costs one write per node, not one event per
    node per peer: the node record under ``nodes/``, which every peer watches, changes
    only when the node's state does.
    """

    at: FiniteFloat  # when the agent wrote it (its clock)
    round: int = -1
    step: int = -1  # the newest step its workers reported (-1: none yet)
    local_world_size: int = 0
    # What its workers do (``hangs.WorkerActivity`` value, from /proc; "" if not sampled)
    # and its recent seconds per step (0: not known): the coordinator's hang and straggler
    # facts. The beat is rewritten when they or the step change, at most once a second.
    activity: str = ""
    step_s: FiniteFloat = 0.0
    # The share of its recent wall time its workers worked rather than waited in a
    # collective (``rendezvous.stragglers.BusyShare``): step_s x busy_share is its own step time.
    busy_share: FiniteFloat = 0.0


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
    committed_at: FiniteFloat
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
class ClosedRecord(_Record):
    """``/elasticd/<job>/rdzv/closed``: the job finished (its workers all succeeded).

    Written by the agent whose workers finished first (``set_closed``); read by every
    agent that arrives later (it exits 0 without joining: elasticd.rendezvous.finished) and
    removed only by ``elasticd start``. Older agents wrote ``1``: still a close, time unknown.
    """

    finished_at: FiniteFloat
    node: str = ""
    round: int = -1


@dataclass(frozen=True)
class StopMark(_Record):
    """``/elasticd/<job>/control/stop`` and ``.../control/drain/<node>``: written by
    ``elasticd stop`` / ``elasticd drain``, obeyed by agents, cleared by ``elasticd start``."""

    requested_at: FiniteFloat
    by: str = ""  # user@host of the operator's command
    reason: str = ""


@dataclass(frozen=True)
class Event(_Record):
    """``/elasticd/<job>/events/<seq>``: one entry of the bounded event history."""

    time: FiniteFloat
    kind: str
    node: str
    round: int
    message: str
    detail: dict[str, Any] = field(default_factory=dict)
