"""How long after etcd is reachable again does a client that kept failing get through?

gRPC reconnects a broken channel with an exponential backoff (by default from 1 s up to
120 s); a channel refused for a while waits out its current backoff even once etcd answers.
A TCP proxy on 127.0.0.1 in front of a live etcd refuses connections (closes its listening
socket and every forwarded connection) for ``--down`` seconds while an ``EtcdClient`` keeps
calling every 0.25 s (an agent's keep-alive when failing), then accepts again; the figure is
the time from the proxy accepting again to the client's first successful call.

Two backoffs in the same run, alternating: elasticd's (``RECONNECT_BACKOFF_MS``, at most
1 s between attempts) and gRPC's defaults (initial 1 s, at most 120 s).

Usage::

    .venv/bin/python benchmarks/grpc_reconnect.py --down 8,15,25
"""

from __future__ import annotations

import argparse
import select
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine_info, machine_line, replace_generated_block  # noqa: E402
from elasticd.etcd import client as client_mod  # noqa: E402
from elasticd.etcd.client import EtcdClient  # noqa: E402
from elasticd.etcd.embedded import EmbeddedEtcd, free_port  # noqa: E402

GRPC_DEFAULT_MS = (1000, 120_000)


class RefusingProxy:
    """Forwards 127.0.0.1:port to etcd; ``refuse()`` closes it all until ``accept()``."""

    def __init__(self, target_port: int) -> None:
        self.port, self.target = free_port(), target_port
        self.open = threading.Event()
        self.open.set()
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def refuse(self) -> None:
        self.open.clear()

    def accept(self) -> None:
        self.open.set()

    def stop(self) -> None:
        self._stop.set()
        self.open.set()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self.open.wait()
            lsock = socket.socket()
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind(("127.0.0.1", self.port))
            lsock.listen(64)
            lsock.settimeout(0.05)
            while self.open.is_set() and not self._stop.is_set():
                try:
                    conn, _ = lsock.accept()
                except TimeoutError:
                    continue
                upstream = socket.create_connection(("127.0.0.1", self.target))
                threading.Thread(target=self._pipe, args=(conn, upstream), daemon=True).start()
            lsock.close()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while self.open.is_set() and not self._stop.is_set():
                ready, _, _ = select.select([a, b], [], [], 0.1)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        raise OSError("closed")
                    (b if s is a else a).sendall(data)
        except OSError:
            pass
        finally:
            a.close()
            b.close()


def one(proxy: RefusingProxy, down_s: float, backoff_ms: tuple[int, int]) -> float:
    """Seconds from the proxy accepting again to the client's first successful call."""
    saved = client_mod.RECONNECT_BACKOFF_MS
    client_mod.RECONNECT_BACKOFF_MS = backoff_ms  # read when the client opens its channel
    client = EtcdClient(f"127.0.0.1:{proxy.port}", timeout_s=2.0)
    try:
        client.put("/bench/k", b"v")
        proxy.refuse()
        start = time.monotonic()
        while time.monotonic() - start < down_s:  # the outage, with the agent's calls
            try:
                client.get("/bench/k")
            except Exception:  # refused: that is the point
                pass
            time.sleep(0.25)
        proxy.accept()
        back = time.monotonic()
        while True:
            try:
                client.get("/bench/k")
                return time.monotonic() - back
            except Exception:
                if time.monotonic() - back > 180:
                    raise
                time.sleep(0.05)
    finally:
        client_mod.RECONNECT_BACKOFF_MS = saved
        client.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--down", default="8,15,25", help="outage lengths (s), comma-separated")
    p.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md")
    args = p.parse_args()
    downs = [float(x) for x in args.down.split(",")]
    info = machine_info()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedEtcd(str(Path(tmp) / "etcd"))
        server.start()
        proxy = RefusingProxy(int(server.endpoint.rsplit(":", 1)[1]))
        try:
            for i, down in enumerate(downs):
                kinds = [("elasticd", client_mod.RECONNECT_BACKOFF_MS), ("gRPC default", GRPC_DEFAULT_MS)]
                got = {}
                for name, ms in (kinds if i % 2 == 0 else kinds[::-1]):
                    got[name] = one(proxy, down, ms)
                    print(f"down {down:g} s, {name}: {got[name]:.2f} s", flush=True)
                rows.append(f"| {down:g} | {got['elasticd']:.2f} | {got['gRPC default']:.2f} |")
        finally:
            proxy.stop()
            server.stop(remove_data=True)
    cmd = " ".join(["benchmarks/grpc_reconnect.py", *sys.argv[1:]])
    body = f"""{machine_line(info)}

```
.venv/bin/python {cmd}
```

A TCP proxy on 127.0.0.1 in front of a live etcd refuses connections for the outage while
an `EtcdClient` calls every 0.25 s; seconds from the proxy accepting again to the client's
first successful call. elasticd: reconnect backoff {client_mod.RECONNECT_BACKOFF_MS[0]}–{client_mod.RECONNECT_BACKOFF_MS[1]} ms;
gRPC default: 1 s growing to 120 s. The two alternate in one run.

| outage (s) | elasticd (s) | gRPC default (s) |
|---:|---:|---:|
{chr(10).join(rows)}"""
    print(body)
    if not args.no_doc:
        replace_generated_block("Watches after an etcd restart (issue 49)", "grpc_reconnect", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
