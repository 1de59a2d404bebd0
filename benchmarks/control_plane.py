"""The control plane at 1,000 nodes: the real coordinator, a 3-member etcd, synthetic nodes.

``etcd_scale.py`` runs one process per node (the real ``EtcdRendezvousHandler`` each):
on 2 cores that stops at ~256 nodes, because each node spends 18-25 ms of its own CPU per
round and 256 of them share the machine. A real fleet's critical path is etcd and the
one coordinator; every other node only issues its own few requests, on its own machine.
So here:

- **the coordinator is real**: an ``EtcdRendezvousHandler`` in a process of its own (its
  ``RoundCoordinator`` thread, ``WatchedView``, lease keeper, liveness listener), which
  registers first and so holds ``rdzv/coordinator``; it rendezvouses like an agent (then
  polls ``num_nodes_waiting()`` every 50 ms and re-rendezvouses), and its CPU is read from
  /proc (``--profile`` writes a cProfile of it);
- **the other N-1 nodes are synthetic**: objects in one process sharing ``--clients`` etcd
  clients (gRPC channels; etcd3 multiplexes every watch of a client on one stream), each
  issuing exactly the etcd requests an agent's handler issues (read from
  ``etcd_handler.py``, ``session.py``, ``watch.py``, ``etcd_store.py``):
  register = read ``rdzv/state``; snapshot + watch ``[rdzv/, rdzv/failures/)`` and
  ``[rdzv/joins0, rdzv0)`` (two watchers per node, as the handler); read its old node key;
  grant a lease; put ``nodes/<node>`` on it and read it back (the incarnation) in one txn;
  keep-alive = one ``LeaseKeepAlive`` per node every TTL/3 (one stream per client carries
  them); join = put ``rdzv/joins/<round>/<node>`` on the lease when the watched state is an
  open round it has not joined; done = the watched state is final with it as a member, then
  ``EtcdStore.bootstrap_info`` on a real ``EtcdStore`` (rank 0 sets MASTER_ADDR/PORT,
  everyone reads them); die = stop its keep-alives (the lease expires, as a SIGKILL).
  What they skip is client-side only: the liveness listener (their records say port 0,
  so the coordinator falls back to the lease), decoding the state once per node (parsed
  once per revision), the structlog lines.

Measured per N: **round** = release -> the last node (synthetic or real) has its rank
(includes every synthetic node's registration; the coordinator registered before the
release, it must hold the key); **recovery** = one synthetic node's keep-alives stop ->
every survivor has its rank at N-1 (includes the lease expiry, TTL minus up to TTL/3, and
the 1 s last call; the part after the expiry is given too); **watch events** from etcd's
``etcd_debugging_mvcc_events_total`` (summed over the members) for the round and the
recovery; etcd CPU seconds and RSS from /proc of the members; the coordinator's CPU.

Usage::

    .venv/bin/python benchmarks/control_plane.py --sizes 8,32,100,300,1000
    .venv/bin/python benchmarks/control_plane.py --sizes 1000 --profile /tmp/coord.prof
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import PY, ROOT, machine_info, machine_line, sigterm_as_interrupt  # noqa: E402
from benchmarks.etcd_scale import Etcd, _wait, _watch_expiry, cpu_s  # noqa: E402

REAL = "real-0"


# -- the real coordinator, in its own process -----------------------------------------------
def coordinator_main(args: argparse.Namespace) -> int:
    """One real handler: arrive (win ``rdzv/coordinator``), "ready", rendezvous on "go",
    then re-rendezvous whenever nodes wait (polled every 50 ms, as etcd_scale's nodes)."""
    import cProfile

    import structlog

    from elasticd.etcd.client import EtcdClient
    from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler
    from elasticd.rendezvous.settings import RendezvousSettings

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    ctl = Path(args.ctl)
    settings = RendezvousSettings(min_nodes=args.total - 1, max_nodes=args.total, node_ttl_s=args.ttl,
                                  join_timeout_s=args.round_timeout, local_addr="127.0.0.1",
                                  start_settle_s=0.0)
    handler = EtcdRendezvousHandler(EtcdClient(args.endpoint, timeout_s=10.0), args.job, settings,
                                    node_id=REAL)
    handler.arrive()
    deadline = time.monotonic() + 30
    while handler.view().coordinator != REAL and time.monotonic() < deadline:
        time.sleep(0.01)
    _emit({"ready": True, "pid": os.getpid(), "coordinator": handler.view().coordinator})
    while not (ctl / "go").exists():
        time.sleep(0.005)
    prof = cProfile.Profile() if args.profile else None
    while not (ctl / "stop").exists():
        if prof is not None:
            prof.enable()
        info = handler.next_rendezvous()
        if prof is not None:
            prof.disable()
            prof.dump_stats(args.profile)
        _emit({"rank": info.rank, "world": info.world_size, "round": handler.round, "t": time.time()})
        while not (ctl / "stop").exists() and handler.num_nodes_waiting() == 0:
            time.sleep(0.05)
    return 0


def _emit(rec: dict) -> None:
    os.write(1, (json.dumps(rec) + "\n").encode())


class Coordinator:
    def __init__(self, endpoint: str, job: str, n: int, args: argparse.Namespace, workdir: Path) -> None:
        self.ctl = workdir / f"ctl-{n}"
        self.ctl.mkdir(parents=True, exist_ok=True)
        self.lines: list[dict] = []
        cmd = [PY, __file__, "--coordinator", "--endpoint", endpoint, "--job", job, "--total", str(n),
               "--ttl", str(args.ttl), "--round-timeout", str(args.round_timeout), "--ctl", str(self.ctl)]
        if args.profile:
            cmd += ["--profile", f"{args.profile}.{n}"]
        with open(workdir / f"coordinator-{n}.err", "w") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=err, text=True, cwd=str(ROOT), start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                pass

    def first(self, pred: Any) -> dict | None:
        return next((r for r in list(self.lines) if pred(r)), None)

    def close(self) -> None:
        (self.ctl / "stop").touch()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=10)


