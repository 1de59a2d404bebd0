"""Forked children of a process that uses etcd: how many reach etcd (issue 52).

The parent has the agent's shape: one ``EtcdClient`` with a prefix watch and a lease kept
alive by ``LeaseKeeper`` (``--busy N`` adds N threads that put/get in a loop). It then
forks ``--children`` children one after another with ``os.fork()`` (what multiprocessing's
"fork" start method does); each child opens its own client, puts and gets one key and exits.
A child is "ok" (exit 0), "failed" (an error exit, or killed by a signal: gRPC's poller
aborts with SIGABRT) or "hung" (still running after ``--child-timeout-s``: SIGKILLed).

    python benchmarks/fork_probe.py --children 200 [--busy 2] [--endpoint host:port]

To compare two versions of elasticd, run it with ``PYTHONPATH`` at each one's checkout.

Without ``--endpoint`` a private etcd is started on 127.0.0.1 and stopped at the end.
Prints one JSON line: counts by outcome, the child exit statuses seen, and the median and
95th percentile of fork-to-exit time of the ok children.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time


def _child(endpoint: str, n: int) -> None:
    code = 5
    try:
        from elasticd.etcd import EtcdClient

        client = EtcdClient(endpoint, timeout_s=5.0)
        client.put(f"/fork-probe/child/{n}", "x")
        code = 0 if client.get(f"/fork-probe/child/{n}") is not None else 3
        client.close()
    except BaseException as exc:  # noqa: BLE001 - the probe counts every failure
        print(f"child {n}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 4
    os._exit(code)


def probe(endpoint: str, children: int, busy: int, child_timeout_s: float) -> dict:
    from elasticd.etcd import EtcdClient, LeaseKeeper

    client = EtcdClient(endpoint, timeout_s=5.0)
    lease = client.grant_lease(5)
    keeper = LeaseKeeper(client, lease, 5).start()
    client.put("/fork-probe/node", "parent", lease=lease)
    watch = client.watch_prefix("/fork-probe/", lambda events: None, lambda kvs, rev: None)
    stop = threading.Event()

    def traffic(i: int) -> None:
        n = 0
        while not stop.is_set():
            try:
                client.put(f"/fork-probe/busy/{i}", str(n))
                client.get(f"/fork-probe/busy/{i}")
            except Exception:  # noqa: BLE001 - background load only
                pass
            n += 1

    threads = [threading.Thread(target=traffic, args=(i,), daemon=True) for i in range(busy)]
    for t in threads:
        t.start()
    outcome = {"ok": 0, "failed": 0, "hung": 0}
    statuses: dict[str, int] = {}
    took: list[float] = []
    t_all = time.monotonic()
    for n in range(children):
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(endpoint, n)
        deadline = t0 + child_timeout_s
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                if status == 0:
                    outcome["ok"] += 1
                    took.append(time.monotonic() - t0)
                else:
                    outcome["failed"] += 1
                    what = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                            else f"exit {os.WEXITSTATUS(status)}")
                    statuses[what] = statuses.get(what, 0) + 1
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                outcome["hung"] += 1
                break
            time.sleep(0.005)
        # The parent must still work after every fork.
        client.put("/fork-probe/parent", str(n))
    total = time.monotonic() - t_all
    stop.set()
    for t in threads:
        t.join(10)
    parent_ok = client.get("/fork-probe/parent") is not None
    watch.stop()
    keeper.stop(revoke=True)
    client.close()
    took.sort()
    return {"children": children, "busy": busy, **outcome, "statuses": statuses,
            "parent_ok": parent_ok, "total_s": round(total, 2),
            "ok_median_s": round(statistics.median(took), 3) if took else None,
            "ok_p95_s": round(took[int(0.95 * (len(took) - 1))], 3) if took else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--children", type=int, default=200)
    ap.add_argument("--busy", type=int, default=0, help="threads doing put/get in the parent")
    ap.add_argument("--child-timeout-s", type=float, default=20.0)
    ap.add_argument("--endpoint", default="", help="an etcd to use (default: start a private one)")
    args = ap.parse_args()
    if args.endpoint:
        result = probe(args.endpoint, args.children, args.busy, args.child_timeout_s)
    else:
        from elasticd.etcd.embedded import EmbeddedEtcd

        with EmbeddedEtcd() as etcd:
            result = probe(etcd.endpoint, args.children, args.busy, args.child_timeout_s)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] == result["children"] and result["parent_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
