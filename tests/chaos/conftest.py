"""Fixtures for chaos tests that run real agents: a node factory that cleans up every process."""

from __future__ import annotations

import pytest
from harness import Node, elasticd_argv


@pytest.fixture
def nodes(tmp_path, etcd_server):
    """Start nodes with ``nodes.start(job, script, ...)``; all are killed after the test."""

    class Factory:
        def __init__(self) -> None:
            self.started: list[Node] = []
            self.etcd = etcd_server

        def start(self, job: str, script: str, *, env: dict[str, str] | None = None, **kw) -> Node:
            node_id = f"n{len(self.started)}"
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
