"""The ``elasticd`` command line: ``run``, ``agent``, ``status``, ``checkpoints``.

Exit codes shared by all subcommands: 0 success, 1 failure, 4 etcd unreachable,
78 configuration error (EX_CONFIG: systemd's ``RestartPreventExitStatus=78`` stops a
restart loop on a config that will never work). ``status`` adds its own health codes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from elasticd import __version__
from elasticd.errors import EX_CONFIG, ConfigError, ElasticdError
from elasticd.etcd.client import TLSFiles
from elasticd.keys import validate_job_name


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4).

    Raises:
        ConfigError: not N or MIN:MAX with 1 <= MIN <= MAX.
    """
    try:
        lo, _, hi = value.partition(":")
        mn, mx = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"--nnodes {value!r}: expected N or MIN:MAX, e.g. 1:4") from None
    if mn < 1 or mx < mn:
        raise ConfigError(f"--nnodes {value!r}: need 1 <= MIN <= MAX")
    return mn, mx


def parse_nproc(value: str) -> int:
    """A positive number, or ``gpu`` (one worker per visible GPU)."""
    if value == "gpu":
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise ConfigError("--nproc-per-node gpu: no GPU is visible; give a number instead")
        return n
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"--nproc-per-node {value!r}: expected a positive number or 'gpu'")
    return int(value)


def add_etcd_flags(p: argparse.ArgumentParser) -> None:
    """Connection flags shared by every subcommand that talks to etcd."""
    g = p.add_argument_group("etcd")
    g.add_argument("--etcd", metavar="HOST:PORT[,...]", help="etcd endpoints (comma-separated)")
    g.add_argument("--etcd-ca", metavar="FILE", help="CA bundle for TLS")
    g.add_argument("--etcd-cert", metavar="FILE", help="client certificate for TLS")
    g.add_argument("--etcd-key", metavar="FILE", help="client key for TLS")
    g.add_argument("--etcd-user", help="etcd user (auth)")
    g.add_argument("--etcd-password-file", metavar="FILE", help="file holding the etcd password")


def tls_from_args(args: argparse.Namespace) -> TLSFiles:
    return TLSFiles(args.etcd_ca, args.etcd_cert, args.etcd_key)


def password_from_args(args: argparse.Namespace) -> str | None:
    if not args.etcd_password_file:
        return None
    try:
        with open(args.etcd_password_file) as fh:
            return fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"--etcd-password-file {args.etcd_password_file!r}: {exc.strerror}") from exc


def _add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a training script on this node (like torchrun)",
                       description="Run a training script under elasticd on this node. "
                       "With --standalone, a private etcd is started on 127.0.0.1.")
    p.add_argument("--standalone", action="store_true", help="start an embedded etcd (single machine)")
    add_etcd_flags(p)
    p.add_argument("--job", default=None, help="job name (letters, digits, -_. ; default 'local' with --standalone)")
    p.add_argument("--nnodes", default="1", help="N or MIN:MAX nodes (default 1)")
    p.add_argument("--nproc-per-node", default="1", help="workers on this node: N or 'gpu'")
    p.add_argument("--node-id", help="this node's id (default HOST-PID)")
    p.add_argument("--local-addr", help="address peers use to reach this node's workers")
    p.add_argument("--max-restarts", type=int, default=3, help="worker-failure restarts (default 3)")
    p.add_argument("--restart-backoff", type=float, default=1.0, help="first restart backoff, s")
    p.add_argument("--node-ttl", type=int, default=5, help="lease TTL in s: a dead node is seen this fast")
    p.add_argument("--join-timeout", type=float, default=600.0, help="max wait for a round, s")
    p.add_argument("--last-call-timeout", type=float, default=1.0,
                   help="wait this long for stragglers once MIN nodes joined, s")
    p.add_argument("--drain-grace", type=float, default=60.0, help="drain grace period, s")
    p.add_argument("--resize-grace", type=float, default=30.0,
                   help="on a join, workers get this long to stop at a step boundary (0=restart at once)")
    p.add_argument("--plain-stop", type=float, default=3.0,
                   help="on a stop, workers that never called should_stop get this long after "
                        "SIGTERM, then SIGKILL, s")
    p.add_argument("--done-exit", type=float, default=30.0,
                   help="workers whose script returned must exit within this, s")
    p.add_argument("--hang-timeout", type=float, default=0.0, help="restart if no step for this long (0=off)")
    p.add_argument("--no-warm-start", dest="warm_start", action="store_false",
                   help="start every worker cold (no standby processes that have imported torch)")
    p.add_argument("--checkpoint-url", help="fsspec URL handed to workers as ELASTICD_CHECKPOINT_URL")
    p.add_argument("--log-format", choices=["auto", "json", "console"], default="auto")
    p.add_argument("--log-dir", help="where worker logs go (default: the runtime dir)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port")
    p.add_argument("command", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...] or -m MODULE [ARGS...]")


