"""The control channel's messages: every type on the wire, and their only parser.

One JSON object per line over the agent's Unix socket. Every field is checked by type
and bound before anything acts on it: ints are real ints (not bools, not floats) within
bounds, strings are bounded, lines are bounded (``MAX_LINE_BYTES``), and an unknown op
is answered with an error naming it. Why so strict on a private socket: a worker runs
arbitrary user code, and a bug there (or a hostile script) must not grow the agent's
memory or crash the thread that commits checkpoints for the whole node.

Requests carry an ``id`` (except ``progress``, which is fire-and-forget and never
answered); replies echo it, so a client skips any reply that is not for its request
(an error answering a torn line, say) and never reads a stale answer.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any

from elasticd import boundedjson
from elasticd.control.api import CommitOutcome
from elasticd.errors import ElasticdError
from elasticd.records import CheckpointPointer

MAX_LINE_BYTES = 64 * 1024
MAX_STR = 4096  # a manifest URL, a reason
MAX_COUNT = 2**62  # steps, epochs, samples, rounds, world sizes, request ids
MAX_RANK = 2**20  # the parser's bound; the server bounds local ranks by its own size
MAX_SECONDS = 7 * 86400.0  # a checkpoint save or load that took longer is a bogus report


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

    local_rank: int
    rank: int
    step: int
    epoch: int = 0
    samples: int = 0
    loss: float | None = None  # the step's training loss, for the job history (optional)
    # [checkpoint] every = "auto": the agreed steps between saves, the interval in seconds
    # and why (checkpoint.cadence.SaveCadence), for `elasticd status`; 0/"": not automatic.
    save_every: int = 0
    save_interval_s: float = 0.0
    cadence: str = ""
    op = "progress"


@dataclass(frozen=True)
class CheckpointIo:
    """A worker saved or loaded a checkpoint (fire-and-forget: no reply); the agent's metrics.

    ``kind`` is ``"save"`` (the writing rank, once its checkpoint is written and the commit
    answered) or ``"load"`` (every rank that read one); ``seconds`` from the call to the
    end, ``nbytes`` the bytes written or read.
    """

    kind: CheckpointIoKind
    step: int
    seconds: float
    nbytes: int
    op = "checkpoint_io"


@dataclass(frozen=True)
class CommitRequest:
    """Ask the agent to point ``checkpoint/latest`` at a written manifest (fenced)."""

    step: int
    manifest_url: str
    world_size: int
    round: int
    id: int = 0
    op = "commit"


@dataclass(frozen=True)
class CommitReply:
    """The commit's outcome (three values: see :class:`CommitOutcome`) and why."""

    outcome: CommitOutcome
    reason: str
    id: int = 0
    op = "commit_reply"


@dataclass(frozen=True)
class LatestRequest:
    """Ask the agent for the committed pointer."""

    id: int = 0
    op = "latest"


@dataclass(frozen=True)
class LatestReply:
    """The committed pointer (None: nothing committed); ``ok`` False: etcd did not answer."""

    ok: bool
    pointer: CheckpointPointer | None = None
    reason: str = ""
    id: int = 0
    op = "latest_reply"


@dataclass(frozen=True)
class Ping:
    """Is the agent there?"""

    id: int = 0
    op = "ping"


@dataclass(frozen=True)
class Pong:
    """The agent is there."""

    id: int = 0
    op = "pong"


@dataclass(frozen=True)
class ErrorReply:
    """The request was invalid (``id`` is None when the line could not be parsed at all)."""

    reason: str
    id: int | None = None
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

    local_rank: int
    pid: int
    id: int = 0
    op = "live"


@dataclass(frozen=True)
class ParkedReport:
    """This worker left its group after ``step`` of ``round`` and waits for an order."""

    local_rank: int
    round: int  # -1: it had no round (never under an agent: not expected)
    step: int  # -1: no step completed yet
    reason: LeaveReason
    id: int = 0
    op = "parked"


@dataclass(frozen=True)
class ReformedReport:
    """This worker trains in ``round`` now (re-formed in place, state agreed at ``step``)."""

    local_rank: int
    round: int
    step: int
    id: int = 0
    op = "reformed"


@dataclass(frozen=True)
class StoppedReport:
    """This worker exits 0 without finishing its script: it stopped for a drain (its own
    node's or a peer's, after ``step``), or its live re-formation fell back
    (``live_fallback`` says why). The agent re-forms the job instead of declaring success.

    Kept as the ``stopped-<rank>`` file (this message, serialised): written on the way out,
    read once the worker has exited, and it must outlive a busy or restarting socket.
    """

    rank: int
    step: int  # -1: none completed
    round: int  # -1: no round
    live_fallback: str = ""
    op = "stopped"


@dataclass(frozen=True)
class AwaitOrder:
    """Wait (at most ``timeout_s``) until the agent publishes a re-formation order for a
    round after ``after_round``; answered by an :class:`OrderNotice` either way. The order
    itself stays in ``reform.json``: this only says when to read it."""

    after_round: int
    timeout_s: float
    id: int = 0
    op = "await_order"