# -- the synthetic nodes ----------------------------------------------------------------------
class Node:
    def __init__(self, fleet: Fleet, name: str, client: Any) -> None:
        self.fleet, self.name, self.client = fleet, name, client
        self.lease = 0
        self.alive = True
        self.joined: set[int] = set()
        self.done: dict[int, tuple[float, int, int]] = {}  # round -> (t, rank, world)
        self.lock = threading.Lock()

    def register(self, init: bool = True) -> None:
        from elasticd.etcd.txn import Get, Put

        f, k, c = self.fleet, self.fleet.keys, self.client
        c.get(k.rdzv_state)  # the connect read
        for start, end, rev_cb in f.ranges:
            kvs, rev = c.get_prefix(start, range_end=end)  # PrefixWatch's snapshot
            for kv in kvs:
                rev_cb(self, kv.key, kv.value, kv.mod_revision)
            c.add_watch(start, lambda resp, me=self: f.on_watch(me, resp), rev + 1, range_end=end)
        key = k.node(self.name)
        c.get(key)  # _retire_previous_process: any old record?
        self.lease = c.grant_lease(f.ttl)
        record = f.record_json(self.name)
        c.txn_read([], [Put(key, record, lease=self.lease), Get(key)])  # record + incarnation
        f.keepalive(self)
        state = f.current_state()
        if state is None:
            if init:  # decide_join's INIT: one wins
                c.put_if(k.rdzv_state, f.initial_state(), mod_revision=0)
        else:
            self.on_state(*state)

    def on_state(self, rev: int, st: Any) -> None:
        if not self.alive:
            return
        with self.lock:
            if st.phase == "open":
                if st.round not in self.joined:
                    self.joined.add(st.round)
                    self.fleet.pool.submit(self._join, st.round)
            elif st.phase == "final":
                if self.name in st.members:
                    if st.round not in self.done and st.round not in self.fleet.store_pending.get(self.name, ()):
                        self.fleet.store_pending.setdefault(self.name, set()).add(st.round)
                        rank = st.members.index(self.name)
                        args = (st.round, rank, len(st.members))
                        if rank == 0:  # never queued behind the reads that wait for its keys
                            threading.Thread(target=self._store, args=args, daemon=True).start()
                        else:
                            self.fleet.pool.submit(self._store, *args)
                elif st.round + 1 not in self.joined:  # final without us: join the next
                    self.joined.add(st.round + 1)
                    self.fleet.pool.submit(self._join, st.round + 1)

    def _join(self, round_: int) -> None:
        try:
            self.client.put(self.fleet.keys.join(round_, self.name), b"1", lease=self.lease)
        except Exception as exc:  # noqa: BLE001 - counted, shown in the result
            self.fleet.errors.append(f"{self.name} join {round_}: {exc}")

    def _store(self, round_: int, rank: int, world: int) -> None:
        from elasticd.rendezvous.etcd_store import EtcdStore

        try:
            store = EtcdStore(self.client, self.fleet.keys.store_prefix(round_), timeout_s=120.0)
            store.bootstrap_info(rank, "127.0.0.1")
            store.close(wait=False)
        except Exception as exc:  # noqa: BLE001
            self.fleet.errors.append(f"{self.name} store {round_}: {exc}")
            return
        self.done[round_] = (time.time(), rank, world)


