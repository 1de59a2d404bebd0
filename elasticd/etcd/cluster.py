"""A multi-member etcd cluster on 127.0.0.1, for failover tests, benchmarks and local trials.

Production runs etcd as 3 (or 5) members on separate machines; a job must ride through a
member's death, freeze or restart without noticing. To test that on one machine, this module
starts N ``EmbeddedEtcd`` members that form one raft group over loopback peer ports, each
with a data dir of its own, and lets a test hit any one member: ``kill`` (SIGKILL),
``freeze``/``resume`` (SIGSTOP/SIGCONT), ``stop``/``restart`` (same ports, same data dir).
``leader()`` asks every live member who leads (etcd's Maintenance.Status RPC).

Members talk raft over TLS with client-certificate auth from one generated CA (the peer
ports are on loopback, where every local user can connect). Each member is an ``EmbeddedEtcd`` whose command line is the single-member one with the
member's identity swapped in (``--name``, ``--initial-cluster``, ``--initial-cluster-token``),
so whatever hardening ``EmbeddedEtcd`` applies to its own server applies here too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from elasticd.errors import EtcdUnavailableError
from elasticd.etcd.embedded import EmbeddedEtcd, make_private_dir
from elasticd.etcd.pki import PeerTLS, generate_private_pki

log = structlog.get_logger(__name__)

# etcd's own defaults, spelled out because the TTL rule in docs/deployment.md depends on them.
DEFAULT_HEARTBEAT_MS = 100
DEFAULT_ELECTION_MS = 1000


def _set_flag(cmd: list[str], flag: str, value: str) -> list[str]:
    """``cmd`` with ``flag``'s value replaced (or the pair appended when absent)."""
    out = list(cmd)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


class ClusterMember(EmbeddedEtcd):
    """One member of an ``EmbeddedEtcdCluster`` (an ``EmbeddedEtcd`` with a cluster identity).

    Args:
        name: the member's name in the cluster (``m0``, ``m1``, ...).
        data_dir: its data dir (kept across ``restart``).
        heartbeat_ms, election_ms: raft timing (etcd's ``--heartbeat-interval`` and
            ``--election-timeout``).
        peer_tls: the cluster's shared peer certificate and CA.
    """

    def __init__(self, name: str, data_dir: str, *, heartbeat_ms: int = DEFAULT_HEARTBEAT_MS,
                 election_ms: int = DEFAULT_ELECTION_MS, start_timeout_s: float = 30.0,
                 peer_tls: PeerTLS | None = None) -> None:
        super().__init__(data_dir, start_timeout_s=start_timeout_s, peer_tls=peer_tls)
        self.name = name
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.initial_cluster = ""  # set by the cluster once every member's peer port is known
        self.cluster_token = "elasticd"
        self.defer_wait = False
        self.log_level = os.environ.get("ELASTICD_TEST_ETCD_LOG_LEVEL", "error")  # tests/benchmarks

    def _wait_healthy(self) -> None:
        # A lone member of a new cluster cannot answer until a quorum is up, so the cluster
        # launches every member first and waits afterwards. (Launching from helper threads
        # instead would be wrong: PR_SET_PDEATHSIG kills etcd when its parent *thread* ends.)
        if not self.defer_wait:
            super()._wait_healthy()

    def launch(self) -> None:
        """Start the etcd process without waiting for it to serve."""
        self.defer_wait = True
        try:
            self.start()
        finally:
            self.defer_wait = False

    def wait_healthy(self) -> None:
        """Wait until this member serves requests (it needs a quorum of the cluster up).

        Raises:
            EtcdUnavailableError: it exited or did not answer within ``start_timeout_s``.
        """
        super()._wait_healthy()

    def _command(self) -> list[str]:
        cmd = super()._command()
        for flag, value in (("--name", self.name), ("--initial-cluster", self.initial_cluster),
                            ("--initial-cluster-token", self.cluster_token),
                            ("--heartbeat-interval", str(self.heartbeat_ms)),
                            ("--election-timeout", str(self.election_ms)),
                            ("--log-level", self.log_level)):
            cmd = _set_flag(cmd, flag, value)
        return cmd

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running and self.proc is not None else None


@dataclass(frozen=True)
class MemberStatus:
    """What one member says about itself: its raft id, who leads, the raft term and index."""

    name: str
    member_id: int
    leader_id: int
    raft_term: int
    raft_index: int

    @property
    def is_leader(self) -> bool:
        return self.leader_id != 0 and self.leader_id == self.member_id


