"""Rendezvous: torch elastic's RendezvousHandler on etcd v3 (backend ``etcd-v3``).

- ``protocol.py``: the round protocol as pure decisions.
- ``etcd_handler.py``: the handler that executes them against etcd.
- ``view.py``: the handler's watched view of ``nodes/`` and ``rdzv/``.
- ``session.py``: this node's lease, record and incarnation (the fencing token), and the
  round it completed; the agent's recorder fences its writes with it.
- ``etcd_store.py``: the per-round c10d Store on etcd.
- ``registry.py``: registration with torch and the ``torchrun.handlers`` entry point.
"""

from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler
from elasticd.rendezvous.settings import RendezvousSettings

__all__ = ["EtcdRendezvousHandler", "RendezvousSettings"]
