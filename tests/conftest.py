"""Shared fixtures: a real etcd server per test on free ports, process-leak checks."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from elasticd.etcd.client import EtcdClient  # noqa: E402
from elasticd.etcd.embedded import EmbeddedEtcd  # noqa: E402


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
