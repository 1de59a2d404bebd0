"""The control channel's messages: every type on the wire, and their only parser.

One JSON object per line over the agent's Unix socket. Every field is checked by type
and bound before anything acts on it: ints are real ints (not bools, not floats) within
bounds, strings are bounded, lines are bounded (``MAX_LINE_BYTES``), and an unknown op
is answered with an error naming it. Why so strict on a private socket: a worker runs
arbitrary user code, and a bug there (or a hostile script) must not grow the agent's
memory or crash the thread that commits checkpoints for the whole node.

Every message is a frozen dataclass whose field types (bounds included, as
``Annotated[int, Range(...)]``) are its schema, read by the one validating codec
(:mod:`elasticd.codec`); this module only picks the record type by ``op``.

Requests carry an ``id`` (except ``progress``, which is fire-and-forget and never
answered); replies echo it, so a client skips any reply that is not for its request
(an error answering a torn line, say) and never reads a stale answer.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass
from typing import Annotated, Any

from elasticd import boundedjson, codec
from elasticd.control.api import CommitOutcome
from elasticd.errors import ElasticdError
from elasticd.records import CheckpointPointer

MAX_LINE_BYTES = 64 * 1024
MAX_STR = 4096  # a manifest URL, a reason
MAX_COUNT = 2**62  # steps, epochs, samples, rounds, world sizes, request ids
MAX_RANK = 2**20  # the parser's bound; the server bounds local ranks by its own size
MAX_SECONDS = 7 * 86400.0  # a checkpoint save or load that took longer is a bogus report
MAX_AWAIT_S = 60.0  # one AwaitOrder's bound: a client asks again

# The field types below are the wire schema (elasticd.codec checks every bound on read).
Count = Annotated[int, codec.Range(0, MAX_COUNT)]  # steps, epochs, samples, bytes, request ids
Rank = Annotated[int, codec.Range(0, MAX_RANK)]
RankOrNone = Annotated[int, codec.Range(-1, MAX_RANK)]  # -1: no rank (e.g. no majority source)
StepOrNone = Annotated[int, codec.Range(-1, MAX_COUNT)]  # -1: none completed / no round
Text = Annotated[str, codec.Length(MAX_STR)]
Seconds = Annotated[float, codec.Range(0, MAX_SECONDS, closed=True)]


class CheckpointIoKind(enum.Enum):
    """What a :class:`CheckpointIo` report is about."""

    SAVE = "save"
    LOAD = "load"


class MessageError(ElasticdError):
    """A line that is not a valid control message; the text names the field and the bound.

    ``request_id`` is the line's valid ``id`` when the line was a JSON object (so the error
    reply can be addressed without parsing the line a second time), else None.
    """

    def __init__(self, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class StepReport:
    """A worker's last completed step (fire-and-forget: no reply)."""

    local_rank: Rank
    rank: Rank
    step: StepOrNone
    epoch: Count = 0
    samples: Count = 0
    loss: float | None = None  # the step's training loss, for the job history (optional)
    # [checkpoint] every = "auto": the agreed steps between saves, the interval in seconds
    # and why (checkpoint.cadence.SaveCadence), for `elasticd status`; 0/"": not automatic.
    save_every: Count = 0
    save_interval_s: Seconds = 0.0
    cadence: Text = ""
    # The median seconds per step of the worker's latest steps (control.client.StepTimes;
    # 0: not measured yet): the goodput ledger's healthy step time, which a report
    # throttled to one per 0.2 s cannot show the agent.
    step_s: Seconds = 0.0
    op = "progress"


@dataclass(frozen=True)
class CheckpointIo:
    """A worker saved or loaded a checkpoint (fire-and-forget: no reply); the agent's metrics.

    ``kind`` is ``"save"`` (the writing rank, once its checkpoint is written and the commit
    answered) or ``"load"`` (every rank that read one); ``seconds`` from the call to the
    end, ``nbytes`` the bytes written or read.
    """

    kind: CheckpointIoKind
    step: Count
    seconds: Seconds
    nbytes: Count
    op = "checkpoint_io"


