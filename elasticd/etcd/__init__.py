"""etcd access: the hardened client and everything around it.

- ``client.py``: ``EtcdClient``, the only module that calls python3-etcd3 (bounded calls,
  error translation, endpoint fail-over).
- ``txn.py``: typed transaction compares (``ModRevision``, ``CreateRevision``) and
  operations (``Put``, ``Delete``, ``DeletePrefix``) for ``EtcdClient.txn``.
- ``watch.py``: ``PrefixWatch``, a prefix watch that survives restarts and dropped streams.
- ``lease.py``: ``LeaseKeeper``, the keep-alive thread of one lease.
- ``kv.py``: the records read back (``KV``, ``WatchEvent``).
- ``endpoints.py``: endpoint parsing and ``TLSFiles``.
- ``embedded.py``, ``cluster.py``, ``pki.py``: the embedded etcd server(s) and their TLS.
"""

import os
import sys

# grpcio ships with gRPC core's fork handlers on: at every fork() they stop gRPC's threads
# and wait for them, inside the forking thread, which holds the GIL when Python forks
# (``subprocess`` with a ``preexec_fn``, ``os.fork``). A gRPC thread that needs the GIL to
# finish then never does, and the process hangs for good: seen in a loaded test run, where
# starting etcd beside live watches froze the runner. elasticd forks with its channels live
# (etcd, the lease bridge, workers) and never uses gRPC in a forked child, so the handlers
# are off for its own import of gRPC, which is when gRPC core reads the setting. The
# variable is restored at once, so the workers and what else the agent starts inherit the
# operator's environment unchanged; an operator who sets it keeps their value.
FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
if FORK_SUPPORT_ENV not in os.environ and "grpc" not in sys.modules:
    os.environ[FORK_SUPPORT_ENV] = "false"
    try:
        import grpc  # noqa: F401 - imported here so that it reads the setting above
    finally:
        del os.environ[FORK_SUPPORT_ENV]

from elasticd.etcd.client import EtcdClient  # noqa: E402 - after gRPC's settings
from elasticd.etcd.endpoints import TLSFiles  # noqa: E402
from elasticd.etcd.kv import KV, WatchEvent  # noqa: E402
from elasticd.etcd.lease import LeaseKeeper  # noqa: E402
from elasticd.etcd.txn import (  # noqa: E402
    Compare,
    CreateRevision,
    Delete,
    DeletePrefix,
    Get,
    ModRevision,
    Op,
    Put,
)
from elasticd.etcd.watch import PrefixWatch  # noqa: E402

__all__ = [
    "KV", "Compare", "CreateRevision", "Delete", "DeletePrefix", "EtcdClient", "Get", "LeaseKeeper",
    "ModRevision", "Op", "PrefixWatch", "Put", "TLSFiles", "WatchEvent",
]
