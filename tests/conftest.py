"""Shared fixtures: a real etcd server per test on free ports, process-leak checks, temp
dirs kept under pytest's own (never left in the real /tmp), per-test CPU seconds
(``--cpu-durations=N``)."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import pytest
import structlog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from cpu_accounting import CpuMeter, RunCost, cpu_table  # noqa: E402
from harness import Node, elasticd_argv  # noqa: E402

from elasticd.etcd.client import EtcdClient  # noqa: E402
from elasticd.etcd.embedded import EmbeddedEtcd  # noqa: E402

# (the real temp dir, the elasticd-* entries in it when the session started)
_REAL_TMP = pytest.StashKey[tuple[Path, frozenset[str]]]()


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-durations", type=int, default=None, metavar="N",
        help="measure each test's CPU seconds (user+sys of pytest and every process the test "
             "ran) beside its wall time; print the N most CPU-hungry (N=0: all) at the end")


def pytest_configure(config):
    top = config.getoption("--cpu-durations")
    if top is not None:
        config.pluginmanager.register(_CpuDurations(top), "elasticd-cpu-durations")
    config.addinivalue_line(
        "markers", "real_tmp: the test's processes keep the real temp dir (not one under "
                   "tmp_path): it checks what another uid can reach, and pytest's temp root "
                   "is private to its owner")


def _elasticd_entries(tmp: Path) -> frozenset[str]:
    return frozenset(p.name for p in tmp.glob("elasticd-*"))


def pytest_sessionstart(session):
    real = Path(tempfile.gettempdir())
    session.config.stash[_REAL_TMP] = (real, _elasticd_entries(real))


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if it left ``elasticd-*`` entries in the real temp dir: agents,
    embedded etcds and logs of tests keep them under the test's tmp_path (``_test_tmpdir``),
    so one there is a leak (a SIGKILLed agent's runtime dir, a test that set no tmp)."""
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller checks once every worker has finished
    real, before = session.config.stash[_REAL_TMP]
    if os.environ.get("ELASTICD_TMP_LEAK_CHECK") == "0":
        return
    left = sorted(_elasticd_entries(real) - before)
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", f"{len(left)} elasticd-* entries left in {real}", red=True)
        for name in left[:20]:
            reporter.write_line(f"  {real / name}")
        reporter.write_line(
            "A test's processes must keep their temp files under its tmp_path (the "
            "_test_tmpdir fixture points TMPDIR there) and remove what they make. Another "
            "test run on this machine at the same time makes such entries too: there, "
            "ELASTICD_TMP_LEAK_CHECK=0 turns this check off.")
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _zygote_pids() -> list[int]:
    import harness

    zygote = harness._zygote
    return [zygote.proc.pid] if zygote is not None and zygote.proc.poll() is None else []


class _CpuDurations:
    """``--cpu-durations``: the process that runs a test measures it (setup, call and
    teardown together) and puts the cost on the test's teardown report; the process that
    prints the summary collects them from the reports. With pytest-xdist those are two
    processes (a worker, the controller); without it, one."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.meter = CpuMeter(helpers=_zygote_pids)
        self.costs: list[RunCost] = []

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.meter.begin(item.nodeid)
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        try:
            return (yield)
        finally:
            cost = self.meter.end()
            item.user_properties.append(("cpu_cost", (cost.wall_s, cost.cpu_s)))

    def pytest_runtest_logreport(self, report):
        if report.when != "teardown":
            return
        for key, value in report.user_properties:
            if key == "cpu_cost":
                self.costs.append(RunCost(report.nodeid, value[0], value[1]))

    def pytest_terminal_summary(self, terminalreporter):
        if not self.costs:
            return
        terminalreporter.write_sep("=", f"{'all' if self.top == 0 else self.top} tests by "
                                        "CPU seconds (their process trees' user+sys)")
        for line in cpu_table(self.costs, self.top):
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True, scope="session")
def _private_state_home(tmp_path_factory):
    """Agents started by the tests keep their state (standalone run records, commit intents)
    under this session's temp dir, never the user's ~/.local/state/elasticd: a record left
    there by one run would make a later standalone start of the same job and checkpoint
    URL say "already finished". A test about the default root removes the variable."""
    old = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state-home"))
    yield
    if old is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = old


@pytest.fixture(autouse=True)
def _test_tmpdir(request, monkeypatch):
    """A test that has a tmp_path keeps every temp file of its own and of the processes it
    starts (agents' runtime dirs, embedded etcds, log dirs) under ``tmp_path / "t"``:
    TMPDIR for children, ``tempfile.tempdir`` here. A SIGKILLed agent cannot remove its
    runtime dir; /tmp once held 2,835 of them. Tests marked ``real_tmp`` are left alone."""
    if "tmp_path" not in request.fixturenames or request.node.get_closest_marker("real_tmp"):
        return
    tmp = request.getfixturevalue("tmp_path") / "t"  # short: a Unix socket path has 107 bytes
    tmp.mkdir(exist_ok=True)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))


@pytest.fixture(autouse=True)
def _fresh_logging():
    """Every test starts with elasticd's logging unconfigured. An in-process CLI run (status,
    agent --check-config) configures it on the stream pytest captured for that test; a
    later test must not inherit handlers writing into that dead buffer."""
    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    from elasticd import logs

    logs._configured, logs._format = False, None
    structlog.reset_defaults()
    for handler in logging.root.handlers[:]:
        if handler not in handlers:
            logging.root.removeHandler(handler)
    logging.root.setLevel(level)
    logging.captureWarnings(False)


@pytest.fixture
def etcd_server(tmp_path):
    """A private etcd on 127.0.0.1 (free ports, temp data dir), stopped after the test."""
    server = EmbeddedEtcd(str(tmp_path / "etcd"))
    server.start()
    try:
        yield server
    finally:
        server.stop(remove_data=True)


@pytest.fixture(scope="module")
def module_etcd(tmp_path_factory):
    """One etcd for a whole module, for tests that neither stop, freeze nor empty it, each
    with job names (and any other keys) of its own: a module overrides ``etcd_server`` with
    it to save an etcd start per test. Tests that fault etcd keep ``etcd_server``'s own."""
    server = EmbeddedEtcd(str(tmp_path_factory.mktemp("etcd")))
    server.start()
    try:
        yield server
    finally:
        server.stop(remove_data=True)


