"""Live re-formation, worker side: keep the training state in memory through a membership change.

In data-parallel training every surviving rank holds the whole model and optimizer state,
so a lost, drained or joining node need not cost a restart and a checkpoint load.
:class:`LiveState` registers that state; on a membership change (a collective that failed
because a peer died, or the agent's order to leave the group at an agreed step) the worker

1. abandons the current step (``optimizer.step()`` never ran for it, gradients are
   zeroed): a half-finished step is never applied;
2. leaves the old process group without waiting on dead peers and tells its agent
   (a ``ParkedReport`` on the control socket), which opens the next round at once;
3. joins the new round's group (the agent's ``reform.json``: ranks, bootstrap address;
   the wait for it is an ``AwaitOrder`` on the socket, answered when the order is out);
4. agrees with every rank on the newest completed step; one rank that completed it
   broadcasts model, optimizer, sampler position and RNG state to every rank that is
   behind or new (a joining worker receives its state this way: no storage read);
5. raises :class:`Reformed`, so the loop rebuilds what holds the old group (the DDP
   wrapper, the batch plan) and continues with step ``live.step + 1``.

When nobody holds a usable state (all ranks fresh: a job start, or after a restart), the
checkpoint is loaded as before. When the re-formation fails within its bound, the worker
logs why and exits 0 with a stopped marker: the agent restarts the group from the newest
checkpoint (today's path). Under plain torchrun, or with live re-formation off, the
object does nothing but call ``should_stop``.

Sharded models (``sharded=``): an HSDP job keeps its shards and feeds joiners from an
intact replica (:mod:`elasticd.worker.sharded`); a change of the shard size (pure FSDP2:
every change) is resharded in memory (:mod:`elasticd.worker.peer_reshard`), from the live
shards when nobody was lost, else from the peer-RAM replicas every rank keeps of one peer
on another node (:mod:`elasticd.worker.peer_replica`, refreshed every ``k`` steps).
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import NoReturn, Protocol, runtime_checkable

import structlog
import torch
import torch.distributed as dist

import elasticd.worker.context as wctx
from elasticd.checkpoint import rng, shards
from elasticd.control.api import LIVE_TIMEOUT_DEFAULT_S
from elasticd.control.messages import (
    LeaveReason,
)
from elasticd.errors import ConfigError
from elasticd.worker import peer_reshard as pmem
from elasticd.worker.failures import is_peer_failure
from elasticd.worker.live_link import AgentLink
from elasticd.worker.peer_replica import (
    DEFAULT_EVERY_STEPS,
    KEY_BYTES,
    NO_HOLDER,
    PeerReplica,
    Snapshot,
    fill_boxes,
    ring_holders,
    take_snapshot,
)
from elasticd.worker.recovery_plan import NO_STATE, Load, plan_replication
from elasticd.worker.sharded import (
    NOT_HELD,
    RankShards,
    ShardedModel,
    ShardPlan,
    optimizer_local_state,
    plan_shard_transfer,
    shard_coordinates,
)
from elasticd.worker.sockets import group_endpoints
from elasticd.worker.state_broadcast import broadcast_state

log = structlog.get_logger(__name__)

MAX_REFORMS_PER_STEP = 3  # the same step failing again and again is a bug, not a peer


@runtime_checkable
class Stateful(Protocol):
    """An object whose state a live re-formation moves (a module, an optimizer, a sampler)."""

    def state_dict(self) -> Mapping[str, object]: ...

    def load_state_dict(self, state_dict: Mapping[str, object], /) -> object: ...


class Regroupable(Protocol):
    """What moves to the new group after a re-formation (``CheckpointManager.regroup``)."""

    def regroup(self) -> None: ...


# What LiveState keeps: objects with state_dict/load_state_dict, or plain dicts.
LiveEntry = Stateful | MutableMapping[str, object]


class Reformed(Exception):  # noqa: N818 - a signal to the loop, not an error
    """The process group was re-formed: rebuild DDP/batch plan, continue at ``live.step + 1``."""


class LiveState:
    """The state a worker keeps in memory across membership changes.

    Args:
        state: what to keep, e.g. ``{"model": model, "optim": optim, "sampler": sampler,
            "extra": progress}``: objects with ``state_dict``/``load_state_dict``, or
            plain dicts (updated in place). The module itself, not the DDP wrapper.
        checkpoint: a :class:`~elasticd.checkpoint.CheckpointManager` to move to the new
            group after each re-formation.
        sharded: the job's :class:`~elasticd.worker.sharded.ShardedModel` (FSDP2 / HSDP):
            ``state`` holds its module; on a re-formation the survivors re-mesh their kept
            shards in place (``state``'s entry for the module becomes the new module) and
            joiners receive each shard from a rank with the same shard coordinate; where
            that cannot work (the shard size changes, no intact replica holds a shard) the
            workers take the restart path, with one log line saying why. A change of the
            shard size (pure FSDP2) is resharded in memory instead (see the module doc).
        peer_replica_every: k, the steps between refreshes of the peer-RAM replica of a
            pure FSDP2 job over several nodes (0: none; a node loss then reads the
            checkpoint). A node loss rolls back at most k steps.
        timeout_s: bound on one re-formation (waiting for the order, forming the new
            group, the state transfer); past it the worker falls back to a restart.
            Default: the agent's ``workers.live_reform_timeout_s`` (``ELASTICD_LIVE_TIMEOUT_S``),
            so the worker and its agent give up on the same re-formation together.

    Attributes:
        step: the last step this rank completed (-1: none yet).
        enabled: live re-formation is on (under an agent that enables it, with a group).
        reforms: re-formations so far in this process.
    """

    def __init__(self, state: Mapping[str, LiveEntry], *, checkpoint: Regroupable | None = None,
                 timeout_s: float | None = None, sharded: ShardedModel | None = None,
                 peer_replica_every: int = DEFAULT_EVERY_STEPS) -> None:
        wctx.current_context()  # a hot spare's worker running ahead waits for its round here
        self.state = state  # by reference: the loop may swap an entry (a resharded sampler)
        self.checkpoint = checkpoint
        self.sharded = sharded
        if sharded is not None and not any(v is sharded.module for v in state.values()):
            raise ConfigError("LiveState(sharded=...): the state must hold sharded.module "
                              '(e.g. {"model": sharded.module, ...})')
        if peer_replica_every < 0:
            raise ConfigError(f"peer_replica_every must be >= 0 (0: no replica), not {peer_replica_every}")
        self.peer_replica_every = peer_replica_every
        self.replica: PeerReplica | None = None
        self._old_rank, self._old_world = -1, 0  # this rank in the world its shards are of
        self._refreshed_at = NOT_HELD  # the step of the last replica refresh
        self.step = -1
        env = wctx.agent_environment()
        self.timeout_s = timeout_s if timeout_s is not None else (
            env.live_timeout_s if env is not None else LIVE_TIMEOUT_DEFAULT_S)
        self.reforms = 0
        self._has_state = False
        # True once the group's ranks agreed on a state in memory (every rank now holds the
        # same one); False when they each loaded it (a start: a DDP wrapper must sync).
        self.agreed_in_memory = False
        self._failures_at: dict[int, int] = {}
        ctx = wctx.current_context()
        self._log = log.bind(rank=ctx.rank, local_rank=ctx.local_rank)
        self._deadline: float | None = None  # of the re-formation under way
        self._link = AgentLink(env, self._log)
        self.enabled = bool(env is not None and env.live and dist.is_initialized()
                            and wctx.control_dir() is not None and wctx.control_client() is not None
                            and self._link.register(ctx.local_rank))
        if self.enabled:
            self._link.start_watch()

    # -- the loop's three calls ---------------------------------------------------------
    def resume(self, load: Callable[[], int]) -> int:
        """Get the state: from a peer that holds it, else by ``load()`` (the checkpoint).

        A collective. ``load`` loads the newest checkpoint into the state on every rank
        and returns its step (-1 if none); it runs only when no rank holds a state.

        Returns:
            The last completed step (-1 on a fresh start).
        """
        if not self.enabled:
            self.step = load()
            self._has_state = True
            return self.step
        self._sync(load)
        return self.step

    def step_done(self, step: int) -> bool:
        """Record that ``step`` completed (after ``optimizer.step()``); agree on stops.

        Returns:
            True when the script should save and exit 0 (a drain, as with
            ``should_stop``; with live re-formation only when every node drains). With live re-formation on, a drain of this node exits here
            (the survivors keep the state), and a drain or join elsewhere, or an
            order of the agent for a newer round, re-forms the group here and raises
            :class:`Reformed`.
        """
        self.step = step
        self._has_state = True
        if self.replica is not None and self.replica.due(step) and self._refreshed_at != step:
            self.refresh_replica()
        if not wctx.should_stop(step):
            return False
        if not self.enabled or wctx.every_rank_draining():
            return True  # nobody stays to hold the state: save it and exit (the caller)
        if self.replica is not None and wctx.some_rank_draining():
            # A drained rank's shards exist nowhere else: every rank refreshes the replica
            # at this agreed step and waits for it, so the survivors lose no step.
            if self._refreshed_at != step:
                self.refresh_replica()
            self.replica.wait()
        if wctx.stop_requested_locally():
            self._log.info("live_drained", step=step)
            wctx.fast_exit(0)  # survivors hold this state: no checkpoint to write
        self._reform(LeaveReason.ORDERED if wctx.reform_ordered() else LeaveReason.AGREED_STOP)
        raise Reformed(f"re-formed at the agreed step {step}")

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Wrap one training step: a collective failure re-forms the group.

        Raises:
            Reformed: the group was re-formed; the step was abandoned (never applied).
        """
        try:
            yield
        except Reformed:
            raise
        except Exception as exc:
            if not self.enabled or not is_peer_failure(exc):
                raise
            tries = self._failures_at.get(self.step, 0) + 1
            self._failures_at[self.step] = tries
            if tries > MAX_REFORMS_PER_STEP:
                raise
            self._abandon_step()
            self._log.info("collective_failed", step=self.step + 1, error=str(exc)[:200])
            self._reform(LeaveReason.COLLECTIVE_FAILED)
            raise Reformed(f"re-formed after a failed collective: {exc}") from None

    def refresh_replica(self) -> None:
        """Refresh the peer-RAM replica now, at ``self.step`` (a collective: every rank at
        the same point; the loop is blocked only for the copy to host memory).

        ``ElasticLoop`` calls it at every epoch's end too, so that a rollback never
        crosses an epoch boundary.
        """
        sm, replica = self.sharded, self.replica
        if sm is None or replica is None:
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
        replica.refresh(self.step, tensors, extra)
        self._refreshed_at = self.step

    def _make_replica(self, sm: ShardedModel) -> None:
        """After a group formed: the ring of replica holders over its nodes (a collective)."""
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
                                   key=key, allowed_peers=peers, every_steps=self.peer_replica_every, timeout_s=self.timeout_s,
                                   prefix=f"elasticd/peer/{ctx.round}")
        if self._has_state and self.step >= 0:
            # The new world is covered at once, not only from its first multiple of k.
            self.refresh_replica()

    # -- re-formation ---------------------------------------------------------------------
    def _abandon_step(self) -> None:
        for obj in self.state.values():
            if isinstance(obj, (torch.optim.Optimizer, torch.nn.Module)):
                obj.zero_grad(set_to_none=True)

    def _reform(self, reason: LeaveReason) -> None:
        ctx = wctx.current_context()
        cdir = wctx.control_dir()
        assert cdir is not None
        old_round = ctx.round if ctx.round is not None else -1
        t0 = time.monotonic()
        try:
            with self._link.reforming():
                self._reform_inner(reason, ctx, cdir, old_round, t0)
        finally:
            self._deadline = None

    def _reform_inner(self, reason: LeaveReason, ctx: wctx.WorkerContext, cdir: Path,
                      old_round: int, t0: float) -> None:
        wctx.leave_group()
        self._link.park(cdir, ctx, old_round, self.step, reason)
        deadline = t0 + self.timeout_s
        self._deadline = deadline
        order = self._link.await_order(cdir, ctx.local_rank, old_round, deadline, self.timeout_s, self.step)
        try:
            wctx.rejoin(order.ranks[ctx.local_rank], order.world_size, order.round,
                        order.master_addr, order.master_port,
                        timeout_s=max(deadline - time.monotonic(), 1.0))
            formed = time.monotonic()
            if self.checkpoint is not None:
                self.checkpoint.regroup()
            self._sync(None)
        except Exception as exc:  # noqa: BLE001 - any failure here ends in the restart path
            self._fall_back(f"re-forming round {order.round} failed: {exc!r}"[:300])
        self.reforms += 1
        self._link.confirm(ctx.local_rank, order.round, self.step)
        self._log.info("live_reformed", round=order.round, world_size=order.world_size,
                       rank=order.ranks[ctx.local_rank], step=self.step, reason=reason.value,
                       group_s=round(formed - t0, 3), total_s=round(time.monotonic() - t0, 3))

    def _sync(self, load: Callable[[], int] | None) -> None:
        """Agree on the newest completed step; its holder broadcasts to those behind."""
        if self.sharded is not None:
            self._sync_sharded(load, self.sharded)
            return
        ctx = wctx.current_context()
        # On the group's own device: an NCCL group has no CPU backend (the GPU check found
        # "No backend type associated with device type cpu").
        device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
        mine = torch.tensor([self.step if self._has_state else NO_STATE], dtype=torch.int64, device=device)
        steps = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(steps, mine)
        plan = plan_replication([int(t.item()) for t in steps])
        if isinstance(plan, Load):  # nobody holds a state: a fresh start or a full restart
            self._load_fresh(load)
            return
        self.agreed_in_memory = True
        if not plan.behind:
            return
        t0 = time.monotonic()
        newest, src, behind = plan.step, plan.source, list(plan.behind)
        sd = self._collect() if ctx.rank == src or ctx.rank in behind else None
        # Bounded by what is left of the re-formation (a source that died mid-transfer
        # raises TransferError, and _reform_inner falls back to the restart path). A rank
        # behind receives into its own tensors where they match (``into``).
        left = self._deadline - t0 if self._deadline is not None else self.timeout_s
        received = broadcast_state(sd if ctx.rank == src else None, src, device, receivers=behind,
                                   timeout_s=max(left, 1.0), into=sd)
        if ctx.rank in behind:
            assert received is not None
            self._apply(received)
        self.step = newest
        self._has_state = True
        if ctx.rank == src or ctx.rank in behind:
            self._log.info("live_state_received" if ctx.rank in behind else "live_state_sent",
                           step=newest, source=src, receivers=behind,
                           seconds=round(time.monotonic() - t0, 3))

    def _load_fresh(self, load: Callable[[], int] | None) -> None:
        """Nobody holds a state (a fresh start or a full restart): every rank loads it."""
        if load is None:
            raise RuntimeError("no rank holds a usable state")
        self.step = load()
        self._has_state = True
        self.agreed_in_memory = False

    def _sync_sharded(self, load: Callable[[], int] | None, sm: ShardedModel) -> None:
        """The sharded form of :meth:`_sync`: survivors re-mesh their kept shards, each
        rank behind or new receives its shard coordinate's state from an intact replica."""
        ctx = wctx.current_context()
        device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
        old_size, old_coord = (sm.shard_size, sm.coordinate) if self._has_state else (0, -1)
        mesh = sm.mesh_for_world()  # a collective on a survivor; a joiner built it at start
        mine = torch.tensor([self.step if self._has_state else NOT_HELD, old_size, old_coord],
                            dtype=torch.int64, device=device)
        reports = [torch.zeros(3, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(reports, mine)
        ranks = [RankShards(*(int(x) for x in t.tolist())) for t in reports]
        coords = shard_coordinates(mesh)
        plan = plan_shard_transfer(ranks, int(mesh.size(-1)), coords)  # type: ignore[attr-defined]
        if plan.step == NOT_HELD:  # nobody holds a state: a fresh start or a full restart
            self._load_fresh(load)
            self._make_replica(sm)
            return
        if plan.fallback is not None:
            self._reshard_in_memory(sm, mesh, plan, device)
            self._make_replica(sm)
            return
        self.agreed_in_memory = True
        t0 = time.monotonic()
        optimizers: list[torch.optim.Optimizer] = [o for o in self.state.values()
                                                  if isinstance(o, torch.optim.Optimizer)]
        if mesh is not sm.mesh:  # a survivor: the old mesh's group is gone
            old = sm.module
            new = sm.rebuild(mesh, keep=ctx.rank in plan.keepers, optimizers=optimizers)
            state = self.state
            assert isinstance(state, MutableMapping)
            for key in [k for k, v in state.items() if v is old]:
                state[key] = new
        rebuilt = time.monotonic()
        left = self._deadline - rebuilt if self._deadline is not None else self.timeout_s
        for coord, src, receivers in plan.transfers:
            behind = ctx.rank in receivers
            sd = self._collect_sharded(sm, optimizers) if ctx.rank == src or behind else None
            received = broadcast_state(sd if ctx.rank == src else None, src, device,
                                       receivers=list(receivers), timeout_s=max(left, 1.0), into=sd)
            if behind:
                assert received is not None
                self._apply_sharded(received, sm, optimizers)
                self._log.info("live_shards_received", step=plan.step, source=src, coordinate=coord,
                               seconds=round(time.monotonic() - rebuilt, 3))
        self.step = plan.step
        self._has_state = True
        self._make_replica(sm)
        self._log.info("live_shards_remeshed", step=plan.step, kept=ctx.rank in plan.keepers,
                       shard_size=int(mesh.size(-1)), rebuild_s=round(rebuilt - t0, 3),  # type: ignore[attr-defined]
                       transfer_s=round(time.monotonic() - rebuilt, 3))

    def _reshard_in_memory(self, sm: ShardedModel, mesh: object, plan: ShardPlan, device: torch.device) -> None:
        """The shard size changed: rebuild the old world's shards from memory onto ``mesh``
        (:mod:`elasticd.worker.peer_reshard`), or fall back to the checkpoint saying why."""
        t0 = time.monotonic()
        ctx = wctx.current_context()
        replica = self.replica if self._has_state else None
        own, held = (replica.own, dict(replica.held)) if replica is not None else (None, {})
        report = pmem.MemoryReport(
            self._old_rank if self._has_state else -1, self._old_world if self._has_state else 0,
            self.step if self._has_state else NOT_HELD, own.step if own is not None else -1,
            tuple(sorted((o, snap.step) for o, snap in held.items())), self._committed_step())
        mine = torch.tensor(report.encode(), dtype=torch.int64, device=device)
        gathered = [torch.zeros(pmem.REPORT_LEN, dtype=torch.int64, device=device)
                    for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        mplan = pmem.plan_memory_reshard([pmem.MemoryReport.decode(t.tolist()) for t in gathered])
        if mplan.fallback is not None or mplan.sources is None:
            why = mplan.fallback if self.peer_replica_every or sm.mesh_kind != "fsdp" else (
                "no peer-RAM replica (peer_replica_every=0)")
            self._fall_back(f"{plan.fallback}; in memory: {why}")
        assert mplan.sources is not None
        optimizers = [o for o in self.state.values() if isinstance(o, torch.optim.Optimizer)]
        snaps: dict[int, Snapshot] = {}
        if mplan.fresh and self._has_state:
            tensors, extra = pmem.replica_state(self.state, sm.module, sm.names, sm.params, rng.capture())
            # One copy of each box (HSDP: the replicas at replicate coordinate 0).
            tensors = {k: t for k, t in tensors.items() if shards.writes_box(t)}
            snaps[self._old_rank] = take_snapshot(self._old_rank, self.step, tensors, extra)
        elif not mplan.fresh:
            snaps = pmem.own_snapshots(own, held)
        store = dist.distributed_c10d._get_default_store()
        prefix = f"elasticd/reshard/{ctx.round}"
        for old, src in mplan.sources.items():
            if src == ctx.rank:
                store.set(f"{prefix}/{old}", snaps[old].index().decode())
        if mesh is not sm.mesh:  # a survivor: the old mesh's group is gone
            old_module = sm.module
            new = sm.rebuild(mesh, keep=False, optimizers=optimizers)
            state = self.state
            assert isinstance(state, MutableMapping)
            for key in [k for k, v in state.items() if v is old_module]:
                state[key] = new
        chunks_of: dict[int, list] = {}
        sizes: dict[int, int] = {}
        extras: dict[int, dict[str, object]] = {}
        for old in range(mplan.old_world):
            rank, _, chunks, size, extra = pmem.parse_index(store.get(f"{prefix}/{old}"))
            if rank != old:
                self._fall_back(f"in-memory reshard: the index of old rank {old} names rank {rank}")
            chunks_of[old], sizes[old], extras[old] = chunks, size, extra
        keys = {c.key for cs in chunks_of.values() for c in cs}
        targets = self._reshard_targets(sm, optimizers, keys)
        need = pmem.needed_ranks(targets, chunks_of)
        flags = torch.tensor([1 if o in need else 0 for o in range(mplan.old_world)], dtype=torch.int64,
                             device=device)
        all_flags = [torch.zeros_like(flags) for _ in range(dist.get_world_size())]
        dist.all_gather(all_flags, flags)
        data: dict[int, torch.Tensor] = {}
        left = self._deadline - time.monotonic() if self._deadline is not None else self.timeout_s
        moved = 0
        for old in range(mplan.old_world):
            src = mplan.sources[old]
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
        source_rank = ctx.rank % mplan.old_world
        rng_state = pmem.apply_replica_state(self.state, sm.module, sm.names, sm.params, filled,
                                             extras[source_rank])
        rng.restore([rng_state], 0)
        lost = self.step - mplan.step if self._has_state else 0
        self.step = mplan.step
        self._has_state = True
        self.agreed_in_memory = True
        self._log.info("live_resharded_in_memory", step=mplan.step, shards_from="live shards" if mplan.fresh
                       else "peer-RAM replicas", old_world=mplan.old_world, world_size=dist.get_world_size(),
                       steps_rolled_back=max(lost, 0), bytes_received=moved,
                       seconds=round(time.monotonic() - t0, 3))

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

    def _reshard_targets(self, sm: ShardedModel, optimizers: Sequence[torch.optim.Optimizer],
                         keys: set[str]) -> dict[str, object]:
        """Empty DTensors of the new sharding for every saved key: the module's parameters
        and each optimizer's per-parameter state."""
        targets: dict[str, object] = {}
        for key, obj in self.state.items():
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

    def _collect_sharded(self, sm: ShardedModel, optimizers: list[torch.optim.Optimizer]) -> dict[str, object]:
        out: dict[str, object] = {"__rng__": rng.capture(), "__step__": self.step}
        for name, obj in self.state.items():
            if obj is sm.module:
                out[name] = sm.local_state()
            elif any(obj is o for o in optimizers):
                assert isinstance(obj, torch.optim.Optimizer)
                out[name] = optimizer_local_state(obj)
            else:
                out[name] = obj.state_dict() if isinstance(obj, Stateful) else dict(obj)
        return out

    def _apply_sharded(self, sd: Mapping[str, object], sm: ShardedModel,
                       optimizers: list[torch.optim.Optimizer]) -> None:
        rest: dict[str, object] = {}
        for name, obj in self.state.items():
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
            obj = self.state[name]
            if isinstance(obj, Stateful):
                obj.load_state_dict(entry)  # type: ignore[arg-type]
            else:
                obj.clear()
                obj.update(entry)  # type: ignore[call-overload]
        rng_state = sd["__rng__"]
        if not isinstance(rng_state, dict):
            raise TypeError("received RNG state is not a mapping")
        rng.restore([rng_state], 0)

    def _collect(self) -> dict[str, object]:
        out: dict[str, object] = {"__rng__": rng.capture(), "__step__": self.step}
        for name, obj in self.state.items():
            out[name] = obj.state_dict() if isinstance(obj, Stateful) else dict(obj)
        return out

    def _apply(self, sd: Mapping[str, object]) -> None:
        for name, obj in self.state.items():
            entry = sd[name]
            if not isinstance(entry, Mapping):
                raise TypeError(f"received state {name!r} is a {type(entry).__name__}, not a mapping")
            if isinstance(obj, Stateful):
                obj.load_state_dict(entry)
            else:
                obj.clear()
                obj.update(entry)
        rng_state = sd["__rng__"]
        if not isinstance(rng_state, dict):
            raise TypeError("received RNG state is not a mapping")
        rng.restore([rng_state], 0)

    def _fall_back(self, why: str) -> NoReturn:
        """In-place re-formation failed: exit 0 as stopped, so the agent restarts the group."""
        self._link.fall_back(why, self.step)
