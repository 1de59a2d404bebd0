"""What `elasticd status` says about a job: derived from a snapshot by pure functions.

snapshot.py reads a job from etcd in one range request into a ``JobSnapshot``; this
module derives what that means now:

- ``derive_status``: ``JobSnapshot`` + now -> ``JobStatus`` (state, reason, health, exit
  code, node rows). The rules are listed on ``derive_status`` and in docs/status.md.
- the renderers (render.py, jsondoc.py) turn a ``JobStatus`` into a table or JSON.

Health is about now: a job training at full size is healthy (exit 0) however recently it
recovered; the last recovery is reported as information (``recovered_at``), never as a
health state, so a health check does not trip for minutes after every spot event.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from elasticd.records import CheckpointPointer, NodeRecord, Progress
from elasticd.rendezvous.protocol import LEFT_DRAINED
from elasticd.status.snapshot import JobSnapshot, SeqEvent

# Exit codes of `elasticd status` (docs/status.md). Usable as a health check.
EXIT_OK = 0  # training at full size, now
EXIT_DEGRADED = 1  # training below max nodes, re-forming, or a node draining
EXIT_NOT_TRAINING = 2  # rendezvous, stopped or failed
EXIT_UNKNOWN_JOB = 3  # no keys under /elasticd/<job>/
EXIT_ETCD_UNREACHABLE = 4  # etcd did not answer within --timeout

# Job states, in the order the derivation checks them (first match wins, see derive_status).
JOB_STATES = ("failed", "stopped", "draining", "re-forming", "rendezvous", "training")
# Event kinds a recovery recovers from (reported as "recovered N ago", not as health).
TROUBLE_EVENT_KINDS = frozenset({"failure", "lost", "hang", "lease_lost"})
# How long after a recovery `status` still mentions it (--window).
DEFAULT_WINDOW_S = 3600.0


@dataclass(frozen=True)
class NodeStatus:
    """One row of the nodes table: a live agent, or a round member whose lease expired."""

    node: str
    # A NodeRecord state; or, for a member of the round without a live record, "left"
    # (it recorded a clean leave: drained or finished) or "lost" (its lease expired).
    state: str
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
    left: str | None = None  # how a "left" node left: "drained" or "finished"
    step: int | None = None  # the newest step this node's workers reported in its round
    spare_reason: str | None = None  # why a node in state "spare" waits (full, invalid size)


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
    stop_requested: bool = False  # `elasticd stop` holds the job out until `elasticd start`
    round: int | None = None
    round_phase: str | None = None
    round_opened_at: float | None = None
    round_completed_at: float | None = None
    round_cause: str | None = None  # why the round was opened (member_lost, member_left, ...)
    round_changed: tuple[str, ...] = ()  # ... and the nodes concerned
    nodes_in_round: int = 0
    min_nodes: int | None = None
    max_nodes: int | None = None
    world_size: int | None = None
    waiting_nodes: int = 0
    recovered_at: float | None = None  # the newest recovery within the window, if any
    recovered_from: str | None = None  # what it recovered from ("lost of n3 2m ago")
    progress: Progress | None = None
    checkpoint: CheckpointPointer | None = None
    nodes: tuple[NodeStatus, ...] = ()
    events: tuple[SeqEvent, ...] = ()  # the newest ``events_limit``, oldest first
    unreadable: tuple[str, ...] = ()


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
    left = snap.left.get(snap.round_state.round, {}) if snap.round_state else {}
    rows = []
    for rec in snap.nodes:
        beat = snap.beats.get(rec.node)
        in_round = beat is not None and beat.round == rec.round
        # The record changes only with the node's state; its beat says it is alive now.
        beat_at = max(rec.heartbeat_at, beat.at if beat else 0.0) or None
        rows.append(NodeStatus(
            node=rec.node, state=rec.state, member=rec.node in member_set, host=rec.host,
            ranks=tuple(rec.ranks),
            local_world_size=rec.local_world_size or (beat.local_world_size if in_round and beat else 0),
            restarts=rec.restarts, round=rec.round, heartbeat_at=beat_at, version=rec.version,
            pid=rec.pid, started_at=rec.started_at or None, last_exit=rec.last_exit,
            log_dir=rec.log_dir,
            step=beat.step if in_round and beat and beat.step >= 0 else None,
            spare_reason=(rec.spare_reason or None) if rec.state == "spare" else None,
        ))
    # `elasticd stop` / `drain`: a member gone without a `lost` event since it was asked to
    # leave left on purpose, even when its leave record went with a round opened as the
    # nodes left one by one (the coordinator re-forming around the first to go).
    asked = snap.stop_mark.requested_at if snap.stop_mark is not None else None
    for node in members:
        if node in live:
            continue
        sent_off = (asked is not None or node in snap.drain_marks) and not (
            node in lost_at and (asked is None or lost_at[node] >= asked))
        if node in left:
            rows.append(NodeStatus(node=node, state="left", member=True, left=left[node]))
        elif sent_off:
            rows.append(NodeStatus(node=node, state="left", member=True, left=LEFT_DRAINED))
        else:
            rows.append(NodeStatus(node=node, state="lost", member=True, lost_at=lost_at.get(node)))
    order = {n: i for i, n in enumerate(members)}
    # Members in rank order (gone ones in their slot), then everybody else by name.
    rows.sort(key=lambda r: (0, order[r.node], "") if r.node in order else (1, 0, r.node))
    return rows


def _progress_now(snap: JobSnapshot, current: int | None) -> Progress | None:
    """The job's progress, as fresh as the snapshot allows.

    The ``progress`` record is written by rank 0's agent about once a second; every node's
    beat carries its own newest step, and a committed checkpoint of the same round proves
    its step was completed. The newest of the three wins, so the step shown is never older
    than the checkpoint beside it.
    """
    p = snap.progress
    if current is None:
        return p
    step, at = (p.step, p.updated_at) if p is not None and p.round == current else (-1, 0.0)
    for beat in snap.beats.values():
        if beat.round == current and beat.step > step:
            step, at = beat.step, beat.at
    c = snap.checkpoint
    if c is not None and c.round == current and c.step > step:
        step, at = c.step, c.committed_at
    if p is None:
        return Progress(round=current, step=step, updated_at=at) if step >= 0 else None
    if p.round != current and step < 0:
        return p  # nothing newer in this round yet: the last round's figure, with its round
    return replace(p, round=current, step=max(step, p.step if p.round == current else -1),
                   updated_at=max(at, p.updated_at if p.round == current else 0.0))


def _recovery(snap: JobSnapshot, state: str, now: float, window_s: float) -> tuple[float | None, str | None]:
    """When the job last came back to training after trouble (within ``window_s``): the
    first round formed after the newest trouble event, not the newest round (a later
    join re-forms the job too, and is not a recovery)."""
    rs = snap.round_state
    if state != "training" or rs is None or not rs.completed_at:
        return None, None
    trouble = _last(snap.events, TROUBLE_EVENT_KINDS)
    if trouble is None or trouble.event.time > rs.completed_at:
        return None, None
    after = [se.event.time for se in snap.events
             if se.event.kind == "round" and se.event.time >= trouble.event.time]
    at = min(after) if after else rs.completed_at
    if now - at > window_s:
        return None, None
    return at, describe_event(trouble, now)


def derive_status(snap: JobSnapshot, now: float, *, window_s: float = DEFAULT_WINDOW_S,
                  events_limit: int = 10) -> JobStatus:
    """Derive a job's state, reason, health and exit code. Pure; first rule wins.

    State rules:
      1. failed     - a live node record is in state "failed"; or the rendezvous is closed
                      and the newest "failure"/"finished" event is a failure.
      2. stopped    - the rendezvous is closed (otherwise); or no live node records remain;
                      or every live node record is in state "stopped".
      3. draining   - a live node is in state "draining".
      4. re-forming - the round is final but broken: a member's workers reported a
                      failure in it (a failed collective, a dead worker), or a member is
                      gone (lost: its lease expired; or left after a drain). The agents
                      are about to form the next round. Or a member's record is
                      "re-forming" in this round: its live workers were ordered into it
                      and have not all confirmed (they may still train in the old one).
      5. rendezvous - no round state; the round is "open"; or a member's record is not
                      "training" in the current round (starting, restarting).
      6. training   - otherwise: the round is final and every member trains in it.

    Health is about now. Degraded (training, re-forming or draining): fewer members than
    max_nodes; re-forming; a node draining. A recovery is not a health state: the newest
    one within ``window_s`` is reported in ``recovered_at``/``recovered_from``.

    Exit code: training 0 (1 if degraded); re-forming, draining 1; rendezvous, stopped,
    failed 2.
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
    if state in ("training", "draining", "re-forming"):
        if state != "training":
            degraded_reasons.append(reason)
        if rs and len(members) < rs.max_nodes:
            degraded_reasons.append(f"{len(members)} of max {rs.max_nodes} nodes")
            if snap.drain_marks:
                degraded_reasons.append(f"kept out by `elasticd drain`: {_names(list(snap.drain_marks))}")
    degraded = bool(degraded_reasons)
    if state == "training":
        exit_code = EXIT_DEGRADED if degraded else EXIT_OK
    elif state in ("draining", "re-forming"):
        exit_code = EXIT_DEGRADED
    else:
        exit_code = EXIT_NOT_TRAINING

    by_node = {r.node: r for r in rows}
    world_size = sum(len(live[m].ranks) or by_node[m].local_world_size
                     for m in members if m in live and live[m].round == current) or None
    p = snap.progress
    if (world_size is None or any(m not in live for m in members)) and p and p.round == current \
            and p.world_size:
        world_size = p.world_size  # a gone member's ranks are known only to the progress record
    recovered_at, recovered_from = _recovery(snap, state, now, window_s)
    return JobStatus(
        job=snap.job, state=state, reason=reason, degraded=degraded,
        degraded_reasons=tuple(degraded_reasons), exit_code=exit_code, now=now,
        revision=snap.revision, closed=snap.closed, stop_requested=snap.stop_mark is not None,
        round=current,
        round_phase=rs.phase if rs else None, round_opened_at=(rs.opened_at or None) if rs else None,
        round_completed_at=rs.completed_at if rs else None,
        round_cause=(rs.cause or None) if rs else None,
        round_changed=tuple(rs.changed) if rs else (), nodes_in_round=len(members),
        min_nodes=rs.min_nodes if rs else None, max_nodes=rs.max_nodes if rs else None,
        world_size=world_size, waiting_nodes=waiting, recovered_at=recovered_at,
        recovered_from=recovered_from, progress=_progress_now(snap, current),
        checkpoint=snap.checkpoint, nodes=tuple(rows),
        events=tuple(snap.events[-events_limit:]) if events_limit > 0 else (),
        unreadable=snap.unreadable,
    )