class Fleet:
    """N-1 synthetic nodes on ``clients`` shared etcd clients, one keep-alive thread each."""

    def __init__(self, endpoint: str, job: str, n: int, ttl: int, clients: int, threads: int) -> None:
        from elasticd.etcd.client import EtcdClient
        from elasticd.keys import JobKeys

        self.keys = JobKeys(job)
        self.ttl = ttl
        self.errors: list[str] = []
        self.store_pending: dict[str, set[int]] = {}
        self.clients = [EtcdClient(endpoint, timeout_s=30.0) for _ in range(clients)]
        self.nodes = [Node(self, f"syn-{i:04d}", self.clients[i % clients]) for i in range(n - 1)]
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="syn")
        k = self.keys
        self.ranges = [(k.rdzv_prefix, k.failures_root, self._on_kv),
                       (k.joins_root[:-1] + chr(ord(k.joins_root[-1]) + 1), k.rdzv_prefix[:-1] + "0",
                        self._on_kv)]
        self._state: tuple[int, Any] | None = None
        self._parsed: dict[int, Any] = {}
        self._plock = threading.Lock()
        self._leases: list[list[int]] = [[] for _ in range(clients)]
        self._klock = threading.Lock()
        self._stop = threading.Event()
        self._ka = [threading.Thread(target=self._keepalive_loop, args=(i,), daemon=True)
                    for i in range(clients)]
        for t in self._ka:
            t.start()

    # a state key value, parsed once per revision (each node's watcher delivers it)
    def _on_kv(self, node: Node, key: str, value: bytes | None, rev: int) -> None:
        if key != self.keys.rdzv_state or value is None:
            return
        from elasticd.records import RoundState

        with self._plock:
            st = self._parsed.get(rev)
            if st is None:
                st = self._parsed[rev] = RoundState.from_json(value)
                if self._state is None or rev > self._state[0]:
                    self._state = (rev, st)
        node.on_state(rev, st)

    def on_watch(self, node: Node, resp: Any) -> None:
        for ev in getattr(resp, "events", ()):
            deleted = type(ev).__name__ == "DeleteEvent"
            self._on_kv(node, ev.key.decode(), None if deleted else ev.value, ev.mod_revision)

    def current_state(self) -> tuple[int, Any] | None:
        with self._plock:
            return self._state

    def record_json(self, name: str) -> str:
        from elasticd import __version__
        from elasticd.records import NodeRecord

        return NodeRecord(node=name, host="synthetic", pid=os.getpid(), version=__version__,
                          started_at=time.time(), state="joining",
                          heartbeat_at=time.time()).to_json()

    def initial_state(self) -> str:
        from elasticd.records import RoundState

        n = len(self.nodes) + 1
        return RoundState(0, "open", [], n - 1, n, opened_at=time.time()).to_json()

    def keepalive(self, node: Node) -> None:
        with self._klock:
            self._leases[self.clients.index(node.client)].append(node.lease)

    def kill(self, node: Node) -> None:
        """Stop the node's keep-alives: its lease expires within the TTL (a SIGKILL)."""
        node.alive = False
        with self._klock:
            for ls in self._leases:
                if node.lease in ls:
                    ls.remove(node.lease)

    def _keepalive_loop(self, i: int) -> None:
        import etcd3

        interval = max(self.ttl / 3.0, 0.2)
        while not self._stop.wait(interval):
            with self._klock:
                leases = list(self._leases[i])
            if not leases:
                continue
            reqs = [etcd3.etcdrpc.LeaseKeepAliveRequest(ID=lease) for lease in leases]

            def send(c: Any, reqs: list = reqs) -> int:
                return sum(1 for _ in c.leasestub.LeaseKeepAlive(iter(reqs), interval * 3,
                                                                   credentials=c.call_credentials,
                                                                   metadata=c.metadata))

            try:
                self.clients[i].call(send)
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"keep-alive: {exc}")

    def register_all(self, init: bool = True) -> None:
        list(self.pool.map(lambda nd: nd.register(init), self.nodes))

    def close(self) -> None:
        self._stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()


