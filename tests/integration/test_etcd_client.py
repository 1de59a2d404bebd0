"""The hardened etcd client against a real etcd that is frozen (SIGSTOP) or killed and restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from harness import wait_until

from elasticd.errors import EtcdUnavailableError
from elasticd.etcd.client import KV, EtcdClient, WatchEvent
from elasticd.etcd.lease import LeaseKeeper
from elasticd.etcd.txn import Get, ModRevision, Put

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """Collects what a PrefixWatch delivers."""

    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self.resyncs: list[list[KV]] = []
        self.lock = threading.Lock()

    def on_events(self, events: list[WatchEvent]) -> None:
        with self.lock:
            self.events.extend(events)

    def on_resync(self, kvs: list[KV], revision: int) -> None:
        with self.lock:
            self.resyncs.append(kvs)

    def saw(self, key: str, value: bytes | None) -> bool:
        with self.lock:
            return any(e.key == key and e.value == value for e in self.events)


def _works(client: EtcdClient) -> bool:
    try:
        client.put("/t/ping", b"1")
        return True
    except EtcdUnavailableError:
        return False


def test_frozen_etcd_times_out_calls_then_recovers(etcd_server):
    """With etcd SIGSTOPped a call fails with EtcdUnavailableError within ~timeout_s; after
    SIGCONT the same client works again and its PrefixWatch delivers new events."""
    client = EtcdClient(etcd_server.endpoint, timeout_s=1.0)
    rec = Recorder()
    watch = client.watch_prefix("/t/", rec.on_events, rec.on_resync, name="t")
    try:
        assert watch.connected.wait(10)
        client.put("/t/before", b"1")
        wait_until(lambda: rec.saw("/t/before", b"1"), 10, "event before the freeze")
        etcd_server.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(EtcdUnavailableError) as info:
                client.get("/t/before")
            elapsed = time.monotonic() - t0
            assert elapsed < 1.0 + 1.5, f"a call to a frozen etcd took {elapsed:.1f}s (timeout 1s)"
            assert etcd_server.endpoint in str(info.value)
            assert client.trouble_within(5), "the client did not record the etcd trouble"
        finally:
            etcd_server.resume()
        wait_until(lambda: _works(client), 15, "calls to work after SIGCONT")
        client.put("/t/after", b"2")
        wait_until(lambda: rec.saw("/t/after", b"2"), 15, "watch event after the freeze")
    finally:
        watch.stop()
        client.close()


def test_killed_etcd_restarts_under_the_same_client(etcd_server):
    """etcd killed and restarted: calls fail fast with EtcdUnavailableError while it is down,
    then the same client, watch and lease keeper carry on (no event missed, lease kept)."""
    client = EtcdClient(etcd_server.endpoint, timeout_s=1.0)
    rec = Recorder()
    watch = client.watch_prefix("/t/", rec.on_events, rec.on_resync, name="t")
    lease = client.grant_lease(3)
    keeper = LeaseKeeper(client, lease, 3).start()
    try:
        assert watch.connected.wait(10)
        client.put("/t/leased", b"1", lease=lease)
        wait_until(lambda: rec.saw("/t/leased", b"1"), 10, "event before the kill")
        etcd_server.kill()
        t0 = time.monotonic()
        with pytest.raises(EtcdUnavailableError):
            client.get("/t/leased")
        assert time.monotonic() - t0 < 2.5, "a call to a dead etcd was not bounded by timeout_s"
        etcd_server.start()
        wait_until(lambda: _works(client), 20, "calls to work after the restart")
        client.put("/t/after", b"2")
        wait_until(lambda: rec.saw("/t/after", b"2"), 20, "watch event after the restart")
        # The restart renewed the lease: the keeper keeps it and the leased key stays.
        assert not keeper.lost.is_set()
        assert client.refresh_lease(lease) > 0
        kv = client.get("/t/leased")
        assert kv is not None and kv.lease == lease
        assert not rec.saw("/t/leased", None), "the leased key was deleted by the restart"
    finally:
        keeper.stop(revoke=True)
        watch.stop()
        client.close()


def test_lease_keeper_reports_an_expired_lease(etcd_client):
    """A lease that expired while nobody kept it alive is reported lost (event + callback) once."""
    lease = etcd_client.grant_lease(2)
    etcd_client.revoke_lease(lease)  # as if it expired: etcd no longer knows it
    called = threading.Event()
    keeper = LeaseKeeper(etcd_client, lease, 2, on_lost=called.set).start()
    try:
        assert keeper.lost.wait(5), "the keeper did not notice the lease was gone"
        assert called.wait(5), "on_lost was not called"
    finally:
        keeper.stop(revoke=True)


def test_watch_delivers_deletes_and_resumes_without_loss(etcd_server):
    """A PrefixWatch sees puts and deletes in order, and a stream cut by an etcd restart
    resumes from the last revision: changes made before the restart are not replayed."""
    client = EtcdClient(etcd_server.endpoint, timeout_s=1.0)
    rec = Recorder()
    client.put("/t/a", b"0")
    watch = client.watch_prefix("/t/", rec.on_events, rec.on_resync, name="t")
    try:
        assert watch.connected.wait(10)
        assert [kv.key for kv in rec.resyncs[0]] == ["/t/a"], "first snapshot missing"
        client.put("/t/a", b"1")
        client.delete("/t/a")
        wait_until(lambda: rec.saw("/t/a", None), 10, "delete event")
        with rec.lock:
            assert [(e.key, e.value) for e in rec.events] == [("/t/a", b"1"), ("/t/a", None)]
        etcd_server.kill()
        etcd_server.start()
        wait_until(lambda: _works(client), 20, "calls to work after the restart")
        client.put("/t/b", b"2")
        wait_until(lambda: rec.saw("/t/b", b"2"), 20, "event after the restart")
        with rec.lock:
            revisions = [e.mod_revision for e in rec.events]
        assert revisions == sorted(set(revisions)), f"events replayed or out of order: {revisions}"
    finally:
        watch.stop()
        client.close()


def test_watch_stopped_while_connecting_stops_at_once(etcd_client):
    """Regression: stop() racing the watch's first connect returns promptly and the watch
    thread ends (it used to park forever, stop() waited 5 s, and the etcd watch leaked)."""
    for i in range(15):
        rec = Recorder()
        watch = etcd_client.watch_prefix(f"/race{i}/", rec.on_events, rec.on_resync, name="race")
        t0 = time.monotonic()
        watch.stop()
        assert time.monotonic() - t0 < 2.0, f"stop() took {time.monotonic() - t0:.1f}s"
        assert not watch._thread.is_alive(), "the watch thread outlived stop()"


def test_stopping_a_watch_after_a_stream_swap_does_not_silence_another(etcd_server):
    """A call that times out makes python3-etcd3 open a new watch stream while the old one
    lives on; a watch created there gets the same id as one on the old stream. Stopping the
    old watch must cancel it on its own stream: it used to cancel the other watch, which then
    delivered nothing, for good, with no error (soak seed 880015's silent ``joins`` watch)."""
    client = EtcdClient(etcd_server.endpoint, timeout_s=1.0)
    a_rec, b_rec = Recorder(), Recorder()
    a = client.watch_prefix("/a/", a_rec.on_events, a_rec.on_resync, name="a")
    b = None
    try:
        assert a.connected.wait(10)
        etcd_server.pause()  # a slow etcd, as just after a restart
        try:
            with pytest.raises(EtcdUnavailableError):
                client.get("/x")  # DEADLINE_EXCEEDED: python3-etcd3 drops its watcher
        finally:
            etcd_server.resume()
        b = client.watch_prefix("/b/", b_rec.on_events, b_rec.on_resync, name="b")
        assert b.connected.wait(10)
        client.put("/b/1", b"1")
        wait_until(lambda: b_rec.saw("/b/1", b"1"), 10, "b's first event")
        a.stop()  # e.g. a coordinator giving up its watches
        client.put("/b/2", b"2")
        wait_until(lambda: b_rec.saw("/b/2", b"2"), 10, "b's event after a stopped (b went silent)")
    finally:
        a.stop()
        if b is not None:
            b.stop()
        client.close()


def test_txn_read_returns_what_its_gets_saw_in_the_same_request(etcd_client):
    """A registration's put and the read of its incarnation are one txn: the Get sees the
    put before it (create_revision = the put's revision for a new key, kept on a
    rewrite), a missing key reads None, and a failed compare runs the failure branch's
    reads only."""
    ok, (new, missing) = etcd_client.txn_read([], [Put("/t/node", "a"), Get("/t/node"),
                                                   Get("/t/absent")])
    assert ok and missing is None
    assert new is not None and new.value == b"a"
    assert new.create_revision == new.mod_revision == etcd_client.get("/t/node").create_revision
    ok, (again,) = etcd_client.txn_read([ModRevision("/t/node", new.mod_revision)],
                                        [Put("/t/node", "b"), Get("/t/node")])
    assert ok and again.value == b"b"
    assert (again.create_revision, again.mod_revision > new.mod_revision) == (
        new.create_revision, True)
    ok, reads = etcd_client.txn_read([ModRevision("/t/node", new.mod_revision)],
                                     [Put("/t/node", "c"), Get("/t/node")], [Get("/t/node")])
    assert not ok and [kv.value for kv in reads] == [b"b"]
    assert etcd_client.txn([ModRevision("/t/node", again.mod_revision)], [Get("/t/node")])


# A child that imports elasticd's etcd client, keeps gRPC busy from three threads and a
# watch, and forks until it has forked ``forks`` times (or for ``limit`` seconds): ``how`` is
# "elasticd" for the way elasticd and torch's agent start processes (``subprocess`` without a
# ``preexec_fn``: torch's workers, and every 30th through ``dying_with_parent`` as the
# embedded etcd and the lease bridge), "preexec" for a ``preexec_fn`` (the GIL held across
# fork(), as the agent started its lease bridge and embedded etcd before issue 52).
_FORKING_CHILD = r"""
import os, subprocess, sys, threading, time
endpoint, forks, limit, how = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
from elasticd.etcd import EtcdClient
from elasticd.process import dying_with_parent
print("env-after-import", os.environ.get("GRPC_ENABLE_FORK_SUPPORT"), flush=True)
client = EtcdClient(endpoint, timeout_s=2.0)
watch = client.watch_prefix("/fork/", lambda events: None, lambda kvs, rev: None)
stop = threading.Event()
def busy(i):
    n = 0
    while not stop.is_set():
        client.put(f"/fork/{i}", str(n)); client.get(f"/fork/{i}"); n += 1
threads = [threading.Thread(target=busy, args=(i,)) for i in range(3)]
for t in threads: t.start()
n, deadline = 0, time.monotonic() + limit
while n < forks and time.monotonic() < deadline:
    if how == "preexec":
        subprocess.Popen(["/bin/true"], preexec_fn=lambda: None).wait()
    elif n % 30 == 0:
        subprocess.Popen(dying_with_parent(["true"], os.getpid()), start_new_session=True).wait()
    else:
        subprocess.Popen(["/bin/true"], start_new_session=True).wait()
    n += 1
stop.set()
for t in threads: t.join(10)
watch.stop(); client.close()
print("forked", n, flush=True)
"""

_FORK_HANDLER_LOG = "fork() handlers"  # gRPC core: "... skipping fork() handlers"


def _fork_beside_grpc(endpoint: str, tmp_path, *, how: str) -> tuple[bool, str, str]:
    """Run :data:`_FORKING_CHILD` (300 forks) in its own process group; (hung, out, err).

    A child still running after 20 s is taken as hung: the forks take ~3 s on 2 busy
    cores. Its group (the child and a fork stuck in gRPC's handlers) is then SIGKILLed."""
    script = tmp_path / "forking_child.py"
    script.write_text(_FORKING_CHILD)
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    env["GRPC_VERBOSITY"] = "INFO"
    with subprocess.Popen([sys.executable, str(script), endpoint, "300", "15", how], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=10)
            return True, out, err
    assert proc.returncode == 0, err[-3000:]
    return False, out, err


@pytest.mark.timeout(120)
def test_forking_beside_live_grpc_runs_no_grpc_fork_handlers(etcd_server, tmp_path):
    """gRPC's fork handlers (on, as grpcio ships them: forked children need them) run inside
    every fork() and, with gRPC busy, hang one made while holding the GIL (it froze a loaded
    test run for good). elasticd starts its processes without one (vfork, no handlers), so
    300 starts beside busy gRPC neither hang nor run them; the control run, with a
    ``preexec_fn``, shows the probe sees the handlers: they log that they ran, or the forks
    hang."""
    hung, out, err = _fork_beside_grpc(etcd_server.endpoint, tmp_path, how="elasticd")
    assert not hung, f"forking beside live gRPC hung; the child's stderr ends:\n{err[-2000:]}"
    assert "env-after-import None" in out, "elasticd must leave the workers' environment alone"
    assert "forked 300" in out, out
    assert _FORK_HANDLER_LOG not in err, err[-2000:]

    hung, out, err = _fork_beside_grpc(etcd_server.endpoint, tmp_path, how="preexec")
    assert hung or _FORK_HANDLER_LOG in err, "the probe did not see gRPC's fork handlers"


def _silence_on_the_server(handle) -> threading.Event:
    """Have etcd cancel a watch while python3-etcd3 keeps waiting on it: the stream stays up,
    the client is told nothing, and the watch delivers no more events (a silent watch).

    Returns an event set once etcd confirmed the cancel: the request travels on the watch
    stream's own thread, so a put made right after it could reach etcd first and be
    delivered by the watch before it went silent (seen under load)."""
    import etcd3.etcdrpc

    watcher, confirmed = handle.watcher, threading.Event()
    handle_response = watcher._handle_response

    def spy(rs):
        if rs.canceled and rs.watch_id == handle.watch_id:
            confirmed.set()
        return handle_response(rs)

    watcher._handle_response = spy
    rq = etcd3.etcdrpc.WatchRequest(
        cancel_request=etcd3.etcdrpc.WatchCancelRequest(watch_id=handle.watch_id))
    watcher._request_queue.put(rq)
    return confirmed


@pytest.mark.timeout(120)
def test_watch_health_check_recreates_a_silent_watch_without_loss_or_repeats(etcd_server):
    """Through a freeze (SIGSTOP), a kill and restart, and a watch etcd cancelled without telling
    the client, each change made afterwards is delivered within a bounded time, every change
    exactly once and in order; the silent watch is found by the health check and re-created."""
    client = EtcdClient(etcd_server.endpoint, timeout_s=1.0)
    rec = Recorder()
    watch = client.watch_prefix("/w/", rec.on_events, rec.on_resync, name="w",
                                health_interval_s=0.5)
    bound_s = 20.0
    try:
        assert watch.connected.wait(10)
        client.put("/w/0", b"before")
        wait_until(lambda: rec.saw("/w/0", b"before"), bound_s, "event before the faults")

        etcd_server.pause()
        try:
            with pytest.raises(EtcdUnavailableError):
                client.get("/x")  # a call timed out: python3-etcd3 opens a new stream
        finally:
            etcd_server.resume()
        wait_until(lambda: _works(client), bound_s, "calls to work after SIGCONT")
        client.put("/w/1", b"after-freeze")
        wait_until(lambda: rec.saw("/w/1", b"after-freeze"), bound_s, "event after the freeze")

        etcd_server.kill()
        etcd_server.start()
        wait_until(lambda: _works(client), bound_s, "calls to work after the restart")
        client.put("/w/2", b"after-restart")
        wait_until(lambda: rec.saw("/w/2", b"after-restart"), bound_s, "event after the restart")

        handle = wait_until(lambda: watch._watch_id, bound_s, "the watch to be connected")
        assert _silence_on_the_server(handle).wait(bound_s), "etcd did not confirm the cancel"
        client.put("/w/3", b"while-silent")
        client.delete("/w/0")
        t0 = time.monotonic()
        wait_until(lambda: rec.saw("/w/0", None), bound_s, "the silent watch to be re-created")
        assert time.monotonic() - t0 < bound_s
        assert watch.recreated >= 1, "the health check did not find the silent watch"
        with rec.lock:
            got = [(e.key, e.value) for e in rec.events]
            revisions = [e.mod_revision for e in rec.events]
        assert revisions == sorted(set(revisions)), f"events repeated or out of order: {revisions}"
        assert got == [("/w/0", b"before"), ("/w/1", b"after-freeze"), ("/w/2", b"after-restart"),
                       ("/w/3", b"while-silent"), ("/w/0", None)], got
        assert len(rec.resyncs) == 1, "a resumed watch replaced the consumer's view"
    finally:
        watch.stop()
        client.close()


_STARTS_ETCD = r"""
import sys
from elasticd.etcd.embedded import EmbeddedEtcd
server = EmbeddedEtcd(sys.argv[1]).start()
print("etcd", server.proc.pid, flush=True)
sys.stdin.read()  # until the test kills us
"""


@pytest.mark.timeout(60)
def test_an_embedded_etcd_dies_with_the_process_that_started_it(tmp_path):
    """The embedded etcd, started without a ``preexec_fn`` since issue 52, still gets
    SIGKILL from the kernel when its starter is SIGKILLed: no etcd outlives its agent."""
    from harness import wait_until

    from elasticd.process import pid_alive

    script = tmp_path / "starts_etcd.py"
    script.write_text(_STARTS_ETCD)
    with subprocess.Popen([sys.executable, str(script), str(tmp_path / "etcd")], text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # a log line may come first; the pid line ends them
        while line and not line.startswith("etcd "):
            line = proc.stdout.readline()
        assert line, "the starter exited without starting etcd"
        etcd_pid = int(line.split()[1])
        try:
            with open(f"/proc/{etcd_pid}/cmdline", "rb") as fh:
                assert b"etcd" in fh.read().split(b"\0")[0], "the trampoline did not exec etcd"
            proc.kill()
            proc.wait(10)
            wait_until(lambda: not pid_alive(etcd_pid), 10, "etcd outlived its starter")
        finally:
            if pid_alive(etcd_pid):
                os.kill(etcd_pid, signal.SIGKILL)


def test_an_embedded_etcd_whose_port_was_taken_starts_again_on_fresh_ports(etcd_server, tmp_path):
    """A first start whose client port another etcd took between ``free_port`` and the bind
    (a neighbouring job on a busy host) starts again on fresh ports: it serves its own data,
    not the neighbour's, and the neighbour's keys are untouched."""
    from elasticd.etcd.embedded import EmbeddedEtcd, listener_owned_by

    neighbour = EtcdClient(etcd_server.endpoint, timeout_s=2.0)
    neighbour.put("/neighbour/key", b"theirs")
    taken = int(etcd_server.endpoint.rsplit(":", 1)[1])
    ours = EmbeddedEtcd(str(tmp_path / "ours"))
    ours.client_port = taken  # what free_port handed out, taken since by the neighbour
    try:
        ours.start()
        assert ours.client_port != taken
        assert listener_owned_by(ours.proc.pid, ours.client_port) is True
        client = EtcdClient(ours.endpoint, timeout_s=2.0)
        try:
            assert client.get("/neighbour/key") is None, "the restarted etcd is the neighbour"
            client.put("/ours/key", b"ours")
        finally:
            client.close()
        assert "address already in use" in (tmp_path / "ours" / "etcd.log").read_text()
        assert neighbour.get("/ours/key") is None
        assert neighbour.get("/neighbour/key").value == b"theirs"
    finally:
        ours.stop()
        neighbour.close()


def test_a_restarted_embedded_etcd_keeps_its_ports_and_says_when_one_is_taken(tmp_path):
    """A restart keeps its ports (its clients know them): a taken port there is a clear
    EtcdUnavailableError quoting etcd's log, not a silent move to another port."""
    import socket

    from elasticd.etcd.embedded import EmbeddedEtcd

    e = EmbeddedEtcd(str(tmp_path / "e")).start()
    port = e.client_port
    e.kill()
    holder = socket.socket()
    # Our own connections to the killed etcd may leave the port in TIME_WAIT; etcd binds
    # with SO_REUSEADDR too, so only the listener below stands in its way.
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        with pytest.raises(EtcdUnavailableError, match="address already in use"):
            e.start()
        assert e.client_port == port
    finally:
        holder.close()
        e.stop()
