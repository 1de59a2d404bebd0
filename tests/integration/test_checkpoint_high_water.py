"""The job's high-water step travels in the etcd pointer: real etcd, a real rendezvous
handler, the agent's recorder and control channel, a CheckpointManager on local files.

Issue 11 section 2: a new round that resumes from an older checkpoint moves the pointer
back; retention used to read "newer than the pointer" as "never committed" and deleted
the intact, committed newer checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from elasticd.agent.recorder import JobRecorder
from elasticd.checkpoint import CheckpointManager
from elasticd.checkpoint.catalog import list_checkpoints
from elasticd.control import ControlChannel, ControlClient
from elasticd.etcd.client import EtcdClient
from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler
from elasticd.rendezvous.settings import RendezvousSettings
from elasticd.worker.fence import AgentCommitFence

pytestmark = pytest.mark.timeout(90)


def test_pointer_moved_back_by_a_new_round_keeps_the_newer_committed_save(etcd_server, tmp_path):
    """Round 1 commits 100 and 200, round 2 commits 150: the pointer's high water stays 200
    and pruning (past the grace period) keeps the intact step-200 checkpoint."""
    url = f"file://{tmp_path}/ckpt"
    client = EtcdClient(etcd_server.endpoint, timeout_s=2)
    settings = RendezvousSettings(min_nodes=1, max_nodes=1, node_ttl_s=2, join_timeout_s=30,
                                  last_call_timeout_s=0.2, local_addr="127.0.0.1")
    handler = EtcdRendezvousHandler(client, "hw", settings, node_id="a")
    recorder = JobRecorder(handler.session)
    recorder.run_id = "c" * 16
    channel = ControlChannel(
        on_commit=lambda m: recorder.commit_checkpoint(m.step, m.manifest_url, m.world_size,
                                                       m.round),
        on_latest=recorder.latest_checkpoint).start()
    clock = [1000.0]
    try:
        handler.next_rendezvous()
        first = handler.round
        old = CheckpointManager(url, job="hw", rank=0, world_size=1, keep_last=1, grace_s=10,
                                clock=lambda: clock[0], run_id="c" * 16,
                                fence=AgentCommitFence(ControlClient(channel.socket_path), first))
        old.save(100, {"w": torch.ones(4)}, blocking=True)
        old.save(200, {"w": torch.full((4,), 2.0)}, blocking=True)

        handler.next_rendezvous()  # a restart: the job re-forms in a new round
        assert handler.round > first
        new = CheckpointManager(url, job="hw", rank=0, world_size=1, keep_last=1, grace_s=10,
                                clock=lambda: clock[0], run_id="c" * 16,
                                fence=AgentCommitFence(ControlClient(channel.socket_path),
                                                       handler.round))
        new.save(150, {"w": torch.full((4,), 1.5)}, blocking=True)
        pointer = recorder.latest_checkpoint()
        assert (pointer.step, pointer.highest_step, pointer.run_id) == (150, 200, "c" * 16)

        clock[0] += 3600
        new.prune()
        steps = {i.step for i in list_checkpoints(url, "hw") if i.valid}
        assert 200 in steps and 150 in steps, steps
        old.close()
        new.close()
    finally:
        channel.close()
        handler.shutdown()
        client.close()
