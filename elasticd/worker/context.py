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
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NoReturn

import structlog
import torch
import torch.distributed as dist

from elasticd import teardown
from elasticd.control import (
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

log = structlog.get_logger(__name__)

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
PROGRESS_MIN_INTERVAL_S = 0.2
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


class _State:
    ctx: WorkerContext | None = None
    client: ControlClient | None = None
    control_dir: Path | None = None
    sigterm: bool = False
    stopped: bool = False
    drainable_noted: bool = False  # drainable-<rank> written for the agent
    progress: LatestReport | None = None  # the step reports (throttled, never the newest lost)
    flag: torch.Tensor | None = None  # [any rank asked to stop, -(every rank drains), some rank drains]
    all_drain: bool = False  # at the last agreed stop, every rank's own node was draining
    any_drain: bool = False  # at the last agreed stop, some rank's own node was draining
    stop_group: Any = None  # CPU (gloo) group for the stop flag
    pending: Any = None  # async all-reduce work of the previous should_stop()
    old_sigterm: Any = None
    guards_installed: bool = False  # teardown guards (once per process)
    # The sockets our process groups opened ("socket:[inode]" links in /proc/self/fd): the
    # only ones live re-formation may shut down to wake a wait on a frozen peer.
    group_sockets: frozenset[str] = frozenset()
    # The newest round the agent ordered this node's live workers into (``reform.json``, as
    # LiveState's watcher saw it; -1: none). A worker still in an older round leaves its
    # group at the next agreed step (``should_stop``), as for a park.
    ordered_round: int = -1
    # A hot spare's worker before its round (ELASTICD_SPARE=1): what init() was asked for
    # and the context it returned (no group); None once admitted, or when not a spare.
    ahead: tuple[str | None, float, WorkerContext, int] | None = None  # ..., and our pid
    ran_ahead: bool = False  # this worker ran ahead as a spare's, then joined its round
    # Who forms, leaves and re-forms this worker's process group (one owner: no other
    # code creates or destroys it); None until init() formed one.
    lifecycle: pgl.GroupLifecycle | None = None
    generation: int = 0  # groups formed so far: a wrapper built on an older one is stale


_S = _State()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw not in (None, "") else default


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
    if _S.ctx is not None:
        return _S.ctx
    if os.environ.get(ENV_SPARE) == "1":
        return _run_ahead(backend, timeout_s)
    agent = agent_environment()  # fail before any collective: a config error, not a hang
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    device, backend = _device(backend, local_rank)
    if (world > 1 or "MASTER_ADDR" in os.environ) and not dist.is_initialized():
        choice = _choose_lifecycle(backend, live=agent is not None and agent.live)
        _S.lifecycle = pgl.make_lifecycle(choice, backend, timeout_s, device)
        spec = None
        if choice.kind is pgl.LifecycleKind.RECONFIGURE:
            spec = pgl.GroupSpec(backend, rank, world, agent.round if agent else 0,
                                 os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                 _env_int("MASTER_PORT", 29500), timeout_s, device)
        before = socket_links()
        _S.lifecycle.form(spec)
        _S.generation += 1
        _S.group_sockets = frozenset(socket_links() - before)
        log.info("process_group_lifecycle_chosen", lifecycle=choice.kind.value, reason=choice.reason)
    control_dir = agent.control_dir if agent else os.environ.get(ENV_CONTROL_DIR)
    socket_path = agent.socket_path if agent else None
    _S.ctx = WorkerContext(
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
    _S.control_dir = Path(control_dir) if control_dir else None
    _S.client = ControlClient(socket_path) if socket_path else None
    _S.progress = LatestReport(_S.client.send, PROGRESS_MIN_INTERVAL_S) if _S.client else None
    if not control_dir:
        # Under plain torchrun (or by hand) a SIGTERM asks for a graceful stop.
        _S.old_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    _S.flag = torch.zeros(3, dtype=torch.int32)
    _install_teardown_guards()
    if dist.is_initialized():
        before = socket_links()
        _S.stop_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        _S.group_sockets |= socket_links() - before
    return _S.ctx


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
    return _S.generation


def lifecycle() -> pgl.GroupLifecycle | None:
    """The owner of this worker's process group (None before ``init()`` formed one)."""
    return _S.lifecycle


def _device(backend: str | None, local_rank: int) -> tuple[torch.device, str]:
    """This worker's device (made current on CUDA) and backend."""
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if not use_cuda:
        return torch.device("cpu"), backend or "gloo"
    device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    torch.cuda.set_device(device)
    return device, backend or "nccl"


def _run_ahead(backend: str | None, timeout_s: float) -> WorkerContext:
    """``init()`` in a hot spare's worker before its round: a context without a group
    (rank -1, world size 0) whose device the script builds its model on. The first call
    that needs the round (:func:`current_context`, the control channel, ``LiveState``,
    ``ElasticLoop``, ``ShardedModel``, ...) waits for it (:func:`_await_round`)."""
    if _S.ahead is None:
        local_rank = _env_int("LOCAL_RANK", 0)
        device, chosen = _device(backend, local_rank)
        ctx = WorkerContext(rank=-1, world_size=0, local_rank=local_rank,
                            local_world_size=_env_int("LOCAL_WORLD_SIZE", 1), device=device,
                            backend=chosen, restart_count=0, round=None,
                            job=os.environ.get(ENV_JOB), node=os.environ.get(ENV_NODE),
                            checkpoint_url=os.environ.get(ENV_CHECKPOINT_URL), under_agent=True,
                            run_id=os.environ.get(ENV_RUN_ID) or None,
                            resume=os.environ.get(ENV_RESUME) or "auto")
        _S.ahead = (backend, timeout_s, ctx, os.getpid())
    return _S.ahead[2]


def _await_round() -> None:
    """A hot spare's worker: wait until the agent admits the spare, then become the
    round's worker (its environment and log files: ``elasticd.control.handover``) and
    ``init()`` for real. At once when this worker does not run ahead."""
    ahead = _S.ahead
    if ahead is None or ahead[3] != os.getpid():
        return  # not a spare's worker, or a process it forked (never reads the worker's stdin)
    started = time.monotonic()
    log.info("spare_worker_waiting", pid=os.getpid())
    msg = handover.read(sys.stdin.buffer)
    if msg is None:  # the agent discarded this spare's worker (it stops, or started cold)
        os._exit(0)
    handover.become(msg)
    _S.ahead = None
    _S.ran_ahead = True
    if _env_int("RANK", 0) != 0 and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        # Admitted the moment the round closed, this worker may connect before the round's
        # rank 0 listens, and the TCPStore client then backs off for seconds: wait for the
        # port in 10 ms polls instead (as rejoin() does). A cold worker's start-up hid it.
        _wait_for_port(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                       time.monotonic() + ahead[1])
    ctx = init(ahead[0], timeout_s=ahead[1])
    log.info("spare_worker_admitted", rank=ctx.rank, world_size=ctx.world_size, round=ctx.round,
                waited_s=round(time.monotonic() - started, 3))


def ran_ahead() -> bool:
    """This worker ran ahead as a hot spare's (its script built the model before the
    round) and has since joined its round: what it built for world size 0 is rebuilt."""
    return _S.ran_ahead


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _S.sigterm = True


def _install_teardown_guards() -> None:
    # torch's gloo destructor race (see elasticd.teardown): destroyed groups stay
    # referenced, our own pending all-reduce is settled before any group goes and at
    # exit, and a ConfigError ends the process with 78 (also under plain torchrun).
    if _S.guards_installed:
        return
    _S.guards_installed = True
    teardown.keep_groups_on_destroy()
    teardown.before_destroy(_settle_pending)
    atexit.register(_settle_pending)
    previous = sys.excepthook

    def config_error_exits_78(tp: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous(tp, exc, tb)
        if isinstance(exc, ConfigError):
            teardown.end_process(EX_CONFIG)  # deterministic: the agent must not retry it

    sys.excepthook = config_error_exits_78


def _settle_pending(timeout_s: float = PENDING_SETTLE_S) -> None:
    """Wait (bounded) for our pending should_stop all-reduce, or abandon it."""
    work, _S.pending = _S.pending, None
    if work is None:
        return
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError:  # a peer is gone, or it timed out: nothing to agree on any more
        pass


def current_round() -> int | None:
    """The round this worker trains in now (it changes on a live re-formation)."""
    return _S.ctx.round if _S.ctx is not None else None


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
    groups = (_S.stop_group, dist.group.WORLD) if dist.is_initialized() else ()
    owner = _S.lifecycle or pgl.RebuildLifecycle("gloo", DEFAULT_COLLECTIVE_TIMEOUT_S)
    owner.leave(groups, lambda: _settle_pending(ABORTED_SETTLE_S))
    _S.stop_group = None
    _S.stopped = False


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
    import dataclasses

    ctx = current_context()
    if rank != 0:
        # The TCPStore client backs off exponentially (seconds) when it connects before the
        # new rank 0 listens; wait for the port here, in 10 ms polls, instead.
        _wait_for_port(master_addr, master_port, time.monotonic() + timeout_s)
    spec = pgl.GroupSpec(ctx.backend, rank, world_size, round_, master_addr, master_port, timeout_s,
                         ctx.device if ctx.backend == "nccl" else None)
    if _S.lifecycle is None:
        _S.lifecycle = pgl.RebuildLifecycle(ctx.backend, timeout_s, spec.device)
    before = socket_links()
    _S.lifecycle.join(spec)
    _S.generation += 1
    _S.ctx = dataclasses.replace(ctx, rank=rank, world_size=world_size, round=round_)
    _S.stop_group = dist.new_group(backend="gloo") if ctx.backend != "gloo" else dist.group.WORLD
    now = socket_links()
    # Reconfigured in place, the group keeps the sockets it still has open (its store's).
    kept = _S.group_sockets & now if _S.lifecycle.kind is pgl.LifecycleKind.RECONFIGURE else frozenset()
    _S.group_sockets = frozenset(kept | (now - before))
    _S.pending, _S.stopped = None, False
    return _S.ctx


def every_rank_draining() -> bool:
    """At the last agreed stop, was every rank's own node draining (nobody stays)?"""
    return _S.all_drain


def some_rank_draining() -> bool:
    """At the last agreed stop, was some rank's own node draining (its state must be handed on)?"""
    return _S.any_drain


_wait_for_port = pgl.wait_for_port


def park_requested() -> bool:
    """True if this node's agent asked live workers to leave the group at the next agreed step."""
    return _S.control_dir is not None and (_S.control_dir / PARK_FILE).exists()


def note_reform_order(round_: int) -> None:
    """Record that the agent ordered this node's live workers into round ``round_``.

    Called by ``LiveState``'s watcher thread (one assignment: safe beside the loop).
    """
    _S.ordered_round = max(_S.ordered_round, round_)


def reform_ordered() -> bool:
    """True while the agent's newest order names a round newer than this worker's.

    Such a worker is in a superseded round: it must take the order at its next step
    boundary. Nothing else would move one whose collectives all succeed (alone at world
    size 1), which used to train on alone until its commit was refused (issue 26).
    """
    ctx = _S.ctx
    return ctx is not None and ctx.round is not None and _S.ordered_round > ctx.round


def control_dir() -> Path | None:
    """The agent's runtime directory (None without an agent)."""
    _await_round()
    return _S.control_dir


def current_context() -> WorkerContext:
    """The context of ``init()`` (calls it with defaults if needed). In a hot spare's
    worker running ahead, waits for its round first."""
    _await_round()
    return _S.ctx or init()


def stop_requested_locally() -> bool:
    """True if this node's agent asked for a drain (or this process got SIGTERM). No collective."""
    _await_round()
    if _S.sigterm:
        return True
    return _S.control_dir is not None and (_S.control_dir / DRAIN_FILE).exists()


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
    _await_round()
    if not _S.drainable_noted:
        _note_drainable()
    if every > 1:
        if step is None:
            raise ValueError("should_stop(every=N) needs the step, so all ranks skip the same calls")
        if step % every:
            return False
    ctx = current_context()
    draining = stop_requested_locally()
    local = 1 if draining or park_requested() or reform_ordered() else 0
    if dist.is_initialized() and ctx.world_size > 1:
        assert _S.flag is not None
        stop = False
        if _S.pending is not None:
            _S.pending.wait()  # started a whole step ago: normally already complete
            _S.pending = None
            stop = int(_S.flag[0].item()) > 0
            # MAX of -drain is -1 only when every rank's node drains (a whole-job stop).
            _S.all_drain = stop and int(_S.flag[1].item()) < 0
            _S.any_drain = stop and int(_S.flag[2].item()) > 0
        if not stop:
            _S.flag[0] = local
            _S.flag[1] = -1 if draining else 0
            _S.flag[2] = 1 if draining else 0
            _S.pending = dist.all_reduce(_S.flag, op=dist.ReduceOp.MAX, group=_S.stop_group,
                                         async_op=True)
    else:
        stop = bool(local)
        _S.all_drain = _S.any_drain = draining
    if stop and not _S.stopped:
        _S.stopped = True
        _mark_stopped(ctx, step)
    return stop


def _note_drainable() -> None:
    # Tell the agent once that this script stops at a step boundary when asked, so a
    # joining node is admitted by a drain (no step lost) instead of a worker restart.
    _S.drainable_noted = True
    if _S.control_dir is None:
        return
    try:
        (_S.control_dir / f"{DRAINABLE_PREFIX}{current_context().rank}").touch()
    except OSError:  # the agent is restarting us: it falls back to a plain restart
        pass


def _mark_stopped(ctx: WorkerContext, step: int | None) -> None:
    if _S.control_dir is None:
        return
    write_stopped(_S.control_dir, StoppedReport(rank=ctx.rank, step=-1 if step is None else max(step, -1),
                                                round=ctx.round if ctx.round is not None else -1))


def report_progress(step: int, *, epoch: int = 0, samples: int = 0, loss: float | None = None,
                    force: bool = False) -> None:
    """Tell the agent the last completed step (hang detection, ``elasticd status``).

    ``loss`` (optional, a float) goes into the job's history: ``elasticd status --plot``
    draws it and ``--watch`` shows its trend. Non-blocking and rate-limited (at most every
    0.2 s unless ``force``); a report that comes sooner is sent once the interval has
    passed, so the agent always learns the newest step. A no-op without an agent.
    """
    _await_round()
    if _S.progress is None:
        return
    ctx = current_context()
    _S.progress.offer(StepReport(local_rank=ctx.local_rank, rank=ctx.rank, step=max(step, -1),
                                 epoch=max(epoch, 0), samples=max(samples, 0),
                                 loss=None if loss is None else float(loss)), force=force)


def control_client() -> ControlClient | None:
    """The agent's control channel client (None without an agent)."""
    _await_round()
    return _S.client


def shutdown() -> None:
    """Tear down the process group and the control connection; ``init()`` may be called again.

    No collective of ours is left pending (the last ``should_stop`` all-reduce is waited
    for, at most ``PENDING_SETTLE_S``), and the destroyed groups stay referenced until the
    process ends (``elasticd.teardown``: torch's gloo destructor race).
    """
    _settle_pending()
    if dist.is_initialized():
        dist.destroy_process_group()
    if _S.progress is not None:
        _S.progress.close()
    if _S.client is not None:
        _S.client.close()
    if _S.old_sigterm is not None:
        signal.signal(signal.SIGTERM, _S.old_sigterm)
    _S.ctx, _S.client, _S.control_dir, _S.flag, _S.progress = None, None, None, None, None
    _S.stop_group, _S.pending, _S.old_sigterm, _S.lifecycle = None, None, None, None
    _S.stopped = _S.sigterm = _S.drainable_noted = _S.all_drain = _S.any_drain = False
    _S.ordered_round = -1


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
