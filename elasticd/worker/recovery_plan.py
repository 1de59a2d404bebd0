"""Live re-formation's recovery decision, as a value: replicated and sharded jobs.

Every rank reports what it holds, the reports are gathered once, and from the same list
every rank computes the same plan. Pure, so it is tested as values
(tests/unit/test_recovery_plan.py), the way the agent's ``policy.decide`` is; the
executors (``LiveState``, :class:`~elasticd.worker.live_sharded.ShardedResync`) only move
bytes.

- A replicated (DDP) job reports its newest completed step (``NO_STATE``: it holds none):
  :class:`Load` when nobody holds a state (a fresh start, or after a restart), else
  :class:`Replicate` from the first rank that completed the newest step to every rank
  behind (none: all ranks already agree).
- A sharded (FSDP2 / HSDP) job reports a :class:`ShardReport` (step, old rank and world,
  shard size and coordinate, the steps of the peer-RAM replicas it keeps, the committed
  step): :class:`Load`; :class:`Remesh` when the shard size holds and an intact replica of
  every shard coordinate survives (:func:`elasticd.worker.sharded.plan_shard_transfer`);
  :class:`Reshard` from memory when it does not
  (:func:`elasticd.worker.peer_reshard.plan_memory_reshard`); else :class:`Fallback`,
  saying why the restart path reads the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elasticd.worker.peer_reshard import MAX_HELD, MemoryReport, plan_memory_reshard
from elasticd.worker.sharded import NOT_HELD, RankShards, plan_shard_transfer

NO_STATE = NOT_HELD  # a rank's report: it holds no state (fresh, or behind a restart)


@dataclass(frozen=True)
class Load:
    """Nobody holds a state: every rank loads the newest checkpoint."""

    reason: str


@dataclass(frozen=True)
class Replicate:
    """``source`` completed ``step``, the newest; it sends its state to ``behind``."""

    step: int
    source: int
    behind: tuple[int, ...]  # empty: every rank holds ``step`` already


RecoveryPlan = Load | Replicate


def plan_replication(steps: Sequence[int]) -> RecoveryPlan:
    """The plan from every rank's newest completed step (by rank; ``NO_STATE``: none).

    Raises:
        ValueError: no report at all (an empty group cannot happen in a formed group).
    """
    if not steps:
        raise ValueError("no rank reported a step")
    newest = max(steps)
    if newest == NO_STATE:
        return Load("no rank holds a state")
    return Replicate(newest, steps.index(newest), tuple(r for r, s in enumerate(steps) if s != newest))


# -- the sharded job ----------------------------------------------------------------------
@dataclass(frozen=True)
class ShardReport:
    """What one rank of a sharded job reports before a re-formation (fixed-size, for one
    ``all_gather``).

    Attributes:
        step: the last step its live state completed (``NO_STATE``: it holds none).
        old_rank: its rank in the world its shards are of (-1: none, a joiner).
        old_world: that world's size (0: none).
        shard_size: the shard dimension of that world's mesh (0: none).
        coordinate: its shard coordinate on that mesh (-1: none).
        own_step: the step of its own peer-RAM replica snapshot (-1: none).
        held: (old rank, step) of each peer replica it holds (at most ``MAX_HELD``).
        committed: the newest committed checkpoint's step as its agent knows it (-1: none
            or not asked); an in-memory reshard reads the checkpoint instead of replicas
            older than it.
    """

    step: int
    old_rank: int = -1
    old_world: int = 0
    shard_size: int = 0
    coordinate: int = -1
    own_step: int = -1
    held: tuple[tuple[int, int], ...] = ()
    committed: int = -1

    LEN = 7 + 2 * MAX_HELD + 1  # the encoded length

    def encode(self) -> list[int]:
        held = list(self.held[:MAX_HELD])
        flat = [x for pair in held for x in pair] + [-1] * (2 * (MAX_HELD - len(held)))
        return [self.step, self.old_rank, self.old_world, self.shard_size, self.coordinate,
                self.own_step, len(held), *flat, self.committed]

    @classmethod
    def decode(cls, values: Sequence[int]) -> ShardReport:
        v = [int(x) for x in values]
        if len(v) != cls.LEN or not 0 <= v[6] <= MAX_HELD:
            raise ValueError(f"a shard report of {len(v)} values holding {v[6] if len(v) > 6 else '?'} replicas")
        held = tuple((v[7 + 2 * i], v[8 + 2 * i]) for i in range(v[6]))
        return cls(v[0], v[1], v[2], v[3], v[4], v[5], held, v[-1])

    def shards(self) -> RankShards:
        return RankShards(self.step, self.shard_size, self.coordinate)

    def memory(self) -> MemoryReport:
        return MemoryReport(self.old_rank, self.old_world, self.step, self.own_step, self.held, self.committed)


@dataclass(frozen=True)
class Remesh:
    """The shard size holds: ``keepers`` keep their shards on the new mesh; for each
    ``(coordinate, source, receivers)`` in ``transfers`` an intact replica sends that
    coordinate's state to the ranks behind or new. Every rank ends at ``step``."""

    step: int
    keepers: frozenset[int]
    transfers: tuple[tuple[int, int, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Reshard:
    """The old world's shards are rebuilt in memory on the new mesh, at ``step``: from the
    live shards (``fresh``: nobody was lost), else from the peer-RAM replicas; ``sources``
    maps each old rank to the new rank that serves its shards."""

    step: int
    fresh: bool
    old_world: int
    sources: Mapping[int, int]


@dataclass(frozen=True)
class Fallback:
    """Memory cannot rebuild the state: the re-formation takes the restart path."""

    reason: str


ShardedPlan = Remesh | Reshard | Load | Fallback


def plan_sharded(reports: Sequence[ShardReport], new_shard_size: int, new_coordinates: Sequence[int],
                 *, replicas_kept: bool = True) -> ShardedPlan:
    """The plan of a sharded re-formation from every rank's report (the same on every rank). Pure.

    Args:
        reports: each new rank's report, by new global rank.
        new_shard_size: the shard dimension of the new mesh.
        new_coordinates: each new rank's shard coordinate on the new mesh.
        replicas_kept: the job keeps peer-RAM replicas (False: ``peer_replica_every=0``
            on pure FSDP2; only the fallback's reason reads it).

    Raises:
        ValueError: no report at all, or coordinates that do not match the reports.
    """
    if not reports:
        raise ValueError("no rank reported its shards")
    if len(new_coordinates) != len(reports):
        raise ValueError(f"{len(reports)} reports but {len(new_coordinates)} shard coordinates")
    transfer = plan_shard_transfer([r.shards() for r in reports], new_shard_size, new_coordinates)
    if transfer.step == NOT_HELD:
        return Load("no rank holds a state")
    if transfer.fallback is None:
        return Remesh(transfer.step, transfer.keepers, transfer.transfers)
    memory = plan_memory_reshard([r.memory() for r in reports])
    if memory.fallback is not None or memory.sources is None:
        why = memory.fallback if replicas_kept else "no peer-RAM replica (peer_replica_every=0)"
        return Fallback(f"{transfer.fallback}; in memory: {why}")
    return Reshard(memory.step, memory.fresh, memory.old_world, dict(memory.sources))