@dataclass(frozen=True)
class DivergenceReport:
    """This rank's replica fingerprint differed from the majority's (fire-and-forget).

    Sent by each rank that :func:`elasticd.worker.fingerprint.judge_replicas` named, so the
    agent of the node holding it records the event (``status``, metrics, goodput ledger).
    ``source`` is the majority rank it was restored from; -1: no majority (the job restarts
    from the newest checkpoint). ``step`` is the step whose state differed.
    """

    rank: Rank
    step: StepOrNone
    source: RankOrNone
    reason: Text
    op = "diverged"


@dataclass(frozen=True)
class CommitRequest:
    """Ask the agent to point ``checkpoint/latest`` at a written manifest (fenced)."""

    step: Count
    manifest_url: Text
    world_size: Annotated[int, codec.Range(1, MAX_COUNT)]
    round: Count
    id: Count = 0
    op = "commit"


@dataclass(frozen=True)
class CommitReply:
    """The commit's outcome (three values: see :class:`CommitOutcome`) and why."""

    outcome: CommitOutcome
    reason: Text = ""
    id: Count = 0
    op = "commit_reply"


@dataclass(frozen=True)
class LatestRequest:
    """Ask the agent for the committed pointer."""

    id: Count = 0
    op = "latest"


@dataclass(frozen=True)
class LatestReply:
    """The committed pointer (None: nothing committed); ``ok`` False: etcd did not answer."""

    ok: bool
    pointer: CheckpointPointer | None = None
    reason: Text = ""
    id: Count = 0
    op = "latest_reply"


@dataclass(frozen=True)
class Ping:
    """Is the agent there?"""

    id: Count = 0
    op = "ping"


@dataclass(frozen=True)
class Pong:
    """The agent is there."""

    id: Count = 0
    op = "pong"


@dataclass(frozen=True)
class ErrorReply:
    """The request was invalid (``id`` is None when the line could not be parsed at all)."""

    reason: Text = ""
    id: Count | None = None
    op = "error"


class LeaveReason(enum.Enum):
    """Why a live worker left its process group (``ParkedReport.reason``)."""

    COLLECTIVE_FAILED = "collective_failed"  # a peer died: a collective failed
    AGREED_STOP = "agreed_stop"  # every rank stopped at an agreed step (a node joins/drains)
    ORDERED = "ordered"  # the agent ordered a newer round (a lone worker, a frozen peer)


# -- live re-formation reports (worker to agent, over the socket; answered by a Pong) ----
# The agent keeps the latest report of each kind per local rank (server.WorkerReports):
# they are state ("are all parked?"), asked by every tick.
@dataclass(frozen=True)
class LiveRegistration:
    """This worker re-forms in place when told: the agent does not kill it on a change."""

    local_rank: Rank
    pid: Annotated[int, codec.Range(1, 2**32)]
    id: Count = 0
    op = "live"


@dataclass(frozen=True)
class ParkedReport:
    """This worker left its group after ``step`` of ``round`` and waits for an order."""

    local_rank: Rank
    round: StepOrNone  # -1: it had no round (never under an agent: not expected)
    step: StepOrNone  # -1: no step completed yet
    reason: LeaveReason
    id: Count = 0
    op = "parked"


@dataclass(frozen=True)
class ReformedReport:
    """This worker trains in ``round`` now (re-formed in place, state agreed at ``step``)."""

    local_rank: Rank
    round: Count
    step: StepOrNone
    id: Count = 0
    op = "reformed"


@dataclass(frozen=True)
class StoppedReport:
    """This worker exits 0 without finishing its script: it stopped for a drain (its own
    node's or a peer's, after ``step``), or its live re-formation fell back
    (``live_fallback`` says why). The agent re-forms the job instead of declaring success.

    Kept as the ``stopped-<rank>`` file (this message, serialised): written on the way out,
    read once the worker has exited, and it must outlive a busy or restarting socket.
    """

    rank: Rank
    step: StepOrNone  # -1: none completed
    round: StepOrNone  # -1: no round
    live_fallback: Text = ""
    op = "stopped"


@dataclass(frozen=True)
class AwaitOrder:
    """Wait (at most ``timeout_s``) until the agent publishes a re-formation order for a
    round after ``after_round``; answered by an :class:`OrderNotice` either way. The order
    itself stays in ``reform.json``: this only says when to read it."""

    after_round: StepOrNone
    timeout_s: Annotated[float, codec.Range(0, MAX_AWAIT_S, closed=True)]
    id: Count = 0
    op = "await_order"


