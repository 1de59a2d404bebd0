"""Each measured per-event cost, projected to a 7B-parameter HSDP job on 16 nodes x 8 GPUs.

The local runs (3 CPU nodes, gloo, a small model) measure the control plane: detection,
rendezvous, a drain's hand-off. What a GPU job adds is made of a few parts, each scaled
here from what it is made of, every number beside its source (``SOURCES``):

- **state**: 7e9 parameters x 16 bytes (bf16 weights and gradients, fp32 master weights
  and two Adam moments: ZeRO's 16 bytes per parameter) = 112 GB per replica. HSDP shards
  it over a node's 8 GPUs and replicates it across the 16 nodes, so a node holds a whole
  replica and losing one node loses no state.
- **peer transfer** (live re-formation: a joiner receives a replica from a peer node):
  112 GB over the node's NICs at ``nic_gbps`` x ``nic_efficiency`` (GPU i of the joiner
  receives shard i from GPU i of a peer, one rail each).
- **checkpoint read / write** (the restart path, torchrun): 112 GB per node from object
  storage at ``s3_gbps`` x ``s3_efficiency``; a drain on the restart path writes one
  replica before it leaves.
- **NCCL communicators**: ``nccl_init_s`` per re-formation (HSDP's shard and replicate
  groups), assumed; **compile warm-up**: ``compile_cold_s`` on a node that never compiled
  the model, ``compile_cached_s`` for a restarted process with the node's compile cache.
- **worker start**: ``worker_cold_start_s`` (a new agent and worker up to its first step),
  ``standby_start_s`` (elasticd's warm standby, imports done).

Per system and event (``project``): the control-plane part of the local measurement is
kept (for elasticd, its phases; for torchrun, which reports no phases, the whole local
figure minus a local worker's cold start ``local_worker_start_s``) and the GPU parts are
added as that system's path needs them:

===========  ============================  =================================  ==============================
event        elasticd live                 elasticd restart                   torchrun
===========  ============================  =================================  ==============================
kill         + NCCL                        + standby + ckpt read + cached       + cold worker + ckpt read +
                                           compile + NCCL                      cached compile + NCCL
drain        + NCCL                        + ckpt write + standby + ckpt read   (no notice: a kill)
                                           + cached compile + NCCL
join (new)   cold worker + cold compile    cold worker + cold compile + ckpt    the same as elasticd restart
             + peer transfer + NCCL        read + NCCL
members'     peer transfer + NCCL          ckpt write + standby + ckpt read +   cold worker + ckpt read +
pause                                      cached compile + NCCL               cached compile + NCCL
cold start   cold worker + cold compile + ckpt read + NCCL (every system)
===========  ============================  =================================  ==============================
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from benchmarks.spotbench.model import SystemCosts

#: Where each assumption comes from (printed beside the projected table).
SOURCES = {
    "params": "the job: a 7B-parameter model",
    "bytes_per_param": "16 B/param for mixed-precision Adam (2 bf16 weights + 2 bf16 grads + "
                       "12 fp32 master/momentum/variance): Rajbhandari et al., ZeRO (SC'20), sec. 3.1",
    "nic_gbps": "3,200 Gb/s EFA per p5.48xlarge (8 x H100): AWS EC2 P5 instance specifications",
    "nic_efficiency": "assumed: 80 % of line rate for large RDMA transfers",
    "s3_gbps": "100 Gb/s from one EC2 instance to S3 with parallel requests: AWS S3 "
               "performance guidelines",
    "s3_efficiency": "assumed: 80 % of that for a ranged multi-stream read/write",
    "nccl_init_s": "assumed 2 s for 128 ranks (HSDP's two groups); stock NCCL bootstrap grows "
                   "super-linearly, ~265 s at 96k GPUs: Si et al., NCCLX (arXiv 2510.20171)",
    "compile_cold_s": "assumed 60 s: torch.compile of a 7B decoder with no cache (not measured "
                      "here; replace with a measurement)",
    "compile_cached_s": "assumed 15 s: the same with the node's inductor/FX graph cache warm",
    "worker_cold_start_s": "measured 11.0 s: `elasticd run` launch -> first step, H200 "
                           "(docs/benchmarks.md, GPU figures b)",
    "standby_start_s": "measured 0.96 s: the H200 worker restart with a warm standby, 1.96 s "
                       "minus restart.backoff_s = 1 s (GPU figures c)",
    "local_worker_start_s": "measured 2.87 s: a cold worker start on the local VM, subtracted from "
                            "torchrun's local figures (docs/benchmarks.md, History)",
}


@dataclass(frozen=True)
class GpuJob:
    """The projected job and the hardware it runs on; see ``SOURCES`` for every value."""

    params: float = 7e9
    bytes_per_param: float = 16.0
    nodes: int = 16
    gpus_per_node: int = 8
    nic_gbps: float = 3200.0
    nic_efficiency: float = 0.8
    s3_gbps: float = 100.0
    s3_efficiency: float = 0.8
    nccl_init_s: float = 2.0
    compile_cold_s: float = 60.0
    compile_cached_s: float = 15.0
    worker_cold_start_s: float = 11.0
    standby_start_s: float = 0.96
    local_worker_start_s: float = 2.87

    @property
    def state_bytes(self) -> float:
        """One replica of the training state (HSDP: what one node holds)."""
        return self.params * self.bytes_per_param

    @property
    def peer_transfer_s(self) -> float:
        return self.state_bytes * 8 / (self.nic_gbps * 1e9 * self.nic_efficiency)

    @property
    def ckpt_read_s(self) -> float:
        return self.state_bytes * 8 / (self.s3_gbps * 1e9 * self.s3_efficiency)

    @property
    def ckpt_write_s(self) -> float:
        return self.ckpt_read_s

    def parts(self) -> dict[str, float]:
        """The derived parts, for the table beside the projection."""
        return {"state GB per node": self.state_bytes / 1e9, "peer transfer s": self.peer_transfer_s,
                "checkpoint read s": self.ckpt_read_s, "checkpoint write s": self.ckpt_write_s,
                "NCCL init s": self.nccl_init_s, "compile cold s": self.compile_cold_s,
                "compile cached s": self.compile_cached_s}


#: Phases of elasticd's local trials that are the worker's (replaced by the GPU parts);
#: the rest (detection, stop, rendezvous, drain hand-off) is the control plane and is kept.
WORKER_PHASES = frozenset({"re-form + state + first step", "worker ready", "first step",
                           "new agent start-up"})


def control_s(trials: list[dict], system: str, scenario: str, *, skip: frozenset[str] = frozenset()) -> float:
    """Median over recovered trials of the control-plane phases (all but the worker's and
    ``skip``). Raises ``ValueError`` when no trial has phases."""
    sums = [sum(v for k, v in t["phases"].items() if k not in WORKER_PHASES | skip)
            for t in trials if t["system"] == system and t["scenario"] == scenario
            and t.get("recovered") and t.get("phases")]
    if not sums:
        raise ValueError(f"no recovered {scenario!r} trial of {system!r} with phases")
    return max(statistics.median(sums), 0.0)


def project(costs: SystemCosts, trials: list[dict], job: GpuJob) -> SystemCosts:
    """``costs`` (measured locally) as the 7B HSDP job would pay them (see the module doc)."""
    g = job
    restart_gpu = g.standby_start_s + g.ckpt_read_s + g.compile_cached_s + g.nccl_init_s
    cold_gpu = g.worker_cold_start_s + g.compile_cold_s + g.ckpt_read_s + g.nccl_init_s
    name = costs.name.split(" (")[0]
    if name == "elasticd-live":
        kill = control_s(trials, name, "sigkill") + g.nccl_init_s
        drain = control_s(trials, name, "sigterm") + g.nccl_init_s
        # The joiner's own local "detection" is its agent's start under load: replaced by
        # the GPU worker's cold start.
        rdzv = control_s(trials, name, "join", skip=frozenset({"detection"}))
        pause = rdzv + g.peer_transfer_s + g.nccl_init_s
        join = rdzv + g.worker_cold_start_s + g.compile_cold_s + g.peer_transfer_s + g.nccl_init_s
    elif name == "elasticd":
        kill = control_s(trials, name, "sigkill") + restart_gpu
        drain = control_s(trials, name, "sigterm") + g.ckpt_write_s + restart_gpu
        rdzv = control_s(trials, name, "join", skip=frozenset({"detection", "drain"}))
        pause = rdzv + g.ckpt_write_s + restart_gpu
        join = rdzv + cold_gpu
    else:  # torchrun: no phases; the local figure minus a local worker's cold start
        restart_torch = g.worker_cold_start_s + g.ckpt_read_s + g.compile_cached_s + g.nccl_init_s
        ctl = lambda s: max(s - g.local_worker_start_s, 0.0)  # noqa: E731
        kill = ctl(costs.kill_s) + restart_torch
        drain = 0.0
        pause = ctl(costs.join_pause_s) + restart_torch
        join = ctl(costs.join_s) + cold_gpu
    return replace(costs, kill_s=kill, drain_s=drain if costs.uses_notice else 0.0, join_s=join,
                   join_pause_s=pause, cold_start_s=join)
