"""EtcdRendezvousHandler and EtcdStore against a real etcd: handlers in threads, each with its
own EtcdClient, as separate nodes would be."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from datetime import timedelta

import pytest
import torch.distributed as dist
from harness import wait_until
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.utils import store as store_util

from elasticd.errors import ConfigError, EtcdUnavailableError
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.embedded import free_port
from elasticd.etcd.lease import LeaseKeeper
from elasticd.keys import JobKeys
from elasticd.records import NodeRecord
from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler, JobFinishedError
from elasticd.rendezvous.etcd_store import EtcdStore, RoundAbandonedError
from elasticd.rendezvous.finished import reopen_finished
from elasticd.rendezvous.protocol import LEFT_DRAINED, MembershipChange
from elasticd.rendezvous.registry import create_handler
from elasticd.rendezvous.settings import RendezvousSettings

pytestmark = pytest.mark.timeout(60)


class HandlerFactory:
    """Builds handlers, each with an EtcdClient of its own, as separate nodes would have."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.made: list[EtcdRendezvousHandler] = []
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="node")

    def make(self, job: str, node: str, *, etcd_timeout_s: float = 2.0,
             **kw) -> EtcdRendezvousHandler:
        kw = {"min_nodes": 1, "max_nodes": 4, "node_ttl_s": 2, "join_timeout_s": 20.0,
              "last_call_timeout_s": 0.5, "store_timeout_s": 10.0, "local_addr": "127.0.0.1",
              "start_settle_s": 0.0, **kw}
        client = EtcdClient(self.endpoint, timeout_s=etcd_timeout_s)
        handler = EtcdRendezvousHandler(client, job, RendezvousSettings(**kw), node_id=node)
        self.made.append(handler)
        return handler

    def join(self, hs: list[EtcdRendezvousHandler]) -> list[Future[RendezvousInfo]]:
        """Call next_rendezvous on every handler at once, each in a thread of its own."""
        return [self.pool.submit(h.next_rendezvous) for h in hs]

    def close(self) -> None:
        for h in self.made:
            h.shutdown()
            h.client.close()
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def handlers(module_etcd):
    """Handlers on the module's etcd; all shut down (and clients closed) after the test."""
    factory = HandlerFactory(module_etcd.endpoint)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def own_handlers(etcd_server):
    """Handlers on an etcd of the test's own, which the test may kill or stop."""
    factory = HandlerFactory(etcd_server.endpoint)
    try:
        yield factory
    finally:
        factory.close()


def results(futures: list[Future[RendezvousInfo]], timeout_s: float = 30) -> list[RendezvousInfo]:
    return [f.result(timeout=timeout_s) for f in futures]


def ranks(hs: list[EtcdRendezvousHandler], infos: list[RendezvousInfo]) -> dict[str, int]:
    return {h.node_id: info.rank for h, info in zip(hs, infos, strict=True)}


def elapsed(fn: Callable[[], object]) -> tuple[Exception | None, float]:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # returned to the test to assert on
        return exc, time.monotonic() - t0
    return None, time.monotonic() - t0


# --- rounds ---------------------------------------------------------------------------


def test_three_handlers_form_one_round_with_dense_ranks(handlers):
    """Three nodes joining at once get ranks 0..2, world size 3, the same round and store
    bootstrap info (MASTER_ADDR/PORT published by rank 0)."""
    hs = [handlers.make("r3", f"n{i}", min_nodes=3, max_nodes=3) for i in range(3)]
    infos = results(handlers.join(hs))
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}
    assert {h.round for h in hs} == {0}
    assert len({h.members for h in hs}) == 1
    assert {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos} \
        == {("127.0.0.1", infos[0].bootstrap_store_info.master_port)}
    for h, info in zip(hs, infos, strict=True):
        assert h.members[info.rank] == h.node_id
        assert h.num_nodes_waiting() == 0
    assert hs[0].get_run_id() == "r3" and hs[0].get_backend() == "etcd-v3"


def test_scale_up_new_node_is_admitted_and_ranks_stay_stable(handlers):
    """A 4th node arriving after round 0 makes num_nodes_waiting() > 0 on the members; after
    they re-rendezvous the world is 4 and earlier members keep their relative order."""
    hs = [handlers.make("up", f"n{i}", min_nodes=3, max_nodes=4) for i in range(3)]
    results(handlers.join(hs))
    before = hs[0].members
    late = handlers.make("up", "late", min_nodes=3, max_nodes=4)
    pending = handlers.join([late])
    wait_until(lambda: all(h.num_nodes_waiting() > 0 for h in hs), 10, "members to see the newcomer")
    assert "late" in hs[0].membership().reason
    assert all(h.membership().kind is MembershipChange.JOIN for h in hs), "a join is not join-only"
    infos = results(handlers.join(hs) + pending)
    everyone = [*hs, late]
    assert {i.world_size for i in infos} == {4}
    assert {h.round for h in everyone} == {1}
    after = hs[0].members
    assert [m for m in after if m in before] == list(before), f"{before} -> {after}"
    assert ranks(everyone, infos)["late"] == 3
    assert all(h.num_nodes_waiting() == 0 for h in everyone)


