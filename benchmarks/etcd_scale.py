"""Rendezvous at scale with one process per node: round, recovery, etcd load, watch fan-out.

Each simulated node is a Python process of its own (forked from a zygote that imported
torch once, so the imported modules are shared copy-on-write) running the real
``EtcdRendezvousHandler`` (its own ``EtcdClient``: a lease, the ``nodes/`` and ``rdzv/``
watches) and no workers, with ``RendezvousSettings(min_nodes=N-1, max_nodes=N,
node_ttl_s=--ttl)``. The parent starts one embedded etcd, starts the N processes, waits
until all are connected, then:

1. releases them at once: **round** = release → the last node has its rank (the round
   closes when N have joined);
2. lets the job sit for ``--window`` s: **steady state** per node per minute from etcd's
   own counters (``/metrics``: gRPC requests, keep-alives, bytes, puts+txns);
3. SIGKILLs one node: **recovery** = kill → every survivor has its rank in the next round
   (survivors poll ``num_nodes_waiting()`` every 50 ms, like the agent's monitor loop, then
   call ``next_rendezvous``); this includes the lease TTL (the dead node is noticed when
   its lease expires) and the last-call wait (``last_call_timeout_s`` = 1 s, the round is
   below max_nodes);
4. counts **watch events** etcd sent (``etcd_debugging_mvcc_events_total``) for the round
   and for the recovery, and the watchers it holds (``etcd_debugging_mvcc_watcher_total``);
5. reads the etcd server's CPU seconds and RSS from /proc.

Usage::

    .venv/bin/python benchmarks/etcd_scale.py --sizes 8,64           # ~3 min
    .venv/bin/python benchmarks/etcd_scale.py --sizes 128 --no-doc
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    PY,
    ROOT,
    machine_info,
    machine_line,
    other_load,
    replace_generated_block,
    scrape_etcd,
    sigterm_as_interrupt,
    stat_fields,
)

COUNTERS = {
    "requests": ("grpc_server_msg_received_total", None),
    "keepalives": ("grpc_server_msg_received_total", 'grpc_method="LeaseKeepAlive"'),
    "bytes_in": ("etcd_network_client_grpc_received_bytes_total", None),
    "bytes_out": ("etcd_network_client_grpc_sent_bytes_total", None),
    "writes": ("etcd_mvcc_put_total", None),
    "txns": ("etcd_mvcc_txn_total", None),
    "watch_events": ("etcd_debugging_mvcc_events_total", None),
    "watchers": ("etcd_debugging_mvcc_watcher_total", None),
}


# -- zygote and children: the simulated nodes ------------------------------------------------
def zygote_main(args: argparse.Namespace) -> int:
    """Import torch and elasticd once, then fork one process per simulated node.

    Forking from a warm zygote (no gRPC channel exists before the fork; each child builds
    its own) shares the ~150 MB of imported modules copy-on-write: a spawned process per
    node would hold all of it privately, and 64 of them would not fit next to the other
    work on this machine.
    """
    import gc

    from elasticd.etcd.client import EtcdClient  # noqa: F401 - imported before the fork
    from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler  # noqa: F401

    gc.freeze()  # keep the collector from touching (and so copying) the shared heap
    pids = []
    for i in range(args.total):
        pid = os.fork()
        if pid == 0:
            try:
                code = child_main(args, i)
            except BaseException as exc:  # report, never return into the zygote's loop
                _emit({"i": i, "error": f"{type(exc).__name__}: {exc}", "t": time.time()})
                code = 1
            os._exit(code)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    return 0


def _emit(rec: dict) -> None:
    # One write() of less than PIPE_BUF bytes: lines of concurrent children never interleave.
    os.write(1, (json.dumps(rec) + "\n").encode())


def child_main(args: argparse.Namespace, index: int) -> int:
    """One handler; "ready"; once the go file exists rendezvous, then re-rendezvous whenever
    nodes wait, until the stop file exists."""
    import structlog

    from elasticd.etcd.client import EtcdClient
    from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler
    from elasticd.rendezvous.settings import RendezvousSettings

    # Logs to stderr (the zygote's .err file): stdout carries the JSON lines for the parent.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    go, stop = Path(args.ctl, "go"), Path(args.ctl, "stop")
    # No first-round settle: the rounds measured are the protocol's, as before it existed.
    settings = RendezvousSettings(min_nodes=args.total - 1, max_nodes=args.total, node_ttl_s=args.ttl,
                                  join_timeout_s=args.round_timeout, local_addr="127.0.0.1",
                                  start_settle_s=0.0)
    handler = EtcdRendezvousHandler(EtcdClient(args.endpoint, timeout_s=5.0), args.job, settings,
                                    node_id=f"sim-{index}")
    _emit({"i": index, "ready": True, "pid": os.getpid()})
    while not go.exists():
        time.sleep(0.01)
    while not stop.exists():
        info = handler.next_rendezvous()
        _emit({"i": index, "rank": info.rank, "world": info.world_size, "t": time.time()})
        while not stop.exists() and handler.num_nodes_waiting() == 0:
            time.sleep(0.05)
    return 0


# -- parent -------------------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    fields = stat_fields(pid)
    return sum(int(x) for x in fields[11:13]) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def private_mb(pid: int) -> float:
    """Private (not shared) resident memory of a process, from smaps_rollup."""
    try:
        total = 0
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1])
        return total / 1024.0
    except OSError:
        return 0.0


class Zygote:
    """The zygote process and what its children printed, by node index."""

    def __init__(self, args: argparse.Namespace, endpoint: str, job: str, n: int, workdir: Path) -> None:
        self.ctl = workdir / f"ctl-{n}"
        self.ctl.mkdir(parents=True, exist_ok=True)
        self.lines: dict[int, list[dict]] = {i: [] for i in range(n)}
        self.lock = threading.Lock()
        with open(workdir / f"zygote-{n}.err", "w") as err:
            self.proc = subprocess.Popen(
                [PY, __file__, "--zygote", "--endpoint", endpoint, "--job", job, "--total", str(n),
                 "--ttl", str(args.ttl), "--round-timeout", str(args.round_timeout), "--ctl", str(self.ctl)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(ROOT),
                start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                self.lines[rec["i"]].append(rec)

    def all_have(self, pred, among=None) -> bool:  # type: ignore[no-untyped-def]
        with self.lock:
            return all(any(pred(r) for r in self.lines[i]) for i in (among or self.lines))

    def first_t(self, i: int, pred) -> float:  # type: ignore[no-untyped-def]
        with self.lock:
            return next(r["t"] for r in self.lines[i] if pred(r))

    def pid(self, i: int) -> int:
        with self.lock:
            return next(r["pid"] for r in self.lines[i] if "pid" in r)

    def errors(self) -> list[str]:
        with self.lock:
            return [r["error"] for rs in self.lines.values() for r in rs if "error" in r]

    def close(self) -> None:
        (self.ctl / "stop").touch()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def _watch_expiry(endpoint: str, key: str) -> list[float]:
    """Start watching ``key``; the returned list gets the wall time of its deletion."""
    from elasticd.etcd.client import EtcdClient

    seen: list[float] = []
    client = EtcdClient(endpoint, timeout_s=5.0)

    def on_events(events) -> None:  # type: ignore[no-untyped-def]
        if not seen and any(e.value is None for e in events):
            seen.append(time.time())

    try:
        w = client.watch_prefix(key, on_events, lambda kvs, rev: None, name="expiry",
                                range_end=key + "\0")
    except TypeError:  # a tree before range watches (measuring the old protocol)
        w = client.watch_prefix(key, on_events, lambda kvs, rev: None, name="expiry")
    w.connected.wait(10)
    return seen


def _wait(pred, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.05)


class Etcd:
    """One embedded etcd (``--members 1``) or a local cluster (``--members 3``): its client
    endpoints, the member that serves /metrics (every member counts its own watch events
    and clients: all are summed), and CPU/RSS summed over the members."""

    def __init__(self, members: int, root: Path) -> None:
        from elasticd.etcd.cluster import EmbeddedEtcdCluster
        from elasticd.etcd.embedded import EmbeddedEtcd

        self.cluster = None
        self.single = None
        if members == 1:
            self.single = EmbeddedEtcd(data_dir=str(root)).start()
            self.servers = [self.single]
        else:
            for attempt in range(3):  # a free port can be taken between its pick and etcd's bind
                sub = root / f"try{attempt}"
                sub.mkdir(parents=True, exist_ok=True)
                try:
                    self.cluster = EmbeddedEtcdCluster(members, root_dir=str(sub)).start()
                    break
                except Exception:
                    if attempt == 2:
                        raise
            assert self.cluster is not None
            self.servers = list(self.cluster.members)
        self.endpoint = ",".join(m.endpoint for m in self.servers)

    def pids(self) -> list[int]:
        return [m.proc.pid for m in self.servers if m.proc is not None]

    def scrape(self) -> dict:
        total: dict = {}
        for m in self.servers:
            for k, v in scrape_etcd(m.endpoint, COUNTERS).items():
                total[k] = total.get(k, 0) + v
        return total

    def cpu(self) -> float:
        return sum(cpu_s(p) for p in self.pids())

    def member_cpu(self) -> list[float]:
        """Each member's CPU seconds, in ``servers`` order."""
        return [cpu_s(p) for p in self.pids()]

    def leader(self) -> int | None:
        """The index in ``servers`` of the member that says it is the raft leader."""
        for i, m in enumerate(self.servers):
            if scrape_etcd(m.endpoint, {"leader": ("etcd_server_is_leader", None)})["leader"] >= 1:
                return i
        return None

    def rss(self) -> float:
        return sum(rss_mb(p) for p in self.pids())

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.single is not None:
            self.single.stop()


