"""Rendezvous: torch elastic's RendezvousHandler on etcd v3 (backend ``etcd-v3``).

- ``protocol.py``: the round protocol as pure decisions.
- ``etcd_handler.py``: the handler that executes them against etcd.
- ``view.py``: the handler's watched view of ``nodes/`` and ``rdzv/``.
- ``session.py``: this node's lease, record and incarnation (the fencing token), and the
  round it completed; the agent's recorder fences its writes with it.
- ``etcd_store.py``: the per-round c10d Store on etcd.
- ``registry.py``: registration with torch and the ``torchrun.handlers`` entry point.

The handler (it subclasses torch's ``RendezvousHandler``) is loaded on first use, so that
importing the pure protocol (``elasticd status``, the CLI's parser) does not import torch:
that import cost every agent 2 s before it could start its first standby.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elasticd.rendezvous.settings import RendezvousSettings

if TYPE_CHECKING:
    from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler

__all__ = ["EtcdRendezvousHandler", "RendezvousSettings"]


def __getattr__(name: str) -> Any:
    if name == "EtcdRendezvousHandler":
        from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler

        return EtcdRendezvousHandler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
