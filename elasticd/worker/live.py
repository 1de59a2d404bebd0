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
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import NoReturn

import structlog
import torch
import torch.distributed as dist

import elasticd.worker.context as wctx
from elasticd.checkpoint import first_loss
from elasticd.control.api import LIVE_TIMEOUT_DEFAULT_S
from elasticd.control.messages import LeaveReason
from elasticd.errors import ConfigError
from elasticd.worker.failures import is_peer_failure
from elasticd.worker.fingerprint import offered_step, state_is_finite
from elasticd.worker.live_entries import (
    LiveEntry,
    Regroupable,
    Stateful,
    Synced,
    abandon_step,
    apply,
    collect,
    load_fresh,
)
from elasticd.worker.live_link import AgentLink
from elasticd.worker.live_sharded import ShardedResync
from elasticd.worker.peer_replica import DEFAULT_EVERY_STEPS
from elasticd.worker.recovery_plan import NO_STATE, Load, plan_replication
from elasticd.worker.sharded import ShardedModel
from elasticd.worker.state_broadcast import broadcast_state

log = structlog.get_logger(__name__)

MAX_REFORMS_PER_STEP = 3  # the same step failing again and again is a bug, not a peer


def _never() -> bool:
    return False


__all__ = ["LiveEntry", "LiveState", "Reformed", "Regroupable", "Stateful"]


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
        # True while this rank's state is known diverged (set by ElasticLoop from its
        # replica fingerprints): it then offers no state to a re-formation's transfer.
        self.suspect: Callable[[], bool] = _never
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
        # The sharded state agreement and its peer-RAM replica (None: a replicated job).
        self._sharded = (ShardedResync(state, sharded, checkpoint=checkpoint,
                                       peer_replica_every=peer_replica_every, timeout_s=self.timeout_s,
                                       enabled=self.enabled, log=self._log, fall_back=self._fall_back)
                         if sharded is not None else None)
        if self.enabled:
            self._link.start_watch()
        first_loss.CHECK.agreed_by_live = True  # step_done settles the first loss, every rank

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
        # The first step after a restore: did any rank's loss come out NaN or infinite?
        # Then nothing of this state may be kept (a replica refreshed, a drain saved): every
        # rank leaves for the next tier at this same step.
        if first_loss.CHECK.pending is not None:
            self._judge_first_loss(step)
        if self._sharded is not None:
            self._sharded.after_step(step)
        if not wctx.should_stop(step):
            return False
        if not self.enabled or wctx.every_rank_draining():
            return True  # nobody stays to hold the state: save it and exit (the caller)
        if self._sharded is not None and wctx.some_rank_draining():
            self._sharded.hold_for_drain(step)
        if wctx.stop_requested_locally():
            self._log.info("live_drained", step=step)
            wctx.fast_exit(0)  # survivors hold this state: no checkpoint to write
        self._reform(LeaveReason.ORDERED if wctx.reform_ordered() else LeaveReason.AGREED_STOP)
        raise Reformed(f"re-formed at the agreed step {step}")

    def _judge_first_loss(self, step: int) -> None:
        """Every rank, at the first step after a restore: leave for the next tier if any
        rank's loss was NaN or infinite (:mod:`elasticd.checkpoint.first_loss`)."""
        ctx = wctx.current_context()
        refused = first_loss.CHECK.agree(step, ctx.device if ctx.backend == "nccl" else None)
        if refused:
            if self.enabled:
                self._fall_back(refused)
            raise first_loss.RestoreRefusedError(refused)

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
            abandon_step(self.state)
            self._log.info("collective_failed", step=self.step + 1, error=str(exc)[:200])
            self._reform(LeaveReason.COLLECTIVE_FAILED)
            raise Reformed(f"re-formed after a failed collective: {exc}") from None

    def refresh_replica(self) -> None:
        """Refresh the peer-RAM replica now, at ``self.step`` (a collective: every rank at
        the same point; the loop is blocked only for the copy to host memory).

        ``ElasticLoop`` calls it at every epoch's end too, so that a rollback never
        crosses an epoch boundary.
        """
        if self._sharded is not None:
            self._sharded.refresh(self.step)

    # -- re-formation ---------------------------------------------------------------------
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
        """Agree on the newest completed step; its holder sends the state to those behind."""
        if self._sharded is not None:
            synced = self._sharded.sync(load, self.step, self._has_state, self._deadline)
        else:
            synced = self._sync_replicated(load)
        self.step = synced.step
        self._has_state = True
        self.agreed_in_memory = synced.agreed_in_memory
        if synced.transferred:
            first_loss.CHECK.restored(first_loss.Restore(synced.transferred))
        elif synced.agreed_in_memory:
            first_loss.CHECK.forget()  # the same on every rank (a load sets it on every rank)

    def _sync_replicated(self, load: Callable[[], int] | None) -> Synced:
        """The replicated (DDP) agreement: the newest step's holder broadcasts to those behind."""
        ctx = wctx.current_context()
        # On the group's own device: an NCCL group has no CPU backend (the GPU check found
        # "No backend type associated with device type cpu").
        device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
        held = self.step if self._has_state else NO_STATE
        finite = held == NO_STATE or self._finite("live_state_not_offered")
        mine = torch.tensor([offered_step(held, suspect=self.suspect(), finite=finite)],
                            dtype=torch.int64, device=device)
        steps = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(steps, mine)
        plan = plan_replication([int(t.item()) for t in steps])
        if isinstance(plan, Load):  # nobody holds a state: a fresh start or a full restart
            return load_fresh(load)
        if not plan.behind:
            return Synced(self.step, agreed_in_memory=True)
        t0 = time.monotonic()
        newest, src, behind = plan.step, plan.source, list(plan.behind)
        sd = collect(self.state, self.step) if ctx.rank == src or ctx.rank in behind else None
        # Bounded by what is left of the re-formation (a source that died mid-transfer
        # raises TransferError, and _reform_inner falls back to the restart path). A rank
        # behind receives into its own tensors where they match (``into``).
        left = self._deadline - t0 if self._deadline is not None else self.timeout_s
        received = broadcast_state(sd if ctx.rank == src else None, src, device, receivers=behind,
                                   timeout_s=max(left, 1.0), into=sd)
        if ctx.rank in behind:
            assert received is not None
            apply(self.state, received)
            if not self._finite("live_state_received_non_finite"):  # next tier: the checkpoint
                self._fall_back(f"the state received from rank {src} at step {newest} holds "
                                "non-finite values")
        if ctx.rank == src or ctx.rank in behind:
            self._log.info("live_state_received" if ctx.rank in behind else "live_state_sent",
                           step=newest, source=src, receivers=behind,
                           seconds=round(time.monotonic() - t0, 3))
        return Synced(newest, agreed_in_memory=True,
                      transferred=f"the state rank {src} sent at step {newest}")

    def _finite(self, event: str) -> bool:
        """Does this rank's state hold only finite values? If not, log ``event`` and why."""
        return state_is_finite(self.state, self._log, event, self.step)

    def _fall_back(self, why: str) -> NoReturn:
        """In-place re-formation failed: exit 0 as stopped, so the agent restarts the group."""
        self._link.fall_back(why, self.step)
