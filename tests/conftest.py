"""Shared fixtures: a real etcd server per test on free ports, process-leak checks."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import structlog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from harness import Node, elasticd_argv  # noqa: E402

from elasticd.etcd.client import EtcdClient  # noqa: E402
from elasticd.etcd.embedded import EmbeddedEtcd  # noqa: E402


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
# workers' step lines), the last ones, each cut short.
_DIGEST_EVENTS, _DIGEST_CHARS = 80, 300


def _agent_digest(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            lines.append(line[:_DIGEST_CHARS])  # a traceback, a worker's plain print
            continue
        if not isinstance(doc, dict) or doc.get("event") == "worker_output":
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
            for node in factory.started:
                print(f"==== {node.log_path.name}: the agent's last events")
                print("\n".join(_agent_digest(node.log())))
