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
from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler, RendezvousSettings
from elasticd.worker.fence import AgentCommitFence

pytestmark = pytest.mark.timeout(90)


def _handler(etcd, name, min_nodes):
    client = EtcdClient(etcd.endpoint, timeout_s=2)
    settings = RendezvousSettings(min_nodes=min_nodes, max_nodes=2, node_ttl_s=2, join_timeout_s=30,
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
    rec_a, rec_b = JobRecorder(a), JobRecorder(b)
    chan_a, chan_b = _channel(rec_a), _channel(rec_b)
    try:
        zombie = CheckpointManager(url, job="fence", rank=0, world_size=1,
                                   fence=AgentCommitFence(ControlClient(chan_a.socket_path), round_ab))
        zombie.save(10, {"w": torch.ones(4)}, blocking=True)
        assert rec_a.latest_checkpoint().step == 10

        a._keeper.stop()  # node a freezes: no more keep-alives
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