def test_scale_down_graceful_leave_is_seen_at_once(handlers):
    """shutdown() of one node revokes its lease: the others see num_nodes_waiting() > 0 well
    before its TTL (10 s) could expire, and re-form at world 2 with their order kept."""
    hs = [handlers.make("down", f"n{i}", min_nodes=2, max_nodes=3, node_ttl_s=10) for i in range(3)]
    form_round(handlers, hs, world=3)
    before = hs[0].members
    leaver = next(h for h in hs if h.node_id == before[1])
    rest = [h for h in hs if h is not leaver]
    t0 = time.monotonic()
    leaver.leave_kind = LEFT_DRAINED  # what elasticd's agent sets when it drains and leaves
    leaver.shutdown()
    wait_until(lambda: all(h.num_nodes_waiting() > 0 for h in rest), 5, "survivors to see the leave")
    assert time.monotonic() - t0 < 3.0, "a graceful leave waited for the lease TTL"
    assert before[1] in rest[0].membership().reason
    assert rest[0].membership().kind is MembershipChange.MEMBER_LEFT, "a clean leave read as a loss"
    infos = results(handlers.join(rest))
    assert {i.world_size for i in infos} == {2}
    assert list(rest[0].members) == [m for m in before if m != before[1]]


@pytest.mark.parametrize("departure", ["drained", "lost"])
def test_a_member_gone_before_the_rank_exchange_ends_the_others_wait_at_once(handlers, departure):
    """A member that leaves (or dies) just after its round became final never writes its
    part of torch's rank exchange: the others' blocking store read ends within seconds with
    RoundAbandonedError naming the departure, not after store_timeout (the live spot replay:
    seven nodes idle for minutes), and their next rendezvous forms a round without it."""
    hs = [handlers.make(f"gone-{departure}", f"n{i}", min_nodes=1, max_nodes=2, node_ttl_s=2,
                        store_timeout_s=45.0) for i in range(2)]
    # min_nodes=1: the first to register may close round 0 alone; drive both, as torch's
    # agent does, until they share one round of 2.
    infos = form_round(handlers, hs, world=2)
    stay, leaver = hs[0], hs[1]
    store, formed = infos[0].store, stay.round
    if departure == "drained":
        leaver.leave_kind = LEFT_DRAINED
        leaver.shutdown()
    else:  # its lease runs out: no keep-alive, no leave record
        leaver.session.keeper.stop()  # type: ignore[union-attr]
    err, took = elapsed(lambda: store.get(f"rank_info/{leaver.node_id}"))  # never written
    assert isinstance(err, RoundAbandonedError), err
    assert leaver.node_id in str(err), err
    assert took < 15.0, f"the read waited {took:.1f}s for a gone member"
    info = results(handlers.join([stay]))[0]
    assert info.world_size == 1 and stay.round == formed + 1 and stay.members == ("n0",)


def test_finished_node_is_not_a_lost_member_and_the_job_does_not_reform(handlers):
    """shutdown() as torch's launch_agent calls it (the node is done): the others see no
    membership change (their workers finish too), and one that re-rendezvous reads the
    job as closed instead of waiting for a round that never completes."""
    hs = [handlers.make("fin", f"n{i}", min_nodes=2, max_nodes=2) for i in range(2)]
    form_round(handlers, hs, world=2)
    done, slow = hs
    done.shutdown()  # default leave_kind: finished
    wait_until(lambda: done.node_id not in slow.view().alive, 5, "the lease revoked")
    wait_until(lambda: slow.view().left.get(slow.round), 5, "the leave record seen")
    assert slow.num_nodes_waiting() == 0, slow.membership().reason
    with pytest.raises(RendezvousClosedError, match="completed the job"):
        slow.next_rendezvous()


def test_a_finished_job_is_closed_before_a_lost_member_reopens_it(handlers):
    """Regression (soak seed 777000): a node whose workers finished closes the job at once
    (mark_finished), so a member whose lease expires while the job finishes and a late
    joiner open no new round: the joiner is refused and the round stays the finished one."""
    hs = [handlers.make("finlost", f"n{i}", min_nodes=1, max_nodes=4) for i in range(2)]
    form_round(handlers, hs, world=2)
    finished_round = hs[0].round
    coordinator = next(h for h in hs if h.view().coordinator == h.node_id)
    lost = next(h for h in hs if h is not coordinator)
    assert coordinator.mark_finished() and coordinator.closed_written
    lost.session.keeper.stop()  # its lease runs out, as during an etcd freeze
    late = handlers.make("finlost", "late", min_nodes=1, max_nodes=4)
    joined = handlers.pool.submit(late.next_rendezvous)
    wait_until(lambda: lost.node_id not in coordinator.view().alive, 10, "the lease to expire")
    exc = joined.exception(timeout=10)
    assert isinstance(exc, RendezvousClosedError), exc
    state = coordinator.view().state
    assert state is not None and state.round == finished_round, state
    assert coordinator.num_nodes_waiting() == 0


def test_frozen_node_is_dropped_when_its_lease_expires(handlers):
    """A node whose keep-alives stop (frozen process) is seen as lost by the others within
    about its TTL, and they re-form without it."""
    hs = [handlers.make("frozen", f"n{i}", min_nodes=2, max_nodes=3) for i in range(3)]
    form_round(handlers, hs, world=3)
    frozen, rest = hs[2], hs[:2]
    t0 = time.monotonic()
    frozen.session.keeper.stop()  # no revoke: the lease must run out on the server, as for a frozen node
    wait_until(lambda: all(h.num_nodes_waiting() > 0 for h in rest), 10, "survivors to see the loss")
    took = time.monotonic() - t0
    assert took < 2 + 3.0, f"loss seen after {took:.1f}s with a 2 s TTL"
    infos = results(handlers.join(rest))
    assert {i.world_size for i in infos} == {2}
    assert frozen.node_id not in rest[0].members


