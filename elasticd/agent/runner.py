"""Run one node: the engine behind ``elasticd run`` and ``elasticd agent``.

Reads top to bottom: start (or connect to) etcd, build the rendezvous handler, the
control channel and the recorder, start torch's agent with elasticd's loop, wait for the
outcome, clean up on every path, and turn the outcome into an exit code.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import structlog
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
)

import elasticd
from elasticd.agent.admission import admit, make_fingerprint, sizes_fingerprint
from elasticd.agent.boot import (
    BootOutcome,
    boot_after_import,
    checks_after_import,
    log_finished,
    log_refused,
)
from elasticd.agent.commits import CommitRetrier, PendingCommit, read_intents, write_intent
from elasticd.agent.elastic_agent import ElasticdAgent, SupervisionSettings
from elasticd.agent.integrity import DivergenceObserver
from elasticd.agent.recorder import JobRecorder
from elasticd.agent.remote_control import RemoteStopWatch
from elasticd.agent.run_identity import check_resume, ensure_run_id
from elasticd.agent.standalone_runs import (
    RUNNING,
    RunPlan,
    RunRecord,
    plan_standalone_run,
    read_record,
    records_dir,
    status_command,
    write_record,
)
from elasticd.agent.summary import failure_line, failure_summary
from elasticd.agent.worker_user import check_checkpoint_dir, resolve_worker_user
from elasticd.checkpoint.identity import new_run_id
from elasticd.config.model import EtcdConfig
from elasticd.control import CheckpointIo, CheckpointIoKind, CommitRequest, ControlChannel
from elasticd.control.api import ENV_LOG_FORMAT, CommitOutcome
from elasticd.errors import (
    ETCD_UNREACHABLE_HINT,
    ConfigError,
    EtcdUnavailableError,
    TransientError,
)
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.embedded import EmbeddedEtcd
from elasticd.keys import JobKeys
from elasticd.logs import (
    configure_logging,
    current_format,
    default_state_root,
    ensure_private_tree,
    error_line,
    resolve_worker_log_dir,
)
from elasticd.process import make_non_dumpable
from elasticd.records import JobFingerprint
from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler
from elasticd.rendezvous.finished import FinishedJob, read_finished
from elasticd.rendezvous.settings import RendezvousSettings
from elasticd.retry import call_with_retry
from elasticd.sensitive import redact_url
from elasticd.stopmarks import restart_hint

if TYPE_CHECKING:
    from elasticd.agent.cloud_metadata import PreemptionNotice
    from elasticd.agent.early import EarlyStart
    from elasticd.agent.preemption import PreemptionWatcher
    from elasticd.agent.sdnotify import SystemdNotifier
    from elasticd.history import History
    from elasticd.status.metrics import AgentMetrics

log = structlog.get_logger(__name__)

EX_ETCD_UNREACHABLE = 4


@dataclass(frozen=True)
class NodeSpec:
    """Everything needed to run one node, already validated."""

    job: str
    command: tuple[str, ...]  # script [args...] or ("-m", module, args...)
    nproc_per_node: int
    # Size and timing of the rendezvous (RendezvousSettings.from_config); its
    # worker_log_dir is resolved when the node starts.
    rendezvous: RendezvousSettings
    # The [etcd] section, password already resolved (EtcdClient.from_config connects with
    # it); no endpoints: an embedded etcd (--standalone) in data_dir or a fresh temp dir.
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    node_id: str | None = None
    supervision: SupervisionSettings = field(default_factory=SupervisionSettings)
    workdir: str | None = None
    log_format: str = "auto"
    log_level: str = "info"
    log_dir: str | None = None
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    preemption: PreemptionWatcher | None = None  # started once the agent runs
    notify_socket: str | None = None
    watchdog_usec: str | None = None
    # $STATE_DIRECTORY: root of the worker logs and the pending commit intents.
    state_dir: str | None = None
    # Outside systemd: $XDG_STATE_HOME/elasticd or ~/.local/state/elasticd (commit intents).
    state_home: str | None = None
    resume: str = "auto"  # another run's checkpoints: auto (refuse) | require | never


def check_command(command: tuple[str, ...]) -> None:
    """Fail early and clearly if the training command cannot run at all.

    Raises:
        ConfigError: no command, or the script does not exist.
    """
    if not command:
        raise ConfigError("no training command: give a script, e.g. `elasticd run ... examples/train.py`")
    if command[0] == "-m":
        if len(command) < 2:
            raise ConfigError("`-m` needs a module name, e.g. `-m mypkg.train`")
        return
    if not os.path.isfile(command[0]):
        raise ConfigError(f"training script {command[0]!r} does not exist (cwd {os.getcwd()}); "
                          "check the path or the working directory")


def _make_notifier(spec: NodeSpec) -> SystemdNotifier | None:
    if not spec.notify_socket:
        return None
    from elasticd.agent.sdnotify import SystemdNotifier

    return SystemdNotifier(spec.notify_socket, spec.watchdog_usec)


def _make_metrics(spec: NodeSpec, node_id: str) -> AgentMetrics | None:
    if not spec.metrics_port:
        return None
    from elasticd.status.metrics import AgentMetrics

    metrics = AgentMetrics()
    # Every panel of the shipped dashboard joins on elasticd_agent_info{elasticd_job=...}:
    # without the identity the agent's series exist but no query selects them.
    metrics.set_identity(job=spec.job, node=node_id, version=elasticd.__version__)
    metrics.serve(spec.metrics_port, addr=spec.metrics_addr)
    return metrics


def _checkpoint_io_observer(metrics: AgentMetrics | None) -> Callable[[CheckpointIo], None] | None:
    """The control channel's handler of the workers' checkpoint reports (None: no metrics)."""
    if metrics is None:
        return None

    def observe(m: CheckpointIo) -> None:
        if m.kind is CheckpointIoKind.SAVE:
            metrics.observe_checkpoint_save(m.seconds, m.nbytes)
        else:
            metrics.observe_checkpoint_load(m.seconds, m.nbytes)

    return observe


def _divergence_observer(recorder: JobRecorder, metrics: AgentMetrics | None,
                         handler: EtcdRendezvousHandler) -> DivergenceObserver:
    """The control channel's handler of divergence reports: the event, the metric, and a
    quarantine (the straggler probation, ``straggler_probation_s``: live re-formation only)
    of a node whose ranks diverge twice, while the job can spare it."""
    s = handler.settings
    return DivergenceObserver(recorder, metrics, probation_base_s=s.straggler_probation_s,
                              can_leave=lambda: len(handler.members) - 1 >= s.min_nodes)


def _goodput_publisher(recorder: JobRecorder, metrics: AgentMetrics) -> Callable[[History], None]:
    """After each history sample this node writes: the ledger of `status --goodput` as
    metrics (one range read of the bounded event history, every few seconds at most)."""
    from elasticd.status.goodput import life_and_window, read_events

    def publish(history: History) -> None:
        try:
            events = read_events(recorder.client, recorder.keys)
        except TransientError:
            return  # the next sample tries again
        life, recent = life_and_window(history, events)
        metrics.set_goodput(life, recent)

    return publish


def _spare_observer(agent: ElasticdAgent, metrics: AgentMetrics | None) -> Callable[[bool], None]:
    """The handler's ``on_spare``: this node waits as a hot spare, or no longer does (the
    metric; the agent's spare workers, ``workers.spare_prebuild``)."""

    def observe(spare: bool) -> None:
        if metrics is not None:
            metrics.set_spare(spare)
        agent.spare_waiting(spare)

    return observe


