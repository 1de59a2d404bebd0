"""Live re-formation of a sharded model (FSDP2 / HSDP): re-mesh, feed joiners, reshard in memory.

:class:`ShardedResync` is the sharded half of :class:`~elasticd.worker.live.LiveState`'s
state agreement, a collaborator it owns when the job passes ``sharded=``. After a group
formed it gathers every rank's :class:`~elasticd.worker.recovery_plan.ShardReport` once,
takes the pure :func:`~elasticd.worker.recovery_plan.plan_sharded`'s decision, and only
executes it:

- re-meshes the survivors' kept shards in place and sends each rank behind or new its shard
  coordinate's state from an intact replica (HSDP, :mod:`elasticd.worker.sharded`); or
- rebuilds the old world's shards from memory on the new mesh when the shard size changed
  (pure FSDP2, :mod:`elasticd.worker.peer_reshard`): from the live shards when nobody was
  lost, else from the peer-RAM replicas (:mod:`elasticd.worker.peer_replica`) it keeps
  refreshed every ``k`` steps; or
- loads the checkpoint when nobody holds a state; or
- falls back to the restart path, saying why.

It returns what the group agreed on (:class:`~elasticd.worker.live_entries.Synced`);
``LiveState`` owns the step and the agent link.
"""

from __future__ import annotations

import hashlib
import secrets
import time
import zlib
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import NoReturn

import structlog
import torch
import torch.distributed as dist

import elasticd.worker.context as wctx
from elasticd.checkpoint import rng, shards
from elasticd.worker import peer_reshard as pmem
from elasticd.worker.fingerprint import state_is_finite
from elasticd.worker.live_entries import (
    LiveEntry,
    Regroupable,
    Stateful,
    Synced,
    load_entry,
    load_fresh,
    optimizers_in,
    restore_rng,
)
from elasticd.worker.peer_replica import (
    KEY_BYTES,
    NO_HOLDER,
    PeerReplica,
    Snapshot,
    fill_boxes,
    parse_snapshot_index,
    ring_holders,
    take_snapshot,
)
from elasticd.worker.recovery_plan import (
    NO_STATE,
    Fallback,
    Load,
    Remesh,
    Reshard,
    ShardReport,
    plan_sharded,
)
from elasticd.worker.sharded import (
    NOT_HELD,
    ShardedModel,
    optimizer_local_state,
    shard_coordinates,
)
from elasticd.worker.sockets import group_endpoints
from elasticd.worker.state_broadcast import broadcast_state