def test_restarted_process_with_same_node_id_does_not_inherit_its_seat(handlers):
    """Regression: a node's process killed and restarted under the same node id before its
    lease expired gets a new incarnation and a new round that every member joins; it used to
    take the old process's rank in the running round at once, unseen by the others."""
    hs = [handlers.make("reborn", f"n{i}", min_nodes=2, max_nodes=2, node_ttl_s=10) for i in range(2)]
    results(handlers.join(hs))
    dead = hs[1]
    dead.session.keeper._stop.set()  # SIGKILL: keep-alives and watches stop, the lease lives on
    for w in dead._watches:
        w.stop()
    reborn = handlers.make("reborn", dead.node_id, min_nodes=2, max_nodes=2, node_ttl_s=10)
    pending = handlers.join([reborn])
    wait_until(lambda: hs[0].num_nodes_waiting() > 0, 5, "the survivor to see the restart")
    infos = results(handlers.join([hs[0]]) + pending)
    assert {i.world_size for i in infos} == {2}
    assert hs[0].round == reborn.round == 1
    assert reborn.incarnation != dead.incarnation, "the old process's fencing token stays valid"


def _foreign_record(module_etcd, job: str, node: str, *, keep_alive: bool):
    """A node record for ``node`` written by "another machine": a client, a lease (kept
    alive or not) and a record naming another host. Returns (client, keeper or None)."""
    client = EtcdClient(module_etcd.endpoint, timeout_s=2.0)
    lease = client.grant_lease(2)
    record = NodeRecord(node=node, host="other-host", pid=1, version="0", started_at=time.time())
    client.put(JobKeys(job).node(node), record.to_json(), lease=lease)
    keeper = LeaseKeeper(client, lease, 2).start() if keep_alive else None
    return client, keeper


def test_duplicate_node_id_on_a_live_machine_is_refused(handlers, module_etcd):
    """A node id held by a live agent elsewhere (its lease kept alive past a full TTL) is
    refused with a ConfigError naming the id, the other host and the fix; the record stays."""
    client, keeper = _foreign_record(module_etcd, "dup", "n0", keep_alive=True)
    try:
        h = handlers.make("dup", "n0", min_nodes=1, max_nodes=1)
        exc, took = elapsed(h.next_rendezvous)
        assert isinstance(exc, ConfigError), exc
        assert "'n0'" in str(exc) and "other-host" in str(exc) and "--node-id" in str(exc)
        assert 2.0 <= took < 10.0, took
        assert client.get(JobKeys("dup").node("n0")) is not None, "the live agent's record was touched"
    finally:
        keeper.stop(revoke=True)
        client.close()


def test_node_id_of_a_vanished_machine_is_taken_over_after_its_lease(handlers, module_etcd):
    """A replacement machine that reuses the node id of one that vanished (its lease no
    longer kept alive) waits for that lease to expire, then joins normally."""
    client, _ = _foreign_record(module_etcd, "vanished", "n0", keep_alive=False)
    try:
        h = handlers.make("vanished", "n0", min_nodes=1, max_nodes=1)
        info = results(handlers.join([h]))[0]
        assert (info.rank, info.world_size) == (0, 1)
    finally:
        client.close()


def test_stop_request_ends_a_waiting_next_rendezvous(handlers):
    """stop_requested (set from a signal handler) makes a node waiting for peers leave
    next_rendezvous with RendezvousGracefulExitError within about a second."""
    h = handlers.make("stopwait", "n0", min_nodes=2, max_nodes=2)
    pending = handlers.join([h])[0]
    wait_until(lambda: "n0" in h.view().joins.get(0, ()), 10, "the node to join round 0")
    t0 = time.monotonic()
    h.stop_requested = "SIGTERM received"
    exc = pending.exception(timeout=10)
    assert isinstance(exc, RendezvousGracefulExitError), exc
    assert "SIGTERM received" in str(exc) and time.monotonic() - t0 < 3.0


def test_closed_job_refuses_next_rendezvous(handlers):
    """set_closed() is seen by every node (is_closed), and next_rendezvous then raises
    RendezvousClosedError at once, for members and newcomers alike."""
    hs = [handlers.make("closed", f"n{i}", min_nodes=2, max_nodes=2) for i in range(2)]
    results(handlers.join(hs))
    assert not hs[1].is_closed()
    hs[0].set_closed()
    wait_until(lambda: all(h.is_closed() for h in hs), 5, "both nodes to see the close")
    newcomer = handlers.make("closed", "late", min_nodes=2, max_nodes=2)
    assert newcomer.is_closed(), "a handler that never joined reads the closed flag from etcd"
    for h in [*hs, newcomer]:
        exc, took = elapsed(h.next_rendezvous)
        assert isinstance(exc, RendezvousClosedError), exc
        assert took < 5.0
    assert hs[0].num_nodes_waiting() == 0, "a closed job asks nobody to re-rendezvous"


