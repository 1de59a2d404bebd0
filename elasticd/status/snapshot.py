"""Reading a job from etcd into a ``JobSnapshot``: one range read, decoded by pure parsers.

The CLI reads straight from etcd (never from a local daemon), so it answers on any machine
that reaches etcd, even when every agent is dead. Reading is cheap on purpose: a whole job
is ONE range read of ``/elasticd/<job>/`` (``read_job``) and the job list is ONE range read
of ``/elasticd/`` (``read_all_jobs``); a 1,000-node job is therefore one request, not one
per node.

``parse_job_kvs`` (key-values -> ``JobSnapshot``) is pure and unit-tested without etcd:
records are decoded, the per-round c10d store is skipped by key prefix, and joins,
failures and clean leaves are read from the key alone. What the snapshot means is
derived in model.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from elasticd.errors import ConfigError, EtcdUnavailableError
from elasticd.etcd.client import KV, EtcdClient
from elasticd.history import History
from elasticd.keys import ROOT, JobKeys, job_of_key, parse_ascii_int, round_of_key
from elasticd.records import (
    Beat,
    CheckpointPointer,
    Event,
    NodeRecord,
    Progress,
    RoundState,
    StopMark,
)
from elasticd.rendezvous.protocol import LEAVE_KINDS

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SeqEvent:
    """An event record with its sequence number (the last component of its key)."""

    seq: int
    event: Event


@dataclass(frozen=True)
class JobSnapshot:
    """Everything `status` needs about one job, decoded from one consistent range read.

    ``nodes`` holds only live node records: a record sits on its node's lease, so a dead or
    frozen node's record is gone once its lease expires.
    """

    job: str
    revision: int
    round_state: RoundState | None = None
    closed: bool = False
    nodes: tuple[NodeRecord, ...] = ()
    progress: Progress | None = None
    checkpoint: CheckpointPointer | None = None
    events: tuple[SeqEvent, ...] = ()  # sorted by seq, oldest first
    joins: dict[int, int] = field(default_factory=dict)  # round -> number of join keys
    failures: dict[int, tuple[str, ...]] = field(default_factory=dict)  # round -> nodes
    left: dict[int, dict[str, str]] = field(default_factory=dict)  # round -> {node: kind}
    beats: dict[str, Beat] = field(default_factory=dict)  # live node -> its newest beat
    stop_mark: StopMark | None = None  # `elasticd stop` asked the whole job to stop
    drain_marks: tuple[str, ...] = ()  # nodes `elasticd drain` keeps out, by name
    unreadable: tuple[str, ...] = ()  # keys whose value did not decode



# -- parsing -----------------------------------------------------------------------------
def _decode(cls, kv: KV, unreadable: list[str]):  # type: ignore[no-untyped-def]
    try:
        return cls.from_json(kv.value)
    except (ValueError, TypeError) as exc:
        # One corrupt record must not blind the operator to the rest of the job; the key
        # is reported in the output ("warnings"), so the log line is only for debugging.
        log.debug("status_record_unreadable", key=kv.key, error=str(exc))
        unreadable.append(kv.key)
        return None


def parse_job_kvs(job: str, kvs: Iterable[KV], revision: int) -> JobSnapshot:
    """Decode the key-values of one job (any order) into a ``JobSnapshot``.

    Keys under ``store/`` are skipped without decoding; ``rdzv/joins/`` and
    ``rdzv/failures/`` keys are counted from the key alone. Unknown keys are ignored, so a
    newer agent's extra keys do not break an older CLI.
    """
    keys = JobKeys(job)
    prefix = keys.prefix
    round_state = progress = checkpoint = None
    closed = False
    nodes: list[NodeRecord] = []
    events: list[SeqEvent] = []
    joins: dict[int, int] = {}
    failures: dict[int, list[str]] = {}
    left: dict[int, dict[str, str]] = {}
    beats: dict[str, Beat] = {}
    stop_mark: StopMark | None = None
    drain_marks: list[str] = []
    unreadable: list[str] = []
    for kv in kvs:
        if not kv.key.startswith(prefix):
            continue
        rest = kv.key[len(prefix):]
        if rest.startswith("store/"):
            continue  # the c10d store: many keys, none of them status
        if rest.startswith("rdzv/joins/"):
            rnd = round_of_key(kv.key, keys.joins_root)
            if rnd is not None:
                joins[rnd] = joins.get(rnd, 0) + 1
        elif rest.startswith("rdzv/failures/"):
            rnd = round_of_key(kv.key, keys.failures_root)
            if rnd is not None:
                failures.setdefault(rnd, []).append(kv.key.rsplit("/", 1)[-1])
        elif rest.startswith("rdzv/left/"):
            rnd = round_of_key(kv.key, keys.left_root)
            kind = kv.value.decode("utf-8", "replace")
            if rnd is not None:
                # The kind is shown, never trusted: anything but a known kind reads "left".
                left.setdefault(rnd, {})[kv.key.rsplit("/", 1)[-1]] = \
                    kind if kind in LEAVE_KINDS else "left"
        elif kv.key == keys.stop_mark:
            stop_mark = _decode(StopMark, kv, unreadable)
        elif kv.key.startswith(keys.drain_marks_prefix):
            drain_marks.append(kv.key.rsplit("/", 1)[-1])
        elif rest.startswith("beats/"):
            beat = _decode(Beat, kv, unreadable)
            if beat is not None:
                beats[kv.key.rsplit("/", 1)[-1]] = beat
        elif rest.startswith("nodes/"):
            rec = _decode(NodeRecord, kv, unreadable)
            if rec is not None:
                nodes.append(rec)
        elif rest.startswith("events/"):
            # events/<seq> or, as the agent writes them, events/<seq>-<node> (seq: µs).
            head = rest[len("events/"):].split("-", 1)[0]
            ev = _decode(Event, kv, unreadable) if parse_ascii_int(head) is not None else None
            if ev is not None:
                events.append(SeqEvent(int(head), ev))
        elif kv.key == keys.rdzv_state:
            round_state = _decode(RoundState, kv, unreadable)
        elif kv.key == keys.rdzv_closed:
            closed = True
        elif kv.key == keys.progress:
            progress = _decode(Progress, kv, unreadable)
        elif kv.key == keys.checkpoint_latest:
            checkpoint = _decode(CheckpointPointer, kv, unreadable)
    events.sort(key=lambda e: (e.seq, e.event.node))
    nodes.sort(key=lambda n: n.node)
    return JobSnapshot(
        job=job, revision=revision, round_state=round_state, closed=closed, nodes=tuple(nodes),
        progress=progress, checkpoint=checkpoint, events=tuple(events), joins=joins,
        failures={r: tuple(sorted(ns)) for r, ns in failures.items()}, left=left, beats=beats,
        stop_mark=stop_mark, drain_marks=tuple(sorted(drain_marks)),
        unreadable=tuple(unreadable),
    )


def split_by_job(kvs: Iterable[KV]) -> dict[str, list[KV]]:
    """Group key-values under ``/elasticd/`` by job name (invalid names are skipped)."""
    out: dict[str, list[KV]] = {}
    for kv in kvs:
        job = job_of_key(kv.key)
        if job is None:
            continue
        # Skip the bulky per-round store early: the job list never needs it.
        if kv.key.startswith(f"{ROOT}{job}/store/"):
            out.setdefault(job, [])
            continue
        out.setdefault(job, []).append(kv)
    return out


# -- reading (thin I/O) ------------------------------------------------------------------
def one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception as one short line (gRPC errors span several)."""
    details = exc.details() if callable(getattr(exc, "details", None)) else None  # type: ignore[attr-defined]
    text = " ".join(str(details or exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_prefix(client: EtcdClient, prefix: str) -> tuple[list[KV], int]:
    """``client.get_prefix`` with every failure mapped to ConfigError or EtcdUnavailableError.

    Why: the client translates the errors it expects; anything else (a web server on the
    etcd port answers gRPC with HTTP 404 -> UNIMPLEMENTED) must still end as "etcd
    unreachable" (exit 4), not as a traceback from a health check.
    """
    try:
        return client.get_prefix(prefix)
    except (EtcdUnavailableError, ConfigError):
        raise
    except Exception as exc:
        raise EtcdUnavailableError(
            f"{client.endpoint_label()} did not answer as etcd ({one_line(exc)})") from exc


def read_job(client: EtcdClient, job: str) -> JobSnapshot | None:
    """Read one job, normally with a single range request.

    If the job's keys exceed gRPC's 4 MB response limit (thousands of nodes plus a large
    c10d store), the job is read again in five range requests that leave the store out:
    nodes, rdzv, progress, checkpoint, events. That view is not one etcd revision, which
    is fine for a status screen.

    Returns:
        The snapshot, or None when no key exists under ``/elasticd/<job>/``.

    Raises:
        ConfigError: invalid job name, bad credentials/TLS.
        EtcdUnavailableError: etcd did not answer within the client's timeout.
    """
    keys = JobKeys(job)
    try:
        kvs, revision = read_prefix(client, keys.prefix)
    except EtcdUnavailableError as exc:
        if not response_too_large(exc):
            raise
        log.debug("status_read_split", job=job, reason="response over the gRPC message limit")
        kvs, revision = [], 0
        for part in (keys.nodes_prefix, keys.rdzv_prefix, keys.progress,
                     f"{keys.prefix}checkpoint/", keys.events_prefix):
            part_kvs, part_rev = read_prefix(client, part)
            kvs += part_kvs
            revision = max(revision, part_rev)
    if not kvs:
        return None
    return parse_job_kvs(job, kvs, revision)


def response_too_large(exc: BaseException) -> bool:
    """True if etcd answered but the response exceeded the client's gRPC message limit."""
    seen: BaseException | None = exc
    while seen is not None:
        if "larger than max" in str(seen):
            return True
        seen = seen.__cause__
    return False


def read_all_jobs(client: EtcdClient) -> tuple[list[JobSnapshot], int]:
    """Read every job under ``/elasticd/`` with a single range request.

    Returns:
        The snapshots sorted by job name, and the revision the read was served at.

    Raises:
        ConfigError, EtcdUnavailableError: as ``read_job``.
    """
    kvs, revision = read_prefix(client, ROOT)
    return parse_all_kvs(kvs, revision), revision


def parse_all_kvs(kvs: Iterable[KV], revision: int) -> list[JobSnapshot]:
    """Decode the key-values under ``/elasticd/`` into one snapshot per job, by name."""
    snaps = []
    for job, job_kvs in sorted(split_by_job(kvs).items()):
        try:
            snaps.append(parse_job_kvs(job, job_kvs, revision))
        except ConfigError as exc:  # a key written by hand with an invalid job name
            log.warning("status_job_skipped", job=job, error=str(exc))
    return snaps


def read_history(client: EtcdClient, job: str) -> tuple[History, str | None]:
    """The job's history record (``elasticd.history``), and why it is empty if it is.

    Raises:
        EtcdUnavailableError: etcd did not answer.
    """
    kv = client.get(JobKeys(job).history)
    if kv is None:
        return History(), "no history yet: no progress reported, or agents older than this CLI"
    try:
        return History.from_json(kv.value), None
    except ValueError as exc:  # validated like every record read from etcd
        return History(), f"history record unreadable, skipped: {exc}"
