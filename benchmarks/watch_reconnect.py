"""How long after etcd returns from a kill does every watch of a node deliver again?

A coordinating node holds six prefix watches on one client (rdzv, rdzv-hi, control, nodes,
joins, failures), all on one python3-etcd3 stream. etcd is SIGKILLed, stays down for
``--down`` seconds and is restarted on its data dir; then one key is put under each watched
prefix, and the figure per watch is the time from etcd's return (its health check answers)
to that put's event reaching the watch's consumer.

Two ways of making a watch's create are measured in the same run, alternating trial by
trial:

- *elasticd*: a create waiting on a stream python3-etcd3 has closed and replaced gives up
  at once (``StreamClosedError``) and is made again on the current stream;
- *baseline*: the create waits out the call timeout on the closed stream, as
  python3-etcd3 does (``_closed`` forced false): each create queued behind it on that
  stream waits out one more (soak seeds 73010, 73020: a coordinator's joins watch came
  back 6 and 9 s after etcd).

Usage::

    .venv/bin/python benchmarks/watch_reconnect.py --trials 6 --down 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine_info, machine_line, replace_generated_block  # noqa: E402
from elasticd.etcd import watch as watch_mod  # noqa: E402
from elasticd.etcd.client import EtcdClient  # noqa: E402
from elasticd.etcd.embedded import EmbeddedEtcd  # noqa: E402

WATCHES = ["rdzv", "rdzv-hi", "control", "nodes", "joins", "failures"]


@contextmanager
def baseline_creates():
    """python3-etcd3's own behaviour: a closed stream is never noticed by a create."""
    original = watch_mod._closed
    watch_mod._closed = lambda watcher: False
    try:
        yield
    finally:
        watch_mod._closed = original


def one(server: EmbeddedEtcd, down_s: float, call_timeout_s: float) -> list[float]:
    """One kill and restart: seconds from etcd's return to each watch's delivery."""
    client = EtcdClient(server.endpoint, timeout_s=call_timeout_s)
    seen: dict[str, float] = {}
    done = threading.Event()
    watches = []
    tag = f"{time.monotonic_ns()}"

    def consumer(name: str):
        def on_events(events: list) -> None:
            if any(e.key.endswith(tag) for e in events) and name not in seen:
                seen[name] = time.monotonic()
                if len(seen) == len(WATCHES):
                    done.set()
        return on_events

    try:
        for name in WATCHES:
            watches.append(client.watch_prefix(f"/bench/{name}/", consumer(name),
                                               lambda kvs, rev: None, name=name))
        for w in watches:
            if not w.connected.wait(10):
                raise RuntimeError("a watch did not connect")
        # The agent's own traffic (keep-alives, reads): the calls whose failures make
        # python3-etcd3 close and replace its stream.
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                try:
                    client.get_prefix("/bench/rdzv/")
                except Exception:  # etcd is down: that is the point
                    pass
                stop.wait(0.5)

        t = threading.Thread(target=traffic, daemon=True)
        t.start()
        server.kill()
        time.sleep(down_s)  # the outage itself (not a synchronisation)
        server.start()  # returns once etcd answers its health check
        back = time.monotonic()
        for name in WATCHES:
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.put(f"/bench/{name}/{tag}", b"1")
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        if not done.wait(60):
            raise RuntimeError(f"watches never delivered: {sorted(set(WATCHES) - set(seen))}")
        stop.set()
        t.join(timeout=5)
        return [seen[name] - back for name in WATCHES]
    finally:
        for w in watches:
            w.stop(wait=False)
        client.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=6, help="trials of each kind (alternating)")
    p.add_argument("--down", type=float, default=5.0, help="seconds etcd stays killed")
    p.add_argument("--etcd-timeout", type=float, default=3.0, help="the call timeout (agent default 3 s)")
    p.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md")
    args = p.parse_args()
    info = machine_info()
    results: dict[str, list[list[float]]] = {"elasticd": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedEtcd(str(Path(tmp) / "etcd"))
        server.start()
        try:
            for i in range(args.trials):
                for kind in ("elasticd", "baseline") if i % 2 == 0 else ("baseline", "elasticd"):
                    if kind == "baseline":
                        with baseline_creates():
                            r = one(server, args.down, args.etcd_timeout)
                    else:
                        r = one(server, args.down, args.etcd_timeout)
                    results[kind].append(r)
                    print(f"trial {i} {kind}: " + " ".join(f"{x:.2f}" for x in r), flush=True)
        finally:
            server.stop(remove_data=True)
    rows = []
    for kind in ("elasticd", "baseline"):
        last = [max(r) for r in results[kind]]
        every = [x for r in results[kind] for x in r]
        rows.append(f"| {kind} | {len(last)} | {statistics.median(every):.2f} | "
                    f"{statistics.median(last):.2f} | {max(last):.2f} |")
    ratio = (statistics.median(max(r) for r in results["baseline"])
             / max(statistics.median(max(r) for r in results["elasticd"]), 1e-3))
    cmd = " ".join(["benchmarks/watch_reconnect.py", *sys.argv[1:]])
    body = f"""{machine_line(info)}

```
.venv/bin/python {cmd}
```

Six prefix watches on one client (a coordinator's), etcd SIGKILLed for {args.down:g} s and
restarted on its data dir, call timeout {args.etcd_timeout:g} s; per watch, the seconds from
etcd's return to the delivery of a key put under its prefix. *baseline*: a create waits out
the call timeout on a stream python3-etcd3 closed (its own behaviour); the two kinds
alternate trial by trial in one run.

| creates | trials | median, every watch (s) | median, a trial's last watch (s) | worst last watch (s) |
|---|---:|---:|---:|---:|
{chr(10).join(rows)}

The node's last watch is back {ratio:.1f}x sooner (median of the trials' last watch,
baseline / elasticd)."""
    print(body)
    if not args.no_doc:
        replace_generated_block("Watches after an etcd restart (issue 49)", "watch_reconnect", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
