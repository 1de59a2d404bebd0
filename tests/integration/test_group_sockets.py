"""Live re-formation wakes a collective stuck in any of the worker's process groups, not
only the world group: a group made after ``init()`` (HSDP's subgroups from
``init_device_mesh``, a script's own ``new_group``) records the sockets it opened.

Found in the suite: an HSDP survivor's rank 0 waited in a subgroup collective on rank 1,
which had left for the re-formation; every world-group socket was shut down ("count": 3)
and the wait went on until the live bound, so both survivors were restarted from the
checkpoint instead of re-forming in place."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from harness import ROOT

from elasticd.etcd.embedded import free_port

SCRIPT = ROOT / "tests" / "workers" / "subgroup_wake.py"
GROUP_TIMEOUT_S = 60


@pytest.mark.timeout(150)
def test_a_collective_stuck_in_a_subgroup_on_a_survivor_is_woken(tmp_path):
    """Rank 0 in an all-reduce of subgroup {0, 1} that rank 1 never enters: shutting down the
    connections ``group_sockets()`` names (the world's and the subgroup's) ends it with a
    connection error long before the group's 60 s timeout."""
    port = free_port()
    procs = []
    for rank in range(3):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "TORCHELASTIC_"))}
        env.update(RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OUT=str(tmp_path),
                   GROUP_TIMEOUT_S=str(GROUP_TIMEOUT_S))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT)], env=env, cwd=str(tmp_path),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        outputs = [p.communicate(timeout=3 * GROUP_TIMEOUT_S)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(o[-2000:] for o in outputs)
    result = json.loads((tmp_path / "rank0.json").read_text())
    print(result)
    assert result["group_sockets"] > result["world_sockets"], result  # the subgroup's are known
    assert result["shut_down"], result
    assert result["error"], f"the all-reduce returned although rank 1 never entered it: {result}"
    assert result["seconds"] < GROUP_TIMEOUT_S / 2, f"woken by the timeout, not the shutdown: {result}"