@dataclass(frozen=True)
class OrderNotice:
    """The newest order's round (-1: none published for this worker group)."""

    round: int
    id: int = 0
    op = "order_notice"


LiveReport = LiveRegistration | ParkedReport | ReformedReport
Request = StepReport | CheckpointIo | CommitRequest | LatestRequest | Ping | LiveReport | AwaitOrder
Reply = CommitReply | LatestReply | Pong | ErrorReply | OrderNotice
MAX_AWAIT_S = 60.0  # one AwaitOrder's bound: a client asks again


# -- validation -------------------------------------------------------------------------
def _int(obj: dict[str, object], name: str, lo: int, hi: int, default: int | None = None) -> int:
    value = obj.get(name, default)
    if type(value) is not int:  # bool is an int subclass and floats are not counts
        raise MessageError(f"field {name!r} must be an integer, got {type(value).__name__}")
    if not lo <= value < hi:
        raise MessageError(f"field {name!r} = {value} is outside [{lo}, {hi})")
    return value


def _loss(obj: dict[str, object]) -> float | None:
    value = obj.get("loss")
    if value is None:
        return None
    # A finite number; NaN/inf (a diverged step) are dropped, not plotted as a spike.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MessageError(f"field 'loss' must be a number, got {type(value).__name__}")
    return float(value) if math.isfinite(value) else None


def _seconds(obj: dict[str, object], name: str = "seconds", hi: float = MAX_SECONDS) -> float:
    value = obj.get(name)
    if not isinstance(value, int | float) or isinstance(value, bool) \
            or not 0 <= value <= hi:  # NaN fails the comparison too
        raise MessageError(f"field {name!r} must be a number in [0, {hi:.0f}], got {value!r}")
    return float(value)


def _io_kind(obj: dict[str, object]) -> CheckpointIoKind:
    raw = _str(obj, "kind")
    try:
        return CheckpointIoKind(raw)
    except ValueError:
        raise MessageError(f"field 'kind' = {raw!r} is not one of "
                           f"{[k.value for k in CheckpointIoKind]}") from None


def _str(obj: dict[str, object], name: str, default: str | None = None) -> str:
    value = obj.get(name, default)
    if not isinstance(value, str):
        raise MessageError(f"field {name!r} must be a string, got {type(value).__name__}")
    if len(value) > MAX_STR:
        raise MessageError(f"field {name!r} is {len(value)} characters long (at most {MAX_STR})")
    return value


def _object(line: bytes) -> dict[str, object]:
    if len(line) > MAX_LINE_BYTES:
        raise MessageError(f"line of {len(line)} bytes exceeds {MAX_LINE_BYTES}")
    try:
        return boundedjson.loads_object(line, what="message", max_bytes=MAX_LINE_BYTES)
    except boundedjson.BoundedJSONError as exc:
        raise MessageError(str(exc)) from None


def _request_id(obj: dict[str, object]) -> int | None:
    try:
        return _int(obj, "id", 0, MAX_COUNT)
    except MessageError:
        return None


def parse_request(line: bytes) -> Request:
    """Parse and validate one request line (worker to agent); the line is decoded once.

    Raises:
        MessageError: not JSON, not an object, too long, an unknown op, or a field of the
            wrong type or out of bounds; the message names which, and its ``request_id``
            is the line's valid ``id`` if it has one (to address the error reply).
    """
    obj = _object(line)
    try:
        return _request(obj)
    except MessageError as exc:
        exc.request_id = _request_id(obj)
        raise


def _request(obj: dict[str, object]) -> Request:
    op = obj.get("op")
    if op == "progress":
        return StepReport(local_rank=_int(obj, "local_rank", 0, MAX_RANK),
                        rank=_int(obj, "rank", 0, MAX_RANK), step=_int(obj, "step", -1, MAX_COUNT),
                        epoch=_int(obj, "epoch", 0, MAX_COUNT, 0),
                        samples=_int(obj, "samples", 0, MAX_COUNT, 0), loss=_loss(obj),
                        save_every=_int(obj, "save_every", 0, MAX_COUNT, 0),
                        save_interval_s=_seconds(obj, "save_interval_s") if "save_interval_s" in obj else 0.0,
                        cadence=_str(obj, "cadence", ""))
    if op == "checkpoint_io":
        return CheckpointIo(kind=_io_kind(obj), step=_int(obj, "step", 0, MAX_COUNT),
                            seconds=_seconds(obj), nbytes=_int(obj, "nbytes", 0, MAX_COUNT))
    rid = _int(obj, "id", 0, MAX_COUNT, 0)
    if op == "commit":
        return CommitRequest(step=_int(obj, "step", 0, MAX_COUNT),
                             manifest_url=_str(obj, "manifest_url"),
                             world_size=_int(obj, "world_size", 1, MAX_COUNT),
                             round=_int(obj, "round", 0, MAX_COUNT), id=rid)
    if op == "latest":
        return LatestRequest(id=rid)
    if op == "ping":
        return Ping(id=rid)
    if op in ("live", "parked", "reformed"):
        return _live_report(obj, op, rid)
    if op == "await_order":
        return AwaitOrder(after_round=_int(obj, "after_round", -1, MAX_COUNT),
                          timeout_s=_seconds(obj, "timeout_s", MAX_AWAIT_S), id=rid)
    known = "progress, checkpoint_io, commit, latest, ping, live, parked, reformed, await_order"
    if op is None:
        raise MessageError(f"no 'op' field (known ops: {known})")
    shown = op if isinstance(op, str) and len(op) <= 64 else type(op).__name__
    raise MessageError(f"unknown op {shown!r} (known: {known})")


