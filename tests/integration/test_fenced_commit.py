"""The fenced checkpoint commit end to end: real etcd, real handlers, the agent's control
channel, a real CheckpointManager writing files (issue: fencing)."""

from __future__ import annotations

import threading

import pytest
import torch
from harness import wait_until

from elasticd.agent.recorder import JobRecorder
from elasticd.checkpoint import CheckpointManager
from elasticd.checkpoint.catalog import list_checkpoints
from elasticd.control import ControlChannel, ControlClient
from elasticd.errors import FencedError
from elasticd.etcd.client import EtcdClient
from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler
from elasticd.rendezvous.settings import RendezvousSettings
from elasticd.worker.fence import AgentCommitFence

pytestmark = pytest.mark.timeout(90)


def _handler(etcd, name, min_nodes, ttl_s=2):
    client = EtcdClient(etcd.endpoint, timeout_s=2)
    settings = RendezvousSettings(min_nodes=min_nodes, max_nodes=2, node_ttl_s=ttl_s, join_timeout_s=30,
                                  last_call_timeout_s=0.5, local_addr="127.0.0.1")
    return EtcdRendezvousHandler(client, "fence", settings, node_id=name)


def _channel(recorder):
    return ControlChannel(
        on_commit=lambda m: recorder.commit_checkpoint(m.step, m.manifest_url, m.world_size, m.round),
        on_latest=recorder.latest_checkpoint).start()


