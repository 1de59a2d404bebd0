"""The replay simulator: walk a spot availability trace and charge a launcher its event costs.

A trace says how many nodes were available at each tick (5 minutes apart). Between two
ticks the count changes by ``d``; each of those ``|d|`` node arrivals or losses happens at
some instant inside the interval, chosen by a :class:`Placement` (the trace cannot say
when). The simulator then plays the job under one launcher's :class:`SystemCosts`:

- every node the job holds is paid for (``held`` = available nodes, capped at ``max_nodes``);
- a node trains new steps only while it is a member of a formed world and the world is not
  stalled (detecting a fault, re-forming, restarting, draining, a cold start);
- a launcher that restarts from a checkpoint after a fault also loses the node-seconds
  trained since the last checkpoint (charged as *retrained*);
- a joiner is idle (but paid) from its arrival until it trains in the new world
  (``join_s``); the members pause for the last ``join_pause_s`` of that, so that they and
  the joiner take their first step at the new world together, as ``recovery.py`` measures
  both (the pause ends at that first step);
- below ``min_nodes`` the job waits; it starts cold once enough nodes are held again.

Capacity goodput = useful node-seconds / available node-seconds over the whole trace: the
share of paid node-time that turned into new training. Everything here is pure arithmetic
over the trace and the costs, so it is unit-tested without processes.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

from elasticd.checkpoint.cadence import choose_save_every


class Placement(enum.Enum):
    """Where inside a tick's interval its node events fall (the trace cannot say)."""

    EARLY = "early"      # right after the tick that saw the old count
    MIDDLE = "middle"    # halfway through the interval
    LATE = "late"        # just before the tick that sees the new count
    UNIFORM = "uniform"  # each event at its own uniform offset (seeded)


@dataclass(frozen=True)
class SystemCosts:
    """What one launcher's events cost, in seconds of wall time (measured, see costs.py).

    Attributes:
        name: the launcher as the table shows it.
        kill_s: fault -> first step at the new world for a node lost without notice; the
            surviving members are stalled for all of it.
        kill_rollback: the survivors restart from the newest checkpoint (the node-seconds
            trained since it are retrained); False when survivors keep their state in memory.
        uses_notice: a preemption notice makes the node drain (save, leave at a step
            boundary) at the notice; False: the notice is ignored and the loss is a kill.
        drain_s: notice -> first step at the new world (members stalled), when used.
        join_s: a node's arrival -> it trains in the new world (the joiner is idle for it).
        join_pause_s: how long the members stop training for a join: the last part of
            ``join_s`` (they resume with the joiner).
        join_rollback: a join restarts the members from the newest checkpoint.
        cold_start_s: nodes held -> first step, for a job that starts (or restarts) from zero.
        store_host_fatal: the job's rendezvous store lives in one node's launcher (torchrun's
            c10d backend), so losing that node ends the job; its scheduler starts it again
            after ``relaunch_s``, cold, from the newest checkpoint.
        relaunch_s: a scheduler's time to notice a dead job and start it again.
        elastic: False for a fixed-size job that trains only at ``max_nodes``.
        drain_lead_s: a launcher that uses the notice drains when this many seconds are left
            before the deadline (elasticd's ``preemption.drain_lead_s``); None: at the notice.
    """

    name: str
    kill_s: float
    kill_rollback: bool
    uses_notice: bool
    drain_s: float
    join_s: float
    join_pause_s: float
    join_rollback: bool
    cold_start_s: float
    store_host_fatal: bool = False
    relaunch_s: float = 60.0
    elastic: bool = True
    drain_lead_s: float | None = None


@dataclass(frozen=True)
class JobShape:
    """The job being replayed: node bounds, checkpoint cadence, the notice a cloud gives."""

    min_nodes: int = 1
    max_nodes: int = 16
    checkpoint_every_s: float = 600.0
    notice_s: float = 0.0        # AWS gives 120 s, GCP 30 s; 0 = no notice
    step_s: float = 1.0          # one training step's wall time (to count steps retrained)
    # Seconds each save blocks the loop (charged to every member as "checkpoint_block") and
    # takes to be written; 0: saves are free (the replays before issue 49).
    save_block_s: float = 0.0
    save_write_s: float = 0.0
    # [checkpoint] every = "auto": after every save and every rollback the interval is
    # re-chosen as elasticd's workers do (checkpoint.cadence.choose_save_every), from the
    # rollbacks seen so far over the time so far; checkpoint_every_s is the first interval.
    checkpoint_auto: bool = False


@dataclass
class Ledger:
    """Where one replay's node-seconds went (all in node-seconds unless named ``_s``)."""

    available: float = 0.0
    paid: float = 0.0
    useful: float = 0.0
    retrained: float = 0.0
    steps_retrained: float = 0.0
    events: dict[str, int] = field(default_factory=dict)
    #: Node-seconds that trained nothing new, by cause; with ``useful`` they add up to
    #: ``available``: "cold_start", "kill", "drain", "join_pause" (the world stalled for
    #: that), "join_start" (a joiner starting), "notice_lead" (a drained node still held),
    #: "below_min" (waiting for enough nodes), "retrained" (rolled back to a checkpoint).
    lost: dict[str, float] = field(default_factory=dict)

    def charge(self, cause: str, node_s: float) -> None:
        if node_s > 0:
            self.lost[cause] = self.lost.get(cause, 0.0) + node_s

    @property
    def goodput(self) -> float:
        return self.useful / self.available if self.available else 0.0