@pytest.fixture
def etcd_client(etcd_server):
    """An EtcdClient connected to ``etcd_server``."""
    client = EtcdClient(etcd_server.endpoint, timeout_s=2.0)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def etcd_cluster(tmp_path):
    """A 3-member etcd cluster on 127.0.0.1 (free ports, one data dir each), stopped after
    the test; ``etcd_cluster.endpoints`` is the ``--etcd`` value naming every member."""
    from elasticd.etcd.cluster import EmbeddedEtcdCluster

    cluster = EmbeddedEtcdCluster(3, str(tmp_path / "etcd-cluster"))
    cluster.start()
    try:
        yield cluster
    finally:
        for i in range(len(cluster.members)):
            cluster.kill(i)  # SIGKILL: a graceful stop of the last members waits on the first
        cluster.stop()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the item: fixtures read ``item.rep_call`` at teardown."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


# What a failed agent test prints of each node's log: the agents' own events (not the
# workers' step lines nor the routine events below), the last ones, each cut short. CI
# shows only the head and the tail of a failed run's output, so the nodes that logged a
# warning or an error come first.
_DIGEST_EVENTS, _DIGEST_CHARS = 60, 300
_ROUTINE_EVENTS = frozenset({
    "worker_output", "checkpoint_saved", "checkpoint_committed", "checkpoint_pruned",
    "sampler_state_loaded", "worker_log_dir_chosen", "process_group_lifecycle_chosen",
    "started", "heartbeat"})


def _troubled_first(nodes: list) -> list:
    """``nodes`` with those whose log holds a warning or an error first (stable)."""
    def troubled(node) -> bool:
        text = node.log()
        return '"level": "warning"' in text or '"level": "error"' in text or "Traceback" in text
    return sorted(nodes, key=lambda n: not troubled(n))


def _agent_digest(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            lines.append(line[:_DIGEST_CHARS])  # a traceback, a worker's plain print
            continue
        if not isinstance(doc, dict) or doc.get("event") in _ROUTINE_EVENTS:
            continue
        head = f"{doc.get('timestamp', '')[11:23]} {doc.get('event')}"
        rest = {k: v for k, v in doc.items() if k not in ("timestamp", "event", "job", "level")}
        lines.append(f"{head} {json.dumps(rest)}"[:_DIGEST_CHARS])
    return lines[-_DIGEST_EVENTS:]


@pytest.fixture
def nodes(tmp_path, etcd_server, request):
    """Real agents (``elasticd run`` processes) against ``etcd_server``: start nodes with ``nodes.start(job, script, ...)``; all are killed after the test."""

    class Factory:
        def __init__(self) -> None:
            self.started: list[Node] = []
            self.etcd = etcd_server

        def start(self, job: str, script: str, *, env: dict[str, str] | None = None,
                  name: str | None = None, **kw) -> Node:
            idx = len(self.started)
            node_id = name or f"n{idx}"
            node = Node(elasticd_argv(etcd_server.endpoint, job, script, node_id=node_id, **kw),
                        env or {}, tmp_path / f"{node_id}.log")
            self.started.append(node)
            return node

    factory = Factory()
    try:
        yield factory
    finally:
        for node in factory.started:
            node.cleanup()
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            # A CI failure is read from this output alone: say what every agent did.
            for node in _troubled_first(factory.started):
                print(f"==== {node.log_path.name}: the agent's last events")
                print("\n".join(_agent_digest(node.log())))
