"""Stop and drain marks: how ``elasticd stop``/``drain`` reach every agent of a job.

An operator's stop is a key in etcd, not a signal: it works from any machine that reaches
etcd (like ``elasticd status``), under the same TLS and auth, and it outlives the agents.

- ``/elasticd/<job>/control/stop``: the whole job stops. Every agent starts the drain it
  does on SIGTERM (all ranks stop after the same step, save, exit 0; the agent leaves),
  and an agent that starts later (systemd restarting it, a reboot) sees the mark and
  exits 0 without joining.
- ``/elasticd/<job>/control/drain/<node>``: only that node drains and leaves; the others
  re-form without it (no step lost). It stays out until the mark is cleared.
- ``elasticd start --job J [--node N]`` clears the marks; agents then join again.

The marks carry no lease on purpose: a stopped job must stay stopped while no agent runs.
They are written in a transaction that first compares that the job (its run id) and, for
a drain, the node (its live record) exist, so a typo in ``--job`` or ``--node`` touches no
key. Agents treat a mark's *presence* as the request; its body (who, when, why) is only
information, validated like any record read from etcd.

Pure functions (:func:`pending_request`, :func:`restart_hint`) decide; the few functions
that take an ``EtcdClient`` do the I/O.
"""

from __future__ import annotations

import getpass
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass

from elasticd.errors import ElasticdError
from elasticd.etcd.client import KV, EtcdClient
from elasticd.etcd.txn import Exists, Put
from elasticd.keys import JobKeys
from elasticd.records import NodeRecord, RecordError, StopMark

EXIT_NOT_FOUND = 3  # as `elasticd status`: job (or node) unknown


class NotFoundError(ElasticdError):
    """The named job or node does not exist in etcd; nothing was written."""

    exit_code = EXIT_NOT_FOUND


@dataclass(frozen=True)
class StopRequest:
    """A stop (``node`` None) or a drain of ``node``, as found in etcd."""

    job: str
    node: str | None
    mark: StopMark | None  # None: the key exists but its body is not a valid record

    @property
    def reason(self) -> str:
        """One line for logs and the job's event history."""
        what = f"job {self.job!r} stopped" if self.node is None else f"node {self.node!r} drained"
        who = f" by {self.mark.by}" if self.mark and self.mark.by else ""
        why = f": {self.mark.reason}" if self.mark and self.mark.reason else ""
        return f"{what}{who} (elasticd {'stop' if self.node is None else 'drain'}){why}"


def restart_hint(req: StopRequest) -> str:
    """The command that lets the agent(s) join again. Pure."""
    if req.node is None:
        return f"`elasticd start --job {req.job}` clears the stop, then start the agents again"
    return (f"`elasticd start --job {req.job} --node {req.node}` clears the drain, then start "
            "this node's agent again")


def _mark(kv: KV) -> StopMark | None:
    try:
        return StopMark.from_json(kv.value)
    except RecordError:
        return None


def pending_request(kvs: Iterable[KV], keys: JobKeys, node_id: str) -> StopRequest | None:
    """The stop or drain that applies to ``node_id``, given the keys under ``control/``.

    A job stop wins over a drain of the node (both mean "leave now", the stop's hint is the
    one that helps). Pure.

    Args:
        kvs: key-values under ``keys.control_prefix`` (others are ignored).
        keys: the job's keys.
        node_id: this agent's node id.

    Returns:
        The request, or None when this node may run.
    """
    table = {kv.key: kv for kv in kvs}
    if keys.stop_mark in table:
        return StopRequest(keys.job, None, _mark(table[keys.stop_mark]))
    mine = keys.drain_mark(node_id)
    if mine in table:
        return StopRequest(keys.job, node_id, _mark(table[mine]))
    return None


def read_request(client: EtcdClient, keys: JobKeys, node_id: str) -> StopRequest | None:
    """:func:`pending_request` on a fresh read of ``control/`` (one range request)."""
    kvs, _ = client.get_prefix(keys.control_prefix)
    return pending_request(kvs, keys, node_id)


def operator_name() -> str:
    """``user@host`` of whoever runs the command (shown in logs and events)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{user}@{socket.gethostname().split('.')[0]}"


def live_nodes(client: EtcdClient, keys: JobKeys) -> dict[str, NodeRecord | None]:
    """Node id -> record (None if unreadable) of every live agent of the job."""
    kvs, _ = client.get_prefix(keys.nodes_prefix)
    out: dict[str, NodeRecord | None] = {}
    for kv in kvs:
        node = kv.key[len(keys.nodes_prefix):]
        try:
            out[node] = NodeRecord.from_json(kv.value)
        except RecordError:
            out[node] = None
    return out


def _unknown_job(keys: JobKeys, endpoints: str) -> NotFoundError:
    return NotFoundError(
        f"job {keys.job!r} unknown: no run id at {keys.run_id} on {endpoints}; nothing was "
        "written. Check --job and --etcd (`elasticd status` lists the jobs)")


def write_stop(client: EtcdClient, keys: JobKeys, *, reason: str = "", by: str = "",
               now: float | None = None) -> None:
    """Mark the job stopped (one transaction: only if the job exists).

    Raises:
        NotFoundError: the job has no run id (never ran here); no key was written.
        EtcdUnavailableError: etcd did not answer.
    """
    mark = StopMark(requested_at=time.time() if now is None else now, by=by, reason=reason)
    ok = client.txn([Exists(keys.run_id)], [Put(keys.stop_mark, mark.to_json())])
    if not ok:
        raise _unknown_job(keys, client.endpoint_label())


def write_drain(client: EtcdClient, keys: JobKeys, node: str, *, reason: str = "",
                by: str = "", now: float | None = None) -> None:
    """Mark ``node`` drained (one transaction: only if the job and the live node exist).

    Raises:
        NotFoundError: unknown job, or no live agent ``node`` in it (the message lists the
            live nodes); no key was written.
        ConfigError: ``node`` is not a valid node id.
        EtcdUnavailableError: etcd did not answer.
    """
    mark = StopMark(requested_at=time.time() if now is None else now, by=by, reason=reason)
    node_key = keys.node(node)
    ok = client.txn([Exists(keys.run_id), Exists(node_key)],
                    [Put(keys.drain_mark(node), mark.to_json())])
    if ok:
        return
    if client.get(keys.run_id) is None:
        raise _unknown_job(keys, client.endpoint_label())
    live = sorted(live_nodes(client, keys))
    raise NotFoundError(
        f"node {node!r} is not a live node of job {keys.job!r} (live: "
        f"{', '.join(live) or 'none'}); nothing was written. Check --node "
        f"(`elasticd status --job {keys.job}` lists the nodes)")


def clear_marks(client: EtcdClient, keys: JobKeys, node: str | None = None) -> list[str]:
    """Remove the stop mark and every drain mark (``node`` None), or ``node``'s drain mark.

    Returns:
        The keys that were removed (empty: nothing was stopped or drained).

    Raises:
        NotFoundError: unknown job; nothing was touched.
    """
    if client.get(keys.run_id) is None:
        raise _unknown_job(keys, client.endpoint_label())
    kvs, _ = client.get_prefix(keys.control_prefix, keys_only=True)
    wanted = {keys.drain_mark(node)} if node is not None else {kv.key for kv in kvs}
    removed = [kv.key for kv in kvs if kv.key in wanted]
    for key in removed:
        client.delete(key)
    return removed
