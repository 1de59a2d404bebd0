"""The `elasticd status --json` documents: versioned, stable field names, no secrets.

The schema is ``elasticd/status/schema.json`` (JSON Schema 2020-12) and is described field
by field in docs/status.md. Compatibility rule: within one ``schema_version`` fields are
only ever added, never renamed, removed or re-typed; consumers must ignore fields they do
not know. Times are RFC 3339 UTC strings (``2025-01-31T12:00:00.000Z``); durations and ages
are seconds (numbers, ``_s`` suffix).

Secrets: etcd credentials are never part of the document. Checkpoint URLs lose their
userinfo and query values (pre-signed URLs carry signatures there), and event-detail
entries whose names look like credentials are replaced by ``"<redacted>"``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib import resources
from typing import Any

from elasticd import sensitive
from elasticd.status.model import JobStatus, NodeStatus, exit_detail
from elasticd.status.snapshot import SeqEvent

SCHEMA_VERSION = 1
REDACTED = "<redacted>"


def rfc3339(ts: float | None) -> str | None:
    """Unix seconds -> ``"2025-01-31T12:00:00.000Z"`` (None stays None)."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def redact_url(url: str) -> str:
    """Drop userinfo and query values from a URL (elasticd.sensitive's one rule)."""
    return sensitive.redact_url(url, query_mask=REDACTED)


def redact_detail(detail: Any) -> Any:
    """Copy an event detail with credential-looking entries replaced, recursively."""
    if isinstance(detail, dict):
        return {k: REDACTED if sensitive.is_secret_name(str(k)) else redact_detail(v)
                for k, v in detail.items()}
    if isinstance(detail, list):
        return [redact_detail(v) for v in detail]
    return detail


def _age(now: float, ts: float | None) -> float | None:
    return None if ts is None else round(max(now - ts, 0.0), 3)


def _node(n: NodeStatus, now: float) -> dict[str, Any]:
    return {
        "node": n.node,
        "state": n.state,
        "member": n.member,
        "host": n.host,
        "ranks": list(n.ranks),
        "local_world_size": n.local_world_size,
        "restarts": n.restarts,
        "round": n.round,
        "heartbeat_at": rfc3339(n.heartbeat_at),
        "heartbeat_age_s": _age(now, n.heartbeat_at),
        "version": n.version,
        "pid": n.pid,
        "started_at": rfc3339(n.started_at),
        "last_exit": n.last_exit,
        "lost_at": rfc3339(n.lost_at),
        "log_dir": n.log_dir,
        "left": n.left,
        "step": n.step,
        "spare_reason": n.spare_reason,
    }


def _event(se: SeqEvent) -> dict[str, Any]:
    ev = se.event
    detail = ev.detail if isinstance(ev.detail, dict) else {}
    return {
        "seq": se.seq,
        "time": rfc3339(ev.time),
        "kind": ev.kind,
        "node": ev.node,
        "round": ev.round,
        "message": ev.message,
        "exit": exit_detail(detail) or None,
        "detail": redact_detail(detail),
    }


def job_summary(s: JobStatus) -> dict[str, Any]:
    """The ``job`` object: state, reason, health and round facts of one job."""
    return {
        "name": s.job,
        "state": s.state,
        "reason": s.reason,
        "degraded": s.degraded,
        "degraded_reasons": list(s.degraded_reasons),
        "exit_code": s.exit_code,
        "closed": s.closed,
        "stop_requested": s.stop_requested,
        "round": s.round,
        "round_phase": s.round_phase,
        "round_opened_at": rfc3339(s.round_opened_at),
        "round_completed_at": rfc3339(s.round_completed_at),
        "round_cause": s.round_cause,
        "round_changed": list(s.round_changed),
        "nodes": s.nodes_in_round,
        "min_nodes": s.min_nodes,
        "max_nodes": s.max_nodes,
        "world_size": s.world_size,
        "waiting_nodes": s.waiting_nodes,
        "recovered_at": rfc3339(s.recovered_at),
        "recovered_age_s": _age(s.now, s.recovered_at),
        "recovered_from": s.recovered_from,
    }


def _progress(s: JobStatus) -> dict[str, Any] | None:
    p = s.progress
    if p is None:
        return None
    updated = p.updated_at or None
    return {
        "step": p.step,
        "epoch": p.epoch,
        "samples_trained": p.samples_trained,
        "samples_per_s": p.samples_per_s,
        "world_size": p.world_size,
        "round": p.round,
        "updated_at": rfc3339(updated),
        "age_s": _age(s.now, updated),
        "checkpoint_cadence": ({"every_steps": p.save_every, "interval_s": p.save_interval_s,
                                "reason": p.cadence} if p.save_every else None),
    }


def _checkpoint(s: JobStatus) -> dict[str, Any] | None:
    c = s.checkpoint
    if c is None:
        return None
    return {
        "step": c.step,
        "round": c.round,
        "url": redact_url(c.manifest_url),
        "committed_at": rfc3339(c.committed_at),
        "age_s": _age(s.now, c.committed_at),
        "world_size": c.world_size,
    }


def _etcd(endpoints: Sequence[str], revision: int | None) -> dict[str, Any]:
    return {"endpoints": list(endpoints), "revision": revision}


def job_document(s: JobStatus, *, endpoints: Sequence[str]) -> dict[str, Any]:
    """The ``kind: "job"`` document for ``elasticd status --job NAME --json``."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "job",
        "generated_at": rfc3339(s.now),
        "etcd": _etcd(endpoints, s.revision),
        "job": job_summary(s),
        "progress": _progress(s),
        "checkpoint": _checkpoint(s),
        "nodes": [_node(n, s.now) for n in s.nodes],
        "events": [_event(e) for e in s.events],
        "warnings": [f"unreadable record at {k}" for k in s.unreadable],
    }


def job_list_document(statuses: Sequence[JobStatus], *, endpoints: Sequence[str],
                      revision: int | None, now: float) -> dict[str, Any]:
    """The ``kind: "job_list"`` document for ``elasticd status --json`` (no --job)."""
    jobs = []
    for s in statuses:
        row = job_summary(s)
        row["step"] = s.progress.step if s.progress else None
        row["samples_per_s"] = s.progress.samples_per_s if s.progress else None
        row["checkpoint_step"] = s.checkpoint.step if s.checkpoint else None
        row["checkpoint_committed_at"] = rfc3339(s.checkpoint.committed_at) if s.checkpoint else None
        row["checkpoint_age_s"] = _age(now, s.checkpoint.committed_at) if s.checkpoint else None
        jobs.append(row)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "job_list",
        "generated_at": rfc3339(now),
        "etcd": _etcd(endpoints, revision),
        "jobs": jobs,
    }


def error_document(exit_code: int, message: str, *, job: str | None, endpoints: Sequence[str],
                   now: float) -> dict[str, Any]:
    """The ``kind: "error"`` document: unknown job (3), etcd unreachable (4), bad config (78)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "error",
        "generated_at": rfc3339(now),
        "etcd": _etcd(endpoints, None),
        "job_name": job,
        "exit_code": exit_code,
        "error": message,
    }


def dumps(doc: dict[str, Any], *, pretty: bool = True) -> str:
    """Serialise a document (pretty for people, one line per document in --watch)."""
    if pretty:
        return json.dumps(doc, indent=2, sort_keys=False)
    return json.dumps(doc, separators=(",", ":"))


def load_schema() -> dict[str, Any]:
    """The shipped JSON Schema of all status documents (elasticd/status/schema.json)."""
    text = resources.files("elasticd.status").joinpath("schema.json").read_text("utf-8")
    return json.loads(text)