def _self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def run_size(n: int, args: argparse.Namespace, workdir: Path) -> dict:
    etcd = Etcd(args.members, workdir / f"etcd-{n}")
    r: dict = {"n": n, "members": args.members, "clients": args.clients}
    coord: Coordinator | None = None
    fleet: Fleet | None = None
    try:
        job = f"cp-{n}"
        coord = Coordinator(etcd.endpoint, job, n, args, workdir)
        c = coord
        _wait(lambda: c.first(lambda x: "ready" in x) is not None, 60, "the coordinator")
        ready = c.first(lambda x: "ready" in x)
        assert ready is not None
        if ready["coordinator"] != REAL:
            raise RuntimeError(f"the real handler does not hold rdzv/coordinator: {ready}")
        cpid = ready["pid"]
        fleet = Fleet(etcd.endpoint, job, n, args.ttl, args.clients, args.threads)
        f = fleet
        def everyone_done(world: int, after: int = -1) -> bool:
            return (c.first(lambda x: x.get("world") == world and x["round"] > after) is not None
                    and all(any(w == world and rnd > after for rnd, (_, _, w) in nd.done.items())
                            for nd in f.nodes if nd.alive))

        def last_done(world: int, after: int = -1) -> float:
            t_real = c.first(lambda x: x.get("world") == world and x["round"] > after)["t"]  # type: ignore[index]
            return max([t_real] + [t for nd in f.nodes if nd.alive
                                   for rnd, (t, _, w) in nd.done.items() if w == world and rnd > after])

        if args.preregistered:  # registered (lease, record, watches) before the release
            f.register_all(init=False)
        c0, e0, cc0, s0 = etcd.scrape(), etcd.cpu(), cpu_s(cpid), _self_cpu()
        m0 = etcd.member_cpu()
        go = time.time()
        (c.ctl / "go").touch()
        if not args.preregistered:
            f.register_all()
        _wait(lambda: everyone_done(n) or bool(f.errors), args.round_timeout, "round 1")
        if f.errors:
            raise RuntimeError(f"synthetic nodes failed: {f.errors[:2]}")
        r["round_s"] = round(last_done(n) - go, 2)
        full = c.first(lambda x: x.get("world") == n)["round"]  # type: ignore[index]
        # A round closes once every *registered* node joined: one that registers later
        # joins the next (the protocol's rule; etcd_scale's processes race the same way).
        r["rounds_to_full"] = full + 1
        c1, e1 = etcd.scrape(), etcd.cpu()
        r["round_watch_events"] = c1["watch_events"] - c0["watch_events"]
        r["round_requests"] = c1["requests"] - c0["requests"]
        r["round_etcd_cpu_s"] = round(e1 - e0, 2)
        # Per member, the raft leader first: on a fleet each member has cores of its own,
        # and the leader (every write goes through it) is the one on the critical path.
        lead = etcd.leader()
        per = [round(b - a, 2) for a, b in zip(m0, etcd.member_cpu(), strict=True)]
        if lead is not None:
            per.insert(0, per.pop(lead))
        r["round_etcd_cpu_by_member_s"] = per
        r["round_etcd_leader_cpu_s"] = per[0] if lead is not None else None
        r["round_coordinator_cpu_s"] = round(cpu_s(cpid) - cc0, 3)
        r["round_synthetic_cpu_ms_per_node"] = round(1000 * (_self_cpu() - s0) / max(n - 1, 1), 2)
        r["watchers"] = c1["watchers"]
        time.sleep(args.settle)
        a, ea, ta = etcd.scrape(), etcd.cpu(), time.monotonic()
        time.sleep(args.window)
        b, eb, tb = etcd.scrape(), etcd.cpu(), time.monotonic()
        r["steady_etcd_cpu_pct"] = round(100 * (eb - ea) / (tb - ta), 1)
        r["keepalives_per_node_min"] = round((b["keepalives"] - a["keepalives"]) / n / ((tb - ta) / 60), 1)
        # recovery: the last synthetic node dies
        victim = f.nodes[-1]
        expired = _watch_expiry(etcd.endpoint, f.keys.node(victim.name))
        before, eb0, cb0 = etcd.scrape(), etcd.cpu(), cpu_s(cpid)
        t_kill = time.time()
        f.kill(victim)
        _wait(lambda: everyone_done(n - 1, full) or bool(f.errors), args.round_timeout,
              "the survivors' next round")
        if f.errors:
            raise RuntimeError(f"synthetic nodes failed in the recovery: {f.errors[:2]}")
        t_all = last_done(n - 1, full)
        r["recovery_s"] = round(t_all - t_kill, 2)
        if expired:
            r["expiry_s"] = round(expired[0] - t_kill, 2)
            r["after_expiry_s"] = round(t_all - expired[0], 2)
        after = etcd.scrape()
        r["recovery_watch_events"] = after["watch_events"] - before["watch_events"]
        r["recovery_etcd_cpu_s"] = round(etcd.cpu() - eb0, 2)
        r["recovery_coordinator_cpu_s"] = round(cpu_s(cpid) - cb0, 3)
        r["etcd_cpu_total_s"] = round(etcd.cpu() - e0, 2)
        r["etcd_rss_mb"] = round(etcd.rss(), 1)
        r["errors"] = f.errors[:3]
    finally:
        if fleet is not None:
            fleet.close()
        if coord is not None:
            coord.close()
        etcd.stop()
    return r


