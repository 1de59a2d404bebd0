"""Liveness probes: prove that a peer's agent process is gone, long before its lease expires.

Why: a SIGKILLed or crashed node keeps its etcd lease for up to a TTL, so a round opened
at once on a failed collective (live re-formation) waited the whole last call for it, and
a plain script's agent waited for the lease to call the failure a membership change.

Each agent holds a TCP listener (:class:`LivenessListener`: port 0, a thread that accepts
and closes at once, reads nothing) and publishes its address in its node record
(``probe_host``/``probe_port``). A connection *refused* to that port proves that no
process holds the listener any more: the agent is gone. A timeout or an accepted
connection proves nothing: a SIGSTOPped process's kernel still completes the handshake,
and a slow network may drop the SYN; the lease decides then, as before. So a probe can
only shorten the wait for a node that is certainly dead, never remove a live one:

- A firewall that *rejects* (TCP reset) makes a live node look dead. Such a node sets
  ``rendezvous.liveness_probe = false``: it publishes no port and is never probed.
- A probed node that restarted has a new record (a new incarnation, a new port): results
  are kept per (node, incarnation), and only the current incarnation's count.
- A node wrongly left out (it cannot be: refused means gone) would rejoin through the
  normal join path. No other node's lease is ever revoked.

:class:`PeerProber` runs probes on daemon threads (never on a watch or the agent's tick)
and tells its owner when one proved a node dead.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog

from elasticd.etcd.kv import KV
from elasticd.records import NodeRecord

log = structlog.get_logger(__name__)

PROBE_TIMEOUT_S = 0.2  # one connect attempt; a live peer on a LAN answers in well under 1 ms
REPROBE_S = 0.25  # a peer that answered (or did not) is probed again this long after

_REFUSED = (errno.ECONNREFUSED,)


@dataclass(frozen=True)
class ProbeTarget:
    """Where to probe one node's agent, and which incarnation that address belongs to.

    Attributes:
        node: the node id.
        host: its advertised address (IPv4, IPv6 or a host name).
        port: its listener's port.
        incarnation: create_revision of its node record (a restarted agent has a new one).
    """

    node: str
    host: str
    port: int
    incarnation: int

    @classmethod
    def of_record(cls, node: str, kv: KV | None) -> ProbeTarget | None:
        """The target named by ``node``'s record ``kv``; None without one (no record, an
        unreadable one, or an agent that publishes no probe)."""
        if kv is None:
            return None
        try:
            rec = NodeRecord.from_json(kv.value)
        except (ValueError, TypeError):
            return None
        if rec.probe_host and 0 < rec.probe_port < 65536:
            return cls(node, rec.probe_host, rec.probe_port, kv.create_revision)
        return None


def probe(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``host:port`` certainly has no listener (every address refused). Blocking.

    Returns:
        True only if every address ``host`` resolves to refused the connection; False if
        any accepted, timed out or failed otherwise, or the name did not resolve.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    if not infos:
        return False
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(timeout_s)
                s.connect(addr)
            return False  # something listens there: not dead (or a stranger took the port)
        except OSError as exc:
            if exc.errno not in _REFUSED:
                return False
    return True


def _bind(addr: str | None) -> socket.socket:
    """A listening socket on ``addr`` (any family, port 0), else on every interface.

    ``addr`` may be an address this host does not hold (a public address behind NAT): then
    every interface is bound; probes of the published address time out and prove nothing.

    Raises:
        OSError: not even the wildcard address could be bound.
    """
    if addr:
        try:
            family = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0][0]
            return socket.create_server((addr, 0), family=family)
        except (OSError, UnicodeError) as exc:
            log.warning("liveness_probe_bound_everywhere", addr=addr, error=str(exc))
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", 0))


class LivenessListener:
    """The agent's probe target: accepts connections and closes them at once.

    Args:
        bind_addr: address to bind (the node's ``local_addr``), or None for every
            interface (IPv4 and IPv6 where the host has both).
    """

    def __init__(self, bind_addr: str | None = None) -> None:
        self._sock = _bind(bind_addr)
        self.port: int = self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="liveness-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # e.g. EMFILE: never spin
                continue
            conn.close()

    def close(self) -> None:
        """Stop listening (only when the node has left: a probe then reads it as gone)."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class PeerProber:
    """Probes peers on daemon threads and remembers which incarnations were proven dead.

    Args:
        on_dead: called (from a probe thread) when a probe proved a node dead.
        timeout_s: connect timeout of one probe.
        probe_fn: the probe (tests inject one).
    """

    def __init__(self, on_dead: Callable[[], None] | None = None, *,
                 timeout_s: float = PROBE_TIMEOUT_S,
                 probe_fn: Callable[[str, int, float], bool] = probe) -> None:
        self.on_dead = on_dead
        self.timeout_s = timeout_s
        self._probe = probe_fn
        self._lock = threading.Lock()
        self._dead: dict[str, int] = {}  # node -> incarnation proven dead
        self._last: dict[tuple[str, int], float] = {}  # (node, incarnation) -> last probe start
        self._inflight: set[tuple[str, int]] = set()

    def dead(self) -> dict[str, int]:
        """``{node: incarnation}`` proven dead so far (compare with the current records)."""
        with self._lock:
            return dict(self._dead)

    def request(self, targets: Iterable[ProbeTarget], now: float | None = None) -> float | None:
        """Probe each target not yet proven dead, unless probed within ``REPROBE_S``.

        Returns:
            When (monotonic) a target becomes due for its next probe, or None.
        """
        now = time.monotonic() if now is None else now
        due: float | None = None
        start: list[ProbeTarget] = []
        with self._lock:
            for t in targets:
                key = (t.node, t.incarnation)
                if self._dead.get(t.node) == t.incarnation or key in self._inflight:
                    continue
                last = self._last.get(key)
                if last is not None and now - last < REPROBE_S:
                    at = last + REPROBE_S
                    due = at if due is None else min(due, at)
                    continue
                self._last[key] = now
                self._inflight.add(key)
                start.append(t)
            if len(self._last) > 4096:  # bounded memory over weeks of rounds
                self._last = {k: v for k, v in self._last.items() if now - v < 60.0}
        for t in start:
            threading.Thread(target=self._run, args=(t,), name=f"probe:{t.node}",
                             daemon=True).start()
        return due

    def _run(self, t: ProbeTarget) -> None:
        try:
            gone = self._probe(t.host, t.port, self.timeout_s)
        except Exception:  # a probe never takes the owner down: it proved nothing
            gone = False
        with self._lock:
            self._inflight.discard((t.node, t.incarnation))
            if gone:
                self._dead[t.node] = t.incarnation
        if gone:
            log.info("peer_proven_dead", peer=t.node, host=t.host, port=t.port,
                     incarnation=t.incarnation)
            if self.on_dead is not None:
                self.on_dead()


class MemberProbes:
    """The agent's probes of its round's members while a local worker failure waits for
    its attribution: reads their records (a thread, at most every ``REPROBE_S``), probes.

    Args:
        prober: the node's prober (None: probing is off, nothing is ever proven).
        load_targets: reads the members' probe targets (from etcd); may raise.
    """

    def __init__(self, prober: PeerProber | None,
                 load_targets: Callable[[list[str]], list[ProbeTarget]]) -> None:
        self.prober = prober
        self._load = load_targets
        self._due = 0.0
        self._busy = threading.Event()
        self._incarnations: dict[str, int] = {}

    def proven_dead(self, members: list[str]) -> frozenset[str]:
        """Non-blocking: starts a round of probes when due, answers what they proved so far
        (a member counts only while its record is the incarnation that was probed)."""
        if self.prober is None or not members:
            return frozenset()
        now = time.monotonic()
        if now >= self._due and not self._busy.is_set():
            self._due = now + REPROBE_S
            self._busy.set()
            threading.Thread(target=self._run, args=(list(members),), daemon=True,
                             name="probe-members").start()
        return self.known_dead(members)

    def known_dead(self, members: list[str]) -> frozenset[str]:
        """What the probes proved so far (starts none)."""
        if self.prober is None:
            return frozenset()
        dead = self.prober.dead()
        return frozenset(m for m in members
                         if m in dead and self._incarnations.get(m) == dead[m])

    def _run(self, members: list[str]) -> None:
        assert self.prober is not None
        try:
            targets = self._load(members)
            self._incarnations.update({t.node: t.incarnation for t in targets})
            self.prober.request(targets)
        except Exception as exc:  # noqa: BLE001 - etcd away: the lease decides, as before
            log.info("member_probe_skipped", error=str(exc)[:200])
        finally:
            self._busy.clear()
