"""A synthetic job written straight into etcd, for status tests and benchmarks.

It writes what a running job's agents would have written: node records on a lease,
the round state, join keys, a slice of c10d store keys (which `status` must skip),
progress, the checkpoint pointer and a full event history. Writes go in transactions
of ``BATCH`` operations (etcd's default limit is 128 per transaction), so a 1,000-node
job is written in about thirty requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from elasticd.etcd.client import EtcdClient
from elasticd.etcd.txn import Put
from elasticd.history import History, Sample
from elasticd.keys import JobKeys
from elasticd.records import CheckpointPointer, Event, NodeRecord, Progress, RoundState

BATCH = 100
_OLD_KINDS = ("join", "round", "restart", "notice", "drain", "leave", "failure", "lost", "hang")


@dataclass(frozen=True)
class SyntheticJob:
    """Shape of the synthetic job.

    ``nodes`` members in the current round; the last ``lost`` of them have no node record
    (their lease expired); the first ``draining`` records are in state "draining";
    ``waiting`` extra agents ask to join the next round. Events are all older than 15
    minutes except, with ``recent_failure``, one worker failure a minute ago.
    """

    job: str
    nodes: int = 1000
    ranks_per_node: int = 8
    max_nodes: int | None = None  # None: == nodes
    min_nodes: int = 1
    lost: int = 0
    draining: int = 0
    waiting: int = 0
    events: int = 256
    store_keys_per_node: int = 2
    round: int = 12
    step: int = 123_456
    recent_failure: bool = False
    checkpoint: bool = True
    history: int = 0  # samples in /elasticd/<job>/history (one every 10 s up to now)
    history_loss: bool = True  # the samples carry a loss

    def member(self, i: int) -> str:
        return f"node-{i:04d}"


def _put_all(client: EtcdClient, items: list[tuple[str, str, int | None]]) -> None:
    for start in range(0, len(items), BATCH):
        client.txn([], [Put(k, v, lease=lease) for k, v, lease in items[start:start + BATCH]])


def write_synthetic_job(client: EtcdClient, spec: SyntheticJob, *, now: float,
                        lease_ttl_s: int = 600) -> int:
    """Write ``spec`` under ``/elasticd/<job>/``; returns the lease the live keys sit on.

    Revoking the returned lease makes every node record disappear at once, as if all
    agents had died.
    """
    keys = JobKeys(spec.job)
    lease = client.grant_lease(lease_ttl_s)
    members = [spec.member(i) for i in range(spec.nodes)]
    items: list[tuple[str, str, int | None]] = []
    rs = RoundState(round=spec.round, phase="final", members=members, min_nodes=spec.min_nodes,
                    max_nodes=spec.max_nodes or spec.nodes, opened_at=now - 3700,
                    completed_at=now - 3600)
    items.append((keys.rdzv_state, rs.to_json(), None))
    live = spec.nodes - spec.lost
    for i, node in enumerate(members):
        items.append((keys.join(spec.round, node), "{}", lease))
        for k in range(spec.store_keys_per_node):
            items.append((f"{keys.store_prefix(spec.round)}torchelastic/{node}/{k}", "x" * 64, None))
        if i >= live:
            continue  # lost: its record went with its lease
        rec = NodeRecord(
            node=node, host=f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}", pid=1000 + i,
            version="0.1.0", started_at=now - 7200, state="draining" if i < spec.draining else "training",
            round=spec.round, ranks=list(range(i * spec.ranks_per_node, (i + 1) * spec.ranks_per_node)),
            restarts=i % 3, heartbeat_at=now - (i % 5), local_world_size=spec.ranks_per_node,
        )
        items.append((keys.node(node), rec.to_json(), lease))
    for j in range(spec.waiting):
        node = f"spare-{j:04d}"
        items.append((keys.join(spec.round + 1, node), "{}", lease))
        rec = NodeRecord(node=node, host=f"192.168.0.{j % 256}", pid=9000 + j, version="0.1.0",
                         started_at=now - 30, state="joining", heartbeat_at=now - 1)
        items.append((keys.node(node), rec.to_json(), lease))
    world = spec.nodes * spec.ranks_per_node
    items.append((keys.progress, Progress(
        round=spec.round, step=spec.step, epoch=3, samples_trained=spec.step * 1024,
        samples_per_s=8192.5, world_size=world, updated_at=now - 2).to_json(), None))
    if spec.checkpoint:
        items.append((keys.checkpoint_latest, CheckpointPointer(
            step=spec.step - spec.step % 1000, round=spec.round,
            manifest_url=f"s3://ckpt/{spec.job}/step-{spec.step - spec.step % 1000}/manifest.json",
            committed_at=now - 240, world_size=world).to_json(), None))
    items += [(keys.event(seq), ev.to_json(), None) for seq, ev in _events(spec, now)]
    if spec.history:
        items.append((keys.history, synthetic_history(spec, now).to_json(), None))
    _put_all(client, items)
    return lease


def _events(spec: SyntheticJob, now: float) -> list[tuple[int, Event]]:
    out = []
    n = spec.events
    for i in range(n):
        t = now - 900 - (n - i) * 30  # all older than 15 minutes
        kind = _OLD_KINDS[i % len(_OLD_KINDS)]
        node = spec.member(i % max(spec.nodes, 1))
        detail: dict = {}
        message = f"{kind} of {node}"
        if kind == "failure":
            detail = {"exit_code": 1} if i % 2 else {"signal": "SIGKILL"}
            message = f"worker rank {i % 8} on {node} failed"
        elif kind == "restart":
            detail = {"cause": "failure"}
        out.append((1000 + i, Event(time=t, kind=kind, node=node, round=spec.round - 1,
                                    message=message, detail=detail)))
    if spec.recent_failure and n:
        out[-1] = (out[-1][0], Event(time=now - 60, kind="failure", node=spec.member(0),
                                     round=spec.round - 1, message="worker rank 3 exited with 1",
                                     detail={"exit_code": 1}))
    if spec.lost:
        # A lost event for each lost member, in time order, after the history above.
        base = out[-1][0] + 1 if out else 1000
        for k in range(spec.lost):
            node = spec.member(spec.nodes - spec.lost + k)
            out.append((base + k, Event(time=now - 5, kind="lost", node=node, round=spec.round,
                                        message=f"lease of {node} expired", detail={})))
    return out


def synthetic_history(spec: SyntheticJob, now: float) -> History:
    """``spec.history`` samples 10 s apart ending now: the world drops to half for a third of
    the run (as after a lost node), steps advance at ~2/s, the loss decays, and a checkpoint
    is committed every 100 steps."""
    n = spec.history
    world = spec.nodes * spec.ranks_per_node
    samples = []
    for i in range(n):
        size = world // 2 if n // 3 <= i < 2 * n // 3 else world
        step = spec.step - (n - 1 - i) * 20
        samples.append(Sample(t=now - (n - 1 - i) * 10, step=step, world_size=size,
                              samples_per_s=float(size * 64), round=spec.round,
                              loss=(1.0 / (1 + i) if spec.history_loss else None),
                              checkpoint_step=step - step % 100))
    return History(interval_s=10.0, samples=tuple(samples))
