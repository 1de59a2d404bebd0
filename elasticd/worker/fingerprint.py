"""Replica fingerprints: data-parallel ranks prove on a cadence that they hold equal state.

Why: DDP replicas must hold bit-identical parameters and optimizer state after every
optimizer step. A flipped bit, a bad device, a transfer that delivered wrong bytes or a
parameter updated outside DDP makes one replica diverge, and nothing else notices: the
ranks finish with different models, and elasticd would copy the diverged state to joiners
and peer replicas. So every N steps each rank hashes the bits of its model and optimizer
tensors (one int64 per rank), the hashes are all-gathered, and a rank that differs from the
majority is restored in memory from a majority rank (never the other way round).

Policy (pure, unit-tested): :func:`judge_replicas` (who differs, who may be a source) and
:func:`cadence_steps` (how often, from the measured cost: at most ``budget`` of step time).
Mechanism: :class:`ReplicaFingerprints`, called by ``ElasticLoop`` after each step.
With two ranks that differ there is no majority: both are named and the worker fails with
:class:`ReplicaDivergedError`, so the agent restarts the job from the newest checkpoint.

A divergence is an event: each rank named reports itself to its agent
(:class:`~elasticd.control.messages.DivergenceReport`), which records a ``diverged`` event
naming the rank and the node (``elasticd status``, the goodput ledger's ``integrity``
cause) and counts ``elasticd_replica_divergences_total``.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.distributed as dist

from elasticd.control.messages import MAX_STR, DivergenceReport
from elasticd.errors import ConfigError, ElasticdError
from elasticd.worker.recovery_plan import NO_STATE

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


def judge_replicas(prints: Sequence[int]) -> ReplicaVerdict:
    """Judge one replica group's fingerprints (index = rank in the group)."""
    counts = Counter(prints)
    if len(counts) <= 1:
        return ReplicaVerdict((), None, "all replicas agree")
    value, n = counts.most_common(1)[0]
    if n * 2 > len(prints):
        odd = tuple(r for r, p in enumerate(prints) if p != value)
        source = prints.index(value)
        return ReplicaVerdict(odd, source, f"rank(s) {list(odd)} differ from the majority "
                                           f"({n} of {len(prints)} agree); restored from rank {source}")
    return ReplicaVerdict(tuple(range(len(prints))), None,
                          f"no majority among {len(prints)} replicas ({dict(counts.most_common())} "
                          "fingerprints): none can be trusted as a source")


def offered_step(step: int, *, suspect: bool) -> int:
    """The step a rank offers when a re-formation picks the source of a state transfer
    (:func:`elasticd.worker.recovery_plan.plan_replication`): its own, or ``NO_STATE``
    while its fingerprint was named diverged and no restore has verified it since.

    Why: the source is the first rank holding the newest step, and every rank of a DDP job
    holds the same step, so a diverged rank 0 whose restore was cut short by a peer's death
    would otherwise send its state to every rank (a joiner included). Offering no state it
    is planned among those behind; with every rank suspect, nobody holds a state and the
    job loads the newest checkpoint (the next tier), instead of spreading the corruption.
    """
    return NO_STATE if suspect else step


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
    return [t.detach() for t in out]


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


class ReplicaFingerprints:
    """Checks that the ranks of the default group hold equal state, every ``every`` steps.

    Args:
        state: the loop's state (modules and optimizers are fingerprinted).
        progress: the loop's progress dict, which travels with the state: the agreed
            cadence lives there as ``fingerprint_every``, so joiners and restarts use it.
        every: steps between checks; None: measured ("auto", <= ``budget`` of step time).
        report: where this rank reports its own divergence (never blocks); default: its
            agent over the control channel, when it runs under one.
    """

    def __init__(self, state: Mapping[str, Any], progress: dict[str, int], *,
                 every: int | None = None, budget: float = DEFAULT_BUDGET,
                 report: Callable[[DivergenceReport], None] | None = None) -> None:
        if every is not None and every < 1:
            raise ConfigError(f"fingerprint_every must be >= 1 (or 0: off, None: measured), "
                              f"got {every}")
        self._state = state
        self._progress = progress
        self._fixed = every
        self._budget = budget
        self._report = report if report is not None else _report_to_agent
        self._last_step_at: float | None = None
        self._step_time_s = 0.0
        self.diverged: list[tuple[int, ...]] = []  # one entry per divergence found
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
        self._last_step_at = time.perf_counter()  # a check's own time is not step time

    def check(self, steps_done: int) -> ReplicaVerdict:
        """Compare fingerprints across the group; restore diverged ranks from the majority.

        Raises:
            ReplicaDivergedError: no majority, or a restored rank still differs.
        """
        t0 = time.perf_counter()
        tensors = state_tensors(self._state)
        mine = fingerprint(tensors)
        cost_s = time.perf_counter() - t0
        proposal = cadence_steps(cost_s, self._step_time_s, self._budget)
        prints, proposals = self._gather(mine, proposal)
        if self._fixed is None:
            self._progress["fingerprint_every"] = max(proposals)  # the same on every rank
        verdict = judge_replicas(prints)
        if not verdict.diverged:
            return verdict
        self.diverged.append(verdict.diverged)
        log.warning("replica_diverged", step=steps_done - 1, ranks=list(verdict.diverged),
                    source=verdict.source, reason=verdict.reason)
        if dist.get_rank() in verdict.diverged:  # the event names this rank and its node
            self.suspect = True
            self._report(DivergenceReport(rank=dist.get_rank(), step=max(steps_done - 1, -1),
                                          source=-1 if verdict.source is None else verdict.source,
                                          reason=verdict.reason[:MAX_STR]))
        if verdict.source is None:
            raise ReplicaDivergedError(f"replicas diverged at step {steps_done - 1}: "
                                       f"{verdict.reason}")
        device = _group_device()
        for t in tensors:
            _broadcast(t, verdict.source, device)
        again, _ = self._gather(fingerprint(tensors), proposal)
        if len(set(again)) > 1:
            raise ReplicaDivergedError(f"rank(s) {list(verdict.diverged)} still differ after a "
                                       f"restore from rank {verdict.source} (step {steps_done - 1})")
        bad = non_finite(tensors)
        if bad:  # the majority's own state is unusable: fall back to the checkpoint, once
            raise ReplicaDivergedError(f"the state restored from rank {verdict.source} at step "
                                       f"{steps_done - 1} holds non-finite values (tensors {bad[:5]}): "
                                       "restarting from the newest checkpoint")
        self.suspect = False
        log.info("replica_restored", step=steps_done - 1, ranks=list(verdict.diverged),
                 source=verdict.source)
        return verdict

    @staticmethod
    def _gather(mine: int, proposal: int) -> tuple[list[int], list[int]]:
        local = torch.tensor([mine, proposal], dtype=torch.int64, device=_group_device())
        out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(out, local)
        rows = [row.tolist() for row in out]
        return [int(r[0]) for r in rows], [int(r[1]) for r in rows]


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


def _broadcast(t: torch.Tensor, src: int, device: torch.device) -> None:
    """Broadcast ``t`` in place from ``src`` (through ``device`` if it lives elsewhere, e.g.
    Adam's CPU step counter on an NCCL group)."""
    if t.device == device:
        dist.broadcast(t, src)
        return
    tmp = t.to(device)
    dist.broadcast(tmp, src)
    t.copy_(tmp)
