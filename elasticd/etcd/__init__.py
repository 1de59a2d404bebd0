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

from elasticd.etcd.client import EtcdClient
from elasticd.etcd.endpoints import TLSFiles
from elasticd.etcd.kv import KV, WatchEvent
from elasticd.etcd.lease import LeaseKeeper
from elasticd.etcd.txn import Compare, CreateRevision, Delete, DeletePrefix, ModRevision, Op, Put
from elasticd.etcd.watch import PrefixWatch

__all__ = [
    "KV", "Compare", "CreateRevision", "Delete", "DeletePrefix", "EtcdClient", "LeaseKeeper",
    "ModRevision", "Op", "PrefixWatch", "Put", "TLSFiles", "WatchEvent",
]
