"""elasticd's training-side API (see docs/worker-api.md).

``init()`` sets up the process group from torchrun's environment; ``ElasticSampler``
shards one global data order by (rank, world size); ``should_stop()`` makes every rank
stop at the same step on a drain; ``report_progress()`` feeds hang detection and status;
``CheckpointManager`` (elasticd.checkpoint) saves and resumes at any world size.
"""

from elasticd.worker.context import (
    WorkerContext,
    context,
    control_client,
    init,
    report_progress,
    should_stop,
    shutdown,
    stop_requested_locally,
)

__all__ = [
    "WorkerContext",
    "context",
    "control_client",
    "init",
    "report_progress",
    "should_stop",
    "shutdown",
    "stop_requested_locally",
]