def test_finished_job_is_not_reopened_by_a_node_that_arrives(handlers):
    """Regression (issue 25 item 1): a node arriving at a finished job (closed, nobody
    live) gets JobFinishedError naming when and in which round it finished and how to
    reopen it; it registers nothing. Only reopen_finished (`elasticd start`) runs it again."""
    first = handlers.make("reuse", "a", min_nodes=1, max_nodes=1)
    results(handlers.join([first]))
    first.set_closed()
    first.shutdown()
    again = handlers.make("reuse", "b", min_nodes=1, max_nodes=1)
    exc, took = elapsed(again.next_rendezvous)
    assert isinstance(exc, JobFinishedError), exc
    assert (exc.finished.round, exc.finished.node) == (0, "a") and exc.finished.finished_at
    assert "finished" in str(exc) and "`elasticd start --job reuse`" in str(exc), str(exc)
    assert took < 5.0
    assert again.client.get(JobKeys("reuse").node("b")) is None, "the refused node registered"
    keys = JobKeys("reuse")
    assert reopen_finished(again.client, keys).reopened
    late = handlers.make("reuse", "c", min_nodes=1, max_nodes=1)
    info = results(handlers.join([late]))[0]
    assert (info.rank, info.world_size, late.round) == (0, 1, 0)
    assert not late.is_closed()


def test_reopen_is_refused_while_a_node_is_live_and_never_wipes_a_new_round(handlers):
    """`elasticd start` on a job whose last agents are still leaving reopens nothing; a
    second, stale reopen (guarded by the close's revision) never wipes the round that the
    first reopen let form."""
    keys = JobKeys("rerun")
    old = handlers.make("rerun", "old", min_nodes=1, max_nodes=1)
    results(handlers.join([old]))
    old.set_closed()
    refused = reopen_finished(old.client, keys)
    assert (refused.reopened, refused.live) == (False, ("old",))
    old.shutdown()
    closed = old.client.get(keys.rdzv_closed)
    assert reopen_finished(old.client, keys).reopened
    fresh = handlers.make("rerun", "fresh", min_nodes=1, max_nodes=1)
    results(handlers.join([fresh]))
    state = fresh.client.get(keys.rdzv_state)
    # A reopen racing ours read the same close: its guarded delete must do nothing.
    assert not fresh.client.delete_prefixes_if(keys.rdzv_closed, mod_revision=closed.mod_revision,
                                               prefixes=[keys.rdzv_prefix, keys.store_root])
    assert fresh.client.get(keys.rdzv_state) == state
    assert not reopen_finished(fresh.client, keys).reopened, "a job that is not finished was reopened"


def test_join_timeout_raises_rendezvous_timeout(handlers):
    """Too few nodes for min_nodes: next_rendezvous raises RendezvousTimeoutError at
    join_timeout, naming the job and the sizes."""
    h = handlers.make("lonely", "solo", min_nodes=2, max_nodes=2, join_timeout_s=1.5)
    exc, took = elapsed(h.next_rendezvous)
    assert isinstance(exc, RendezvousTimeoutError), exc
    assert 1.5 <= took < 1.5 + 2.0
    assert "lonely" in str(exc) and "2..2" in str(exc)


def test_etcd_restart_mid_run_keeps_lease_and_watch(own_handlers, etcd_server):
    """etcd killed and restarted between rounds: nobody is counted as lost, and the same
    handlers (same leases, re-established watches) complete another round."""
    hs = [own_handlers.make("restart", f"n{i}", min_nodes=2, max_nodes=2) for i in range(2)]
    results(own_handlers.join(hs))
    leases = [h.lease_id for h in hs]
    etcd_server.kill()
    assert all(h.num_nodes_waiting() == 0 for h in hs), "an etcd outage looked like a lost peer"
    etcd_server.start()
    infos = results(own_handlers.join(hs))
    assert {i.world_size for i in infos} == {2}
    assert {h.round for h in hs} == {1}
    assert [h.lease_id for h in hs] == leases, "a lease was replaced across the etcd restart"
    assert not any(h.lease_lost.is_set() for h in hs)


def test_etcd_gone_raises_connection_error_within_deadline(own_handlers, etcd_server):
    """With etcd stopped for good, next_rendezvous raises RendezvousConnectionError naming
    the endpoint by join_timeout (+ one call), both for a member and for a new node."""
    kw = {"min_nodes": 2, "max_nodes": 2, "join_timeout_s": 2.0, "etcd_timeout_s": 1.0}
    hs = [own_handlers.make("gone", f"n{i}", **kw) for i in range(2)]
    results(own_handlers.join(hs))
    etcd_server.stop()
    newcomer = own_handlers.make("gone", "late", **kw)
    for h in (hs[0], newcomer):
        exc, took = elapsed(h.next_rendezvous)
        assert isinstance(exc, RendezvousConnectionError), exc
        assert took < 2.0 + 1.0 + 2.0, f"took {took:.1f}s"
        assert etcd_server.endpoint in str(exc)


# --- the registry: torch's RendezvousParameters in, a handler or a ConfigError out -----


def params(endpoint: str, job: str = "cfg", **conf) -> RendezvousParameters:
    return RendezvousParameters(backend="etcd-v3", endpoint=endpoint, run_id=job, min_nodes=1,
                                max_nodes=2, local_addr="127.0.0.1", **conf)