def test_zombie_commit_is_refused_and_its_files_pruned(etcd_server, tmp_path):
    """A node frozen past its TTL while the job re-formed: its save's commit is refused, its
    files are deleted, and the pointer keeps naming the live job's newer checkpoint."""
    url = f"file://{tmp_path}/ckpt"
    a, b = _handler(etcd_server, "a", 2), _handler(etcd_server, "b", 2)
    infos = {}
    threads = [threading.Thread(target=lambda h=h: infos.__setitem__(h.node_id, h.next_rendezvous()))
               for h in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    round_ab = a.round
    rec_a, rec_b = JobRecorder(a.session), JobRecorder(b.session)
    chan_a, chan_b = _channel(rec_a), _channel(rec_b)
    try:
        zombie = CheckpointManager(url, job="fence", rank=0, world_size=1,
                                   fence=AgentCommitFence(ControlClient(chan_a.socket_path), round_ab))
        zombie.save(10, {"w": torch.ones(4)}, blocking=True)
        assert rec_a.latest_checkpoint().step == 10

        a.session.keeper.stop()  # node a freezes: no more keep-alives
        wait_until(lambda: b.num_nodes_waiting() > 0, 15, "b to see a's lease expire")
        b.settings = RendezvousSettings(min_nodes=1, max_nodes=2, node_ttl_s=2, join_timeout_s=30,
                                        last_call_timeout_s=0.5, local_addr="127.0.0.1")
        b.next_rendezvous()
        assert b.round > round_ab
        live = CheckpointManager(url, job="fence", rank=0, world_size=1,
                                 fence=AgentCommitFence(ControlClient(chan_b.socket_path), b.round))
        live.save(20, {"w": torch.full((4,), 2.0)}, blocking=True)

        # The zombie wakes up mid-job and finishes a save of a newer step.
        zombie.save(25, {"w": torch.full((4,), 9.0)})
        with pytest.raises(FencedError):
            zombie.wait()
        pointer = rec_b.latest_checkpoint()
        assert (pointer.step, pointer.round) == (20, b.round)
        steps = {i.step for i in list_checkpoints(url, "fence")}
        assert 25 not in steps, f"zombie files left: {steps}"
        template = {"w": torch.zeros(4)}
        loaded = live.load_latest(template)
        assert loaded.step == 20 and torch.equal(template["w"], torch.full((4,), 2.0))
        live.close()
    finally:
        for chan in (chan_a, chan_b):
            chan.close()
        for h in (a, b):
            h.shutdown()
            h.client.close()


def test_commit_without_an_answer_is_unknown_and_the_upload_is_kept(etcd_server, tmp_path):
    """etcd frozen: the commit is UNKNOWN (not refused), the save stays, no FencedError; the
    agent's retry commits it once etcd is back. A lease lost to the outage while the round is
    still ours is UNKNOWN too, never a zombie verdict."""
    from elasticd.agent.commits import CommitRetrier, PendingCommit
    from elasticd.checkpoint.api import CommitOutcome

    url = f"file://{tmp_path}/ckpt"
    a = _handler(etcd_server, "a", 1, ttl_s=30)  # the lease outlives the short freeze here
    a.next_rendezvous()
    rec = JobRecorder(a.session)
    retrier = CommitRetrier(lambda p: rec.commit_checkpoint(p.step, p.manifest_url, p.world_size, p.round),
                            initial_s=0.05, max_s=0.2)
    chan = ControlChannel(
        on_commit=lambda m: retrier.submit(PendingCommit(m.step, m.manifest_url, m.world_size, m.round,
                                                         a.round_state_revision)),
        on_latest=rec.latest_checkpoint).start()
    try:
        mgr = CheckpointManager(url, job="fence", rank=0, world_size=1,
                                fence=AgentCommitFence(ControlClient(chan.socket_path), a.round))
        mgr.save(1, {"w": torch.ones(4)}, blocking=True)
        etcd_server.pause()
        try:
            mgr.save(2, {"w": torch.full((4,), 2.0)}, blocking=True)  # raises nothing
            assert mgr.wait().outcome is CommitOutcome.UNKNOWN
            assert retrier.pending() is not None
        finally:
            etcd_server.resume()
        assert {i.step for i in list_checkpoints(url, "fence")} >= {2}, "the upload was deleted"
        wait_until(lambda: rec.latest_checkpoint().step == 2, 20, "the retry to commit step 2")

        a.session.keeper.stop(revoke=True)  # our lease is gone; the round state is unchanged
        outcome, reason = rec.commit_checkpoint(3, "u3", 1, a.round)
        assert outcome is CommitOutcome.UNKNOWN and "lease" in reason
        mgr.close()
    finally:
        retrier.close()
        chan.close()
        a.shutdown()
        a.client.close()


def test_commit_lands_while_the_next_round_is_open_and_not_after_it_formed(etcd_server):
    """A join (or a loss) opens the next round while a member's upload is in flight: nobody
    trains in the open round yet, so the save is still the job's newest state and its commit
    lands (it was refused, and the member restarted from an older checkpoint). Once the next
    round has formed, a commit from the old round is refused."""
    from elasticd.checkpoint.api import CommitOutcome
    from elasticd.records import RoundState

    a, b = _handler(etcd_server, "a", 2), _handler(etcd_server, "b", 2)
    threads = [threading.Thread(target=h.next_rendezvous) for h in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    old_round = a.round
    rec_a = JobRecorder(a.session)
    try:
        assert rec_a.commit_checkpoint(5, "u5", 2, old_round)[0] is CommitOutcome.COMMITTED
        opener = threading.Thread(target=b.next_rendezvous)  # b re-rendezvous: opens the next round
        opener.start()
        wait_until(lambda: RoundState.from_json(rec_a.client.get(rec_a.keys.rdzv_state).value).round
                   == old_round + 1, 15, "b to open the next round")
        outcome, reason = rec_a.commit_checkpoint(10, "u10", 2, old_round)
        assert outcome is CommitOutcome.COMMITTED, reason
        assert rec_a.latest_checkpoint().step == 10

        a.next_rendezvous()  # the next round forms with a and b
        opener.join(30)
        assert a.round == b.round == old_round + 1
        outcome, reason = rec_a.commit_checkpoint(11, "u11", 2, old_round)
        assert outcome is CommitOutcome.REFUSED, reason
        assert rec_a.latest_checkpoint().step == 10
    finally:
        for h in (a, b):
            h.shutdown()
            h.client.close()


def test_a_left_intent_commits_once_and_only_forward_under_its_round(etcd_server):
    """commit_intent (a previous agent's pending commit) shares the pointer's one
    compare-and-swap: it commits under the round it was made in, is idempotent, refuses a
    step that is not newer, and refuses once the round state moved on."""
    from elasticd.agent.commits import PendingCommit
    from elasticd.control.api import CommitOutcome

    h = _handler(etcd_server, "a", 1)
    try:
        h.next_rendezvous()
        rec = JobRecorder(h.session)
        rev = h.round_state_revision
        first = PendingCommit(10, "file:///c/step-10/manifest.json", 1, h.round, rev, "fence")
        assert rec.commit_intent(first) == (CommitOutcome.COMMITTED, "committed")
        assert rec.commit_intent(first) == (CommitOutcome.COMMITTED, "already committed")
        older = PendingCommit(5, "file:///c/step-5/manifest.json", 1, h.round, rev, "fence")
        outcome, why = rec.commit_intent(older)
        assert outcome is CommitOutcome.REFUSED and "not newer" in why
        stale = PendingCommit(20, "file:///c/step-20/manifest.json", 1, h.round, rev - 1, "fence")
        outcome, why = rec.commit_intent(stale)
        assert outcome is CommitOutcome.REFUSED and "no longer current" in why
        pointer = rec.latest_checkpoint()
        assert (pointer.step, pointer.round) == (10, h.round)
    finally:
        h.shutdown()
