"""Watch fan-out of the rendezvous (issue 15 §3): one coordinator sees every join and lease,
everyone else only the state key, so a round costs O(N) watch events, not O(N^2); and the
coordinator's loss is a member loss that a newly elected coordinator turns into a round."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import wait_until

from elasticd.etcd.client import EtcdClient
from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler
from elasticd.rendezvous.protocol import Attribution, MembershipChange, attribute_failure
from elasticd.rendezvous.settings import RendezvousSettings

pytestmark = pytest.mark.timeout(60)


def watch_events_sent(endpoint: str) -> float:
    """etcd's own count of watch events sent to watchers (its /metrics)."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("etcd_debugging_mvcc_events_total"))


@pytest.fixture
def nodes(etcd_server):
    """make(n, job): n handlers of one job, each with its own client; all shut down after."""
    made: list[EtcdRendezvousHandler] = []
    pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="node")

    def make(n: int, job: str, min_nodes: int = 2) -> list[EtcdRendezvousHandler]:
        settings = RendezvousSettings(min_nodes=min_nodes, max_nodes=n, node_ttl_s=2, join_timeout_s=30.0,
                                      last_call_timeout_s=0.5, store_timeout_s=10.0,
                                      local_addr="127.0.0.1")
        hs = [EtcdRendezvousHandler(EtcdClient(etcd_server.endpoint, timeout_s=2.0), job, settings,
                                    node_id=f"n{i}") for i in range(n)]
        made.extend(hs)
        return hs

    make.pool = pool  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for h in made:
            h.shutdown()
            h.client.close()
        pool.shutdown(wait=True, cancel_futures=True)


def test_a_round_costs_linear_watch_events(nodes, etcd_server):
    """Eight nodes form a round with at most 12 watch events per node in all, store
    included (the design before the coordinator sent 190-250: every registration and join
    to every node), and only the coordinator holds the node and join keys."""
    hs = nodes(8, "fanout", min_nodes=8)  # one round of all 8, however the joins interleave
    before = watch_events_sent(etcd_server.endpoint)
    infos = [f.result(timeout=30) for f in [nodes.pool.submit(h.next_rendezvous) for h in hs]]
    assert sorted(i.rank for i in infos) == list(range(8))
    sent = watch_events_sent(etcd_server.endpoint) - before
    assert sent <= 12 * len(hs), f"{sent:.0f} watch events for a round of {len(hs)}"
    views = [h.view() for h in hs]
    coordinators = [h.node_id for h, v in zip(hs, views, strict=True) if v.full]
    assert len(coordinators) == 1 and all(v.coordinator == coordinators[0] for v in views)
    partial = [v for v in views if not v.full]
    assert all(not v.alive and set(v.joins) <= {0} for v in partial)


def test_a_job_wide_worker_failure_costs_linear_watch_events(nodes, etcd_server):
    """Every node of a round of 8 reports a worker failure: the reports reach only the
    coordinator, whose one verdict reaches everyone (at most 3 watch events per node; with
    every node watching every report it was 8), and the nodes agree on one root cause."""
    hs = nodes(8, "fanout-failure", min_nodes=8)
    [f.result(timeout=30) for f in [nodes.pool.submit(h.next_rendezvous) for h in hs]]
    before = watch_events_sent(etcd_server.endpoint)
    [f.result(timeout=30) for f in [nodes.pool.submit(h.report_failure, "exit 1") for h in hs]]

    def verdicts() -> list[Attribution]:
        return [attribute_failure(h.view(), h.round, h.node_id)[0] for h in hs]

    wait_until(lambda: Attribution.UNDECIDED not in verdicts(), timeout_s=15,
               what="every node to attribute the failure")
    assert sorted(v.value for v in verdicts()) == sorted(
        [Attribution.ROOT.value] + [Attribution.VICTIM.value] * 7)
    sent = watch_events_sent(etcd_server.endpoint) - before
    assert sent <= 3 * len(hs), f"{sent:.0f} watch events for a failure of {len(hs)} nodes"


def test_lost_coordinator_is_reported_and_replaced(nodes):
    """The coordinator freezes (keep-alives stop): the others report it as a lost member
    (MEMBER_LOST, named), a new coordinator is elected among them, and they re-form."""
    hs = nodes(3, "lost-coordinator")
    [f.result(timeout=30) for f in [nodes.pool.submit(h.next_rendezvous) for h in hs]]
    name = hs[0].view().coordinator
    coordinator = next(h for h in hs if h.node_id == name)
    others = [h for h in hs if h is not coordinator]
    # Frozen, as far as etcd can tell: no keep-alive, no coordinating, no revoke.
    coordinator._coordinator.stop()  # noqa: SLF001 - simulating a freeze
    coordinator.session.keeper.stop()
    wait_until(lambda: all(h.membership().kind is MembershipChange.MEMBER_LOST for h in others),
               timeout_s=15, what="survivors to report the lost coordinator")
    assert all(name in h.membership().reason for h in others)
    infos = [f.result(timeout=30) for f in [nodes.pool.submit(h.next_rendezvous) for h in others]]
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
    assert others[0].view().coordinator in {h.node_id for h in others}