def test_registry_builds_a_working_handler(module_etcd):
    """create_handler with torch's RendezvousParameters (and rdzv-conf numbers as strings)
    builds a handler that completes a round."""
    h = create_handler(params(module_etcd.endpoint, "reg", node_ttl="2", join_timeout="10",
                              last_call_timeout="0.2", node_id="only"))
    try:
        info = h.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert h.settings.node_ttl_s == 2 and h.node_id == "only"
    finally:
        h.shutdown()
        h.client.close()


def test_registry_handler_closes_its_own_client_on_shutdown(module_etcd):
    """Regression (issue 25 item 3): shutdown() of a handler that create_handler built
    closes the EtcdClient it owns (no channel or threads left behind), while a handler
    given a client by its caller leaves that client open."""
    before = set(threading.enumerate())
    h = create_handler(params(module_etcd.endpoint, "owned", node_ttl="2", join_timeout="10",
                              node_id="only"))
    h.next_rendezvous()
    h.shutdown()
    with pytest.raises(EtcdUnavailableError, match="closed"):
        h.client.get(JobKeys("owned").rdzv_state)
    wait_until(lambda: not [t for t in threading.enumerate() if t not in before and t.is_alive()],
               10, lambda: f"the handler's threads to end: "
               f"{[t.name for t in threading.enumerate() if t not in before]}")
    client = EtcdClient(module_etcd.endpoint, timeout_s=2.0)
    try:
        mine = EtcdRendezvousHandler(client, "owned2", RendezvousSettings(1, 1, node_ttl_s=2),
                                     node_id="mine")
        mine.next_rendezvous()
        mine.shutdown()
        assert client.get(JobKeys("owned2").rdzv_state) is not None, "the caller's client was closed"
    finally:
        client.close()


def test_torch_etcd_backend_timeout_key_sets_join_timeout():
    """Regression: rdzv-conf `timeout` (torch's etcd backend name for the join timeout) is
    honoured, not silently ignored; `join_timeout` wins when both are given."""
    for conf, expected in [({}, 600.0), ({"timeout": "42"}, 42.0),
                           ({"timeout": "42", "join_timeout": "7"}, 7.0)]:
        h = create_handler(params("127.0.0.1:2379", **conf))
        assert h.settings.join_timeout_s == expected, conf
        h.client.close()


def test_unreachable_endpoint_fails_clearly_in_bounded_time():
    """An endpoint where nothing listens: next_rendezvous raises RendezvousConnectionError
    naming the endpoint within join_timeout (+ one call)."""
    endpoint = f"127.0.0.1:{free_port()}"
    h = create_handler(params(endpoint, join_timeout="2", etcd_timeout="1"))
    try:
        exc, took = elapsed(h.next_rendezvous)
        assert isinstance(exc, RendezvousConnectionError), exc
        assert endpoint in str(exc) and "refused" in str(exc), str(exc)
        assert took < 2 + 1 + 2.0, f"took {took:.1f}s"
    finally:
        h.shutdown()
        h.client.close()


@pytest.mark.parametrize(
    ("job", "conf", "needle"),
    [
        ("cfg", {"ca_file": "/nonexistent/ca.pem"}, "/nonexistent/ca.pem"),
        ("cfg", {"cert_file": "/nonexistent/c.pem", "key_file": "/nonexistent/k.pem"}, "/nonexistent/"),
        ("cfg", {"cert_file": "/nonexistent/c.pem"}, "both a certificate and its key"),
        ("a/b", {}, "invalid job name"),
        ("..", {}, "invalid job name"),
        ("cfg", {"join_timout": "5"}, "join_timout"),
        ("cfg", {"node_ttl": "1"}, "node_ttl"),
        ("cfg", {"join_timeout": "soon"}, "join_timeout"),
        ("cfg", {"last_call_timeout": "-1"}, "last_call_timeout"),
        ("cfg", {"password": "x"}, "user"),
        ("cfg", {"password_file": "/nonexistent/pw"}, "password_file"),
        ("cfg", {"node_id": "a/b"}, "node id"),
    ],
)
def test_bad_parameters_are_config_errors(job, conf, needle):
    """Bad TLS paths, job name, unknown rdzv-conf key, node_ttl < 2, non-numbers, half
    credentials and bad node ids fail at creation with a ConfigError naming the problem."""
    with pytest.raises(ConfigError) as info:
        create_handler(params("127.0.0.1:2379", job, **conf))
    assert needle in str(info.value)


def test_bad_endpoint_is_a_config_error():
    """A malformed endpoint fails at creation with a ConfigError showing the expected form."""
    with pytest.raises(ConfigError, match="invalid port"):
        create_handler(params("localhost:notaport"))


# --- the c10d store on etcd ------------------------------------------------------------


@pytest.fixture
def stores(module_etcd, request):
    """``stores.make(round)``: EtcdStores of this test's own job, each with a client of its
    own; all closed after the test."""

    class Factory:
        def __init__(self) -> None:
            self.made: list[tuple[EtcdStore, EtcdClient]] = []
            self.keys = JobKeys(f"st-{request.node.name[:50]}".replace("[", "-").replace("]", ""))

        def make(self, round_: int = 0, timeout_s: float = 5.0) -> EtcdStore:
            client = EtcdClient(module_etcd.endpoint, timeout_s=2.0)
            store = EtcdStore(client, self.keys.store_prefix(round_), timeout_s=timeout_s)
            self.made.append((store, client))
            return store

    factory = Factory()
    try:
        yield factory
    finally:
        for store, client in factory.made:
            store.close()
            client.close()