class ShardedResync:
    """The state agreement of a sharded job, and the peer-RAM replica it keeps.

    Args:
        state: the kept entries (``LiveState.state``, by reference: an entry holding the
            module is swapped for the rebuilt one).
        sharded: the job's sharded model.
        checkpoint: its checkpoint manager (the committed step is a hint for the plan).
        peer_replica_every: k, steps between replica refreshes (0: no replica).
        timeout_s: bound on a transfer when no re-formation deadline is set.
        enabled: live re-formation is on (no replica without it).
        log: the bound logger of the ``LiveState``.
        fall_back: ends the re-formation on the restart path, saying why.
    """

    def __init__(self, state: Mapping[str, LiveEntry], sharded: ShardedModel, *,
                 checkpoint: Regroupable | None, peer_replica_every: int, timeout_s: float,
                 enabled: bool, log: structlog.typing.FilteringBoundLogger,
                 fall_back: Callable[[str], NoReturn]) -> None:
        self.state = state
        self.sharded = sharded
        self.checkpoint = checkpoint
        self.peer_replica_every = peer_replica_every
        self.timeout_s = timeout_s
        self.enabled = enabled
        self._log = log
        self._fall_back = fall_back
        self.replica: PeerReplica | None = None
        self._old_rank, self._old_world = -1, 0  # this rank in the world its shards are of
        self._refreshed_at = NOT_HELD  # the step of the last replica refresh

    # -- the peer-RAM replica -------------------------------------------------------------
    def after_step(self, step: int) -> None:
        """``step`` completed: refresh the replica when it is due."""
        if self.replica is not None and self.replica.due(step) and self._refreshed_at != step:
            self.refresh(step)

    def hold_for_drain(self, step: int) -> None:
        """A drained rank's shards exist nowhere else: every rank refreshes the replica at
        this agreed step and waits for it, so the survivors lose no step."""
        if self.replica is None:
            return
        if self._refreshed_at != step:
            self.refresh(step)
        if self.replica is not None:
            self.replica.wait()

    def refresh(self, step: int) -> None:
        """Refresh the peer-RAM replica now, at ``step`` (a collective)."""
        sm, replica = self.sharded, self.replica
        if replica is None:
            return
        if replica.error is not None:
            self._log.warning("peer_replica_refresh_failed", error=repr(replica.error)[:300])
            replica.error = None
        try:
            tensors, extra = pmem.replica_state(self.state, sm.module, sm.names, sm.params, rng.capture())
        except TypeError as exc:
            self._log.warning("peer_replica_off", reason=str(exc)[:300])
            self.replica = None
            return
        replica.refresh(step, tensors, extra)
        self._refreshed_at = step

    def _make_replica(self, step: int) -> None:
        """After a group formed: the ring of replica holders over its nodes (a collective)."""
        sm = self.sharded
        self.replica = None
        self._refreshed_at = NOT_HELD
        ctx = wctx.current_context()
        self._old_rank, self._old_world = ctx.rank, ctx.world_size
        if not self.peer_replica_every or sm.mesh_kind != "fsdp" or not self.enabled:
            return
        device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
        # Each rank's node and 32 random bytes: the round key that seals the replica's
        # tickets is agreed here, through the group, never through its (open) store.
        nonce = torch.frombuffer(bytearray(secrets.token_bytes(KEY_BYTES)), dtype=torch.int64)
        mine = torch.cat([torch.tensor([zlib.crc32(str(ctx.node).encode())], dtype=torch.int64),
                          nonce]).to(device)
        nodes = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
        dist.all_gather(nodes, mine)
        holders = ring_holders([str(int(t[0].item())) for t in nodes])
        key = hashlib.sha256(b"".join(t[1:].cpu().numpy().tobytes() for t in nodes)).digest()
        if all(h == NO_HOLDER for h in holders):
            return  # one node: a replica on it dies with it
        hosts, peers = group_endpoints(wctx.group_sockets())
        if not hosts:
            self._log.warning("peer_replica_off", reason="this rank's address in the group is unknown")
            return
        self.replica = PeerReplica(ctx.rank, holders, dist.distributed_c10d._get_default_store(), hosts[0],
                                   key=key, allowed_peers=peers, every_steps=self.peer_replica_every,
                                   timeout_s=self.timeout_s, prefix=f"elasticd/peer/{ctx.round}")
        if step >= 0:
            # The new world is covered at once, not only from its first multiple of k.
            self.refresh(step)

    # -- the state agreement --------------------------------------------------------------
    def sync(self, load: Callable[[], int] | None, step: int, has_state: bool,
             deadline: float | None) -> Synced:
        """Survivors re-mesh their kept shards, each rank behind or new receives its shard
        coordinate's state from an intact replica (a collective).

        Args:
            load: loads the checkpoint on every rank (None inside a re-formation).
            step: this rank's last completed step; ``has_state``: it holds one.
            deadline: the end of the re-formation under way (None: ``timeout_s``).
        """
        synced = self._agree(load, step, has_state, deadline)
        self._make_replica(synced.step)
        return synced

    def _agree(self, load: Callable[[], int] | None, step: int, has_state: bool,
               deadline: float | None) -> Synced:
        """Gather every rank's :class:`ShardReport` once, plan (:func:`plan_sharded`), execute."""
        sm = self.sharded
        ctx = wctx.current_context()
        device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
        if has_state and not state_is_finite(self.state, self._log, "live_shards_not_offered", step):
            # A NaN or an infinity in our shards: offered as no state (its replicas are not
            # offered either), so an intact replica of our coordinate is the source, or the
            # plan falls back to the checkpoint; never a source for a joiner or a survivor.
            has_state = False
        old_size, old_coord = (sm.shard_size, sm.coordinate) if has_state else (0, -1)
        mesh = sm.mesh_for_world()  # a collective on a survivor; a joiner built it at start
        new_size = int(mesh.size(-1))  # type: ignore[attr-defined]
        replica = self.replica if has_state else None
        own, held = (replica.own, dict(replica.held)) if replica is not None else (None, {})
        report = ShardReport(
            step if has_state else NO_STATE, self._old_rank if has_state else -1,
            self._old_world if has_state else 0, old_size, old_coord,
            own.step if own is not None else -1, tuple(sorted((o, snap.step) for o, snap in held.items())),
            # The committed step only matters when the shard size changes; only then ask the agent.
            self._committed_step() if has_state and old_size != new_size else -1)
        mine = torch.tensor(report.encode(), dtype=torch.int64, device=device)
        gathered = [torch.zeros(ShardReport.LEN, dtype=torch.int64, device=device)
                    for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        plan = plan_sharded([ShardReport.decode(t.tolist()) for t in gathered], new_size,
                            shard_coordinates(mesh),
                            replicas_kept=bool(self.peer_replica_every) or sm.mesh_kind != "fsdp")
        if isinstance(plan, Load):  # nobody holds a state: a fresh start or a full restart
            return load_fresh(load)
        if isinstance(plan, Fallback):
            self._fall_back(plan.reason)
        if isinstance(plan, Reshard):
            return self._reshard_in_memory(mesh, plan, device, step, has_state, deadline,
                                           snapshots=(own, held))
        return self._remesh(mesh, plan, device, step, deadline)

    def _remesh(self, mesh: object, plan: Remesh, device: torch.device, step: int,
                deadline: float | None) -> Synced:
        """The shard size holds: keepers keep their shards on ``mesh``, each rank behind or
        new receives its coordinate's state from an intact replica."""
        sm = self.sharded
        ctx = wctx.current_context()
        t0 = time.monotonic()
        optimizers = optimizers_in(self.state)
        if mesh is not sm.mesh:  # a survivor: the old mesh's group is gone
            self._rebuild(mesh, keep=ctx.rank in plan.keepers, optimizers=optimizers)
        rebuilt = time.monotonic()
        left = deadline - rebuilt if deadline is not None else self.timeout_s
        for coord, src, receivers in plan.transfers:
            behind = ctx.rank in receivers
            sd = collect_sharded(self.state, sm, optimizers, step) if ctx.rank == src or behind else None
            received = broadcast_state(sd if ctx.rank == src else None, src, device,
                                       receivers=list(receivers), timeout_s=max(left, 1.0), into=sd)
            if behind:
                assert received is not None
                apply_sharded(self.state, received, sm, optimizers)
                self._check_received(f"the shards of coordinate {coord} received from rank {src}",
                                     plan.step)
                self._log.info("live_shards_received", step=plan.step, source=src, coordinate=coord,
                               seconds=round(time.monotonic() - rebuilt, 3))
        self._log.info("live_shards_remeshed", step=plan.step, kept=ctx.rank in plan.keepers,
                       shard_size=int(mesh.size(-1)), rebuild_s=round(rebuilt - t0, 3),  # type: ignore[attr-defined]
                       transfer_s=round(time.monotonic() - rebuilt, 3))
        return Synced(plan.step, agreed_in_memory=True,
                      transferred=f"the shards sent at step {plan.step}" if plan.transfers else "")

    def _rebuild(self, mesh: object, *, keep: bool, optimizers: list[torch.optim.Optimizer]) -> None:
        """Re-apply the job's parallelize on ``mesh``; the state's module entry becomes the new module."""
        old = self.sharded.module
        new = self.sharded.rebuild(mesh, keep=keep, optimizers=optimizers)
        state = self.state
        assert isinstance(state, MutableMapping)
        for key in [k for k, v in state.items() if v is old]:
            state[key] = new

    def _reshard_in_memory(self, mesh: object, plan: Reshard, device: torch.device, step: int,
                           has_state: bool, deadline: float | None, *,
                           snapshots: tuple[Snapshot | None, dict[int, Snapshot]]) -> Synced:
        """The shard size changed: rebuild the old world's shards from memory onto ``mesh``
        (:mod:`elasticd.worker.peer_reshard`); ``snapshots``: this rank's own replica
        snapshot and those it holds, as it reported them."""
        sm = self.sharded
        t0 = time.monotonic()
        ctx = wctx.current_context()
        own, held = snapshots
        optimizers = optimizers_in(self.state)
        snaps: dict[int, Snapshot] = {}
        if plan.fresh and has_state:
            tensors, extra = pmem.replica_state(self.state, sm.module, sm.names, sm.params, rng.capture())
            # One copy of each box (HSDP: the replicas at replicate coordinate 0).
            tensors = {k: t for k, t in tensors.items() if shards.writes_box(t)}
            snaps[self._old_rank] = take_snapshot(self._old_rank, step, tensors, extra)
        elif not plan.fresh:
            snaps = pmem.own_snapshots(own, held)
        store = dist.distributed_c10d._get_default_store()
        prefix = f"elasticd/reshard/{ctx.round}"
        for old, src in plan.sources.items():
            if src == ctx.rank:
                store.set(f"{prefix}/{old}", snaps[old].index().decode())
        if mesh is not sm.mesh:  # a survivor: the old mesh's group is gone
            self._rebuild(mesh, keep=False, optimizers=optimizers)
        chunks_of: dict[int, list] = {}
        sizes: dict[int, int] = {}
        extras: dict[int, dict[str, object]] = {}
        for old in range(plan.old_world):
            rank, _, chunks, size, extra = parse_snapshot_index(store.get(f"{prefix}/{old}"))
            if rank != old:
                self._fall_back(f"in-memory reshard: the index of old rank {old} names rank {rank}")
            chunks_of[old], sizes[old], extras[old] = chunks, size, extra
        keys = {c.key for cs in chunks_of.values() for c in cs}
        targets = reshard_targets(self.state, sm, optimizers, keys)
        need = pmem.needed_ranks(targets, chunks_of)
        flags = torch.tensor([1 if o in need else 0 for o in range(plan.old_world)], dtype=torch.int64,
                             device=device)
        all_flags = [torch.zeros_like(flags) for _ in range(dist.get_world_size())]
        dist.all_gather(all_flags, flags)
        data: dict[int, torch.Tensor] = {}
        left = deadline - time.monotonic() if deadline is not None else self.timeout_s
        moved = 0
        for old in range(plan.old_world):
            src = plan.sources[old]
            receivers = [r for r, f in enumerate(all_flags) if int(f[old]) and r != src]
            if ctx.rank == src and old in need:
                data[old] = snaps[old].data
            if not receivers:
                continue
            sd: dict[str, object] | None = {"data": snaps[old].data} if ctx.rank == src else None
            got = broadcast_state(sd, src, device, receivers=receivers, timeout_s=max(left, 1.0))
            if ctx.rank in receivers:
                assert got is not None and isinstance(got["data"], torch.Tensor)
                data[old] = got["data"]
                moved += int(got["data"].numel())
        filled = fill_boxes(targets, chunks_of, sizes, data)
        source_rank = ctx.rank % plan.old_world
        rng_state = pmem.apply_replica_state(self.state, sm.module, sm.names, sm.params, filled,
                                             extras[source_rank])
        rng.restore([rng_state], 0)
        self._check_received("the shards resharded in memory", plan.step)
        lost = step - plan.step if has_state else 0
        self._log.info("live_resharded_in_memory", step=plan.step, shards_from="live shards" if plan.fresh
                       else "peer-RAM replicas", old_world=plan.old_world, world_size=dist.get_world_size(),
                       steps_rolled_back=max(lost, 0), bytes_received=moved,
                       seconds=round(time.monotonic() - t0, 3))
        return Synced(plan.step, agreed_in_memory=True,
                      transferred=f"the shards resharded in memory at step {plan.step}")

    def _check_received(self, what: str, step: int) -> None:
        """After a transfer: a NaN or an infinity in what arrived sends the job one tier
        down (the checkpoint), never on with it."""
        if not state_is_finite(self.state, self._log, "live_shards_received_non_finite", step):
            self._fall_back(f"{what} at step {step} hold non-finite values")

    def _committed_step(self) -> int:
        """The newest committed checkpoint's step, from the checkpoint's fence (the agent's
        pointer); -1 when there is none or nobody can tell."""
        latest = getattr(getattr(self.checkpoint, "fence", None), "latest", None)
        if latest is None:
            return -1
        try:
            pointer = latest()
        except Exception:  # noqa: BLE001 - a hint for the plan, never a reason to fail
            return -1
        step = getattr(pointer, "step", -1)
        return step if isinstance(step, int) else -1


def reshard_targets(state: Mapping[str, LiveEntry], sm: ShardedModel,
                    optimizers: Sequence[torch.optim.Optimizer], keys: set[str]) -> dict[str, object]:
    """Empty DTensors of the new sharding for every saved key: the module's parameters
    and each optimizer's per-parameter state."""
    targets: dict[str, object] = {}
    for key, obj in state.items():
        if obj is sm.module:
            targets.update({f"{key}/{n}": p for n, p in zip(sm.names, sm.params, strict=True)})
        elif any(obj is o for o in optimizers):
            assert isinstance(obj, torch.optim.Optimizer)
            flat = [p for g in obj.param_groups for p in g["params"]]
            for k in keys:
                parts = k.split("/")
                if len(parts) == 3 and parts[0] == key and parts[1].isdigit():
                    targets[k] = torch.empty_like(flat[int(parts[1])])
    return targets


def collect_sharded(state: Mapping[str, LiveEntry], sm: ShardedModel,
                    optimizers: list[torch.optim.Optimizer], step: int) -> dict[str, object]:
    """This rank's shard coordinate's state as one tree (what an intact replica sends)."""
    out: dict[str, object] = {"__rng__": rng.capture(), "__step__": step}
    for name, obj in state.items():
        if obj is sm.module:
            out[name] = sm.local_state()
        elif any(obj is o for o in optimizers):
            assert isinstance(obj, torch.optim.Optimizer)
            out[name] = optimizer_local_state(obj)
        else:
            out[name] = obj.state_dict() if isinstance(obj, Stateful) else dict(obj)
    return out


def apply_sharded(state: Mapping[str, LiveEntry], sd: Mapping[str, object], sm: ShardedModel,
                  optimizers: list[torch.optim.Optimizer]) -> None:
    """Write a received tree (:func:`collect_sharded`'s form) into the kept state.

    Raises:
        TypeError: an entry or the RNG state is not a mapping.
    """
    rest: dict[str, dict[str, object]] = {}
    for name, obj in state.items():
        entry = sd[name]
        if not isinstance(entry, dict):
            raise TypeError(f"received state {name!r} is a {type(entry).__name__}, not a mapping")
        if obj is sm.module:
            sm.load_local_state(entry)
        elif any(obj is o for o in optimizers):
            assert isinstance(obj, torch.optim.Optimizer)
            obj.load_state_dict(entry)
            sm.adopt_optimizer_state(obj)
        else:
            rest[name] = entry
    for name, entry in rest.items():
        load_entry(state[name], entry)
    restore_rng(sd)
