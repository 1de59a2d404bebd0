"""Prometheus metrics of one elasticd agent, served over HTTP when a port is configured.

The agent calls the ``AgentMetrics`` methods at its state changes (never per poll); each
is a few counter/gauge updates and never blocks on I/O, so they are safe to call from the
agent's main loop. The metrics live in a registry of their own, so several agents in one
process (tests) do not collide and nothing from the default process registry leaks in.

Exposed series (all prefixed ``elasticd_``)::

    round, world_size                          gauges of the current round
    spare                                      1 while this node waits as a hot spare
    straggler_ratio{node}                      a flagged straggler's own step time / the
                                               median's (set by the coordinating node)
    restarts_total{cause}                      cause in failure | membership | hang
    replica_divergences_total                  this node's ranks whose replica fingerprint
                                               differed from the majority's
    rendezvous_duration_seconds                histogram: join -> round final
    recovery_duration_seconds                  histogram: fault detected -> training again
    training_step, training_steps_per_second, training_samples_per_second
    checkpoint_save_duration_seconds, checkpoint_save_bytes_total, checkpoint_last_save_bytes
    checkpoint_load_duration_seconds, checkpoint_load_bytes_total
    last_checkpoint_step, last_checkpoint_timestamp_seconds
    goodput_ratio{window}                      window in life | recent (the ledger of
    goodput_worker_seconds{window, cause}      `status --goodput`; set by the node that
                                               writes the job's history)
    agent_info{elasticd_job, node, version}    constant 1

Binding: ``serve`` listens on ``127.0.0.1`` unless told otherwise (``metrics.addr`` /
``--metrics-addr``, passed through the runner): the metrics hold no secrets, but they name
the job and its nodes, and every listening socket on all interfaces is attack surface an
operator should choose, not inherit. Set the address Prometheus scrapes.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, MetricsHandler

from elasticd.errors import ConfigError
from elasticd.status.goodput import CAUSES, Ledger

log = structlog.get_logger(__name__)

RESTART_CAUSES = ("failure", "membership", "hang")
DEFAULT_METRICS_ADDR = "127.0.0.1"
# Rendezvous and recovery take from sub-second (graceful leave) to minutes (spot capacity).
DURATION_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CHECKPOINT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# One thread per connection, each idle one held forever, made 23 -> 215 threads in 30 s of
# connections that sent nothing. A scrape sends its request at once and is answered in
# milliseconds: an idle connection is closed after METRICS_IDLE_TIMEOUT_S, and past
# METRICS_MAX_CONNECTIONS at once a new one is closed unserved (the next scrape retries).
METRICS_IDLE_TIMEOUT_S = 5.0
METRICS_MAX_CONNECTIONS = 16


class MetricsServer:
    """A running metrics endpoint. ``stop()`` closes the socket and joins the thread."""

    def __init__(self, server: ThreadingHTTPServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        addr, port = server.server_address[:2]
        self.addr: str = addr.decode() if isinstance(addr, bytes) else str(addr)
        self.port: int = int(port)

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class AgentMetrics:
    """The agent's metrics, in a registry of their own.

    Args:
        registry: where to register; a fresh ``CollectorRegistry`` when None.
        clock: monotonic clock for the step rate (tests inject one).
        rate_interval_s: the step rate is averaged over at least this long, so a loop that
            reports every step does not publish a jittery rate.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 clock: Callable[[], float] = time.monotonic, rate_interval_s: float = 5.0) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self._clock = clock
        self._rate_interval_s = rate_interval_s
        self._lock = threading.Lock()
        # (step, samples trained, time) the rates are measured from
        self._anchor: tuple[int, int | None, float] | None = None

        self.info = Info("elasticd_agent", "elasticd agent identity", registry=r)
        self.round = Gauge("elasticd_round", "Current rendezvous round of this node", registry=r)
        self.world_size = Gauge("elasticd_world_size",
                                "Worker processes (ranks) in the current round", registry=r)
        self.restarts = Counter("elasticd_restarts", "Worker-group restarts by cause",
                                ["cause"], registry=r)
        for cause in RESTART_CAUSES:
            self.restarts.labels(cause=cause)  # export zeros: rate() needs the series to exist
        self.divergences = Counter("elasticd_replica_divergences",
                                   "Ranks of this node whose replica fingerprint differed from "
                                   "the majority's (elasticd.worker.fingerprint)", registry=r)
        self.rendezvous_s = Histogram("elasticd_rendezvous_duration_seconds",
                                      "Time from joining a round until it was final",
                                      buckets=DURATION_BUCKETS_S, registry=r)
        self.recovery_s = Histogram("elasticd_recovery_duration_seconds",
                                    "Time from a detected fault until workers trained again",
                                    buckets=DURATION_BUCKETS_S, registry=r)
        self.spare = Gauge("elasticd_spare",
                           "1 while this node waits as a hot spare (the job is full without it)",
                           registry=r)
        self.straggler_ratio = Gauge("elasticd_straggler_ratio",
                                     "A member flagged as a straggler: its own step time over "
                                     "the members' median (exported by the coordinating node)",
                                     ["node"], registry=r)
        self._stragglers: set[str] = set()
        self.step = Gauge("elasticd_training_step", "Last training step reported", registry=r)
        self.steps_per_s = Gauge("elasticd_training_steps_per_second",
                                 "Training steps per second (averaged)", registry=r)
        self.samples_per_s = Gauge("elasticd_training_samples_per_second",
                                   "Samples per second, all ranks together", registry=r)
        self.ckpt_save_s = Histogram("elasticd_checkpoint_save_duration_seconds",
                                     "Checkpoint save duration", buckets=CHECKPOINT_BUCKETS_S,
                                     registry=r)
        self.ckpt_save_bytes = Counter("elasticd_checkpoint_save_bytes",
                                       "Bytes written by checkpoint saves", registry=r)
        self.ckpt_last_save_bytes = Gauge("elasticd_checkpoint_last_save_bytes",
                                          "Size of the last checkpoint saved", registry=r)
        self.ckpt_load_s = Histogram("elasticd_checkpoint_load_duration_seconds",
                                     "Checkpoint load duration", buckets=CHECKPOINT_BUCKETS_S,
                                     registry=r)
        self.ckpt_load_bytes = Counter("elasticd_checkpoint_load_bytes",
                                       "Bytes read by checkpoint loads", registry=r)
        self.goodput = Gauge("elasticd_goodput_ratio",
                             "Share of worker-time that trained new steps (status --goodput)",
                             ["window"], registry=r)
        self.goodput_s = Gauge("elasticd_goodput_worker_seconds",
                               "Worker-seconds of the job by cause (status --goodput)",
                               ["window", "cause"], registry=r)
        self.last_ckpt_step = Gauge("elasticd_last_checkpoint_step",
                                    "Step of the newest committed checkpoint", registry=r)
        self.last_ckpt_time = Gauge("elasticd_last_checkpoint_timestamp_seconds",
                                    "Unix time the newest checkpoint was committed", registry=r)

    # -- what the agent calls -----------------------------------------------------------
    def set_identity(self, *, job: str, node: str, version: str) -> None:
        """Label the agent (``elasticd_job`` avoids clashing with Prometheus' ``job``)."""
        self.info.info({"elasticd_job": job, "node": node, "version": version})

    def set_round(self, round_: int) -> None:
        self.round.set(round_)

    def set_world_size(self, n: int) -> None:
        self.world_size.set(n)

    def set_stragglers(self, flagged: dict[str, float]) -> None:
        """The members flagged as stragglers now (node -> ratio); the others' series go."""
        for node in self._stragglers - set(flagged):
            self.straggler_ratio.remove(node)
        for node, ratio in flagged.items():
            self.straggler_ratio.labels(node=node).set(ratio)
        self._stragglers = set(flagged)

    def set_spare(self, spare: bool) -> None:
        """This node waits as a hot spare (True) or is a member / joining (False)."""
        self.spare.set(1 if spare else 0)

    def restart(self, cause: str) -> None:
        """Count one worker-group restart.

        Raises:
            ValueError: ``cause`` is not one of ``RESTART_CAUSES`` (a bug in the caller).
        """
        if cause not in RESTART_CAUSES:
            raise ValueError(f"restart cause {cause!r} is not one of {RESTART_CAUSES}")
        self.restarts.labels(cause=cause).inc()

    def diverged(self) -> None:
        """Count one rank of this node found diverged from its replicas."""
        self.divergences.inc()

    def observe_rendezvous_s(self, seconds: float) -> None:
        self.rendezvous_s.observe(seconds)

    def observe_recovery_s(self, seconds: float) -> None:
        self.recovery_s.observe(seconds)

    def set_step(self, step: int, samples: int | None = None) -> None:
        """Report the current step; the step and sample rates come from consecutive reports.

        Args:
            step: the newest step the workers completed.
            samples: samples trained so far, all ranks together, cumulative over the job
                (what ``ElasticLoop`` and ``report_progress(samples=...)`` report); None
                when the workers do not report samples (the sample rate stays as it is).

        The rates are (steps or samples advanced) / (time elapsed) since the last anchor,
        updated once at least ``rate_interval_s`` has passed. A step lower than the anchor
        (workers resumed from an older checkpoint) restarts the measurement.
        """
        now = self._clock()
        with self._lock:
            self.step.set(step)
            anchor = self._anchor
            if anchor is None or step < anchor[0]:
                self._anchor = (step, samples, now)
                return
            dt = now - anchor[2]
            if dt >= self._rate_interval_s and dt > 0:
                self.steps_per_s.set((step - anchor[0]) / dt)
                if samples is not None and anchor[1] is not None and samples >= anchor[1]:
                    self.samples_per_s.set((samples - anchor[1]) / dt)
                self._anchor = (step, samples, now)

    def observe_checkpoint_save(self, seconds: float, nbytes: int) -> None:
        """One checkpoint save of this node's workers (reported over the control channel)."""
        self.ckpt_save_s.observe(seconds)
        self.ckpt_save_bytes.inc(max(nbytes, 0))
        self.ckpt_last_save_bytes.set(nbytes)

    def observe_checkpoint_load(self, seconds: float, nbytes: int) -> None:
        """One rank's checkpoint load (every rank reads the checkpoint: one observation each)."""
        self.ckpt_load_s.observe(seconds)
        self.ckpt_load_bytes.inc(max(nbytes, 0))

    def set_goodput(self, life: Ledger, recent: Ledger) -> None:
        """Publish the goodput ledger (``elasticd.status.goodput``) of the job's life and
        its recent window; called by the agent that writes the job's history."""
        for window, ledger in (("life", life), ("recent", recent)):
            ratio = ledger.goodput
            self.goodput.labels(window=window).set(float("nan") if ratio is None else ratio)
            for cause in CAUSES:
                self.goodput_s.labels(window=window, cause=cause).set(ledger.seconds.get(cause, 0.0))

    def set_last_checkpoint_step(self, step: int, committed_at: float | None = None) -> None:
        """Record the newest committed checkpoint (``committed_at``: Unix time, default now).

        The timestamp lets an alert fire on checkpoint age:
        ``time() - elasticd_last_checkpoint_timestamp_seconds > 3600``.
        """
        self.last_ckpt_step.set(step)
        self.last_ckpt_time.set(time.time() if committed_at is None else committed_at)

    # -- serving ------------------------------------------------------------------------
    def serve(self, port: int, addr: str = DEFAULT_METRICS_ADDR) -> MetricsServer:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread (``port=0``: any free).

        Returns:
            The running server; call ``stop()`` on shutdown.

        Raises:
            ConfigError: the address cannot be bound (port in use, bad address).
        """

        slots = threading.BoundedSemaphore(METRICS_MAX_CONNECTIONS)

        class _Server(ThreadingHTTPServer):
            daemon_threads = True
            # socketserver's default backlog is 5: a burst of connections (scrapers, a
            # dashboard's panels) beyond it waited on SYN retransmits (1, 2, 4 s...) before
            # this loop even saw them. The cap below closes the excess at once instead.
            request_queue_size = 128
            address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

            def process_request(self, request, client_address):  # type: ignore[no-untyped-def]
                if not slots.acquire(blocking=False):
                    self.shutdown_request(request)  # over the cap: closed, no thread
                    return
                super().process_request(request, client_address)

            def process_request_thread(self, request, client_address):  # type: ignore[no-untyped-def]
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

        # A socket timeout on each connection (StreamRequestHandler.timeout).
        handler = type("MetricsHandlerWithTimeout", (MetricsHandler.factory(self.registry),),
                       {"timeout": METRICS_IDLE_TIMEOUT_S})
        try:
            server = _Server((addr, port), handler)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {addr}:{port}: {exc.strerror}; set "
                              "another metrics port or free this one") from exc
        thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
        thread.start()
        running = MetricsServer(server, thread)
        log.info("metrics_server_started", url=running.url)
        return running
