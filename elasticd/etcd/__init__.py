"""etcd access: the hardened client (client.py) and the embedded server (embedded.py)."""

from elasticd.etcd.client import KV, EtcdClient, LeaseKeeper, PrefixWatch, TLSFiles, WatchEvent

__all__ = ["KV", "EtcdClient", "LeaseKeeper", "PrefixWatch", "TLSFiles", "WatchEvent"]