def run_size(n: int, args: argparse.Namespace, workdir: Path) -> dict:
    etcd = Etcd(args.members, workdir / f"etcd-{n}")
    zyg: Zygote | None = None
    r: dict = {"n": n, "members": args.members}
    try:
        t_spawn = time.time()
        zyg = Zygote(args, etcd.endpoint, f"scale-{n}", n, workdir)
        z = zyg
        _wait(lambda: z.all_have(lambda x: "ready" in x) or bool(z.errors()), args.round_timeout * 2,
              "every simulated node to connect")
        if z.errors():
            raise RuntimeError(f"simulated nodes failed: {z.errors()[:2]}")
        r["spawn_s"] = round(time.time() - t_spawn, 1)
        pids = [z.pid(i) for i in range(n)]
        r["sim_private_mb"] = round(sum(private_mb(p) for p in pids) / n, 1)
        c0, cpu0 = etcd.scrape(), etcd.cpu()
        sim0 = sum(cpu_s(p) for p in pids)
        go = time.time()
        (z.ctl / "go").touch()
        _wait(lambda: z.all_have(lambda x: "rank" in x), args.round_timeout, "round 1")
        r["round_s"] = round(max(z.first_t(i, lambda x: "rank" in x) for i in range(n)) - go, 2)
        c1, cpu1 = etcd.scrape(), etcd.cpu()
        # The simulated nodes' own CPU in the round: on real machines each node has its own.
        r["round_node_cpu_ms"] = round(1000.0 * (sum(cpu_s(p) for p in pids) - sim0) / n, 1)
        r["sim_private_mb_active"] = round(sum(private_mb(p) for p in pids) / n, 1)
        r["round_watch_events"] = c1["watch_events"] - c0["watch_events"]
        r["round_requests"] = c1["requests"] - c0["requests"]
        r["round_etcd_cpu_s"] = round(cpu1 - cpu0, 2)
        r["watchers"] = c1["watchers"]
        time.sleep(args.settle)
        a, cpu_a, ta = etcd.scrape(), etcd.cpu(), time.monotonic()
        time.sleep(args.window)
        b, cpu_b, tb = etcd.scrape(), etcd.cpu(), time.monotonic()
        minutes = (tb - ta) / 60.0
        r["per_node_min"] = {k: round((b[k] - a[k]) / n / minutes, 1) for k in
                             ("requests", "keepalives", "bytes_in", "bytes_out", "writes", "txns")}
        r["steady_etcd_cpu_pct"] = round(100.0 * (cpu_b - cpu_a) / (tb - ta), 1)
        r["etcd_rss_mb"] = round(etcd.rss(), 1)
        r["steady_watch_events_per_node_min"] = round((b["watch_events"] - a["watch_events"]) / n / minutes, 1)
        # recovery after one node is lost
        survivors = list(range(n - 1))
        expired = _watch_expiry(etcd.endpoint, f"/elasticd/scale-{n}/nodes/sim-{n - 1}")
        before = etcd.scrape()
        t_kill = time.time()
        os.kill(pids[-1], signal.SIGKILL)
        shrunk = lambda x: "rank" in x and x["world"] == n - 1  # noqa: E731
        _wait(lambda: z.all_have(shrunk, survivors), args.round_timeout, "the survivors' next round")
        t_all = max(z.first_t(i, shrunk) for i in survivors)
        r["recovery_s"] = round(t_all - t_kill, 2)
        # The part after the lease expired (the kill -> expiry part is TTL - up to TTL/3, a
        # matter of when the last keep-alive went out, the same for every protocol).
        if expired:
            r["expiry_s"] = round(expired[0] - t_kill, 2)
            r["after_expiry_s"] = round(t_all - expired[0], 2)
        after, cpu_end = etcd.scrape(), etcd.cpu()
        r["recovery_watch_events"] = after["watch_events"] - before["watch_events"]
        r["recovery_requests"] = after["requests"] - before["requests"]
        r["etcd_cpu_total_s"] = round(cpu_end - cpu0, 2)
        r["etcd_rss_mb_end"] = round(etcd.rss(), 1)
        r["recovery_etcd_cpu_s"] = round(cpu_end - cpu_b, 2)
        r["errors"] = z.errors()[:3]
    finally:
        if zyg is not None:
            zyg.close()
        etcd.stop()
    return r


