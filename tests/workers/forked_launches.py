"""Two nodes forked from a process that already talked to etcd, each run by torch's own
launcher API (``elastic_launch``) on the etcd-v3 handler, as torch's agent tests and
frameworks that launch agents in-process do.

The process first completes a one-node rendezvous of its own (job ``warmup``) and keeps
its handler (its etcd channel, lease and watches live) until the end; meanwhile it forks (``multiprocessing``'s "fork") two nodes of
job ``forked`` (two nodes, one worker each, ``SCRIPT``) and waits for them. Each prints
``node I finished`` when ``elastic_launch`` returned.

Usage: python forked_launches.py ENDPOINT SCRIPT
"""

import multiprocessing as mp
import sys
import time

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

import elasticd.rendezvous  # noqa: F401  (registers etcd-v3)


def warm_up(endpoint: str) -> RendezvousHandler:
    params = RendezvousParameters("etcd-v3", endpoint, "warmup", 1, 1, local_addr="127.0.0.1",
                                  node_ttl=2, join_timeout=30)
    handler = registry.create_handler(params)
    info = handler.next_rendezvous()
    print(f"warm-up rendezvous: world {info.world_size}", flush=True)
    return handler


def node(i: int, endpoint: str, script: str) -> None:
    config = LaunchConfig(min_nodes=2, max_nodes=2, nproc_per_node=1, run_id="forked",
                          rdzv_backend="etcd-v3", rdzv_endpoint=endpoint,
                          rdzv_configs={"node_ttl": 2, "join_timeout": 60}, max_restarts=0,
                          monitor_interval=0.2, start_method="spawn", local_addr="127.0.0.1")
    elastic_launch(config, sys.executable)(script)
    print(f"node {i} finished", flush=True)


def main() -> int:
    endpoint, script = sys.argv[1:3]
    handler = warm_up(endpoint)
    try:
        ctx = mp.get_context("fork")
        nodes = [ctx.Process(target=node, args=(i, endpoint, script)) for i in range(2)]
        started = time.monotonic()
        for p in nodes:
            p.start()
        for p in nodes:
            p.join()
    finally:
        handler.shutdown()
    print(f"nodes exited {[p.exitcode for p in nodes]} after {time.monotonic() - started:.1f} s",
          flush=True)
    return 0 if all(p.exitcode == 0 for p in nodes) else 1


if __name__ == "__main__":
    sys.exit(main())