def _live_report(obj: dict[str, Any], op: str, rid: int) -> LiveReport:
    local_rank = _int(obj, "local_rank", 0, MAX_RANK)
    if op == "live":
        return LiveRegistration(local_rank=local_rank, pid=_int(obj, "pid", 1, 2**32), id=rid)
    if op == "parked":
        raw = _str(obj, "reason")
        try:
            reason = LeaveReason(raw)
        except ValueError:
            raise MessageError(f"field 'reason' = {raw!r} is not one of "
                               f"{[r.value for r in LeaveReason]}") from None
        return ParkedReport(local_rank=local_rank, round=_int(obj, "round", -1, MAX_COUNT),
                            step=_int(obj, "step", -1, MAX_COUNT), reason=reason, id=rid)
    return ReformedReport(local_rank=local_rank, round=_int(obj, "round", 0, MAX_COUNT),
                          step=_int(obj, "step", -1, MAX_COUNT), id=rid)


def parse_stopped(line: bytes) -> StoppedReport:
    """Parse and validate a ``stopped-<rank>`` file's content.

    Raises:
        MessageError: as :func:`parse_request`.
    """
    obj = _object(line)
    if obj.get("op") != "stopped":
        raise MessageError("not a stopped report (op must be 'stopped')")
    return StoppedReport(rank=_int(obj, "rank", 0, MAX_RANK), step=_int(obj, "step", -1, MAX_COUNT),
                         round=_int(obj, "round", -1, MAX_COUNT),
                         live_fallback=_str(obj, "live_fallback", ""))


def parse_reply(line: bytes) -> Reply:
    """Parse and validate one reply line (agent to worker).

    Raises:
        MessageError: as :func:`parse_request`.
    """
    obj = _object(line)
    op = obj.get("op")
    if op == "error":
        raw_id = obj.get("id")
        return ErrorReply(reason=_str(obj, "reason", ""),
                          id=None if raw_id is None else _int(obj, "id", 0, MAX_COUNT))
    rid = _int(obj, "id", 0, MAX_COUNT, 0)
    if op == "commit_reply":
        raw = _str(obj, "outcome")
        try:
            outcome = CommitOutcome(raw)
        except ValueError:
            raise MessageError(f"field 'outcome' = {raw!r} is not one of "
                               f"{[o.value for o in CommitOutcome]}") from None
        return CommitReply(outcome=outcome, reason=_str(obj, "reason", ""), id=rid)
    if op == "latest_reply":
        ok = obj.get("ok")
        if not isinstance(ok, bool):
            raise MessageError("field 'ok' must be a boolean")
        raw_pointer = obj.get("pointer")
        pointer = None
        if raw_pointer is not None:
            if not isinstance(raw_pointer, dict):
                raise MessageError("field 'pointer' must be an object or null")
            try:
                pointer = CheckpointPointer.from_json(json.dumps(raw_pointer))
            except (TypeError, ValueError, KeyError) as exc:
                raise MessageError(f"field 'pointer' is not a checkpoint pointer: {exc}") from None
        return LatestReply(ok=ok, pointer=pointer, reason=_str(obj, "reason", ""), id=rid)
    if op == "pong":
        return Pong(id=rid)
    if op == "order_notice":
        return OrderNotice(round=_int(obj, "round", -1, MAX_COUNT), id=rid)
    shown = op if isinstance(op, str) and len(op) <= 64 else type(op).__name__
    raise MessageError(f"unknown reply op {shown!r}")


def serialise(msg: Request | Reply | StoppedReport) -> bytes:
    """One message as a JSON line (newline included).

    Raises:
        MessageError: the line would exceed ``MAX_LINE_BYTES``.
    """
    body: dict[str, Any] = {"op": msg.op}
    for name, value in vars(msg).items():
        if isinstance(value, CommitOutcome | LeaveReason | CheckpointIoKind):
            value = value.value
        elif isinstance(value, CheckpointPointer):
            value = json.loads(value.to_json())
        body[name] = value
    if isinstance(msg, CommitReply):
        body["ok"] = msg.outcome is CommitOutcome.COMMITTED  # for readers of the old reply
    line = json.dumps(body, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_LINE_BYTES:
        raise MessageError(f"{msg.op} message of {len(line)} bytes exceeds {MAX_LINE_BYTES}")
    return line
