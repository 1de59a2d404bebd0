"""Replica fingerprints: data-parallel ranks prove on a cadence that they hold equal state.

Why: DDP replicas must hold bit-identical parameters and optimizer state after every
optimizer step. A flipped bit, a bad device, a transfer that delivered wrong bytes or a
parameter updated outside DDP makes one replica diverge, and nothing else notices: the
ranks finish with different models, and elasticd would copy the diverged state to joiners
and peer replicas. So every N steps each rank hashes the bits of its model and optimizer
tensors (one int64 per rank), the hashes are all-gathered, and a rank that differs from the
majority is restored in memory from a majority rank (never the other way round).

HSDP: the ranks that must hold equal state are the replicas of one shard, i.e. the ranks
of one shard coordinate (one per node, the mesh's ``replicate`` dimension). Each rank
hashes its local shards (parameters and optimizer state), the hashes are all-gathered over
the world, each shard coordinate's group is judged on its own, and a diverged rank is
restored over its ``replicate`` group from a majority rank of the same shard. A pure FSDP
mesh has no replicas (every shard is held once): nothing to compare, no fingerprints.

Policy (pure, unit-tested): :func:`judge_replicas` / :func:`judge_groups` (who differs,
who may be a source) and
:func:`cadence_steps` (how often, from the measured cost: at most ``budget`` of step time).
Mechanism: :class:`ReplicaFingerprints`, called by ``ElasticLoop`` after each step.
With two replicas that differ there is no majority: both are named and the worker fails with
:class:`ReplicaDivergedError`, so the agent restarts the job from the newest checkpoint.

A divergence is an event: each rank named reports itself to its agent
(:class:`~elasticd.control.messages.DivergenceReport`), which records a ``diverged`` event
naming the rank and the node (``elasticd status``, the goodput ledger's ``integrity``
cause) and counts ``elasticd_replica_divergences_total``.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.distributed as dist

from elasticd.control.messages import MAX_STR, DivergenceReport
from elasticd.errors import ConfigError, ElasticdError
from elasticd.worker.recovery_plan import NO_STATE
from elasticd.worker.sharded import local_of

log = structlog.get_logger(__name__)

# The share of step time fingerprints may cost (cadence "auto").
DEFAULT_BUDGET = 0.005
# Steps before the first check, when the cadence is still to be measured.
FIRST_CHECK_STEPS = 10
# The longest cadence "auto" picks: a divergence is found within this many steps.
MAX_EVERY_STEPS = 1000
_MASK = (1 << 63) - 1


class ReplicaDivergedError(ElasticdError):
    """Replicas disagree and no majority can restore them (two ranks, or a restore that did
    not take): the worker fails and the job restarts from the newest checkpoint."""


@dataclass(frozen=True)
class ReplicaVerdict:
    """Who differs from the majority, the rank to restore them from, and why.

    Attributes:
        diverged: ranks whose state differs from the majority's (with no majority: every
            rank that disagrees, e.g. the pair of a two-rank job). Empty: all agree.
        source: a majority rank to restore from; None when all agree or no majority exists.
        reason: a human-readable account for the event.
    """

    diverged: tuple[int, ...]
    source: int | None
    reason: str


def judge_replicas(prints: Sequence[int], ranks: Sequence[int] | None = None) -> ReplicaVerdict:
    """Judge one replica group's fingerprints.

    Args:
        prints: the group's fingerprints, one per member.
        ranks: the members' global ranks (default: ``0..n-1``); the verdict names these.
    """
    ranks = list(range(len(prints))) if ranks is None else list(ranks)
    counts = Counter(prints)
    if len(counts) <= 1:
        return ReplicaVerdict((), None, "all replicas agree")
    value, n = counts.most_common(1)[0]
    if n * 2 > len(prints):
        odd = tuple(r for r, p in zip(ranks, prints, strict=True) if p != value)
        source = ranks[prints.index(value)]
        return ReplicaVerdict(odd, source, f"rank(s) {list(odd)} differ from the majority "
                                           f"({n} of {len(prints)} agree); restored from rank {source}")
    return ReplicaVerdict(tuple(ranks), None,
                          f"no majority among {len(prints)} replicas ({dict(counts.most_common())} "
                          "fingerprints): none can be trusted as a source")


def judge_groups(prints: Sequence[int], keys: Sequence[int]) -> dict[int, ReplicaVerdict]:
    """Judge every replica group of the world at once (index = global rank).

    Ranks with the same ``keys`` value must hold equal state: under DDP every rank (one
    key), under HSDP the ranks of one shard coordinate (one per replica, i.e. per node).
    A group of one rank has nothing to compare and is always agreed.

    Returns:
        global rank -> the verdict of its group (global ranks in it).
    """
    members: dict[int, list[int]] = {}
    for rank, key in enumerate(keys):
        members.setdefault(key, []).append(rank)
    out: dict[int, ReplicaVerdict] = {}
    for ranks in members.values():
        verdict = judge_replicas([prints[r] for r in ranks], ranks)
        out.update(dict.fromkeys(ranks, verdict))
    return out


def offered_step(step: int, *, suspect: bool, finite: bool = True) -> int:
    """The step a rank offers when a re-formation picks the source of a state transfer
    (:func:`elasticd.worker.recovery_plan.plan_replication`): its own, or ``NO_STATE``
    while its fingerprint was named diverged and no restore has verified it since, or
    while its state holds a NaN or an infinity (``finite`` False).

    Why: the source is the first rank holding the newest step, and every rank of a DDP job
    holds the same step, so a diverged rank 0 whose restore was cut short by a peer's death
    would otherwise send its state to every rank (a joiner included). Offering no state it
    is planned among those behind; with every rank suspect, nobody holds a state and the
    job loads the newest checkpoint (the next tier), instead of spreading the corruption.
    A non-finite state is never sent either: another rank holding the step is the source,
    and with none the checkpoint is loaded (one tier down each time, never back up).
    """
    return NO_STATE if suspect or not finite else step


def cadence_steps(check_cost_s: float, step_time_s: float, budget: float = DEFAULT_BUDGET,
                  max_every: int = MAX_EVERY_STEPS) -> int:
    """Steps between checks so that a check costs at most ``budget`` of step time.

    Returns:
        ``ceil(check_cost / (budget * step_time))``, at least 1 and at most ``max_every``.
    """
    if step_time_s <= 0 or check_cost_s <= 0:
        return max_every if step_time_s <= 0 else 1
    return max(1, min(max_every, math.ceil(check_cost_s / (budget * step_time_s))))


def state_tensors(state: Mapping[str, Any]) -> list[torch.Tensor]:
    """Every tensor replicas must hold equal: the modules' parameters and the optimizers'
    state, in a fixed order (the same on every rank).

    Buffers are left out on purpose: under DDP they are rank-local between broadcasts
    (BatchNorm's running statistics are broadcast from rank 0 at the start of a forward and
    then updated from each rank's own batch), so a fingerprint over them would name every
    BatchNorm model's ranks as diverged and restart the job in a loop.
    """
    out: list[torch.Tensor] = []
    for _, value in sorted(state.items()):
        if isinstance(value, torch.nn.Module):
            out += [t for _, t in sorted(value.named_parameters())]
        elif isinstance(value, torch.optim.Optimizer):
            for _, slot in sorted(value.state_dict()["state"].items()):
                out += [t for _, t in sorted(slot.items()) if isinstance(t, torch.Tensor)]
    # A sharded (FSDP2 / HSDP) tensor counts by its local shard: the replicas of one shard
    # coordinate compare those, and a restore writes into them (views of the shard).
    return [local_of(t.detach()) for t in out]


def fingerprint(tensors: Sequence[torch.Tensor]) -> int:
    """A hash of the tensors' bits: any flipped bit changes it (one int64-range int)."""
    sums = []
    for t in tensors:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        # Summed as int64 words where the size allows: 20x faster than widening int32
        # words (measured on CPU), and a flipped bit still moves the sum by 2**k.
        if raw.numel() % 8 == 0:
            sums.append(raw.view(torch.int64).sum())
        else:
            sums.append((raw.view(torch.int32) if raw.numel() % 4 == 0 else raw).sum(dtype=torch.int64))
    h = 0
    for s in torch.stack(sums).tolist() if sums else []:
        h = (h * 1000003 + int(s)) & _MASK
    return h


def non_finite(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Indexes of the floating-point tensors holding a NaN or an infinity."""
    return [i for i, t in enumerate(tensors)
            if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def state_is_finite(state: Mapping[str, Any], log: Any, event: str, step: int) -> bool:
    """Does this rank's state (its local shards, when sharded) hold only finite values?
    If not, log ``event`` with the offending tensors: such a state is never a source of a
    transfer, and one just received sends the job one tier down (the checkpoint)."""
    bad = non_finite(tensors := state_tensors(state))
    if bad:
        log.warning(event, step=step, tensors=len(tensors), non_finite=bad[:5],
                    reason="NaN or infinity in the model or optimizer state: not a source; "
                           "the next tier is used")
    return not bad


# This rank's replica group: (a key equal on exactly the ranks that must hold equal state,
# the process group those ranks form; None: the default group, i.e. every rank).
Replicas = Callable[[], tuple[int, Any]]


def ddp_replicas() -> tuple[int, Any]:
    """Under DDP every rank is a replica of every other: one key, the default group."""
    return 0, None


def hsdp_replicas(sharded: Any) -> Replicas:
    """Under HSDP the replicas of a rank's shards are the ranks of its shard coordinate on
    the other nodes: the mesh's ``replicate`` dimension (re-read after each re-formation)."""
    return lambda: (int(sharded.coordinate), sharded.mesh.get_group("replicate"))


class ReplicaFingerprints:
    """Checks that the replicas of each rank's state hold equal state, every ``every`` steps.

    Args:
        state: the loop's state (modules and optimizers are fingerprinted; sharded ones by
            their local shards).
        progress: the loop's progress dict, which travels with the state: the agreed
            cadence lives there as ``fingerprint_every``, so joiners and restarts use it.
        every: steps between checks; None: measured ("auto", <= ``budget`` of step time).
        report: where this rank reports its own divergence (never blocks); default: its
            agent over the control channel, when it runs under one.
        replicas: this rank's replica group (:func:`ddp_replicas`, :func:`hsdp_replicas`).
    """

    def __init__(self, state: Mapping[str, Any], progress: dict[str, int], *,
                 every: int | None = None, budget: float = DEFAULT_BUDGET,
                 report: Callable[[DivergenceReport], None] | None = None,
                 replicas: Replicas = ddp_replicas) -> None:
        if every is not None and every < 1:
            raise ConfigError(f"fingerprint_every must be >= 1 (or 0: off, None: measured), "
                              f"got {every}")
        self._state = state
        self._progress = progress
        self._fixed = every
        self._budget = budget
        self._report = report if report is not None else _report_to_agent
        self._replicas = replicas
        self._last_step_at: float | None = None
        self._step_time_s = 0.0
        self.diverged: list[tuple[int, ...]] = []  # one entry per divergence found
        # The latest checks' own times (hash + gather, restore included), for measurements.
        self.check_s: deque[float] = deque(maxlen=1000)
        # This rank was named diverged and no restore has verified it since: it is never a
        # source for another rank's state (:func:`offered_step`).
        self.suspect = False

    def every(self) -> int:
        if self._fixed is not None:
            return self._fixed
        return int(self._progress.get("fingerprint_every", FIRST_CHECK_STEPS))

    def step_done(self, steps_done: int) -> None:
        """After an optimizer step (a collective on the check steps, on every rank)."""
        now = time.perf_counter()
        if self._last_step_at is not None:
            dt = now - self._last_step_at
            self._step_time_s = dt if not self._step_time_s else 0.8 * self._step_time_s + 0.2 * dt
        if dist.is_initialized() and dist.get_world_size() > 1 and steps_done % self.every() == 0:
            self.check(steps_done)
            self.check_s.append(time.perf_counter() - now)
        self._last_step_at = time.perf_counter()  # a check's own time is not step time

    def check(self, steps_done: int) -> ReplicaVerdict:
        """Compare fingerprints within each replica group; restore diverged ranks from their
        group's majority. Returns this rank's group's verdict.

        Raises:
            ReplicaDivergedError: a group has no majority, or a restored rank still differs
                (on every rank: each sees every group's fingerprints).
        """
        t0 = time.perf_counter()
        tensors = state_tensors(self._state)
        mine = fingerprint(tensors)
        cost_s = time.perf_counter() - t0
        proposal = cadence_steps(cost_s, self._step_time_s, self._budget)
        key, group = self._replicas()
        prints, proposals, keys = self._gather(mine, proposal, key)
        if self._fixed is None:
            self._progress["fingerprint_every"] = max(proposals)  # the same on every rank
        verdicts = judge_groups(prints, keys)
        named = tuple(sorted(r for r, v in verdicts.items() if r in v.diverged))
        me = dist.get_rank()
        verdict = verdicts[me]
        if not named:
            return verdict
        self.diverged.append(named)
        reason = "; ".join(sorted({v.reason for v in verdicts.values() if v.diverged}))
        log.warning("replica_diverged", step=steps_done - 1, ranks=list(named),
                    source=verdict.source, reason=reason)
        if me in named:  # the event names this rank and its node
            self.suspect = True
            self._report(DivergenceReport(rank=me, step=max(steps_done - 1, -1),
                                          source=-1 if verdict.source is None else verdict.source,
                                          reason=verdict.reason[:MAX_STR]))
        if any(v.diverged and v.source is None for v in verdicts.values()):
            raise ReplicaDivergedError(f"replicas diverged at step {steps_done - 1}: {reason}")
        if verdict.source is not None:  # this rank's group restores from its majority
            device = _group_device()
            for t in tensors:
                _broadcast(t, verdict.source, device, group)
        again, bad, _ = self._gather(fingerprint(tensors), len(non_finite(tensors)), key)
        still = [r for r, v in judge_groups(again, keys).items() if v.diverged]
        if still:
            raise ReplicaDivergedError(f"rank(s) {still} still differ after a restore from "
                                       f"their replicas' majority (step {steps_done - 1})")
        if any(bad):  # the majority's own state is unusable: fall back to the checkpoint, once
            raise ReplicaDivergedError(f"the state restored at step {steps_done - 1} holds "
                                       f"non-finite values on rank(s) {[r for r, b in enumerate(bad) if b]}: "
                                       "restarting from the newest checkpoint")
        self.suspect = False
        log.info("replica_restored", step=steps_done - 1, ranks=list(named), source=verdict.source)
        return verdict

    @staticmethod
    def _gather(*values: int) -> tuple[list[int], ...]:
        """All-gather one row of ints per rank; returns the columns (index = global rank)."""
        local = torch.tensor(values, dtype=torch.int64, device=_group_device())
        out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(out, local)
        rows = [row.tolist() for row in out]
        return tuple([int(r[i]) for r in rows] for i in range(len(values)))


def _report_to_agent(msg: DivergenceReport) -> None:
    """Send ``msg`` to this worker's agent (fire-and-forget); nothing without an agent."""
    from elasticd.worker.context import control_client

    client = control_client()
    if client is not None:
        client.send(msg)


def _group_device() -> torch.device:
    """Where the default group's collectives run: the CPU for gloo, the current GPU else."""
    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _broadcast(t: torch.Tensor, src: int, device: torch.device, group: Any = None) -> None:
    """Broadcast ``t`` in place from global rank ``src`` over ``group`` (None: the default
    group), through ``device`` if it lives elsewhere (e.g. Adam's CPU step counter on NCCL)."""
    if t.device == device:
        dist.broadcast(t, src, group=group)
        return
    tmp = t.to(device)
    dist.broadcast(tmp, src, group=group)
    t.copy_(tmp)
