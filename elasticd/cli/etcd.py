"""`elasticd etcd`: a local etcd (one member, or a cluster of N) in the foreground.

For trials on one machine: start it in one terminal, pass the endpoints it prints to
``elasticd run --etcd`` in others, press Ctrl-C (or send SIGTERM) to stop every member.
``--members 3`` runs a 3-member cluster on loopback, so a trial can kill, freeze or
restart a member (their PIDs are printed) and watch the job ride through. Production etcd
runs on separate machines (docs/deployment.md, "etcd cluster"). Exit codes::

    0  stopped on Ctrl-C/SIGTERM      78 bad flags, or a data dir made for another size
    4  etcd did not start (its log is quoted)

A member that exits (a trial killed it) is reported once; the others keep serving.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any

from elasticd import boundedjson
from elasticd.errors import ConfigError

PROG = "elasticd etcd"
LAYOUT_FILE = "cluster.json"  # member ports, so a restart on the same data dir keeps them


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``etcd`` subcommand to an argparse subparsers object.

    Returns:
        The new parser (its ``func`` default is :func:`run`).
    """
    p = subparsers.add_parser(
        "etcd", help="run a local etcd (or a local N-member cluster) in the foreground",
        description="Start etcd on 127.0.0.1 for trials on one machine and print the --etcd "
                    "value to use (every member's client endpoint). Ctrl-C or SIGTERM stops "
                    "it. Exit codes: 0 stopped, 4 etcd did not start, 78 bad flags.",
    )
    p.add_argument("--members", type=int, default=1, metavar="N",
                   help="cluster size (default 1; 3 for a local cluster that survives a member)")
    p.add_argument("--data-dir", metavar="DIR",
                   help="keep the data (and the ports) here across runs; a temp dir removed "
                        "on exit when omitted")
    p.set_defaults(func=run)
    return p


def _layout(data_dir: str | None, members: int) -> list[tuple[int, int]] | None:
    """The (client, peer) ports a previous run on ``data_dir`` used, or None.

    Raises:
        ConfigError: the data dir holds a cluster of another size.
    """
    if data_dir is None:
        return None
    path = os.path.join(data_dir, LAYOUT_FILE)
    try:
        layout = boundedjson.load_file(path, what=LAYOUT_FILE, max_bytes=64 * 1024)
        ports = [tuple(p) for p in layout["ports"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is unreadable ({exc}); remove --data-dir {data_dir} to "
                          "start afresh") from exc
    if len(ports) != members:
        raise ConfigError(f"--data-dir {data_dir} holds a {len(ports)}-member cluster, not "
                          f"{members}: pass --members {len(ports)}, or another --data-dir")
    return [(int(c), int(p)) for c, p in ports]


def run(args: argparse.Namespace) -> int:
    """Run the cluster until Ctrl-C/SIGTERM or until a member exits."""
    from elasticd.etcd.cluster import EmbeddedEtcdCluster
    from elasticd.logs import configure_logging

    if not 1 <= args.members <= 9:
        raise ConfigError(f"--members {args.members}: give 1 to 9 (3 or 5 for a cluster "
                          "that survives one or two members)")
    configure_logging("auto", level="warning")
    data_dir = os.path.abspath(args.data_dir) if args.data_dir else None
    ports = _layout(data_dir, args.members)
    cluster = EmbeddedEtcdCluster(args.members, data_dir)
    if ports is not None:
        for m, (client_port, peer_port) in zip(cluster.members, ports, strict=True):
            m.client_port, m.peer_port = client_port, peer_port
        cluster.refresh_initial_cluster()
    stop = threading.Event()
    # Handlers only set a flag; the main thread stops etcd.
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster.start()
        if data_dir is not None:
            with open(os.path.join(data_dir, LAYOUT_FILE), "w") as fh:
                json.dump({"ports": [[m.client_port, m.peer_port] for m in cluster.members]}, fh)
        where = data_dir or f"{cluster.root_dir} (removed on exit)"
        pids = ", ".join(f"{m.name}={m.pid}" for m in cluster.members)
        sys.stderr.write(f"etcd is up: {args.members} member(s), data in {where}; pids {pids}\n"
                         "use it with:\n")
        sys.stdout.write(f"--etcd {cluster.endpoints}\n")
        sys.stdout.flush()
        sys.stderr.write("note: it serves clients in plaintext without auth: every local user can "
                         "read and write it (for trials; its peer ports use TLS); use "
                         "`elasticd run --standalone` for a private etcd\n"
                         "Ctrl-C stops it\n")
        sys.stderr.flush()
        reported: set[str] = set()
        while not stop.wait(0.5):
            for m in cluster.members:
                if m.name not in reported and m.proc is not None and m.proc.poll() is not None:
                    reported.add(m.name)
                    sys.stderr.write(f"{PROG}: member {m.name} exited (code {m.proc.returncode}); "
                                     "the others serve while a quorum is up (its log: etcd.log "
                                     "in its data dir)\n")
                    sys.stderr.flush()
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        cluster.stop()