def test_store_set_get_check_delete_num_keys(stores):
    """set/get round-trip bytes and str, check/num_keys see keys, delete_key removes one."""
    s = stores.make()
    s.set("a", b"\x00\x01")
    s.set("b", "text")
    assert s.get("a") == b"\x00\x01" and s.get("b") == b"text"
    assert s.check(["a", "b"]) and not s.check(["a", "nope"])
    assert s.num_keys() == 2
    assert s.delete_key("a") is True
    assert s.delete_key("a") is False
    assert not s.check(["a"]) and s.num_keys() == 1


def test_store_get_blocks_until_another_store_sets(stores):
    """get() on one store returns a value set later through another store (another node)."""
    reader, writer = stores.make(), stores.make()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(reader.get, "later")
        writer.set("later", b"v")
        assert pending.result(timeout=10) == b"v"


def test_store_get_and_wait_time_out(stores):
    """get() of a missing key times out after the store timeout, wait() after its own
    timeout, both with DistStoreError naming the key."""
    s = stores.make(timeout_s=0.5)
    exc, took = elapsed(lambda: s.get("missing"))
    assert isinstance(exc, dist.DistStoreError) and "missing" in str(exc)
    assert 0.5 <= took < 2.5
    exc, took = elapsed(lambda: s.wait(["missing2"], timedelta(seconds=0.3)))
    assert isinstance(exc, dist.DistStoreError) and "missing2" in str(exc)
    assert 0.3 <= took < 2.3
    s.set("there", b"1")
    s.wait(["there"], timedelta(seconds=5))


def test_store_add_is_atomic_across_stores(stores):
    """add() from two stores in parallel loses no increment (compare-and-swap)."""
    a, b = stores.make(), stores.make()
    assert a.add("n", 0) == 0

    def bump(store: EtcdStore) -> None:
        for _ in range(10):
            store.add("n", 1)

    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(bump, a), pool.submit(bump, b)]:
            f.result(timeout=30)
    assert a.add("n", 5) == 25
    assert int(b.get("n")) == 25


def test_store_reads_are_never_stale(stores):
    """Regression: get/multi_get/wait answer from etcd, not from a lagging watch cache, so a
    completed write (ours or another node's) is always seen and a deleted key is gone."""
    a, b = stores.make(), stores.make()
    for i in range(20):
        a.set("k", str(i))
        assert a.get("k") == str(i).encode(), "a store did not read its own write"
        assert b.multi_get(["k"]) == [str(i).encode()], "another store read a stale value"
    b.delete_key("k")
    exc, _ = elapsed(lambda: a.wait(["k"], timedelta(seconds=0.3)))
    assert isinstance(exc, dist.DistStoreError), "wait() returned for a deleted key"


def test_store_compare_set_follows_torch_semantics(stores):
    """compare_set: missing key with empty expectation sets; missing key with a non-empty
    expectation returns it untouched; a mismatch returns the current value; a match swaps."""
    s = stores.make()
    assert s.compare_set("k", "x", "y") == b"x" and not s.check(["k"])
    assert s.compare_set("k", "", "first") == b"first"
    assert s.compare_set("k", "wrong", "second") == b"first"
    assert s.compare_set("k", "first", "second") == b"second"
    assert s.get("k") == b"second"


def test_store_multi_get_and_multi_set(stores):
    """multi_set writes every pair and multi_get returns values in key order."""
    s = stores.make()
    s.multi_set(["x", "y", "z"], [b"1", "2", b"3"])
    assert s.multi_get(["z", "x", "y"]) == [b"3", b"1", b"2"]


def test_store_multi_set_is_one_revision_and_bootstrap_info_agrees_with_torch(stores):
    """multi_set is one transaction (every key at one revision: a reader sees all or none).
    bootstrap_info: a rank that asks before rank 0 has published waits for it, and every
    rank, torch's own RendezvousStoreInfo.build on the same store included, gets rank 0's
    address and port."""
    from torch.distributed.elastic.rendezvous import RendezvousStoreInfo

    s = stores.make()
    s.multi_set(["a", "b"], [b"1", b"2"])
    kvs, _ = stores.made[0][1].get_prefix(stores.keys.store_prefix(0))
    assert len({kv.mod_revision for kv in kvs}) == 1 and len(kvs) == 2

    r0, r1, torch_r2 = stores.make(3), stores.make(3), stores.make(3)
    with ThreadPoolExecutor(2) as pool:
        early = pool.submit(r1.bootstrap_info, 1, None)  # blocks: nothing published yet
        torch_view = pool.submit(RendezvousStoreInfo.build, 2, torch_r2, None)
        assert not early.done()
        mine = r0.bootstrap_info(0, "127.0.0.1")
        got = [f.result(timeout=10) for f in (early, torch_view)]
    assert mine.master_addr == "127.0.0.1" and 0 < mine.master_port < 65536
    assert {(i.master_addr, i.master_port) for i in got} == {(mine.master_addr, mine.master_port)}


def test_store_timeout_property_and_prefix_isolation(stores):
    """set_timeout/timeout round-trip (torch's store_timeout helper), and stores of two
    rounds never see each other's keys."""
    r0, r1 = stores.make(0), stores.make(1)
    r0.set_timeout(timedelta(seconds=7))
    assert r0.timeout == timedelta(seconds=7)
    r0.set("MASTER_ADDR", b"old")
    assert not r1.check(["MASTER_ADDR"]) and r1.num_keys() == 0


