"""Valid world sizes (issue 24 item 2) with real etcd, agents and gloo workers: a node
that would make an invalid world size waits as a spare instead of failing the round."""

from __future__ import annotations

import signal
import time
from collections import Counter

import pytest
from harness import ROOT, agent_events, end_job, read_jsonl, trained_samples, wait_until

from elasticd.keys import JobKeys
from elasticd.records import NodeRecord, RoundState

SCRIPT = str(ROOT / "examples" / "train.py")
DATASET, BATCH, EPOCH = 40, 2, 20  # 20 steps an epoch
STEPS = 100_000  # the job ends on the test's word (--end-file) after the admission
pytestmark = pytest.mark.timeout(180)


def _round(etcd_client, keys: JobKeys) -> RoundState | None:
    kv = etcd_client.get(keys.rdzv_state)
    return RoundState.from_json(kv.value) if kv is not None else None


def _records(etcd_client, keys: JobKeys) -> dict[str, NodeRecord]:
    kvs, _ = etcd_client.get_prefix(keys.nodes_prefix)
    return {kv.key.rsplit("/", 1)[-1]: NodeRecord.from_json(kv.value) for kv in kvs}


def test_a_batch_of_two_trains_at_two_with_a_spare_admitted_on_a_kill(nodes, etcd_client,
                                                                     tmp_path):
    """Three agents, --nnodes 1:3, a global batch of 2 (--global-batch 2): two train, the
    third waits as `spare` saying why (today it joined at world 3 and exited 78); SIGKILL
    of a member -> the spare is in the next round at once, its worker a warm standby
    (imports done); the job completes with every
    sample of every epoch trained exactly once, and no agent exited 78."""
    job, keys = "sizes", JobKeys("sizes")
    trace, end = tmp_path / "trace.jsonl", tmp_path / "end"
    args = ["--steps", str(STEPS), "--dataset-size", str(DATASET), "--global-batch", str(BATCH),
            "--micro-batch", "1", "--dtype", "float64", "--step-sleep", "0.05",
            "--trace", str(trace), "--end-file", str(end)]
    extra = ["--global-batch", str(BATCH), "--checkpoint-url", f"file://{tmp_path}/ckpt"]
    started = {n: nodes.start(job, SCRIPT, name=n, nnodes="1:3", extra=extra, script_args=args)
               for n in ("n0", "n1", "n2")}

    def spare() -> str | None:
        return next((n for n, r in _records(etcd_client, keys).items() if r.state == "spare"), None)

    wait_until(lambda: spare() is not None and len(read_jsonl(trace)) >= 4, 90,
               lambda: f"two training and a spare: {_records(etcd_client, keys)}")
    name = spare()
    assert name is not None
    record = _records(etcd_client, keys)[name]
    assert "largest valid size (2 nodes; valid sizes 1,2)" in record.spare_reason, record
    state = _round(etcd_client, keys)
    assert state is not None and state.phase == "final" and len(state.members) == 2
    assert name not in state.members

    victim = state.members[-1]
    started[victim].signal(signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: (s := _round(etcd_client, keys)) is not None and s.round > state.round
               and s.phase == "final" and name in s.members, 30,
               lambda: f"the spare admitted: {_round(etcd_client, keys)}")
    admitted_s = time.monotonic() - killed_at
    # A warm spare: its worker is the standby its agent started on arrival (imports done).
    def after_admission() -> str:
        text = started[name].log()
        return text[text.index('"spare_admitted"'):]

    new_round = _round(etcd_client, keys).round  # type: ignore[union-attr]
    wait_until(lambda: any((r["round"] or 0) >= new_round for r in read_jsonl(trace)), 60,
               "a step in the round with the spare")
    steps = end_job(end, trace, epoch_steps=EPOCH)
    assert '"standby_handed_over"' in after_admission(), after_admission()[-3000:]
    # "At once": the round closes when the survivor and the spare joined (the largest
    # valid size), not after a last call or a lease TTL; bounded loosely for a loaded box.
    assert admitted_s < 10, admitted_s
    survivors = [n for n in started if n != victim]
    for n in survivors:
        assert started[n].wait(120) == 0, started[n].log()[-3000:]
    for n in survivors:
        worlds = {e["nnodes"] for e in agent_events(started[n].log(), "rendezvous_completed")}
        assert worlds <= {1, 2}, (n, worlds)  # never an invalid round of three
    epochs = steps // EPOCH
    assert trained_samples(trace) == Counter(
        {(e, i): 1 for e in range(epochs) for i in range(DATASET)})