def report(results: list[dict], info: dict, argv: list[str], busy: list[str], args: argparse.Namespace) -> str:
    rows = ["| N | round (s) | recovery after 1 node lost (s) | watch events: round (per N) | "
            "watch events: recovery (per N) | watchers | requests /node/min | keep-alives /node/min "
            "| bytes in+out /node/min | etcd CPU: round (s) | etcd CPU: recovery (s) | etcd CPU "
            "steady (%) | etcd RSS (MB) | private MB per node process | node CPU in the round (ms/node) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['n']} | error: {r['error'][:90]} |" + " |" * 13)
            continue
        m, n = r["per_node_min"], r["n"]
        after = f" ({r['after_expiry_s']} after expiry)" if "after_expiry_s" in r else ""
        rows.append(f"| {n} | {r['round_s']} | {r['recovery_s']}{after} | {r['round_watch_events']:,.0f} "
                    f"({r['round_watch_events'] / n:.1f}) | {r['recovery_watch_events']:,.0f} "
                    f"({r['recovery_watch_events'] / n:.1f}) | {r['watchers']:,.0f} | {m['requests']} | "
                    f"{m['keepalives']} | {m['bytes_in'] + m['bytes_out']:,.0f} | "
                    f"{r['round_etcd_cpu_s']} | {r.get('recovery_etcd_cpu_s', '–')} | "
                    f"{r['steady_etcd_cpu_pct']} | {r['etcd_rss_mb_end']} | {r.get('sim_private_mb_active', r['sim_private_mb'])} | "
                    f"{r.get('round_node_cpu_ms', '–')} |")
    shared = (f" The machine was shared (other busy processes at the start: {len(busy)}); times "
              "are ±30 %, counts are exact.") if busy else ""
    return "\n".join([
        f"Measured {machine_line(info)}.{shared}",
        "",
        "```",
        f".venv/bin/python benchmarks/etcd_scale.py {' '.join(argv)}".rstrip(),
        "```",
        "",
        f"One process per simulated node, forked from a zygote that imported torch (the real "
        f"`EtcdRendezvousHandler`, its own gRPC connection, lease and watches; no workers), one "
        f"{'embedded etcd' if args.members == 1 else f'local etcd cluster of {args.members} members (elasticd.etcd.cluster; counters and CPU/RSS summed over the members)'}, "
        f"`min_nodes=N-1, max_nodes=N, node_ttl_s={args.ttl}`. Recovery includes "
        f"the TTL ({args.ttl} s) and the 1 s last call. Steady state over {args.window:.0f} s.",
        "",
        *rows,
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8,64")
    p.add_argument("--ttl", type=int, default=5)
    p.add_argument("--members", type=int, default=1, help="etcd members (3: a local cluster)")
    p.add_argument("--window", type=float, default=20.0)
    p.add_argument("--settle", type=float, default=3.0)
    p.add_argument("--round-timeout", type=float, default=180.0)
    p.add_argument("--workdir")
    p.add_argument("--no-doc", action="store_true")
    p.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--total", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ctl", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.zygote:
        return zygote_main(args)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="elasticd-etcd-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    info, busy = machine_info(), other_load()
    results = []
    with sigterm_as_interrupt():
        for n in [int(x) for x in args.sizes.split(",") if x]:
            try:
                r = run_size(n, args, workdir)
            except Exception as exc:  # noqa: BLE001 - report it in the table, go on
                r = {"n": n, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            results.append(r)
            print(json.dumps(r), flush=True)
    (workdir / "results.json").write_text(json.dumps({"machine": info, "results": results}, indent=1))
    text = report(results, info, sys.argv[1:], busy, args)
    if not args.no_doc:
        replace_generated_block("Rendezvous at scale, one process per node", "etcd_scale", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
