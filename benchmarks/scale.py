"""Rendezvous at scale: elasticd's etcd-v3 handler against torch's c10d dynamic rendezvous.

N simulated nodes are N rendezvous handlers (no workers), spread over a few child
processes, each handler with a connection of its own:

- ``elasticd``: ``EtcdRendezvousHandler`` with its own ``EtcdClient`` (lease, two
  watches), ``RendezvousSettings(min_nodes=N, max_nodes=N, node_ttl_s=5)``, against one
  embedded etcd started fresh for each N;
- ``torch``: ``dynamic_rendezvous.create_handler`` over ``C10dRendezvousBackend`` on a
  ``TCPStore`` client of its own (torch's defaults: keep-alive every 5 s), against one
  TCPStore server in this process, started fresh for each N.

All handlers are built and connected first, then released at once; "round" is the time
from the release to the last handler returning from ``next_rendezvous``. Then, after a
short settle, the steady state is measured over ``--window`` seconds:

- elasticd: etcd's own Prometheus counters (``/metrics`` on the client port), sampled
  before and after: requests by gRPC method (``grpc_server_msg_received_total``), bytes
  received from clients (``etcd_network_client_grpc_received_bytes_total``), puts and
  txns, bytes appended to the WAL (``etcd_disk_wal_write_bytes_total``);
- torch: the TCPStore has no counters, so the clients reach it through a byte-counting
  TCP proxy in this process (one thread, ``selectors``); requests are counted as
  client-to-server writes in the proxy, bytes as TCP payload in each direction. The
  proxy adds a copy per message, not round trips.

Usage::

    .venv/bin/python benchmarks/scale.py                      # N = 8, 32, 128; ~7 min
    .venv/bin/python benchmarks/scale.py --sizes 8,32 --window 10 --no-doc   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    PY,
    ROOT,
    free_port,
    machine_info,
    machine_line,
    other_load,
    replace_generated_block,
    scrape_etcd,
    sigterm_as_interrupt,
    stat_fields,
)

ETCD_COUNTERS = {
    "requests": ("grpc_server_msg_received_total", None),
    "keepalives": ("grpc_server_msg_received_total", 'grpc_method="LeaseKeepAlive"'),
    "bytes_in": ("etcd_network_client_grpc_received_bytes_total", None),
    "bytes_out": ("etcd_network_client_grpc_sent_bytes_total", None),
    "puts": ("etcd_mvcc_put_total", None),
    "txns": ("etcd_mvcc_txn_total", None),
    "wal_bytes": ("etcd_disk_wal_write_bytes_total", None),
}


# -- child process: K simulated nodes ------------------------------------------------------
def child_main(args: argparse.Namespace) -> int:
    """Build ``--count`` handlers, say "ready", wait for "go", rendezvous, report, wait for "stop"."""
    handlers = build_handlers(args)
    print(json.dumps({"ready": len(handlers)}), flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    done: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def join(h: object) -> None:
        try:
            h.next_rendezvous()  # type: ignore[attr-defined]
            with lock:
                done.append(time.time())
        except Exception as exc:  # report, the parent decides
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=args.round_timeout)
    print(json.dumps({"done": done, "errors": errors[:3]}), flush=True)
    sys.stdin.readline()  # "stop" (or EOF: the parent is gone)
    for h in handlers:
        try:
            h.shutdown()  # type: ignore[attr-defined]
        except Exception:
            pass
    os._exit(0)  # skip joining gRPC/TCPStore threads of hundreds of clients


def build_handlers(args: argparse.Namespace) -> list[object]:
    if args.child == "elasticd":
        from elasticd.etcd.client import EtcdClient
        from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler
        from elasticd.rendezvous.settings import RendezvousSettings

        settings = RendezvousSettings(min_nodes=args.total, max_nodes=args.total, node_ttl_s=5,
                                      join_timeout_s=args.round_timeout, local_addr="127.0.0.1")
        return [EtcdRendezvousHandler(EtcdClient(args.endpoint), args.job, settings,
                                      node_id=f"sim-{args.first + i}") for i in range(args.count)]
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    host, port = args.endpoint.rsplit(":", 1)
    out = []
    for _ in range(args.count):
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=args.round_timeout))
        params = RendezvousParameters("c10d", args.endpoint, args.job, args.total, args.total,
                                      local_addr="127.0.0.1", join_timeout=str(int(args.round_timeout)))
        out.append(create_handler(store, C10dRendezvousBackend(store, args.job), params))
    return out


# -- the byte-counting proxy in front of the TCPStore ----------------------------------------
class CountingProxy:
    """A one-thread TCP proxy that counts payload bytes and client writes (requests)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.bytes_in = 0  # client -> server
        self.bytes_out = 0  # server -> client
        self.writes = 0  # client recv() chunks ~ requests (TCPStore sends one per call)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="proxy", daemon=True)

    def start(self) -> CountingProxy:
        self._thread.start()
        return self

    def counters(self) -> dict[str, float]:
        return {"requests": self.writes, "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self.sel.select(timeout=0.2):
                if key.data is None:
                    self._accept()
                    continue
                src, dst, from_client = key.data
                try:
                    chunk = src.recv(65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    self._drop(src, dst)
                    continue
                if from_client:
                    self.bytes_in += len(chunk)
                    self.writes += 1
                else:
                    self.bytes_out += len(chunk)
                try:
                    dst.setblocking(True)
                    dst.sendall(chunk)
                    dst.setblocking(False)
                except OSError:
                    self._drop(src, dst)

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.target_port))
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
        self.sel.register(client, selectors.EVENT_READ, (client, server, True))
        self.sel.register(server, selectors.EVENT_READ, (server, client, False))

    def _drop(self, a: socket.socket, b: socket.socket) -> None:
        for s in (a, b):
            try:
                self.sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.listener.close()