def _names(nodes: Sequence[str]) -> str:
    return ", ".join(nodes[:3]) + (" ..." if len(nodes) > 3 else "")


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
        if snap.stop_mark is not None:
            by = f" by {snap.stop_mark.by}" if snap.stop_mark.by else ""
            return "stopped", (f"stopped with `elasticd stop`{by} "
                               f"{format_age(now - snap.stop_mark.requested_at)} ago; "
                               f"`elasticd start --job {snap.job}` lets agents join again")
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
        return "draining", f"{len(draining)} node(s) draining: {_names([n.node for n in draining])}"
    if rs is None:
        return "rendezvous", f"no round formed yet; {len(snap.nodes)} agent(s) joining"
    if rs.phase != "final":
        joined = max(snap.joins.get(rs.round, 0), len(members))
        since = f" for {format_age(now - rs.opened_at)}" if rs.opened_at else ""
        return "rendezvous", (f"round {rs.round} open{since}: "
                              f"{joined} joined, needs {rs.min_nodes}..{rs.max_nodes}")
    left = snap.left.get(rs.round, {})
    reported = [n for n in snap.failures.get(rs.round, ()) if n in members]
    if reported:
        return "re-forming", (f"round {rs.round}: {len(reported)} node(s) reported failed "
                              f"workers ({_names(reported)}); the next round is forming")
    lost = [m for m in members if m not in live and m not in left]
    if lost:
        return "re-forming", f"{len(lost)} member(s) of round {rs.round} lost: {_names(lost)}"
    drained = [m for m in members if m not in live and left.get(m) != "finished"]
    if drained:
        return "re-forming", (f"{len(drained)} member(s) of round {rs.round} left: "
                              f"{_names(drained)}; the others re-form without them")
    # A live re-formation: the member's agent is in this round, its workers may still
    # train in the superseded one until they confirm (issue 26: never "full size" then).
    reforming = [m for m in members if m in live and live[m].state == "re-forming"
                 and live[m].round == rs.round]
    if reforming:
        return "re-forming", (f"round {rs.round}: {len(reforming)} node(s) re-forming in place "
                              f"({_names(reforming)}): their workers are not all in it yet")
    behind = [live[m] for m in members if m in live
              and (live[m].state != "training" or live[m].round != rs.round)]
    if behind:
        n = behind[0]
        more = f" (+{len(behind) - 1} more)" if len(behind) > 1 else ""
        where = f"round {n.round}" if n.round != rs.round else f"round {rs.round}"
        return "rendezvous", f"node {n.node} {n.state} in {where}{more}"
    if not members:
        return "rendezvous", f"round {rs.round} final with no members"
    training = [m for m in members if m in live]
    return "training", f"round {rs.round}: {len(training)} node(s) training"


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