@dataclass(frozen=True, order=True)
class _Event:
    t: float
    order: int            # ties: losses before notices before gains, then input order
    kind: str             # "loss" | "notice" | "gain" | "pause" | "ready"
    node: int = -1


def node_events(counts: list[int], gap_s: float, placement: Placement, seed: int,
                notice_s: float) -> list[_Event]:
    """The trace as node arrivals and losses (and the notice before each loss).

    Nodes are identities: a loss takes one of the available nodes at random (seeded), so a
    joiner still starting, or the node that hosts a launcher's store, can be the one lost.
    """
    rng = random.Random(seed)
    out: list[_Event] = []
    present: list[int] = list(range(counts[0]))
    next_id = counts[0]
    seq = 0
    for i in range(len(counts) - 1):
        d = counts[i + 1] - counts[i]
        base = i * gap_s
        for _ in range(abs(d)):
            if placement is Placement.EARLY:
                u = 0.0
            elif placement is Placement.MIDDLE:
                u = 0.5
            elif placement is Placement.LATE:
                u = 0.999
            else:
                u = rng.random()
            t = base + u * gap_s
            seq += 1
            if d > 0:
                out.append(_Event(t, 2 * 10**9 + seq, "gain", next_id))
                present.append(next_id)
                next_id += 1
            else:
                node = present.pop(rng.randrange(len(present)))
                out.append(_Event(t, seq, "loss", node))
                if notice_s > 0:
                    out.append(_Event(max(0.0, t - notice_s), 10**9 + seq, "notice", node))
    return sorted(out)