def _straggler_observer(metrics: AgentMetrics | None,
                        recorder: JobRecorder) -> Callable[[dict[str, float]], None]:
    """The handler's ``on_stragglers`` (the coordinator's thread): metrics and an event."""

    def observe(flagged: dict[str, float]) -> None:
        if metrics is not None:
            metrics.set_stragglers(flagged)
        for node, ratio in sorted(flagged.items()):
            recorder.event("straggler", f"node {node} is a straggler: its own step time is "
                           f"{ratio:.2f}x the members' median", node=node, ratio=ratio)

    return observe


def run_node(spec: NodeSpec, early: EarlyStart | None = None, boot: BootOutcome | None = None) -> int:
    """Run this node until the job finishes, this node drains, or it gives up.

    Args:
        spec: the node.
        early: an ``elasticd.agent.early.EarlyStart`` (standbys started before torch was
            imported, and the runtime directory they report to), or None.
        boot: the boot sequence's outcome before torch was imported
            (``elasticd.agent.boot``): its etcd client and node session are taken over
            here, and only the checks it left run again; None: every check runs here.

    Returns:
        The process exit code: 0 finished/drained, 1 failed, 4 etcd unreachable,
        78 configuration error.
    """
    configure_logging(spec.log_format, level=spec.log_level)
    # `kill -USR1 <agent>` prints every thread's stack to the agent's stderr (its log), as
    # the workers do: what an operator (or the soak) needs to see where a stuck agent waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    # Training code runs as our uid: it must not read our memory or environment (etcd
    # credentials) through ptrace or /proc (docs/security.md, "Same-uid workers").
    if not make_non_dumpable():
        log.warning("agent_dumpable", reason="prctl(PR_SET_DUMPABLE, 0) failed")
    if spec.workdir:
        os.chdir(spec.workdir)
    check_command(spec.command)
    # What every agent of the job must match (elasticd.agent.admission), read once here.
    fingerprint = make_fingerprint(spec.command, min_nodes=spec.rendezvous.min_nodes,
                                   max_nodes=spec.rendezvous.max_nodes,
                                   checkpoint_url=spec.supervision.checkpoint_url,
                                   live_reform=spec.supervision.live_reform,
                                   extra=sizes_fingerprint(spec.rendezvous.valid_sizes))
    embedded: EmbeddedEtcd | None = None
    client: EtcdClient | None = None
    control: ControlChannel | None = None
    handler: EtcdRendezvousHandler | None = None
    agent: ElasticdAgent | None = None
    commits: CommitRetrier | None = None
    remote: RemoteStopWatch | None = None
    logs: Any = None
    state_dir: str | None = None
    runs_dir: str | None = None  # a standalone job's run records (standalone_runs)
    run_record: RunRecord | None = None
    log_dir: str | None = None
    closing: str | None = None  # the agent's last line, once the run has an outcome
    try:
        # Worker logs outlive the agent: private, never a predictable shared path. Chosen
        # first, so a refused log dir fails before anything starts.
        log_dir = resolve_worker_log_dir(spec.log_dir, spec.job, state_dir=spec.state_dir)
        # workers.user: root, a real unprivileged user, a checkpoint dir it can write
        # (exit 78 otherwise), checked before anything of the job is touched.
        workers_user = None
        if spec.supervision.workers_user:
            workers_user = resolve_worker_user(spec.supervision.workers_user, euid=os.geteuid())
            made = check_checkpoint_dir(spec.supervision.checkpoint_url, spec.job, workers_user)
            if made:
                log.info("checkpoint_dir_created", path=made, owner=workers_user.run_as.name)
        elif spec.supervision.checkpoint_url:  # before etcd and any worker start: exit 78 now
            # (not as root for workers.user: it would make the job's directory root's)
            _probe_checkpoint_url(spec.supervision.checkpoint_url, spec.job)
        state_dir = _intents_dir(spec)
        if spec.etcd.embedded:
            # Private to this user: TLS with a generated client certificate (docs/security.md).
            embedded = EmbeddedEtcd(spec.etcd.data_dir, private=True).start()
        early_session = None
        if boot is not None and boot.session is not None and boot.client is not None \
                and not embedded:
            client, early_session = boot.client, boot.session
        elif embedded is not None:
            client = EtcdClient.from_config(spec.etcd, endpoints=embedded.endpoint,
                                            tls=embedded.client_tls)
        else:
            client = EtcdClient.from_config(spec.etcd)
        # Probe the job's own prefix: an etcd role may grant only /elasticd/<job>/.
        job_prefix = JobKeys(spec.job).prefix
        _connect(client, job_prefix, spec.etcd.connect_timeout_s)
        handler = EtcdRendezvousHandler(
            client, spec.job, replace(spec.rendezvous, worker_log_dir=log_dir,
                                      fingerprint=fingerprint.digest),
            node_id=spec.node_id, session=early_session)
        if boot is not None and early_session is not None:
            boot.hand_over()  # the handler owns the session now (closed by its shutdown)
        # Until the agent says how it leaves (finished, drained), a shutdown is a loss: a
        # node that gives up or crashes out of run() is re-formed around, as before.
        handler.leave_kind = None
        structlog.contextvars.bind_contextvars(job=spec.job, node=handler.node_id)
        # The rest of the boot sequence (elasticd.agent.boot): the stop marks again (a
        # stopped job or a drained node is a clean exit before joining, also when the mark
        # came during the torch import), and what the early path did not do: the admission
        # precheck here (exit 78 before anything of the job is touched), the finished-job
        # check, registration and admission in the handler's first rendezvous.
        fingerprint = replace(fingerprint, node=handler.node_id)
        boot_plan = checks_after_import(boot if early_session is not None else None)
        checked = boot_after_import(client, handler.keys, handler.node_id, fingerprint, boot_plan,
                                    deadline_s=spec.etcd.connect_timeout_s)
        if checked.refused is not None:
            log_refused(checked.refused, handler.node_id)
            return 0
        if boot_plan.admit_on_register:  # decided for good once registered (the txn)
            handler.on_registered = lambda deadline: _admit(client, handler, fingerprint, deadline)
        recorder = JobRecorder(handler.session)
        # A standalone start (a fresh private etcd) continues its job's last run, or starts
        # a new one after a finished run (elasticd.agent.standalone_runs): decided before
        # anything starts.
        plan = RunPlan(resume=spec.resume)
        if embedded is not None and spec.etcd.data_dir is None:
            runs_dir = records_dir(spec.state_dir, spec.state_home)
            plan = plan_standalone_run(read_record(runs_dir, spec.job), job=spec.job,
                                       checkpoint_url=spec.supervision.checkpoint_url,
                                       resume=spec.resume, fresh_run_id=new_run_id())
        # The run's identity (docs/checkpoints.md#run-identity): stamped on the pointer,
        # handed to workers, and checked against the stored checkpoints before any starts.
        recorder.run_id = ensure_run_id(client, handler.keys, proposed=plan.run_id)
        if plan.message:
            event = "standalone_run_started_anew" if plan.anew else "standalone_run_continued"
            error_line(plan.message, event=event, level="info", run_id=recorder.run_id)
        supervision = check_resume(spec.supervision, spec.job, recorder.run_id, plan.resume)
        if runs_dir is not None and spec.supervision.checkpoint_url:
            run_record = RunRecord(recorder.run_id, spec.supervision.checkpoint_url, RUNNING,
                                   plan.resume)
            write_record(runs_dir, spec.job, run_record)
        if current_format() == "json":  # the worker API logs JSON when its agent does
            supervision = replace(supervision, worker_env={**supervision.worker_env,
                                                           ENV_LOG_FORMAT: "json"})
        if workers_user is not None:  # [workers.env] may still set its own HOME
            supervision = replace(supervision, worker_env={**workers_user.env(),
                                                           **supervision.worker_env})
        metrics = _make_metrics(spec, handler.node_id)
        if metrics is not None:
            recorder.history.on_written = _goodput_publisher(recorder, metrics)

        _commit_intents(recorder, state_dir, spec.job)

        def committed(p: PendingCommit) -> None:
            if metrics is not None:
                metrics.set_last_checkpoint_step(p.step, committed_at=time.time())

        # Commits etcd does not answer are retried here, by the agent (it owns the fencing
        # token and outlives its workers), never refused: see elasticd.agent.commits.
        commits = CommitRetrier(
            lambda p: recorder.commit_checkpoint(p.step, p.manifest_url, p.world_size, p.round),
            on_committed=committed)

        def on_commit(m: CommitRequest) -> tuple[CommitOutcome, str]:
            assert commits is not None
            outcome, reason = commits.submit(PendingCommit(
                step=m.step, manifest_url=m.manifest_url, world_size=m.world_size, round=m.round,
                state_rev=handler.round_state_revision if handler else 0, job=spec.job))
            if outcome is CommitOutcome.COMMITTED:
                committed(PendingCommit(m.step, m.manifest_url, m.world_size, m.round, 0))
            return outcome, reason

        control = ControlChannel(on_commit=on_commit, on_latest=recorder.latest_checkpoint,
                                 max_local_ranks=spec.nproc_per_node,
                                 directory=early.control_dir if early is not None else None,
                                 on_checkpoint_io=_checkpoint_io_observer(metrics),
                                 on_divergence=_divergence_observer(recorder, metrics, handler)).start()
        if workers_user is not None:
            control.share_with(workers_user.run_as.gid)
        worker_spec = WorkerSpec(
            role="default", local_world_size=spec.nproc_per_node, rdzv_handler=handler,
            entrypoint=sys.executable, args=("-m", "elasticd.agent.worker_exec", *spec.command),
            max_restarts=spec.supervision.max_restarts,
            monitor_interval=spec.supervision.monitor_interval_s, local_addr=spec.rendezvous.local_addr,
        )
        if current_format() == "json":  # every worker line one JSON object, rank and stream
            from elasticd.agent.worker_logs import JsonTeeLogsSpecs

            logs = JsonTeeLogsSpecs(log_dir, job=spec.job, node=handler.node_id, out=sys.stderr)
        else:
            logs = DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL, tee=Std.ALL)
        agent = ElasticdAgent(worker_spec, supervision, handler, control, recorder,
                              logs_specs=logs, metrics=metrics,
                              notifier=_make_notifier(spec), commits=commits,
                              standby=early.standby if early is not None else None)
        if early is not None:
            for local_rank, pid in early.standby.pids().items():
                log.info("standby_started", local_rank=local_rank, pid=pid, urgent=True, early=True)
        agent.install_signal_handlers()
        if agent.notifier is not None:
            handler.on_wait = agent.notifier.watchdog
        handler.on_spare = _spare_observer(agent, metrics)
        handler.on_stragglers = _straggler_observer(metrics, recorder)
        handler.on_members_lost = lambda lost, rnd: _record_lost(recorder, handler, lost, rnd)
        if spec.preemption is not None:
            spec.preemption.start(lambda notice: _on_notice(agent, recorder, notice))
        drain = agent.request_drain  # from the watch thread: only sets flags
        remote = RemoteStopWatch(client, handler.keys, handler.node_id,
                                 lambda req: drain(req.reason)).start()
        log.info("agent_started", endpoints=client.endpoint_label(), nproc_per_node=spec.nproc_per_node,
                 nnodes=f"{spec.rendezvous.min_nodes}:{spec.rendezvous.max_nodes}", command=list(spec.command),
                 worker_log_dir=log_dir)
        if embedded is not None:  # a private etcd: its address and certificate are new each run
            command = status_command(spec.job, embedded.endpoint, embedded.client_tls)
            error_line(f"elasticd: watch this job with: {command}", event="status_command_printed",
                       level="info", command=command)
        try:
            agent.run()
        except RendezvousClosedError as exc:
            # We arrived (or came back) after the job finished: exit 0, train nothing, and
            # say when it finished and how to run it again (a systemd restart stays down).
            _log_finished(client, handler.keys, exc)
            if runs_dir is not None and run_record is not None:
                write_record(runs_dir, spec.job, replace(run_record, outcome="closed"))
            return 0
        outcome = agent.outcome
        if runs_dir is not None and run_record is not None:  # how this run ended, for the next
            write_record(runs_dir, spec.job, replace(run_record, outcome=outcome.kind))
        if outcome.kind == "failed":
            first = min(outcome.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]),
                        default=None)
            error_line(failure_summary(outcome), event="failure_summary",
                       error=failure_line(first[1]) if first is not None else outcome.reason)
        log.info("agent_exited", outcome=outcome.kind, reason=outcome.reason, exit_code=outcome.exit_code)
        closing = closing_line(spec.supervision.checkpoint_url, log_dir)  # said last, below
        if remote.fired is not None and outcome.kind == "drained":
            log.info("agent_stopped_by_operator", reason=remote.fired.reason,
                     fix=restart_hint(remote.fired))
        if outcome.kind == "finished" and not handler.closed_written:
            handler.set_closed()  # mark_finished could not write it (etcd did not answer)
        return outcome.exit_code
    except (EtcdUnavailableError, RendezvousError) as exc:
        error_line(f"elasticd: {exc}")
        # By type, not by message: etcd unreachable is 4 (retry later), anything else 1.
        unreachable = isinstance(exc, (TransientError, RendezvousConnectionError))
        return EX_ETCD_UNREACHABLE if unreachable else 1
    finally:
        if commits is not None and handler is not None:
            pending = commits.close()
            if pending is not None and state_dir is not None:  # the next agent retries it
                write_intent(state_dir, handler.node_id, pending)
        if remote is not None:
            remote.stop()
        if agent is not None:
            agent.standby.close()
        if logs is not None and hasattr(logs, "close"):
            logs.close()  # the last worker lines, once the workers are gone
        if spec.preemption is not None:
            spec.preemption.stop()
        if handler is not None:
            handler.shutdown()
        if control is not None:
            control.close()
        if client is not None:
            client.close()
        if embedded is not None:
            embedded.stop()
        if log_dir is not None and not spec.log_dir and not spec.state_dir:
            # Our own fresh temp dir (elasticd.logs): gone again when no worker wrote to it.
            try:
                os.rmdir(log_dir)
            except OSError:
                pass  # not empty: a worker started, its logs stay
        if closing is not None:  # after the teardown's own lines: the last thing said
            error_line(closing, event="run_files", level="info",
                       checkpoint_url=spec.supervision.checkpoint_url, worker_log_dir=log_dir)


