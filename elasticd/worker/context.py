"""The training-side API: ``init``, ``should_stop``, ``report_progress``, ``shutdown``.

This is the one module (with ``elasticd.config``) that reads the environment: torchrun's
contract (RANK, WORLD_SIZE, LOCAL_RANK, ...) and elasticd's (ELASTICD_JOB, ELASTICD_ROUND,
ELASTICD_CHECKPOINT_URL, ELASTICD_CONTROL_DIR/SOCKET). Everything also works under plain
torchrun (no agent: a SIGTERM asks for the stop instead of the drain file) and in a
single process with no launcher at all (world size 1).

Stop agreement: ``should_stop()`` checks the local drain flag (one ``stat``) and all-reduces
one integer (MAX) so that every rank of every node returns True at the same call, once any
node was asked to drain. The all-reduce is asynchronous and read one call later, on a CPU
(gloo) group even when training uses NCCL: the training loop never waits for it and the
GPU is never synchronised for it. Every rank reads the same previous result, so all ranks
still agree; a drain takes effect one step later.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NoReturn

import structlog
import torch
import torch.distributed as dist

from elasticd import teardown
from elasticd.checkpoint import first_loss
from elasticd.checkpoint.cadence import SaveCadence
from elasticd.control import (
    API_PREFIX,
    DRAIN_FILE,
    DRAINABLE_PREFIX,
    ENV_CONTROL_DIR,
    ControlClient,
    StepReport,
    handover,
)
from elasticd.control.api import (
    ENV_CHECKPOINT_URL,
    ENV_JOB,
    ENV_NODE,
    ENV_RESUME,
    ENV_RUN_ID,
    ENV_SPARE,
    PARK_FILE,
)
from elasticd.control.client import LatestReport

# The agent's variables are parsed behind the control seam (the checkpoint package reads
# them too); re-exported here for the worker API's callers.
from elasticd.control.environment import AgentEnvironment, agent_environment  # noqa: F401
from elasticd.control.fence import set_round_source
from elasticd.control.messages import StoppedReport
from elasticd.control.reform import write_stopped
from elasticd.errors import EX_CONFIG, ConfigError
from elasticd.worker import process_group as pgl
from elasticd.worker.sockets import socket_links
from elasticd.worker.stop_agreement import StopAgreement

log = structlog.get_logger(__name__)

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
PROGRESS_MIN_INTERVAL_S = 0.2
MAX_CADENCE_CHARS = 400  # the cadence's reason in a step report (the channel bounds strings)
# A pending should_stop all-reduce gets this long to complete at shutdown; then it is
# abandoned (a peer is gone). It started a step ago, so it is normally complete.
PENDING_SETTLE_S = 5.0
# ... and this long when leaving an aborted group (live re-formation): a peer is gone and
# nothing wakes a wait on an aborted gloo group in its own process, so the full bound was
# 5 s added to one re-formation in three after a SIGKILL (measured), for nothing.
ABORTED_SETTLE_S = 0.1
# ELASTICD_GROUP_LIFECYCLE: unset, re-form with torch's c10d reconfigure where the torch in
# use has it (gloo, 2.14+), else rebuild; =rebuild: rebuild everywhere; =nccl-reconfigure:
# NCCL groups too (experimental, unproven on a GPU) (elasticd.worker.process_group).
ENV_GROUP_LIFECYCLE = "ELASTICD_GROUP_LIFECYCLE"


@dataclass(frozen=True)
class WorkerContext:
    """Who this worker is. Returned by ``init()``."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    restart_count: int
    round: int | None
    job: str | None
    node: str | None
    checkpoint_url: str | None
    under_agent: bool  # started by an elasticd agent (drain file, fenced commits)
    # The run's identity and resume mode (ELASTICD_RUN_ID/ELASTICD_RESUME from the agent),
    # for CheckpointManager(run_id=..., resume=...). None/"auto" without an agent.
    run_id: str | None = None
    resume: str = "auto"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class WorkerRuntime:
    """What this worker process holds: its context, its process group's owner and sockets,
    the agent's channel, and the stop agreement's flag and pending all-reduce.

    One per process (the module's functions delegate to it); no other code touches its
    fields: what the re-formation and the transports need from it are its methods.
    """

    def __init__(self, ctx: WorkerContext | None = None) -> None:
        """A runtime with nothing formed yet, or (``ctx``) one that adopts a known context
        with no group and no agent (a unit test, a single process)."""
        self._ctx = ctx
        self._client: ControlClient | None = None
        self._control_dir: Path | None = None
        self._sigterm = False
        self._stopped = False
        self._drainable_noted = False  # drainable-<rank> written for the agent
        self._progress: LatestReport | None = None  # step reports (throttled, never the newest lost)
        self._stop = StopAgreement()
        self._old_sigterm: Any = None
        self._guards_installed = False  # teardown guards (once per process)
        # Our groups' sockets ("socket:[inode]"): all live re-formation may shut down.
        self._group_sockets: frozenset[str] = frozenset()
        # The newest round the agent ordered this node's live workers into (``reform.json``; -1:
        # none). A worker in an older round leaves at the next agreed step, as for a park.
        self._ordered_round = -1
        # A hot spare's worker before its round (ELASTICD_SPARE=1): what init() was asked for
        # and the context it returned (no group); None once admitted, or when not a spare.
        self._ahead: tuple[str | None, float, WorkerContext, int] | None = None  # ..., and our pid
        self._ran_ahead = False  # this worker ran ahead as a spare's, then joined its round
        # The one owner that forms, leaves and re-forms the group; None until init() formed one.
        self._lifecycle: pgl.GroupLifecycle | None = None
        self._generation = 0  # groups formed so far: a wrapper built on an older one is stale

    # -- forming and re-forming ---------------------------------------------------------
    def init(self, backend: str | None, timeout_s: float) -> WorkerContext:
        """See :func:`init`."""
        if self._ctx is not None:
            return self._ctx
        _announce_api()
        if os.environ.get(ENV_SPARE) == "1":
            return self._run_ahead(backend, timeout_s)
        agent = agent_environment()  # fail before any collective: a config error, not a hang
        world = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        local_rank = _env_int("LOCAL_RANK", 0)
        device, backend = _device(backend, local_rank)
        if (world > 1 or "MASTER_ADDR" in os.environ) and not dist.is_initialized():
            _record_sockets_of_new_groups(self)
            choice = _choose_lifecycle(backend, live=agent is not None and agent.live)
            self._lifecycle = pgl.make_lifecycle(choice, backend, timeout_s, device)
            spec = None
            if choice.kind is pgl.LifecycleKind.RECONFIGURE:
                spec = pgl.GroupSpec(backend, rank, world, agent.round if agent else 0,
                                     os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                     _env_int("MASTER_PORT", 29500), timeout_s, device)
            before = socket_links()
            self._lifecycle.form(spec)
            self._generation += 1
            self._group_sockets = frozenset(socket_links() - before)
            log.info("process_group_lifecycle_chosen", lifecycle=choice.kind.value, reason=choice.reason)
        control_dir = agent.control_dir if agent else os.environ.get(ENV_CONTROL_DIR)
        socket_path = agent.socket_path if agent else None
        self._ctx = WorkerContext(
            rank=rank, world_size=world, local_rank=local_rank,
            local_world_size=_env_int("LOCAL_WORLD_SIZE", 1), device=device, backend=backend,
            restart_count=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
            round=agent.round if agent else None,
            job=os.environ.get(ENV_JOB), node=os.environ.get(ENV_NODE),
            checkpoint_url=os.environ.get(ENV_CHECKPOINT_URL),
            under_agent=bool(control_dir),
            run_id=agent.run_id if agent else None,
            resume=agent.resume if agent else "auto",
        )
        self._control_dir = Path(control_dir) if control_dir else None
        self._client = ControlClient(socket_path) if socket_path else None
        self._progress = LatestReport(self._client.send, PROGRESS_MIN_INTERVAL_S) if self._client else None
        if not control_dir:
            # Under plain torchrun (or by hand) a SIGTERM asks for a graceful stop.
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._install_teardown_guards()
        if dist.is_initialized():
            before = socket_links()
            self._stop.use(dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD)
            self._group_sockets |= socket_links() - before
        return self._ctx

    def _run_ahead(self, backend: str | None, timeout_s: float) -> WorkerContext:
        """``init()`` in a hot spare's worker before its round: a context without a group
        (rank -1, world size 0) whose device the script builds its model on. The first call
        that needs the round (:func:`current_context`, the control channel, ``LiveState``,
        ``ElasticLoop``, ``ShardedModel``, ...) waits for it (:meth:`await_round`)."""
        if self._ahead is None:
            self._ahead = (backend, timeout_s, _ahead_context(backend), os.getpid())
        return self._ahead[2]

    def await_round(self) -> None:
        """A hot spare's worker: wait until the agent admits the spare, then become the
        round's worker (its environment and log files: ``elasticd.control.handover``) and
        ``init()`` for real. At once when this worker does not run ahead."""
        ahead = self._ahead
        if ahead is None or ahead[3] != os.getpid():
            return  # not a spare's worker, or a process it forked (never reads the worker's stdin)
        started = time.monotonic()
        log.info("spare_worker_waiting", pid=os.getpid())
        msg = handover.read(sys.stdin.buffer)
        if msg is None:  # the agent discarded this spare's worker (it stops, or started cold)
            os._exit(0)
        handover.become(msg)
        self._ahead = None
        self._ran_ahead = True
        if _env_int("RANK", 0) != 0 and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            # Admitted the moment the round closed, this worker may connect before the round's
            # rank 0 listens, and the TCPStore client then backs off for seconds: wait for the
            # port in 10 ms polls instead (as rejoin() does). A cold worker's start-up hid it.
            _wait_for_port(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           time.monotonic() + ahead[1])
        ctx = self.init(ahead[0], ahead[1])
        log.info("spare_worker_admitted", rank=ctx.rank, world_size=ctx.world_size, round=ctx.round,
                 waited_s=round(time.monotonic() - started, 3))

    def leave_group(self) -> None:
        """See :func:`leave_group`."""
        groups = (self._stop.group, dist.group.WORLD) if dist.is_initialized() else ()
        owner = self._lifecycle or pgl.RebuildLifecycle("gloo", DEFAULT_COLLECTIVE_TIMEOUT_S)
        owner.leave(groups, lambda: self.settle_pending(ABORTED_SETTLE_S))
        self._stop.use(None)
        self._stopped = False

    def rejoin(self, spec: pgl.GroupSpec) -> WorkerContext:
        """See :func:`rejoin` (``spec``: the new round's group)."""
        ctx = self.current_context()
        if self._lifecycle is None:
            self._lifecycle = pgl.RebuildLifecycle(ctx.backend, spec.timeout_s, spec.device)
        before = socket_links()
        self._lifecycle.join(spec)
        self._generation += 1
        self._ctx = dataclasses.replace(ctx, rank=spec.rank, world_size=spec.world_size, round=spec.round)
        self._stop.use(dist.new_group(backend="gloo") if ctx.backend != "gloo" else dist.group.WORLD)
        now = socket_links()
        # Reconfigured in place, the group keeps the sockets it still has open (its store's).
        kept = self._group_sockets & now if self._lifecycle.kind is pgl.LifecycleKind.RECONFIGURE else frozenset()
        self._group_sockets = frozenset(kept | (now - before))
        self._stopped = False
        return self._ctx

    def abort_groups(self, proceed: Callable[[], bool]) -> None:
        """Abort the world group and the stop flag's group (another thread's wake-up of a
        loop blocked on a peer), each only while ``proceed()`` holds; errors of a group
        already gone are ignored."""
        for group in (dist.group.WORLD, self._stop.group):
            try:
                if group is not None and proceed():
                    group.abort()
            except (RuntimeError, AttributeError, ValueError):
                pass

    def group_sockets(self) -> frozenset[str]:
        """The "socket:[inode]" links our process groups opened (see the field)."""
        return self._group_sockets

    def note_group_sockets(self, links: frozenset[str]) -> None:
        """Add a later group's sockets (:func:`_record_sockets_of_new_groups`)."""
        self._group_sockets |= links

    def group_generation(self) -> int:
        return self._generation

    def lifecycle(self) -> pgl.GroupLifecycle | None:
        return self._lifecycle

    def ran_ahead(self) -> bool:
        return self._ran_ahead

    # -- teardown -----------------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._sigterm = True

    def _install_teardown_guards(self) -> None:
        # torch's gloo destructor race (elasticd.teardown): destroyed groups stay referenced, our
        # pending all-reduce settles first, and a ConfigError exits 78 (plain torchrun too).
        if self._guards_installed:
            return
        self._guards_installed = True
        teardown.keep_groups_on_destroy()
        teardown.before_destroy(self.settle_pending)
        atexit.register(self.settle_pending)
        previous = sys.excepthook

        def config_error_exits_78(tp: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            previous(tp, exc, tb)
            if isinstance(exc, ConfigError):
                teardown.end_process(EX_CONFIG)  # deterministic: the agent must not retry it

        sys.excepthook = config_error_exits_78

    def settle_pending(self, timeout_s: float = PENDING_SETTLE_S) -> None:
        """Wait (bounded) for our pending should_stop all-reduce, or abandon it."""
        self._stop.settle(timeout_s)

    def shutdown(self) -> None:
        """See :func:`shutdown`."""
        self.settle_pending()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._progress is not None:
            self._progress.close()
        if self._client is not None:
            self._client.close()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
        self._ctx, self._client, self._control_dir, self._progress = None, None, None, None
        self._old_sigterm, self._lifecycle = None, None
        self._stop.reset()
        self._stopped = self._sigterm = self._drainable_noted = False
        self._ordered_round = -1

    # -- what the loop asks -------------------------------------------------------------
    def current_round(self) -> int | None:
        return self._ctx.round if self._ctx is not None else None

    def current_context(self) -> WorkerContext:
        self.await_round()
        return self._ctx or self.init(None, DEFAULT_COLLECTIVE_TIMEOUT_S)

    def control_dir(self) -> Path | None:
        self.await_round()
        return self._control_dir

    def control_client(self) -> ControlClient | None:
        self.await_round()
        return self._client

    def every_rank_draining(self) -> bool:
        return self._stop.every_rank_draining()

    def some_rank_draining(self) -> bool:
        return self._stop.some_rank_draining()

    def park_requested(self) -> bool:
        return self._control_dir is not None and (self._control_dir / PARK_FILE).exists()

    def note_reform_order(self, round_: int) -> None:
        self._ordered_round = max(self._ordered_round, round_)

    def reform_ordered(self) -> bool:
        ctx = self._ctx
        return ctx is not None and ctx.round is not None and self._ordered_round > ctx.round

    def stop_requested_locally(self) -> bool:
        self.await_round()
        if self._sigterm:
            return True
        return self._control_dir is not None and (self._control_dir / DRAIN_FILE).exists()

    def should_stop(self, step: int | None, every: int) -> bool:
        """See :func:`should_stop`."""
        self.await_round()
        if not self._drainable_noted:
            self._note_drainable()
        if every > 1:
            if step is None:
                raise ValueError("should_stop(every=N) needs the step, so all ranks skip the same calls")
            if step % every:
                return False
        ctx = self.current_context()
        draining = self.stop_requested_locally()
        local = draining or self.park_requested() or self.reform_ordered()
        if dist.is_initialized() and ctx.world_size > 1:
            stop = self._stop.agree(local, draining)
        else:
            stop = self._stop.alone(local, draining)
        if stop and not self._stopped:
            self._stopped = True
            self._mark_stopped(ctx, step)
        return stop

    def _note_drainable(self) -> None:
        # Tell the agent once that this script stops at a step boundary when asked, so a
        # joining node is admitted by a drain (no step lost) instead of a worker restart.
        self._drainable_noted = True
        if self._control_dir is None:
            return
        try:
            (self._control_dir / f"{DRAINABLE_PREFIX}{self.current_context().rank}").touch()
        except OSError:  # the agent is restarting us: it falls back to a plain restart
            pass

    def _mark_stopped(self, ctx: WorkerContext, step: int | None) -> None:
        if self._control_dir is None:
            return
        write_stopped(self._control_dir, StoppedReport(rank=ctx.rank, step=-1 if step is None else max(step, -1),
                                                       round=ctx.round if ctx.round is not None else -1))

    def report_progress(self, report: Callable[[WorkerContext], StepReport], force: bool) -> None:
        """See :func:`report_progress` (``report``: the step report for this context)."""
        self.await_round()
        if self._progress is None:
            return
        self._progress.offer(report(self.current_context()), force=force)


_RUNTIME = WorkerRuntime()
_NEW_GROUPS_RECORDED = False  # torch's group helper wrapped (once per process)


def _record_sockets_of_new_groups(owner: WorkerRuntime) -> None:
    """Make every process group this process creates from now on record the sockets it
    opened with ``owner`` (once per process).

    The world group's and the stop flag's sockets were the only ones known, so a collective
    of a group the script or torch made later (HSDP's shard and replicate groups from
    ``init_device_mesh``, an example's own group for its asynchronous saves) that waited on a
    *surviving* peer could not be woken: that peer had left the old round's collectives for
    the re-formation, the wait went on until the live bound (30 s) and the workers were
    restarted from the checkpoint (the suite: an HSDP survivor's rank 0, with every world
    socket shut down, still waited). torch creates every group through
    ``distributed_c10d._new_process_group_helper``; it is wrapped to take the sockets that
    appeared meanwhile, as ``init()`` does for the world group. Groups connect their peers
    when they are created (a gloo group under ``TORCH_GLOO_LAZY_INIT`` connects at its first
    collective, and its sockets stay unknown).
    """
    global _NEW_GROUPS_RECORDED
    from torch.distributed import distributed_c10d as c10d

    original = getattr(c10d, "_new_process_group_helper", None)
    if _NEW_GROUPS_RECORDED or original is None:  # a torch without it: as before, world only
        return

    def recorded(*args: Any, **kwargs: Any) -> Any:
        before = socket_links()
        try:
            return original(*args, **kwargs)
        finally:
            owner.note_group_sockets(frozenset(socket_links() - before))

    c10d._new_process_group_helper = recorded
    _NEW_GROUPS_RECORDED = True


def runtime() -> WorkerRuntime:
    """This process's worker runtime (what the module's functions delegate to)."""
    return _RUNTIME


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw not in (None, "") else default


def _announce_api() -> None:
    """Tell the agent this worker uses the worker API (``api-<local rank>`` in the control
    dir), before the process group opens its first socket: a join then waits for this
    group to register for live re-formation instead of restarting it, while a plain
    script's group, which never writes one, is restarted for a join at once. Best effort."""
    control_dir = os.environ.get(ENV_CONTROL_DIR)
    if control_dir:
        try:
            (Path(control_dir) / f"{API_PREFIX}{_env_int('LOCAL_RANK', 0)}").touch()
        except OSError:
            pass  # the agent is gone or restarting: it starts new workers anyway


def init(backend: str | None = None, *, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> WorkerContext:
    """Set up the process group from torchrun's environment; idempotent.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; default NCCL when CUDA is available, else gloo.
        timeout_s: collective timeout. Bounded, so a peer that vanished is noticed even
            without the agent (the agent usually restarts the group much sooner).

    Returns:
        The ``WorkerContext``.

    Raises:
        ConfigError: started by an agent without ``ELASTICD_ROUND`` (see
            :func:`agent_environment`).
    """
    return _RUNTIME.init(backend, timeout_s)


def _choose_lifecycle(backend: str, *, live: bool) -> pgl.LifecycleChoice:
    """The group lifecycle for this worker: reconfigure only for live re-formation (a
    worker that never re-forms gains nothing), where torch has it (see ``choose_lifecycle``).

    Raises:
        ConfigError: ``ELASTICD_GROUP_LIFECYCLE`` names no lifecycle (exit 78).
    """
    request = pgl.parse_lifecycle_request(os.environ.get(ENV_GROUP_LIFECYCLE))
    if not live:
        return pgl.LifecycleChoice(pgl.LifecycleKind.REBUILD, "live re-formation is off")
    return pgl.choose_lifecycle(pgl.torch_version(torch.__version__), backend,
                                has_reconfigure=pgl.has_reconfigure(), request=request)


def group_generation() -> int:
    """How many process groups this worker formed (init and each re-formation): a DDP
    wrapper built at an older generation is bound to a group that is gone or re-pointed."""
    return _RUNTIME.group_generation()


def lifecycle() -> pgl.GroupLifecycle | None:
    """The owner of this worker's process group (None before ``init()`` formed one)."""
    return _RUNTIME.lifecycle()


def group_sockets() -> frozenset[str]:
    """The sockets this worker's process groups opened ("socket:[inode]" links): the
    transports' own addresses, and the only ones a re-formation may shut down."""
    return _RUNTIME.group_sockets()


def abort_groups(proceed: Callable[[], bool]) -> None:
    """Abort this worker's process groups while ``proceed()`` holds (a watcher thread's
    wake-up of a loop blocked on a frozen peer)."""
    _RUNTIME.abort_groups(proceed)


def _ahead_context(backend: str | None) -> WorkerContext:
    """A hot spare's worker's context before its round: no group (rank -1, world size 0)."""
    local_rank = _env_int("LOCAL_RANK", 0)
    device, chosen = _device(backend, local_rank)
    return WorkerContext(rank=-1, world_size=0, local_rank=local_rank,
                         local_world_size=_env_int("LOCAL_WORLD_SIZE", 1), device=device,
                         backend=chosen, restart_count=0, round=None,
                         job=os.environ.get(ENV_JOB), node=os.environ.get(ENV_NODE),
                         checkpoint_url=os.environ.get(ENV_CHECKPOINT_URL), under_agent=True,
                         run_id=os.environ.get(ENV_RUN_ID) or None,
                         resume=os.environ.get(ENV_RESUME) or "auto")


def _device(backend: str | None, local_rank: int) -> tuple[torch.device, str]:
    """This worker's device (made current on CUDA) and backend."""
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if not use_cuda:
        return torch.device("cpu"), backend or "gloo"
    device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    torch.cuda.set_device(device)
    return device, backend or "nccl"


def ran_ahead() -> bool:
    """This worker ran ahead as a hot spare's (its script built the model before the
    round) and has since joined its round: what it built for world size 0 is rebuilt."""
    return _RUNTIME.ran_ahead()


def current_round() -> int | None:
    """The round this worker trains in now (it changes on a live re-formation)."""
    return _RUNTIME.current_round()


set_round_source(current_round)  # fences commit with the round this worker trains in now


def leave_group() -> None:
    """Leave the process group without waiting on peers (live re-formation).

    The group is aborted first: its connections close, so every peer blocked in a
    collective with this rank fails at once instead of waiting for the collective timeout
    (the failure spreads through the whole old group within milliseconds). Then the
    pending stop-flag all-reduce is settled; the group is destroyed (rebuild) or kept to
    be reconfigured (:mod:`elasticd.worker.process_group`), and nothing an earlier
    re-formation left is held any more.
    """
    _RUNTIME.leave_group()


def rejoin(rank: int, world_size: int, round_: int, master_addr: str, master_port: int, *,
           timeout_s: float) -> WorkerContext:
    """Join the process group of a new round (live re-formation) and update the context.

    The new round's global rank 0 hosts its TCPStore at ``master_addr:master_port`` (the
    same bootstrap a worker started in that round uses), so survivors and fresh workers
    form one group.

    Args:
        rank: this worker's global rank in the new round.
        world_size: the new round's world size.
        round_: the new round (checkpoint commits are fenced by it).
        master_addr: the new round's bootstrap host.
        master_port: ... and port.
        timeout_s: bound on forming the group and on its collectives.

    Returns:
        The new ``WorkerContext``.

    Raises:
        RuntimeError: the group could not be formed within ``timeout_s``.
    """
    ctx = current_context()
    if rank != 0:
        # The TCPStore client backs off exponentially (seconds) when it connects before the
        # new rank 0 listens; wait for the port here, in 10 ms polls, instead.
        _wait_for_port(master_addr, master_port, time.monotonic() + timeout_s)
    return _RUNTIME.rejoin(pgl.GroupSpec(ctx.backend, rank, world_size, round_, master_addr, master_port,
                                         timeout_s, ctx.device if ctx.backend == "nccl" else None))


def every_rank_draining() -> bool:
    """At the last agreed stop, was every rank's own node draining (nobody stays)?"""
    return _RUNTIME.every_rank_draining()


def some_rank_draining() -> bool:
    """At the last agreed stop, was some rank's own node draining (its state must be handed on)?"""
    return _RUNTIME.some_rank_draining()


_wait_for_port = pgl.wait_for_port


def park_requested() -> bool:
    """True if this node's agent asked live workers to leave the group at the next agreed step."""
    return _RUNTIME.park_requested()


def note_reform_order(round_: int) -> None:
    """Record that the agent ordered this node's live workers into round ``round_``.

    Called by ``LiveState``'s watcher thread (one assignment: safe beside the loop).
    """
    _RUNTIME.note_reform_order(round_)


def reform_ordered() -> bool:
    """True while the agent's newest order names a round newer than this worker's.

    Such a worker is in a superseded round: it must take the order at its next step
    boundary. Nothing else would move one whose collectives all succeed (alone at world
    size 1), which used to train on alone until its commit was refused (issue 26).
    """
    return _RUNTIME.reform_ordered()


def control_dir() -> Path | None:
    """The agent's runtime directory (None without an agent)."""
    return _RUNTIME.control_dir()


def current_context() -> WorkerContext:
    """The context of ``init()`` (calls it with defaults if needed). In a hot spare's
    worker running ahead, waits for its round first."""
    return _RUNTIME.current_context()


def stop_requested_locally() -> bool:
    """True if this node's agent asked for a drain (or this process got SIGTERM). No collective."""
    return _RUNTIME.stop_requested_locally()


def should_stop(step: int | None = None, *, every: int = 1) -> bool:
    """True on every rank at the same call once any node was asked to stop.

    Call it once per step at the same point on every rank (it is a collective). When it
    returns True, save a checkpoint and exit 0: the agent then knows the job is not
    finished but drained, and survivors re-form without this node. With several ranks the
    answer reflects the drain flags as of the previous call (see the module docstring).
    The first call also tells the agent (an empty ``drainable-<rank>`` file in the control
    dir) that this script stops this way, so a node joining mid-training is admitted
    through such a stop (no step lost) rather than by restarting the workers.

    Args:
        step: the last fully trained step, recorded for the agent.
        every: agree only on steps that are multiples of ``every`` (``step`` required);
            other calls return False at once, with no collective. Use it when one tiny
            all-reduce per step is measurable (very short steps, CPU-bound gloo jobs); a
            drain then takes up to ``every`` more steps, which the drain grace must cover.
    """
    return _RUNTIME.should_stop(step, every)


def report_progress(step: int, *, epoch: int = 0, samples: int = 0, loss: float | None = None,
                    force: bool = False, cadence: SaveCadence | None = None) -> None:
    """Tell the agent the last completed step (hang detection, ``elasticd status``).

    ``loss`` (optional, a float) goes into the job's history: ``elasticd status --plot``
    draws it and ``--watch`` shows its trend. Non-blocking and rate-limited (at most every
    0.2 s unless ``force``); a report that comes sooner is sent once the interval has
    passed, so the agent always learns the newest step. A no-op without an agent.
    ``cadence`` (``[checkpoint] every = "auto"``) is shown by ``elasticd status``.

    The first ``loss`` after a restore is checked (:mod:`elasticd.checkpoint.first_loss`): a NaN
    or an infinity refuses the restored state. Without a ``LiveState`` this raises
    :class:`~elasticd.checkpoint.first_loss.RestoreRefusedError` (the agent restarts the group
    and the checkpoint before is loaded); with one, ``LiveState.step_done`` settles it on
    every rank, so report the loss before calling it.
    """
    first_loss.CHECK.saw_loss(step, None if loss is None else float(loss))
    _RUNTIME.report_progress(
        lambda ctx: StepReport(local_rank=ctx.local_rank, rank=ctx.rank, step=max(step, -1),
                               epoch=max(epoch, 0), samples=max(samples, 0),
                               loss=None if loss is None else float(loss),
                               **_cadence_fields(cadence)), force)


def _cadence_fields(cadence: SaveCadence | None) -> dict[str, Any]:
    if cadence is None:
        return {}
    return {"save_every": cadence.every_steps, "save_interval_s": max(0.0, cadence.interval_s),
            "cadence": cadence.reason[:MAX_CADENCE_CHARS]}


def control_client() -> ControlClient | None:
    """The agent's control channel client (None without an agent)."""
    return _RUNTIME.control_client()


def shutdown() -> None:
    """Tear down the process group and the control connection; ``init()`` may be called again.

    No collective of ours is left pending (the last ``should_stop`` all-reduce is waited
    for, at most ``PENDING_SETTLE_S``), and the destroyed groups stay referenced until the
    process ends (``elasticd.teardown``: torch's gloo destructor race).
    """
    _RUNTIME.shutdown()


def fast_exit(code: int = 0) -> NoReturn:
    """Shut down and end this process now, skipping the interpreter's teardown.

    A process that imported torch spends 1–3 s finalising its modules after ``main``
    returns, and every restart after a drain (a SIGTERM, a spot notice, a node joining)
    waits for it. Call this instead of returning once the drain's checkpoint is committed
    and nothing else needs to run at exit: it destroys the process group, closes the agent
    channel, flushes stdout, stderr and ``logging``, and calls ``os._exit(code)``.
    ``atexit`` handlers and ``finally`` blocks further up the stack do **not** run.

    Args:
        code: the exit status (0 after a drain: the agent reads "stopped", not "failed").
    """
    shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more to write
            pass
    logging.shutdown()
    os._exit(code)