def simulate(counts: list[int], gap_s: float, costs: SystemCosts, job: JobShape,
             placement: Placement = Placement.UNIFORM, seed: int = 0) -> Ledger:
    """Replay ``counts`` (nodes available per tick) under ``costs``; return the ledger.

    The job starts when the trace starts, with a cold start, and ends at the last tick.
    """
    if not counts:
        raise ValueError("empty trace")
    if max(counts) > job.max_nodes:
        # Every available node is held (a job asks for the whole pool); a pool larger than
        # the job would need a model of which spare nodes it picks up, and we have none.
        raise ValueError(f"the trace reaches {max(counts)} nodes, above max_nodes={job.max_nodes}")
    end = (len(counts) - 1) * gap_s
    led = Ledger()
    lead = 0.0
    if costs.uses_notice:
        lead = job.notice_s if costs.drain_lead_s is None else min(job.notice_s, costs.drain_lead_s)
    events = node_events(counts, gap_s, placement, seed, lead)
    pending: list[_Event] = list(events)

    avail = counts[0]                            # nodes the trace has now
    held: set[int] = set(range(counts[0]))       # those the job holds (paid): all of them
    store_host = -1                              # the node whose launcher holds the store
    members: set[int] = set()                    # nodes in the formed world
    joining: set[int] = set()                    # held, starting, not yet members
    draining: set[int] = set()                   # noticed: left the world, still held
    stalled_until = 0.0
    stall_cause = "cold_start"
    formed = False
    since_ckpt = 0.0          # useful node-seconds since the last checkpoint
    since_ckpt_wall = 0.0     # wall seconds of training since the last checkpoint
    every_s = job.checkpoint_every_s
    rollbacks = 0
    t = 0.0

    def count(kind: str) -> None:
        led.events[kind] = led.events.get(kind, 0) + 1

    def rechoose(now: float) -> None:
        nonlocal every_s
        if job.checkpoint_auto:
            every_s = choose_save_every(blocking_s=job.save_block_s, write_s=job.save_write_s,
                                        step_time_s=job.step_s, losses=rollbacks, observed_s=now,
                                        first_every=1).interval_s
            led.events["auto_interval_s"] = round(every_s)  # the last one chosen

    def rollback() -> None:
        nonlocal since_ckpt, since_ckpt_wall, rollbacks
        if since_ckpt_wall > 0:
            rollbacks += 1
            rechoose(t)
        led.useful -= since_ckpt
        led.retrained += since_ckpt
        led.charge("retrained", since_ckpt)
        led.steps_retrained += since_ckpt_wall / job.step_s
        since_ckpt = since_ckpt_wall = 0.0

    def checkpointed(now: float | None = None) -> None:
        """A save; ``now``: a periodic one, whose copy blocks the members (a drain's save
        is inside the measured drain cost)."""
        nonlocal since_ckpt, since_ckpt_wall
        since_ckpt = since_ckpt_wall = 0.0
        if now is not None and job.save_block_s > 0:
            stall(now, job.save_block_s, "checkpoint_block")
        rechoose(t if now is None else now)

    def can_train(n: int) -> bool:
        return n >= job.min_nodes if costs.elastic else n >= job.max_nodes

    def stall(now: float, seconds: float, cause: str) -> None:
        """The world trains nothing until ``seconds`` after ``now``; with a stall already in
        progress, the later end wins and names the cause from here on."""
        nonlocal stalled_until, stall_cause
        until = now + seconds
        if until > stalled_until:
            stalled_until, stall_cause = until, cause

    def start_cold(now: float, extra_s: float = 0.0) -> None:
        nonlocal formed, store_host
        members.clear()
        members.update(sorted(held - draining)[: job.max_nodes])
        store_host = min(members, default=-1)
        joining.clear()
        formed = True
        stall(now, extra_s + costs.cold_start_s, "cold_start")
        count("cold_start")

    def stop_world() -> None:
        nonlocal formed
        formed = False
        joining.clear()
        members.clear()

    def advance(to: float) -> None:
        """Account [t, to): paid and available node-time, training where it happens."""
        nonlocal t, since_ckpt, since_ckpt_wall
        if to <= t:
            return
        span = to - t
        led.available += avail * span
        led.paid += len(held) * span
        led.charge("join_start", len(joining) * span)
        led.charge("notice_lead", len(draining) * span)
        if not formed:
            led.charge("below_min", len(held - draining) * span)
        if formed and members:
            led.charge(stall_cause, len(members) * max(0.0, min(to, stalled_until) - t))
            start = max(t, stalled_until)
            while start < to:
                # Train until the next checkpoint or the end of the span.
                to_ckpt = every_s - since_ckpt_wall
                step = min(to - start, to_ckpt)
                led.useful += len(members) * step
                since_ckpt += len(members) * step
                since_ckpt_wall += step
                start += step
                if since_ckpt_wall >= every_s - 1e-9:
                    checkpointed(start)
                    if stalled_until > start:  # the save's blocking copy
                        blocked = min(to, stalled_until) - start
                        led.charge(stall_cause, len(members) * blocked)
                        start += blocked
        t = to

    if can_train(len(held)):
        start_cold(0.0)

    while pending:
        ev = pending.pop(0)
        if ev.t > end:
            break
        advance(ev.t)
        now = ev.t
        if ev.kind == "gain":
            avail += 1
            held.add(ev.node)
            if not formed:
                if can_train(len(held - draining)):
                    start_cold(now)
                continue
            if not costs.elastic:
                continue
            joining.add(ev.node)
            pause_at = now + max(0.0, costs.join_s - costs.join_pause_s)
            _insert(pending, _Event(pause_at, 3 * 10**9, "pause", ev.node))
            _insert(pending, _Event(now + costs.join_s, 3 * 10**9 + 1, "ready", ev.node))
        elif ev.kind == "pause":
            # The members stop for the joiner (a restart, or a live re-formation's pause).
            # A pause in progress for another joiner absorbs this one up to its end, and
            # only what this one needs beyond that is added: the bound that favours a
            # restart-based launcher, whose rendezvous admits every node registered before
            # it closes. Queued one after another instead, torchrun's replay came out 29
            # points below what it measured; shared, 3 points above (docs/benchmarks.md).
            if ev.node not in joining or not formed:
                continue  # lost while it started, or nothing to pause
            if costs.join_rollback:
                rollback()
            stall(now, costs.join_pause_s, "join_pause")
        elif ev.kind == "ready":
            if ev.node not in joining:
                continue  # lost while it started
            joining.discard(ev.node)
            if not formed:
                continue
            count("join")
            members.add(ev.node)
        elif ev.kind == "notice":
            if ev.node not in held or ev.node in draining:
                continue
            draining.add(ev.node)
            if ev.node in joining:
                joining.discard(ev.node)
                continue
            if ev.node not in members:
                continue
            count("drain")
            members.discard(ev.node)
            checkpointed()  # the drain saves at the agreed step
            if not can_train(len(members)):
                stop_world()
                continue
            stall(now, costs.drain_s, "drain")
        elif ev.kind == "loss":
            avail -= 1
            held.discard(ev.node)
            draining.discard(ev.node)
            if ev.node in joining:
                joining.discard(ev.node)
                continue
            if ev.node not in members:
                continue
            count("kill")
            members.discard(ev.node)
            if costs.store_host_fatal and ev.node == store_host:
                count("job_lost")
                rollback()
                stop_world()
                if can_train(len(held - draining)):
                    start_cold(now, costs.relaunch_s)
                continue
            if not costs.elastic or not can_train(len(members)):
                rollback()
                stop_world()
                if can_train(len(held - draining)):
                    start_cold(now)
                continue
            if costs.kill_rollback:
                rollback()
            stall(now, costs.kill_s, "kill")
    advance(end)
    return led


def _insert(queue: list[_Event], ev: _Event) -> None:
    """Insert ``ev`` keeping ``queue`` sorted (queues are short: one tick's events)."""
    lo, hi = 0, len(queue)
    while lo < hi:
        mid = (lo + hi) // 2
        if queue[mid] < ev:
            lo = mid + 1
        else:
            hi = mid
    queue.insert(lo, ev)
