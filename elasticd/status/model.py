"""What `elasticd status` knows about a job: read from etcd, then derived by pure functions.

The CLI reads straight from etcd (never from a local daemon), so it answers on any machine
that reaches etcd, even when every agent is dead. Reading is cheap on purpose: a whole job
is ONE range read of ``/elasticd/<job>/`` (``read_job``) and the job list is ONE range read
of ``/elasticd/`` (``read_all_jobs``); a 1,000-node job is therefore one request, not one
per node.

The logic splits into three pure steps, each unit-tested without etcd:

- ``parse_job_kvs``: key-values -> ``JobSnapshot`` (records decoded; the per-round c10d
  store is skipped by key prefix and joins/failures are only counted by key, never decoded).
- ``derive_status``: ``JobSnapshot`` + now -> ``JobStatus`` (state, reason, degraded,
  exit code, node rows). The rules are listed on ``derive_status`` and in docs/status.md.
- the renderers (render.py, jsondoc.py) turn a ``JobStatus`` into a table or JSON.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import structlog

from elasticd.errors import ConfigError, EtcdUnavailableError
from elasticd.etcd.client import KV, EtcdClient
from elasticd.keys import ROOT, JobKeys, job_of_key, parse_ascii_int, round_of_key
from elasticd.records import CheckpointPointer, Event, NodeRecord, Progress, RoundState

log = structlog.get_logger(__name__)

# Exit codes of `elasticd status` (docs/status.md). Usable as a health check.
EXIT_OK = 0  # training at full size, no failures in the window
EXIT_DEGRADED = 1  # training, but below max nodes / recent failures / a node draining
EXIT_NOT_TRAINING = 2  # rendezvous, stopped or failed
EXIT_UNKNOWN_JOB = 3  # no keys under /elasticd/<job>/
EXIT_ETCD_UNREACHABLE = 4  # etcd did not answer within --timeout

# Job states, in the order the derivation checks them (first match wins, see derive_status).
JOB_STATES = ("failed", "stopped", "draining", "rendezvous", "training")
# Event kinds that make a training job "degraded" while they are younger than the window.
TROUBLE_EVENT_KINDS = frozenset({"failure", "lost", "hang", "lease_lost"})
DEFAULT_WINDOW_S = 300.0


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
    unreadable: tuple[str, ...] = ()  # keys whose value did not decode


@dataclass(frozen=True)
class NodeStatus:
    """One row of the nodes table: a live agent, or a round member whose lease expired."""

    node: str
    state: str  # a NodeRecord state, or "lost" (member of the round without a live record)
    member: bool  # in the current round's member list
    host: str | None = None
    ranks: tuple[int, ...] = ()
    local_world_size: int = 0
    restarts: int | None = None
    round: int | None = None
    heartbeat_at: float | None = None
    version: str | None = None
    pid: int | None = None
    started_at: float | None = None
    last_exit: str | None = None
    lost_at: float | None = None  # time of the node's newest "lost" event, if any
    log_dir: str | None = None  # where the node keeps its worker logs


@dataclass(frozen=True)
class JobStatus:
    """The derived answer for one job (see ``derive_status`` for the rules)."""

    job: str
    state: str  # one of JOB_STATES
    reason: str  # one human-readable line: why this state
    degraded: bool
    degraded_reasons: tuple[str, ...]
    exit_code: int
    now: float
    revision: int
    closed: bool = False
    round: int | None = None
    round_phase: str | None = None
    round_opened_at: float | None = None
    round_completed_at: float | None = None
    nodes_in_round: int = 0
    min_nodes: int | None = None
    max_nodes: int | None = None
    world_size: int | None = None
    waiting_nodes: int = 0
    progress: Progress | None = None
    checkpoint: CheckpointPointer | None = None
    nodes: tuple[NodeStatus, ...] = ()
    events: tuple[SeqEvent, ...] = ()  # the newest ``events_limit``, oldest first
    unreadable: tuple[str, ...] = ()


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
        failures={r: tuple(sorted(ns)) for r, ns in failures.items()}, unreadable=tuple(unreadable),
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


# -- derivation (pure) -------------------------------------------------------------------
def _last(events: Sequence[SeqEvent], kinds: Iterable[str]) -> SeqEvent | None:
    wanted = set(kinds)
    for se in reversed(events):
        if se.event.kind in wanted:
            return se
    return None


def describe_event(se: SeqEvent, now: float) -> str:
    """``"failure of node-3 2m ago (exit 1)"``: a short phrase for reasons."""
    ev = se.event
    text = f"{ev.kind} of {ev.node}" if ev.node else ev.kind
    text += f" {format_age(now - ev.time)} ago"
    cause = exit_detail(ev.detail)
    return f"{text} ({cause})" if cause else text


def exit_detail(detail: dict) -> str:
    """``"exit 1"`` / ``"signal SIGKILL"`` from an event's detail, or ``""``.

    A negative ``exit_code`` is torch's way of saying "killed by signal -code".
    """
    parts = []
    code = detail.get("exit_code")
    if isinstance(code, int) and code < 0:
        try:
            parts.append(f"signal {signal.Signals(-code).name}")
        except ValueError:
            parts.append(f"exit {code}")
    elif code is not None:
        parts.append(f"exit {code}")
    if detail.get("signal"):
        parts.append(f"signal {detail['signal']}")
    return ", ".join(parts)


def format_age(seconds: float) -> str:
    """Compact age: ``"4s"``, ``"3m12s"``, ``"2h05m"``, ``"3d04h"`` (negative -> ``"0s"``)."""
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _node_rows(snap: JobSnapshot, members: Sequence[str], lost_at: dict[str, float]) -> list[NodeStatus]:
    live = {n.node: n for n in snap.nodes}
    member_set = set(members)
    rows = []
    for rec in snap.nodes:
        rows.append(NodeStatus(
            node=rec.node, state=rec.state, member=rec.node in member_set, host=rec.host,
            ranks=tuple(rec.ranks), local_world_size=rec.local_world_size,
            restarts=rec.restarts, round=rec.round,
            heartbeat_at=rec.heartbeat_at or None, version=rec.version, pid=rec.pid,
            started_at=rec.started_at or None, last_exit=rec.last_exit, log_dir=rec.log_dir,
        ))
    for node in members:
        if node not in live:
            rows.append(NodeStatus(node=node, state="lost", member=True, lost_at=lost_at.get(node)))
    order = {n: i for i, n in enumerate(members)}
    # Members in rank order (lost ones in their slot), then everybody else by name.
    rows.sort(key=lambda r: (0, order[r.node], "") if r.node in order else (1, 0, r.node))
    return rows


def derive_status(snap: JobSnapshot, now: float, *, window_s: float = DEFAULT_WINDOW_S,
                  events_limit: int = 10) -> JobStatus:
    """Derive a job's state, reason, degradation and exit code. Pure; first rule wins.

    State rules:
      1. failed     - a live node record is in state "failed"; or the rendezvous is closed
                      and the newest "failure"/"finished" event is a failure.
      2. stopped    - the rendezvous is closed (otherwise); or no live node records remain;
                      or every live node record is in state "stopped".
      3. draining   - a live node is in state "draining".
      4. rendezvous - no round state; the round is "open"; a member has no live record
                      (lost); or a member's record is not "training" in the current round.
      5. training   - otherwise: the round is final and every member trains in it.

    Degraded (only training or draining): fewer members than max_nodes; a "failure",
    "lost", "hang" or "lease_lost" event within ``window_s``; a node draining.

    Exit code: training 0 (1 if degraded); draining 1; rendezvous, stopped, failed 2.
    """
    rs = snap.round_state
    members = list(rs.members) if rs else []
    live = {n.node: n for n in snap.nodes}
    lost_at: dict[str, float] = {}
    for se in snap.events:
        if se.event.kind == "lost":
            lost_at[se.event.node] = se.event.time
    rows = _node_rows(snap, members, lost_at)
    current = rs.round if rs else None
    waiting = sum(c for r, c in snap.joins.items() if current is None or r > current)

    state, reason = _state_and_reason(snap, members, live, now)

    degraded_reasons: list[str] = []
    if state in ("training", "draining"):
        if rs and len(members) < rs.max_nodes:
            degraded_reasons.append(f"{len(members)} of max {rs.max_nodes} nodes")
        recent = [se for se in snap.events
                  if se.event.kind in TROUBLE_EVENT_KINDS and now - se.event.time <= window_s]
        if recent:
            degraded_reasons.append(f"{len(recent)} failure event(s) in the last "
                                    f"{format_age(window_s)}, newest: "
                                    f"{describe_event(recent[-1], now)}")
        if state == "draining":
            degraded_reasons.insert(0, reason)
    degraded = bool(degraded_reasons)
    if state == "training":
        exit_code = EXIT_DEGRADED if degraded else EXIT_OK
    elif state == "draining":
        exit_code = EXIT_DEGRADED
    else:
        exit_code = EXIT_NOT_TRAINING

    world_size = sum(len(live[m].ranks) or live[m].local_world_size
                     for m in members if m in live and live[m].round == current) or None
    p = snap.progress
    if (world_size is None or any(m not in live for m in members)) and p and p.round == current \
            and p.world_size:
        world_size = p.world_size  # a lost member's ranks are known only to the progress record
    return JobStatus(
        job=snap.job, state=state, reason=reason, degraded=degraded,
        degraded_reasons=tuple(degraded_reasons), exit_code=exit_code, now=now,
        revision=snap.revision, closed=snap.closed, round=current,
        round_phase=rs.phase if rs else None, round_opened_at=(rs.opened_at or None) if rs else None,
        round_completed_at=rs.completed_at if rs else None, nodes_in_round=len(members),
        min_nodes=rs.min_nodes if rs else None, max_nodes=rs.max_nodes if rs else None,
        world_size=world_size, waiting_nodes=waiting, progress=snap.progress,
        checkpoint=snap.checkpoint, nodes=tuple(rows),
        events=tuple(snap.events[-events_limit:]) if events_limit > 0 else (),
        unreadable=snap.unreadable,
    )


def _state_and_reason(snap: JobSnapshot, members: list[str], live: dict[str, NodeRecord],
                      now: float) -> tuple[str, str]:
    rs = snap.round_state
    failed_nodes = [n for n in snap.nodes if n.state == "failed"]
    if failed_nodes:
        n = failed_nodes[0]
        why = f": {n.last_exit}" if n.last_exit else ""
        return "failed", f"node {n.node} failed{why}"
    terminal = _last(snap.events, ("failure", "finished"))
    if snap.closed:
        if terminal and terminal.event.kind == "failure":
            return "failed", f"rendezvous closed after {describe_event(terminal, now)}"
        if terminal:
            return "stopped", f"job finished {format_age(now - terminal.event.time)} ago"
        return "stopped", "rendezvous closed"
    if not snap.nodes or all(n.state == "stopped" for n in snap.nodes):
        if snap.nodes:
            return "stopped", f"all {len(snap.nodes)} agent(s) stopped"
        last = snap.events[-1] if snap.events else None
        if last and last.event.kind == "finished":
            return "stopped", f"job finished {format_age(now - last.event.time)} ago"
        if last:
            return "stopped", f"no live agents; last event: {describe_event(last, now)}"
        return "stopped", "no live agents"
    draining = [n for n in snap.nodes if n.state == "draining"]
    if draining:
        names = ", ".join(n.node for n in draining[:3]) + (" ..." if len(draining) > 3 else "")
        return "draining", f"{len(draining)} node(s) draining: {names}"
    if rs is None:
        return "rendezvous", f"no round formed yet; {len(snap.nodes)} agent(s) joining"
    if rs.phase != "final":
        joined = max(snap.joins.get(rs.round, 0), len(members))
        since = f" for {format_age(now - rs.opened_at)}" if rs.opened_at else ""
        return "rendezvous", (f"round {rs.round} open{since}: "
                              f"{joined} joined, needs {rs.min_nodes}..{rs.max_nodes}")
    lost = [m for m in members if m not in live]
    if lost:
        names = ", ".join(lost[:3]) + (" ..." if len(lost) > 3 else "")
        return "rendezvous", f"{len(lost)} member(s) of round {rs.round} lost: {names}"
    behind = [live[m] for m in members if live[m].state != "training" or live[m].round != rs.round]
    if behind:
        n = behind[0]
        more = f" (+{len(behind) - 1} more)" if len(behind) > 1 else ""
        where = f"round {n.round}" if n.round != rs.round else f"round {rs.round}"
        return "rendezvous", f"node {n.node} {n.state} in {where}{more}"
    if not members:
        return "rendezvous", f"round {rs.round} final with no members"
    return "training", f"round {rs.round}: {len(members)} node(s) training"


def status_line(status: JobStatus) -> str:
    """The one stderr line for a non-zero exit: what is wrong, in words."""
    if status.exit_code == EXIT_OK:
        return f"job {status.job} training at full size"
    if status.exit_code == EXIT_DEGRADED:
        return f"job {status.job} degraded: {'; '.join(status.degraded_reasons)}"
    return f"job {status.job} not training: {status.state} ({status.reason})"


def unreadable_summary(keys: Sequence[str]) -> str:
    """A warning line for undecodable keys (never their values: they may hold anything)."""
    return f"{len(keys)} unreadable record(s): {', '.join(keys[:3])}" + (" ..." if len(keys) > 3 else "")