def closing_line(checkpoint_url: str | None, log_dir: str | None) -> str:
    """The agent's last line: where this run's checkpoints and worker logs are. Pure."""
    where = (f"checkpoints in {checkpoint_url}" if checkpoint_url
             else "checkpoints where the script saves them (no --checkpoint-url)")
    return f"elasticd: {where}; worker logs in {log_dir}" if log_dir else f"elasticd: {where}"


def _connect(client: EtcdClient, prefix: str, timeout_s: float) -> None:
    """Reach etcd (one read of ``prefix``), retrying for ``timeout_s``.

    If the first try fails, says at once what it waits for and for how long; if etcd
    never answers, the error ends with the hint ``elasticd status`` gives.

    Raises:
        EtcdUnavailableError: no answer within ``timeout_s`` (exit 4).
    """
    deadline = time.monotonic() + timeout_s
    label = client.endpoint_label()
    try:
        client.get(prefix)
        return
    except TransientError as exc:
        why = _unreachable_why(exc, label)
    error_line(f"elasticd: etcd at {label} does not answer ({why}); waiting up to "
               f"{timeout_s:g}s for it (--etcd-connect-timeout)", event="etcd_waited_for",
               level="warning", endpoints=label, timeout_s=timeout_s)
    try:
        call_with_retry(lambda: client.get(prefix), what="connect to etcd", deadline=deadline,
                        warn=False)
    except TransientError as exc:
        raise EtcdUnavailableError(
            f"etcd at {label} unreachable for {timeout_s:g}s ({_unreachable_why(exc, label)}); "
            f"{ETCD_UNREACHABLE_HINT}") from exc


