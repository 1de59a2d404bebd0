"""Rendezvous: torch elastic's RendezvousHandler on etcd v3 (backend ``etcd-v3``).

- ``protocol.py``: the round protocol as pure decisions.
- ``etcd_handler.py``: the handler that executes them against etcd.
- ``etcd_store.py``: the per-round c10d Store on etcd.
- ``registry.py``: registration with torch and the ``torchrun.handlers`` entry point.
"""

from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler, RendezvousSettings

__all__ = ["EtcdRendezvousHandler", "RendezvousSettings"]