def _run_command(args: argparse.Namespace) -> int:
    if args.standalone and args.etcd:
        raise ConfigError("--standalone starts its own etcd; drop --etcd (or drop --standalone)")
    if not args.standalone and not args.etcd:
        raise ConfigError("no etcd: pass --etcd HOST:PORT to join a job, or --standalone for a "
                          "single machine")
    job = validate_job_name(args.job or ("local" if args.standalone else ""))
    mn, mx = parse_nnodes(args.nnodes)
    if args.node_ttl < 2:
        raise ConfigError(f"--node-ttl {args.node_ttl}: etcd's minimum lease TTL is 2 s")
    if not args.resize_grace >= 0:  # also refuses NaN
        raise ConfigError(f"--resize-grace {args.resize_grace}: must be at least 0 "
                          "(0 restarts workers at once when a node joins)")
    for flag, value in (("--plain-stop", args.plain_stop), ("--done-exit", args.done_exit)):
        if not value > 0:  # also refuses NaN
            raise ConfigError(f"{flag} {value}: must be more than 0 seconds")
    command = tuple(args.command[1:] if args.command[:1] == ["--"] else args.command)
    # torch is imported only now, after the flags were validated (a typo answers at once).
    from elasticd.agent.elastic_agent import SupervisionSettings
    from elasticd.agent.runner import NodeSpec, run_node

    spec = NodeSpec(
        job=job, command=command, nproc_per_node=parse_nproc(args.nproc_per_node),
        min_nodes=mn, max_nodes=mx, etcd_endpoints=args.etcd, tls=tls_from_args(args),
        etcd_user=args.etcd_user, etcd_password=password_from_args(args), node_id=args.node_id,
        local_addr=args.local_addr or ("127.0.0.1" if args.standalone else None),
        node_ttl_s=args.node_ttl, join_timeout_s=args.join_timeout,
        last_call_timeout_s=args.last_call_timeout,
        supervision=SupervisionSettings(
            max_restarts=args.max_restarts, restart_backoff_s=args.restart_backoff,
            drain_grace_s=args.drain_grace, resize_grace_s=args.resize_grace,
            plain_stop_s=args.plain_stop, done_exit_s=args.done_exit,
            hang_timeout_s=args.hang_timeout,
            attribution_window_s=args.node_ttl + 1.0, checkpoint_url=args.checkpoint_url,
            warm_start=args.warm_start),
        log_format=args.log_format, log_dir=args.log_dir, metrics_port=args.metrics_port or None,
        notify_socket=os.environ.get("NOTIFY_SOCKET"), watchdog_usec=os.environ.get("WATCHDOG_USEC"),
    )
    return run_node(spec)


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad flags; we exit 78 (EX_CONFIG) like every config error,
    so a health check never reads a typo as "job not training" (status exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EX_CONFIG)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="elasticd", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"elasticd {__version__}")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    _add_run_parser(sub)
    for name in ("elasticd.agent.cli", "elasticd.status.cli", "elasticd.cli_checkpoints"):
        try:
            module = __import__(name, fromlist=["add_parser"])
        except ImportError:
            continue
        before = set(sub.choices)
        module.add_parser(sub)
        for new in set(sub.choices) - before:
            if sub.choices[new].get_default("func") is None:
                sub.choices[new].set_defaults(func=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.subcommand == "run":
            return _run_command(args)
        return int(args.func(args))
    except ConfigError as exc:
        sys.stderr.write(f"elasticd: configuration error: {exc}\n")
        return EX_CONFIG
    except ElasticdError as exc:
        sys.stderr.write(f"elasticd: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