def _unreachable_why(exc: Exception, label: str) -> str:
    """The client's error without its own "etcd at X unreachable: " prefix, on one line."""
    why = " ".join(str(exc).split())
    prefix = f"etcd at {label} unreachable: "
    return why[len(prefix):] if why.startswith(prefix) else why


def _probe_checkpoint_url(url: str, job: str) -> None:
    """Create and remove a file under the job's checkpoint directory before anything starts.

    Raises:
        ConfigError: the storage refused the write (exit 78, one line naming the URL).
    """
    from elasticd.checkpoint.store import FsspecCheckpointStore

    try:
        FsspecCheckpointStore(url, job).probe_writable()
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a storage that does not answer may come back
        log.warning("checkpoint_url_probe_failed", url=redact_url(url), error=repr(exc))
    else:
        log.debug("checkpoint_url_probed", url=redact_url(url))


def _intents_dir(spec: NodeSpec) -> str:
    """Where pending commit intents outlive the agent: ``$STATE_DIRECTORY/commit-intents/
    <job>``, else ``<state home>/commit-intents/<job>`` (``$XDG_STATE_HOME/elasticd``, else
    ``~/.local/state/elasticd``); every level 0700 and checked with lstat (a symlink or a
    directory another user made is refused, never followed or reused)."""
    what = ("commit intent dir", "$STATE_DIRECTORY (systemd StateDirectory=) or $XDG_STATE_HOME")
    if spec.state_dir:
        base = os.path.join(os.path.abspath(spec.state_dir.split(":")[0]), "commit-intents")
        return ensure_private_tree(base, (spec.job,), what)
    base = spec.state_home or default_state_root(None, None)
    return ensure_private_tree(base, ("commit-intents", spec.job), what)


