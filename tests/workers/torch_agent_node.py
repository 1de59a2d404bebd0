"""One node run by torch's own ``LocalElasticAgent`` on the etcd-v3 handler, as torch's
agent tests do (``workers_drift_fail``: ``exit_barrier_timeout=0``), and shut down as
torch's ``launch_agent`` does (``rdzv_handler.shutdown()`` once ``run()`` returned).

Usage: python torch_agent_node.py ENDPOINT RUN_ID NNODES SCRIPT
"""

import sys

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

import elasticd.rendezvous  # noqa: F401  (registers etcd-v3)


def main() -> int:
    endpoint, run_id, nnodes, script = sys.argv[1:5]
    params = RendezvousParameters("etcd-v3", endpoint, run_id, int(nnodes), int(nnodes),
                                  local_addr="127.0.0.1", node_ttl=2, join_timeout=30)
    handler = registry.create_handler(params)
    spec = WorkerSpec(role="default", local_world_size=1, rdzv_handler=handler,
                      entrypoint=sys.executable, args=(script,), max_restarts=1,
                      monitor_interval=0.2, local_addr="127.0.0.1")
    agent = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(), start_method="spawn",
                              exit_barrier_timeout=0)
    try:
        result = agent.run()
    finally:
        handler.shutdown()
    print(f"agent result: {result.state.name}", flush=True)
    return 1 if result.is_failed() else 0


if __name__ == "__main__":
    sys.exit(main())