class EmbeddedEtcdCluster:
    """N etcd members on 127.0.0.1 forming one cluster (free ports, one data dir each).

    Args:
        size: number of members (3 or 5 in production; 1 works too).
        root_dir: parent of the members' data dirs; a fresh temp dir when None (removed on
            ``stop``).
        heartbeat_ms, election_ms: raft timing of every member.
        start_timeout_s: how long ``start`` waits for the cluster to serve requests.
    """

    def __init__(self, size: int = 3, root_dir: str | None = None, *,
                 heartbeat_ms: int = DEFAULT_HEARTBEAT_MS, election_ms: int = DEFAULT_ELECTION_MS,
                 start_timeout_s: float = 30.0) -> None:
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least one member, not {size}")
        self._own_dir = root_dir is None
        self.root_dir = root_dir or tempfile.mkdtemp(prefix="elasticd-etcd-cluster-")
        os.makedirs(self.root_dir, mode=0o700, exist_ok=True)
        make_private_dir(self.root_dir)
        # One CA and peer certificate for every member: raft between them is TLS with
        # client-certificate auth, so no other local user can join, read or write the raft
        # group through a peer port (they used to be plain http on loopback).
        peer_tls = generate_private_pki(os.path.join(self.root_dir, "peer-tls")).peer
        self.members = [
            ClusterMember(f"m{i}", os.path.join(self.root_dir, f"m{i}"), heartbeat_ms=heartbeat_ms,
                          election_ms=election_ms, start_timeout_s=start_timeout_s,
                          peer_tls=peer_tls)
            for i in range(size)
        ]
        self._token = f"elasticd-{os.getpid()}-{id(self):x}"
        self.refresh_initial_cluster()

    def refresh_initial_cluster(self) -> None:
        """Tell every member the peer URLs of all (call after changing a member's ports)."""
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial
            m.cluster_token = self._token

    @property
    def endpoints(self) -> str:
        """Every member's client endpoint, comma-separated: the value of ``--etcd``."""
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> EmbeddedEtcdCluster:
        """Start every member and wait until the cluster serves requests.

        Every member is launched before any is waited for: none answers before a quorum
        is up.

        Raises:
            EtcdUnavailableError: a member did not become healthy (its log is quoted).
        """
        try:
            for m in self.members:
                m.launch()
            for m in self.members:
                m.wait_healthy()
        except BaseException:
            self.stop()
            raise
        log.info("etcd_cluster_started", endpoints=self.endpoints, members=len(self.members))
        return self

    # -- faults, by member index --------------------------------------------------------
    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (its data dir stays for ``restart``)."""
        self.members[i].kill()

    def stop_member(self, i: int) -> None:
        """Stop member ``i`` gracefully (SIGTERM), keeping its data dir."""
        self.members[i].stop(remove_data=False)

    def freeze(self, i: int) -> None:
        """SIGSTOP member ``i``: its connections stay open and nothing answers."""
        self.members[i].pause()

    def resume(self, i: int) -> None:
        """SIGCONT member ``i``."""
        self.members[i].resume()

    def restart(self, i: int, *, wait: bool = True) -> None:
        """Start member ``i`` again on its ports and data dir.

        Args:
            wait: wait until it serves requests (needs a quorum of the others up).
        Raises:
            EtcdUnavailableError: ``wait`` and it did not become healthy in time.
        """
        m = self.members[i]
        m.launch()
        if wait:
            m.wait_healthy()

    # -- who leads ----------------------------------------------------------------------
    def status(self, i: int, timeout_s: float = 1.0) -> MemberStatus | None:
        """Member ``i``'s own status, or None if it does not answer within ``timeout_s``."""
        m = self.members[i]
        if not m.running:
            return None
        from etcd3.etcdrpc import StatusRequest

        from elasticd.etcd.client import EtcdClient

        client = EtcdClient(m.endpoint, timeout_s=timeout_s)
        try:
            resp = client.call(lambda c: c.maintenancestub.Status(StatusRequest(), timeout_s))
        except Exception:
            return None
        finally:
            client.close()
        return MemberStatus(m.name, int(resp.header.member_id), int(resp.leader),
                            int(resp.raftTerm), int(resp.raftIndex))

    def leader(self, *, among: Sequence[int] | None = None, timeout_s: float = 1.0) -> int | None:
        """Index of the member that says it leads (asking each live one), or None."""
        for i in among if among is not None else range(len(self.members)):
            st = self.status(i, timeout_s)
            if st is not None and st.is_leader:
                return i
        return None

    def wait_leader(self, timeout_s: float = 30.0, *, exclude: Sequence[int] = ()) -> int:
        """Poll until a member other than ``exclude`` leads; return its index.

        Raises:
            EtcdUnavailableError: no leader within ``timeout_s``.
        """
        among = [i for i in range(len(self.members)) if i not in exclude]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.leader(among=among, timeout_s=0.5)
            if found is not None:
                return found
            time.sleep(0.05)
        raise EtcdUnavailableError(f"etcd cluster elected no leader among members {among} "
                                   f"within {timeout_s:.0f}s")

    def move_leader(self, target: int, timeout_s: float = 10.0) -> None:
        """Hand leadership to member ``target`` (etcd's MoveLeader, sent to the leader).

        Raises:
            EtcdUnavailableError: there is no leader, or ``target`` did not take over in time.
        """
        from etcd3.etcdrpc import MoveLeaderRequest

        from elasticd.etcd.client import EtcdClient

        lead = self.wait_leader(timeout_s)
        if lead == target:
            return
        st = self.status(target)
        if st is None:
            raise EtcdUnavailableError(f"member {self.members[target].name} does not answer")
        client = EtcdClient(self.members[lead].endpoint, timeout_s=timeout_s)
        try:
            client.call(lambda c: c.maintenancestub.MoveLeader(MoveLeaderRequest(targetID=st.member_id),
                                                               timeout_s))
        finally:
            client.close()
        if self.wait_leader(timeout_s) != target:
            raise EtcdUnavailableError(f"leadership did not move to {self.members[target].name}")

    def members_used_by(self, pid: int) -> list[int]:
        """Indices of the members process ``pid`` holds an established TCP connection to
        (from /proc; Linux): which member a client process is talking to."""
        inodes = set()
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
            rows = []
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):  # gRPC uses v4-mapped v6 sockets
                with open(table) as fh:
                    rows += fh.read().splitlines()[1:]
        except OSError:
            return []
        ports = set()
        for row in rows:
            cols = row.split()
            if cols[3] == "01" and cols[9] in inodes:  # 01: ESTABLISHED
                ports.add(int(cols[2].rsplit(":", 1)[1], 16))
        return [i for i, m in enumerate(self.members) if m.client_port in ports]

    def stop(self) -> None:
        """Stop every member; remove the data dirs if this cluster made them."""
        for m in self.members:
            m.stop(remove_data=False)
        if self._own_dir:
            shutil.rmtree(self.root_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedEtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
