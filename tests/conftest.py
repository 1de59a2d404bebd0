"""Shared fixtures: a real etcd server per test on free ports, process-leak checks."""

from __future__ import annotations

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


@pytest.fixture
def nodes(tmp_path, etcd_server):
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