def _commit_intents(recorder: JobRecorder, state_dir: str, job: str) -> None:
    """Commit what a previous agent of this job left pending (before joining any round).

    A drain taken during an etcd outage leaves its save uncommitted when the agent exits;
    it is committed now if its round is still the job's newest (the round state unchanged:
    nobody re-formed since), else it is refused like any zombie's. Either way the intent is
    removed; it stays only while etcd does not answer.
    """
    for path, req in read_intents(state_dir, job):
        outcome, reason = recorder.commit_intent(req)
        log.info("checkpoint_commit_intent_resolved", path=str(path), step=req.step,
                 round=req.round, outcome=outcome.value, reason=reason)
        if outcome is not CommitOutcome.UNKNOWN:
            path.unlink(missing_ok=True)


def _log_finished(client: EtcdClient, keys: JobKeys, exc: RendezvousClosedError) -> None:
    """One line: the job finished (when, at which step) and how to run it again."""
    finished = getattr(exc, "finished", None)
    extra: dict[str, str] = {}
    if finished is None:  # closed while we were in a round, or peers left "finished"
        extra["detail"] = str(exc)
        try:
            finished = read_finished(client, keys)
        except EtcdUnavailableError:
            finished = None
    log_finished(finished or FinishedJob(keys.job), **extra)


def _admit(client: EtcdClient | None, handler: EtcdRendezvousHandler | None,
           fingerprint: JobFingerprint, deadline: float) -> None:
    """The handler's ``on_registered``: admit this node, or refuse it (exit 78)."""
    assert client is not None and handler is not None
    admit(client, handler.keys, handler.node_id, fingerprint,
          deadline_s=max(deadline - time.monotonic(), 1.0))


def _record_lost(recorder: JobRecorder, handler: EtcdRendezvousHandler, lost: list[str],
                 round_: int) -> None:
    for node in lost:
        recorder.event("lost", f"node {node} lost in round {round_} (no clean leave: killed, "
                       "frozen or cut off)", node=node, seen_by=handler.node_id)


def _on_notice(agent: ElasticdAgent, recorder: JobRecorder, notice: PreemptionNotice) -> None:
    deadline = notice.deadline
    left = f", {deadline - time.time():.0f}s left" if deadline else ""
    msg = f"{notice.provider or 'cloud'} preemption notice{left}"
    recorder.event("notice", msg, detail=notice.detail)
    agent.request_drain(msg)
