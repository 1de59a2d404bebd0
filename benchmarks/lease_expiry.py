"""How long after a node freezes do the others see its lease expire? (issue 24, Numbers)

A frozen node (SIGSTOP of agent and workers) is detected by its lease alone: its sockets
stay open, its liveness port still accepts (the kernel completes the handshake). This
measures that detection with nothing else in the way: a real (embedded) etcd, one lease
kept alive by elasticd's ``LeaseKeeper`` (a keep-alive every TTL/3), a key on it, and a
watch on the key. At a random moment the keep-alives stop (the freeze); the figure is the
time to the watch's DELETE event, split into

- *remaining TTL*: what the lease had left at the freeze (last keep-alive + TTL - freeze:
  between TTL - TTL/3 and TTL, set by where the freeze falls between two keep-alives), and
- *etcd + watch*: the rest (etcd's lessor revokes expired leases on a 500 ms loop, then
  the watch delivers the DELETE).

Why: one run of ``benchmarks/recovery.py`` showed the live path noticing a frozen node's
lease ~0.8 s later than the restart path. The agents themselves act within milliseconds
of the watch event on both paths (their ``membership_changed`` and the decision are
logged 1-2 ms apart); the spread is this one: ``TTL*2/3 .. TTL + 0.5 s`` per trial.

Usage::

    .venv/bin/python benchmarks/lease_expiry.py --samples 12 --ttl 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elasticd.etcd.client import EtcdClient  # noqa: E402
from elasticd.etcd.embedded import EmbeddedEtcd  # noqa: E402
from elasticd.etcd.lease import LeaseKeeper  # noqa: E402


def one(client: EtcdClient, ttl_s: int, key: str, rng: random.Random) -> tuple[float, float]:
    """One freeze: (seconds to the DELETE event, remaining TTL at the freeze)."""
    gone = threading.Event()
    seen: list[float] = []

    def on_events(events: list) -> None:
        if any(e.key == key and e.value is None for e in events) and not gone.is_set():
            seen.append(time.monotonic())
            gone.set()

    lease = client.grant_lease(ttl_s)
    client.put(key, b"1", lease=lease)
    keeper = LeaseKeeper(client, lease, ttl_s).start()
    watch = client.watch_prefix(key, on_events, lambda kvs, rev: None, name="bench")
    try:
        if not watch.connected.wait(10):
            raise RuntimeError("watch did not connect")
        time.sleep(ttl_s + rng.uniform(0.0, ttl_s / 3.0))  # a random keep-alive phase
        keeper.stop()  # the freeze: no keep-alive from now on (no revoke)
        frozen = time.monotonic()
        remaining = keeper.last_ok + ttl_s - frozen
        if not gone.wait(ttl_s + 10):
            raise RuntimeError("the lease never expired")
        return seen[0] - frozen, remaining
    finally:
        watch.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=12)
    p.add_argument("--ttl", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    etcd = EmbeddedEtcd().start()
    client = EtcdClient(etcd.endpoint, timeout_s=2.0, tls=etcd.client_tls)
    rows = []
    try:
        for i in range(args.samples):
            total, remaining = one(client, args.ttl, f"/elasticd/bench/nodes/n{i}", rng)
            rows.append((total, remaining))
            print(f"freeze -> lease gone {total:.3f} s  (remaining TTL {remaining:.3f} s, "
                  f"etcd + watch {total - remaining:.3f} s)", flush=True)
    finally:
        client.close()
        etcd.stop()
    totals, rems = [r[0] for r in rows], [r[0] - r[1] for r in rows]
    print(f"\nTTL {args.ttl} s, {len(rows)} freezes: detection median {statistics.median(totals):.2f} s "
          f"(min {min(totals):.2f}, max {max(totals):.2f}); of which etcd + watch median "
          f"{statistics.median(rems):.2f} s (min {min(rems):.2f}, max {max(rems):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