def test_torch_barrier_across_two_stores(stores):
    """torch's store_util.barrier over two EtcdStores (two nodes) releases both; with one
    participant missing it times out."""
    a, b = stores.make(), stores.make()
    with ThreadPoolExecutor(2) as pool:
        fs = [pool.submit(store_util.barrier, s, 2, "bar/", 10) for s in (a, b)]
        for f in fs:
            f.result(timeout=20)
    assert a.timeout == timedelta(seconds=5), "barrier did not restore the store timeout"
    exc, took = elapsed(lambda: store_util.barrier(a, 2, "lonely/", 0.5))
    assert isinstance(exc, dist.DistStoreError), exc
    assert took < 3.0


def test_torch_prefix_store_wraps_etcd_store(stores):
    """The C++ PrefixStore calls into EtcdStore's Python methods (set/get/add/check)."""
    s = dist.PrefixStore("pfx", stores.make())
    s.set("k", "v")
    assert s.get("k") == b"v"
    assert s.add("c", 3) == 3
    assert s.check(["k"])


# --- bounded key space -------------------------------------------------------------------


def test_key_count_stays_bounded_over_50_rounds(handlers, module_etcd):
    """50 re-rendezvous rounds of 2 nodes: rounds are consecutive (no spurious rounds) and the
    job's key count under /elasticd/<job>/ stays below 30 and does not grow after round 25."""
    hs = [handlers.make("soak", f"n{i}", min_nodes=2, max_nodes=2) for i in range(2)]
    counter = EtcdClient(module_etcd.endpoint, timeout_s=2.0)
    prefix = JobKeys("soak").prefix
    gate = threading.Barrier(2, timeout=20)
    counts: dict[int, int] = {}

    def node(h: EtcdRendezvousHandler) -> list[int]:
        seen = []
        for i in range(50):
            info = h.next_rendezvous()
            assert info.world_size == 2
            seen.append(h.round)
            gate.wait()  # both nodes are in round i
            if h is hs[0] and i in (24, 49):
                counts[i] = counter.count_prefix(prefix)
            gate.wait()  # counted before anyone opens round i+1
        return seen

    try:
        rounds = [f.result(timeout=50) for f in [handlers.pool.submit(node, h) for h in hs]]
    finally:
        gate.abort()
        counter.close()
    assert rounds[0] == rounds[1] == list(range(50))
    assert counts[49] < 30, f"{counts[49]} keys after 50 rounds"
    assert counts[49] <= counts[24], f"key count grew: {counts[24]} -> {counts[49]}"


# --- helpers ------------------------------------------------------------------------------


def form_round(factory, hs: list[EtcdRendezvousHandler], world: int,
               timeout_s: float = 20.0) -> list[RendezvousInfo]:
    """Drive the handlers as torch's agent does (re-rendezvous while num_nodes_waiting() > 0)
    until all of them are in one round of ``world`` nodes."""
    futures = {h: factory.pool.submit(h.next_rendezvous) for h in hs}
    deadline = time.monotonic() + timeout_s
    while True:
        done = {h: f for h, f in futures.items() if f.done()}
        infos = {h: f.result() for h, f in done.items()}  # re-raises a handler's error
        if len(infos) == len(hs) and {i.world_size for i in infos.values()} == {world} \
                and len({h.round for h in hs}) == 1:
            return [infos[h] for h in hs]
        for h in done:
            if h.num_nodes_waiting() > 0:
                futures[h] = factory.pool.submit(h.next_rendezvous)
        if time.monotonic() > deadline:
            state = {h.node_id: (h.round, h.members) for h in hs}
            raise AssertionError(f"no round of {world} nodes within {timeout_s}s: {state}")
        pending = [f for f in futures.values() if not f.done()]
        # Poll interval: num_nodes_waiting() is read from each handler's local watch cache.
        wait_futures(pending, timeout=0.05, return_when=FIRST_COMPLETED) if pending \
            else threading.Event().wait(0.05)


def test_resurrection_is_fenced_by_the_round_state(handlers):
    """A node re-registering in its round after an etcd outage (``register(round_rev=)``)
    gets its record on a new lease while the round state is unchanged, and nothing once another
    node opened the next round, however stale its own view (the soak: it trained on in
    the old round beside the new one)."""
    from elasticd.records import RoundState

    h = handlers.make("fenced-resurrect", "n0")
    results(handlers.join([h]))
    key, rev = JobKeys("fenced-resurrect").node("n0"), h.session.state_rev
    before = h.lease_id
    assert h.session.register(time.monotonic() + 10, round_rev=rev) is True
    record = h.client.get(key)
    assert record is not None and record.lease == h.lease_id != before
    moved = RoundState(1, "open", ["n0"], 1, 4, opened_at=time.time(), cause="member_lost",
                       changed=["n0"])
    assert h.client.put_if(h.keys.rdzv_state, moved.to_json(), mod_revision=rev)
    kept = h.client.get(key)
    assert h.session.register(time.monotonic() + 10, round_rev=rev) is False
    now = h.client.get(key)
    assert now is not None and kept is not None
    assert (now.create_revision, now.lease) == (kept.create_revision, kept.lease), \
        "a fenced-out re-registration wrote the node record"