# -- the parent ------------------------------------------------------------------------------
def run_size(system: str, n: int, args: argparse.Namespace, workdir: Path) -> dict:
    """One round of N simulated nodes, then the steady-state counters over the window."""
    procs: list[subprocess.Popen] = []
    etcd = store = proxy = None
    result: dict = {"system": system, "n": n}
    try:
        if system == "elasticd":
            from elasticd.etcd.embedded import EmbeddedEtcd

            etcd = EmbeddedEtcd(data_dir=str(workdir / f"etcd-{n}")).start()
            endpoint = etcd.endpoint
            sample = lambda: scrape_etcd(endpoint, ETCD_COUNTERS)  # noqa: E731
        else:
            from datetime import timedelta

            from torch.distributed import TCPStore

            store = TCPStore("127.0.0.1", free_port(), is_master=True, multi_tenant=True,
                             timeout=timedelta(seconds=args.round_timeout), wait_for_workers=False)
            proxy = CountingProxy(store.port).start()
            endpoint = f"127.0.0.1:{proxy.port}"
            sample = proxy.counters
        job = f"scale-{system}-{n}"
        # Few handlers per process: with dozens, one process's threads starve each other of
        # the GIL and leases (TTL 5 s) expire, which a real node would not see.
        nprocs = max(1, min(args.procs or -(-n // 16), n))
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
        first = 0
        for i in range(nprocs):
            count = n // nprocs + (1 if i < n % nprocs else 0)
            with open(workdir / f"{system}-{n}-{i}.err", "w") as err:
                procs.append(subprocess.Popen(
                    [PY, __file__, "--child", system, "--endpoint", endpoint, "--job", job,
                     "--count", str(count), "--total", str(n), "--first", str(first),
                     "--round-timeout", str(args.round_timeout)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                    cwd=str(ROOT), env=env, start_new_session=True))
            first += count
        for p in procs:
            _expect(p, "ready", args.round_timeout)
        at_go, cpu_go = sample(), sum(cpu_s(p.pid) for p in procs)
        go = time.time()
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        done, errors = [], []
        for p in procs:
            rep = _expect(p, "done", args.round_timeout + 30)
            done += rep["done"]
            errors += rep["errors"]
        at_done, cpu_done = sample(), sum(cpu_s(p.pid) for p in procs)
        result["round_per_node"] = {k: (at_done[k] - at_go[k]) / n for k in at_done}
        result["round_cpu_ms_per_node"] = 1000.0 * (cpu_done - cpu_go) / n
        result["completed"] = len(done)
        result["round_s"] = (max(done) - go) if len(done) == n else None
        result["errors"] = errors[:3]
        if len(done) == n:
            time.sleep(args.settle)
            before, t_before = sample(), time.monotonic()
            time.sleep(args.window)
            after, t_after = sample(), time.monotonic()
            minutes = (t_after - t_before) / 60.0
            result["per_node_min"] = {k: (after[k] - before[k]) / n / minutes for k in after}
            result["window_s"] = t_after - t_before
    finally:
        for p in procs:
            try:
                p.stdin.write("stop\n")  # type: ignore[union-attr]
                p.stdin.close()  # type: ignore[union-attr]
            except (OSError, ValueError):
                pass
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait(timeout=10)
        if proxy is not None:
            proxy.close()
        if store is not None:
            del store
        if etcd is not None:
            etcd.stop()
    return result


def _expect(p: subprocess.Popen, key: str, timeout_s: float) -> dict:
    """Read the child's next JSON line carrying ``key`` (bounded wait)."""
    box: dict = {}

    def read() -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if key in rec:
                box.update(rec)
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout_s)
    if not box:
        raise RuntimeError(f"simulated nodes did not report {key!r} within {timeout_s:.0f}s "
                           f"(see the .err files of this run)")
    return box


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process and its reaped children."""
    fields = stat_fields(pid)
    return sum(int(x) for x in fields[11:15]) / 100.0 if fields else 0.0


def fmt(x: float | None, spec: str = "{:,.0f}") -> str:
    return "n/a" if x is None else spec.format(x)


def report(results: list[dict], info: dict, argv: list[str], busy: list[str], window: float) -> str:
    rows = ["| N | launcher | round (s) | round: CPU ms /node | round: requests /node | "
            "round: bytes in+out /node | "
            "requests /node/min | keep-alives /node/min | bytes in /node/min | bytes out /node/min | "
            "puts+txns /node/min | WAL bytes /node/min |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(results, key=lambda r: (r["n"], r["system"])):
        m = r.get("per_node_min") or {}
        rp = r.get("round_per_node") or {}
        round_cells = (f"{fmt(r.get('round_cpu_ms_per_node'))} | {fmt(rp.get('requests'), '{:,.0f}')} | "
                       f"{fmt(rp['bytes_in'] + rp['bytes_out'] if rp else None)}")
        name = "elasticd (etcd v3)" if r["system"] == "elasticd" else "torch c10d"
        rnd = fmt(r.get("round_s"), "{:.2f}") if r.get("round_s") is not None else \
            f"incomplete ({r.get('completed', 0)}/{r['n']})"
        etcd_only = r["system"] == "elasticd"
        rows.append(f"| {r['n']} | {name} | {rnd} | {round_cells} | {fmt(m.get('requests'), '{:,.1f}')} | "
                    f"{fmt(m.get('keepalives'), '{:,.1f}') if etcd_only else '–'} | "
                    f"{fmt(m.get('bytes_in'))} | {fmt(m.get('bytes_out'))} | "
                    f"{fmt((m.get('puts', 0) + m.get('txns', 0)) if m else None, '{:,.1f}') if etcd_only else '–'} | "
                    f"{fmt(m.get('wal_bytes')) if etcd_only else '–'} |")
    shared = (f"The machine was shared while this ran (other busy processes at the start: "
              f"{len(busy)}); round times are ±30 %, the counts are exact. ") if busy else ""
    return "\n".join([
        f"Measured {machine_line(info)}. {shared}",
        "",
        "```",
        f".venv/bin/python benchmarks/scale.py {' '.join(argv)}".rstrip(),
        "```",
        "",
        f"N simulated nodes = N rendezvous handlers (no workers) in a few processes, each with "
        f"its own connection. Round: release of all handlers → the last one returns from "
        f"`next_rendezvous`; its requests and bytes are counted from the release to the last "
        f"return, its CPU is that of the simulating processes (client side only). Steady state: counters over {window:.0f} s after the round, "
        "per node per minute. elasticd: etcd's `/metrics` (`grpc_server_msg_received_total`, "
        "`etcd_network_client_grpc_{received,sent}_bytes_total`, `etcd_mvcc_{put,txn}_total`, "
        "`etcd_disk_wal_write_bytes_total`), `node_ttl_s=5`. torch: `create_handler` + "
        "`C10dRendezvousBackend` with defaults (keep-alive every 5 s), through a "
        "byte-counting TCP proxy in front of the TCPStore (requests = client writes seen by "
        "the proxy; bytes = TCP payload).",
        "",
        *rows,
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8,32,128", help="comma-separated N (256 overloads 2 cores)")
    p.add_argument("--systems", default="elasticd,torch")
    p.add_argument("--window", type=float, default=30.0, help="steady-state window, s")
    p.add_argument("--settle", type=float, default=3.0, help="wait after the round, s")
    p.add_argument("--procs", type=int, default=0, help="child processes per N (0: one per 16 nodes)")
    p.add_argument("--round-timeout", type=float, default=120.0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--no-doc", action="store_true")
    # child mode (internal)
    p.add_argument("--child", choices=["elasticd", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    p.add_argument("--total", type=int, help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args)
    import tempfile

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="elasticd-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    info, busy = machine_info(), other_load()
    results = []
    started = time.time()
    with sigterm_as_interrupt():
        for n in [int(x) for x in args.sizes.split(",") if x]:
            for system in [s for s in args.systems.split(",") if s]:
                try:
                    r = run_size(system, n, args, workdir)
                except RuntimeError as exc:
                    r = {"system": system, "n": n, "error": str(exc)}
                results.append(r)
                print(json.dumps(r), flush=True)
    (workdir / "results.json").write_text(json.dumps({"machine": info, "results": results,
                                                      "wall_s": time.time() - started}, indent=1))
    text = report(results, info, sys.argv[1:], busy, args.window)
    if not args.no_doc:
        replace_generated_block("Rendezvous at scale", "scale", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
