"""elasticd's training-side API (see docs/worker-api.md).

``init()`` sets up the process group from torchrun's environment; ``ElasticSampler``
shards one global data order by (rank, world size); ``should_stop()`` makes every rank
stop at the same step on a drain; ``report_progress()`` feeds hang detection and status;
``CheckpointManager`` (elasticd.checkpoint) saves and resumes at any world size.
"""

from elasticd.data import (
    BatchPlan,
    ElasticBatchSampler,
    ElasticDistributedSampler,
    ElasticSampler,
    PositionedBatchSampler,
    PositionedSampler,
    SampleKey,
    SeededDataset,
    accumulation_contexts,
    plan_global_batch,
    sample_generator,
    sample_seed,
)
from elasticd.worker.context import (
    WorkerContext,
    control_client,
    current_context,
    fast_exit,
    init,
    report_progress,
    should_stop,
    shutdown,
    stop_requested_locally,
)
from elasticd.worker.fence import AgentCommitFence, agent_fence
from elasticd.worker.live import LiveState, Reformed
from elasticd.worker.loop import ElasticLoop
from elasticd.worker.mesh import elastic_mesh
from elasticd.worker.peer_replica import DEFAULT_EVERY_STEPS as DEFAULT_PEER_REPLICA_EVERY
from elasticd.worker.sharded import ShardedModel

__all__ = [
    "AgentCommitFence",
    "BatchPlan",
    "DEFAULT_PEER_REPLICA_EVERY",
    "ElasticBatchSampler",
    "ElasticDistributedSampler",
    "ElasticLoop",
    "ElasticSampler",
    "LiveState",
    "ShardedModel",
    "Reformed",
    "PositionedBatchSampler",
    "PositionedSampler",
    "SampleKey",
    "SeededDataset",
    "accumulation_contexts",
    "agent_fence",
    "elastic_mesh",
    "plan_global_batch",
    "sample_generator",
    "sample_seed",
    "WorkerContext",
    "current_context",
    "control_client",
    "fast_exit",
    "init",
    "report_progress",
    "should_stop",
    "shutdown",
    "stop_requested_locally",
]
