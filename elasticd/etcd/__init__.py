"""etcd access: the hardened client and everything around it.

- ``client.py``: ``EtcdClient``, the only module that calls python3-etcd3 (bounded calls,
  error translation, endpoint fail-over).
- ``txn.py``: typed transaction compares (``ModRevision``, ``CreateRevision``) and
  operations (``Put``, ``Delete``, ``DeletePrefix``) for ``EtcdClient.txn``.
- ``watch.py``: ``PrefixWatch``, a prefix watch that survives restarts and dropped streams.
- ``lease.py``: ``LeaseKeeper``, the keep-alive thread of one lease.
- ``kv.py``: the records read back (``KV``, ``WatchEvent``).
- ``endpoints.py``: endpoint parsing and ``TLSFiles``.
- ``gateway.py``: etcd's HTTP/JSON gateway, the transport of a process forked from a gRPC user.
- ``embedded.py``, ``cluster.py``, ``pki.py``: the embedded etcd server(s) and their TLS.
"""

# gRPC's fork support is left as grpcio ships it (on) or as the operator set it
# (``GRPC_ENABLE_FORK_SUPPORT``). A process forked from one that opened gRPC channels to etcd
# (torch's ``elastic_launch`` in a ``multiprocessing`` child, a test harness) never uses gRPC:
# gRPC skips its fork reset while a watch's thread is inside it, and the child reaches etcd
# over etcd's HTTP/JSON gateway instead (``gateway.py``). A fork made while holding the GIL
# (``os.fork``, ``preexec_fn``) beside busy gRPC traffic can still hang the *parent* in gRPC's
# fork handlers, so elasticd itself never forks that way: it starts processes with
# ``subprocess`` and no ``preexec_fn`` (CPython uses ``vfork()``, which runs no fork
# handlers), see ``elasticd.process.dying_with_parent``.

from elasticd.etcd.client import EtcdClient
from elasticd.etcd.endpoints import TLSFiles
from elasticd.etcd.kv import KV, WatchEvent
from elasticd.etcd.lease import LeaseKeeper
from elasticd.etcd.txn import (
    Compare,
    CreateRevision,
    Delete,
    DeletePrefix,
    Get,
    ModRevision,
    Op,
    Put,
)
from elasticd.etcd.watch import PrefixWatch

__all__ = [
    "KV", "Compare", "CreateRevision", "Delete", "DeletePrefix", "EtcdClient", "Get", "LeaseKeeper",
    "ModRevision", "Op", "PrefixWatch", "Put", "TLSFiles", "WatchEvent",
]