@dataclass(frozen=True)
class OrderNotice:
    """The newest order's round (-1: none published for this worker group)."""

    round: StepOrNone
    id: Count = 0
    op = "order_notice"


LiveReport = LiveRegistration | ParkedReport | ReformedReport
Request = (StepReport | CheckpointIo | DivergenceReport | CommitRequest | LatestRequest | Ping
           | LiveReport | AwaitOrder)
Reply = CommitReply | LatestReply | Pong | ErrorReply | OrderNotice


# -- validation -------------------------------------------------------------------------
_REQUESTS: dict[str, type[Request]] = {c.op: c for c in (
    StepReport, CheckpointIo, DivergenceReport, CommitRequest, LatestRequest, Ping, LiveRegistration, ParkedReport,
    ReformedReport, AwaitOrder)}
_REPLIES: dict[str, type[Reply]] = {c.op: c for c in (
    CommitReply, LatestReply, Pong, ErrorReply, OrderNotice)}


def _object(line: bytes) -> dict[str, object]:
    if len(line) > MAX_LINE_BYTES:
        raise MessageError(f"line of {len(line)} bytes exceeds {MAX_LINE_BYTES}")
    try:
        return boundedjson.loads_object(line, what="message", max_bytes=MAX_LINE_BYTES)
    except boundedjson.BoundedJSONError as exc:
        raise MessageError(str(exc)) from None


def _record(types_by_op: dict[str, type[Any]], obj: dict[str, object], side: str) -> Any:
    op = obj.get("op")
    cls = types_by_op.get(op) if isinstance(op, str) else None
    if cls is None:
        known = ", ".join(types_by_op)
        if op is None:
            raise MessageError(f"no 'op' field (known {side} ops: {known})")
        shown = op if isinstance(op, str) and len(op) <= 64 else type(op).__name__
        raise MessageError(f"unknown op {shown!r} (known {side} ops: {known})")
    try:
        return codec.from_dict(cls, obj, what=f"{op} message")
    except codec.RecordDecodeError as exc:
        raise MessageError(str(exc)) from None


def _request_id(obj: dict[str, object]) -> int | None:
    rid = obj.get("id")
    return rid if type(rid) is int and 0 <= rid < MAX_COUNT else None


def parse_request(line: bytes) -> Request:
    """Parse and validate one request line (worker to agent); the line is decoded once.

    Raises:
        MessageError: not JSON, not an object, too long, an unknown op, or a field of the
            wrong type or out of bounds; the message names which, and its ``request_id``
            is the line's valid ``id`` if it has one (to address the error reply).
    """
    obj = _object(line)
    try:
        msg: Request = _record(_REQUESTS, obj, "request")
    except MessageError as exc:
        exc.request_id = _request_id(obj)
        raise
    if isinstance(msg, StepReport) and msg.loss is not None and not math.isfinite(msg.loss):
        # A diverged step's NaN/inf loss is dropped, not plotted as a spike (the step counts).
        msg = dataclasses.replace(msg, loss=None)
    return msg


def parse_stopped(line: bytes) -> StoppedReport:
    """Parse and validate a ``stopped-<rank>`` file's content.

    Raises:
        MessageError: as :func:`parse_request`.
    """
    msg: StoppedReport = _record({StoppedReport.op: StoppedReport}, _object(line), "stopped file")
    return msg


def parse_reply(line: bytes) -> Reply:
    """Parse and validate one reply line (agent to worker).

    Raises:
        MessageError: as :func:`parse_request`.
    """
    msg: Reply = _record(_REPLIES, _object(line), "reply")
    return msg


def serialise(msg: Request | Reply | StoppedReport) -> bytes:
    """One message as a JSON line (newline included).

    Raises:
        MessageError: the line would exceed ``MAX_LINE_BYTES``.
    """
    body: dict[str, Any] = {"op": msg.op, **codec.encode(msg)}
    if isinstance(msg, CommitReply):
        body["ok"] = msg.outcome is CommitOutcome.COMMITTED  # for readers of the old reply
    line = json.dumps(body, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_LINE_BYTES:
        raise MessageError(f"{msg.op} message of {len(line)} bytes exceeds {MAX_LINE_BYTES}")
    return line