def _lease_lost_after(h: EtcdRendezvousHandler, other: EtcdClient, state) -> int:
    """Put ``state`` as the round state, wait for ``h`` to see it, revoke ``h``'s lease and
    wait for it to notice; returns the revoked lease."""
    assert other.put_if(h.keys.rdzv_state, state.to_json(), mod_revision=h.session.state_rev)
    wait_until(lambda: h.view().state is not None and h.view().state.round == state.round, 10,
               f"the handler's watch to see round {state.round}")
    lost = h.lease_id
    other.revoke_lease(lost)
    wait_until(h.lease_lost.is_set, 10, "the keep-alive to find the lease gone")
    return lost


def _etcd_trouble_seen(h: EtcdRendezvousHandler, etcd_server) -> None:
    """etcd trouble as ``h`` sees it: one of its calls times out."""
    etcd_server.pause()
    try:
        with pytest.raises(EtcdUnavailableError):
            h.client.get(h.keys.rdzv_state)
    finally:
        etcd_server.resume()


@pytest.mark.timeout(60)
def test_a_lease_lost_to_an_outage_after_the_round_moved_says_it_is_not_resurrected(own_handlers,
                                                                                     etcd_server):
    """A node whose lease expired while the job formed a round without it (soak seed 74008:
    a peer opened the next round the moment etcd came back, and it closed) is not
    re-registered in its old round; after etcd trouble it says so (``lease_not_resurrected``,
    the event docs/failure-model.md names) and rejoins as a new member. A node whose lease
    went while etcd was fine (it was frozen itself) says nothing of the kind."""
    from structlog.testing import capture_logs

    from elasticd.records import RoundState

    h = own_handlers.make("moved", "n0", etcd_timeout_s=0.5)
    results(own_handlers.join([h]))
    other = EtcdClient(etcd_server.endpoint, timeout_s=2.0)
    try:
        moved = RoundState(1, "final", ["n1"], 1, 4, opened_at=time.time(), completed_at=time.time(),
                           cause="member_lost", changed=["n0"])
        _lease_lost_after(h, other, moved)
        with capture_logs() as frozen:
            assert h.try_resurrect() is False
        assert not [e for e in frozen if e["event"] == "lease_not_resurrected"], frozen
        _etcd_trouble_seen(h, etcd_server)
        with capture_logs() as outage:
            assert h.try_resurrect() is False
        (said,) = [e for e in outage if e["event"] == "lease_not_resurrected"]
        assert said["round"] == 0 and "moved on" in said["reason"], said
    finally:
        other.close()


@pytest.mark.timeout(60)
def test_a_lease_lost_to_an_outage_while_the_next_round_is_open_with_us_is_resurrected(own_handlers,
                                                                                        etcd_server):
    """Soak seed 74015: etcd froze, every lease expired, and the peer whose lease came back
    first opened the next round with us among its previous members. Nobody formed a round
    without us, so we re-register (a new lease), our workers and their newest state are
    kept, and the handler reports the open round as a newer round to re-form into. The
    re-registration is fenced by the open state's revision (not our old round's: that one
    would refuse it), as ``test_resurrection_is_fenced_by_the_round_state`` shows."""
    from structlog.testing import capture_logs

    from elasticd.records import RoundState
    from elasticd.rendezvous.protocol import MembershipChange

    h = own_handlers.make("reopened", "n0", etcd_timeout_s=0.5)
    results(own_handlers.join([h]))
    key = h.keys.node("n0")
    other = EtcdClient(etcd_server.endpoint, timeout_s=2.0)
    try:
        opened = RoundState(1, "open", ["n0"], 1, 4, opened_at=time.time(), cause="member_lost",
                            changed=["n0"])
        lost = _lease_lost_after(h, other, opened)
        with capture_logs() as frozen:  # etcd was fine: we were away, a new member
            assert h.try_resurrect() is False
        assert not [e for e in frozen if e["event"] == "lease_resurrected"], frozen
        _etcd_trouble_seen(h, etcd_server)
        with capture_logs() as outage:
            assert h.try_resurrect() is True
        (said,) = [e for e in outage if e["event"] == "lease_resurrected"]
        assert "round 1 is open" in said["reason"], said
        record = other.get(key)
        assert record is not None and record.lease == h.lease_id != lost
        assert not h.lease_lost.is_set()
        assert h.round == 0
        change = h.membership()  # the open round (its cause: our loss) is one to re-form into
        assert change.count >= 1 and change.kind is not MembershipChange.LEASE_LOST, change

    finally:
        other.close()


@pytest.mark.timeout(30)
def test_rendezvous_store_bounds_what_it_accepts(etcd_client):
    """elasticd's etcd-backed c10d store refuses a value over 64 KiB (nothing is written)
    and an add on a key that holds no counter, instead of storing or parsing either."""
    from elasticd.rendezvous.etcd_store import EtcdStore

    store = EtcdStore(etcd_client, "/elasticd/bound/store/0/", timeout_s=5)
    with pytest.raises(ValueError, match="limit"):
        store.set("big", b"x" * (1 << 20))
    assert etcd_client.get("/elasticd/bound/store/0/big") is None
    store.set("k", b"ok")
    assert store.get("k") == b"ok"
    store.set("junk", b"9" * 5000)
    with pytest.raises(ValueError, match="counter"):
        store.add("junk", 1)
    assert store.add("n", 2) == 2