def report(results: list[dict], info: dict, argv: list[str], args: argparse.Namespace) -> str:
    rows = ["| N | round (s) | rounds | recovery (s) (after lease expiry) | watch events: round (per N) | "
            "watch events: recovery (per N) | watchers | etcd CPU: round (s) | etcd CPU: recovery (s) "
            "| etcd CPU steady | etcd RSS, 3 members (MB) | coordinator CPU: round / recovery (s) | "
            "synthetic node CPU in the round (ms/node) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        n = r["n"]
        if "error" in r:
            rows.append(f"| {n} | error: {r['error'][:100]} |" + " |" * 11)
            continue
        after = f" ({r['after_expiry_s']})" if "after_expiry_s" in r else ""
        rows.append(
            f"| {n} | {r['round_s']} | {r['rounds_to_full']} | {r['recovery_s']}{after} | {r['round_watch_events']:,.0f} "
            f"({r['round_watch_events'] / n:.1f}) | {r['recovery_watch_events']:,.0f} "
            f"({r['recovery_watch_events'] / n:.1f}) | {r['watchers']:,.0f} | {r['round_etcd_cpu_s']} | "
            f"{r['recovery_etcd_cpu_s']} | {r['steady_etcd_cpu_pct']} % | {r['etcd_rss_mb']} | "
            f"{r['round_coordinator_cpu_s']} / {r['recovery_coordinator_cpu_s']} | "
            f"{r['round_synthetic_cpu_ms_per_node']} |")
    return "\n".join([f"Measured {machine_line(info)}.", "", "```",
                      f".venv/bin/python benchmarks/control_plane.py {' '.join(argv)}".rstrip(), "```",
                      "", *rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8,32,100,300,1000")
    p.add_argument("--ttl", type=int, default=5)
    p.add_argument("--members", type=int, default=3)
    p.add_argument("--clients", type=int, default=8, help="etcd clients the synthetic nodes share")
    p.add_argument("--threads", type=int, default=64, help="threads issuing their requests")
    p.add_argument("--window", type=float, default=5.0)
    p.add_argument("--settle", type=float, default=2.0)
    p.add_argument("--round-timeout", type=float, default=180.0)
    p.add_argument("--preregistered", action="store_true",
                   help="register the synthetic nodes before the release: the round is then "
                        "open -> joins -> final -> store, without the registrations")
    p.add_argument("--profile", help="write a cProfile of the coordinator's rounds to PATH.<N>")
    p.add_argument("--workdir")
    p.add_argument("--coordinator", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--total", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ctl", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.coordinator:
        return coordinator_main(args)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="elasticd-control-plane-"))
    workdir.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    results = []
    with sigterm_as_interrupt():
        for n in [int(x) for x in args.sizes.split(",") if x]:
            try:
                r = run_size(n, args, workdir)
            except Exception as exc:  # noqa: BLE001 - report it in the table, go on
                r = {"n": n, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            r["load"] = os.getloadavg()[0]
            results.append(r)
            print(json.dumps(r), flush=True)
    (workdir / "results.json").write_text(json.dumps({"machine": info, "results": results}, indent=1))
    print(report(results, info, sys.argv[1:], args))
    return 0


if __name__ == "__main__":
    sys.exit(main())


