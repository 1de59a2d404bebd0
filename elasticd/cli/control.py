"""``elasticd stop``, ``elasticd drain``, ``elasticd start``: control a job from one place.

- ``elasticd stop --job J``: every node drains (all ranks stop after the same step, save,
  exit 0, the agents leave), and the job stays stopped: an agent that starts later (systemd,
  a reboot) exits 0 without joining.
- ``elasticd drain --job J --node N``: only node N drains and leaves (e.g. before
  maintenance); the others go on without it, no step lost. N stays out until cleared.
- ``elasticd start --job J [--node N]``: clears the stop (and every drain), or N's drain;
  agents started after that join again. Without ``--node`` it also reopens a *finished*
  job (the only way to: an agent arriving at a finished job exits 0 without joining).

``stop`` and ``drain`` are fenced writes to etcd (elasticd.stopmarks: only if the job and
the node exist) made with the same connection flags, TLS and auth as ``elasticd status``
(one connection path: ``elasticd.status.options``), then they wait, with a progress line
on stderr, until the node(s) left or ``--wait`` seconds passed.

Exit codes: 0 done, 1 timed out (the mark stays: the agents still stop), 3 unknown job or
node (nothing written), 4 etcd unreachable, 78 bad flags.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from elasticd.errors import EX_CONFIG, ConfigError, EtcdUnavailableError
from elasticd.etcd.client import EtcdClient
from elasticd.keys import JobKeys, validate_node_id
from elasticd.records import CheckpointPointer, NodeRecord, Progress, RecordError
from elasticd.rendezvous.finished import reopen_finished
from elasticd.sensitive import scrub_text
from elasticd.status.options import add_etcd_connection_flags
from elasticd.stopmarks import (
    NotFoundError,
    clear_marks,
    live_nodes,
    operator_name,
    write_drain,
    write_stop,
)

DEFAULT_WAIT_S = 180.0  # above the default drain grace (60 s) plus a re-formation
EXIT_TIMED_OUT = 1
_PROGRESS_EVERY_S = 5.0


def add_parser(sub: Any) -> None:
    """Add ``stop``, ``drain`` and ``start`` to the ``elasticd`` subparsers."""
    stop = sub.add_parser(
        "stop", help="drain every node of a job and keep it stopped",
        description="Drain the whole job: every node stops after the same step, saves and "
                    "leaves; agents started later exit 0 until `elasticd start --job J`. "
                    "Exit: 0 stopped, 1 timed out, 3 unknown job, 4 etcd unreachable.")
    drain = sub.add_parser(
        "drain", help="drain one node of a job (it leaves, the job goes on)",
        description="Drain one node: its workers stop after the same step as their peers, "
                    "save, and it leaves; the job re-forms without it (no step lost). It "
                    "stays out until `elasticd start --job J --node N`. Exit: 0 drained, "
                    "1 timed out, 3 unknown job or node, 4 etcd unreachable.")
    start = sub.add_parser(
        "start", help="clear a stop (or one node's drain) so agents join again",
        description="Clear `elasticd stop` (and every drain) of a job, or with --node one "
                    "node's drain; without --node, also reopen a job that finished (agents "
                    "arriving at a finished job exit 0 until then). Agents started after "
                    "this join again. Exit: 0 done, 1 a finished job's agents are still "
                    "leaving, 3 unknown job, 4 etcd unreachable.")
    for p, node_required in ((stop, False), (drain, True), (start, False)):
        p.add_argument("--job", required=True, metavar="NAME", help="the job")
        if p is not stop:
            p.add_argument("--node", required=node_required, metavar="NODE",
                           help="node id (as in `elasticd status --job J`)")
        add_etcd_connection_flags(p, timeout_type=float)
        if p is not start:
            p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS",
                           help=f"wait this long for the drain to finish (default "
                                f"{DEFAULT_WAIT_S:g}; 0: do not wait)")
            p.add_argument("--reason", default="", metavar="TEXT",
                           help="why (shown in the agents' logs and the job's events)")
        p.set_defaults(func=run)


def run(args: argparse.Namespace, *, out: IO[str] | None = None, err: IO[str] | None = None,
        sleep: Callable[[float], None] = time.sleep) -> int:
    """Run ``stop``, ``drain`` or ``start`` with parsed ``args``; returns the exit code."""
    from elasticd.status.options import make_client, options_from_args, unreachable_message

    out, err = out or sys.stdout, err or sys.stderr
    prog = f"elasticd {args.subcommand}"

    def fail(code: int, message: str) -> int:
        print(f"{prog}: {scrub_text(message)}", file=err, flush=True)
        return code

    try:
        if not args.timeout > 0:
            raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout:g}")
        opts = options_from_args(args)
        node = validate_node_id(args.node) if getattr(args, "node", None) else None
        client = make_client(opts)
    except ConfigError as exc:
        return fail(EX_CONFIG, str(exc))
    keys = JobKeys(args.job)
    try:
        if args.subcommand == "start":
            return _start(client, keys, node, out)
        reason = args.reason or ""
        if node is None:
            write_stop(client, keys, reason=reason, by=operator_name())
            print(f"{prog}: job {keys.job!r} marked stopped; every node drains", file=err, flush=True)
        else:
            write_drain(client, keys, node, reason=reason, by=operator_name())
            print(f"{prog}: node {node!r} of job {keys.job!r} marked drained", file=err, flush=True)
        if args.wait <= 0:
            return 0
        if not wait_for_drain(client, keys, node, args.wait, err=err, prog=prog, sleep=sleep):
            left = ", ".join(sorted(_remaining(client, keys, node))) or "?"
            return fail(EXIT_TIMED_OUT, f"timed out after {args.wait:g}s; still running: {left}. "
                        "The mark stays, so they stop when they can (their drain grace); "
                        f"see `elasticd status --job {keys.job}`")
        print(_done_line(client, keys, node), file=out, flush=True)
        return 0
    except NotFoundError as exc:
        return fail(exc.exit_code, str(exc))
    except EtcdUnavailableError as exc:
        return fail(exc.exit_code, unreachable_message(opts, exc))
    except ConfigError as exc:
        return fail(EX_CONFIG, str(exc))
    finally:
        client.close()


def _start(client: EtcdClient, keys: JobKeys, node: str | None, out: IO[str]) -> int:
    removed = clear_marks(client, keys, node)
    what = f"node {node!r} of job {keys.job!r}" if node else f"job {keys.job!r}"
    if node is None:
        # A finished job is reopened only here, on purpose (elasticd.rendezvous.finished).
        reopen = reopen_finished(client, keys)
        if reopen.live:
            print(f"{what} finished and {len(reopen.live)} of its agents are still leaving "
                  f"({', '.join(reopen.live)}); run `elasticd start --job {keys.job}` again "
                  "once they are gone", file=out, flush=True)
            return EXIT_TIMED_OUT
        if reopen.reopened:
            print(f"{what} had finished: reopened for another run; agents started now form "
                  "round 0 and resume from its newest checkpoint (e.g. `systemctl start "
                  "elasticd` on each node)", file=out, flush=True)
            return 0
    if not removed:
        print(f"{what} was neither stopped nor drained: nothing to clear", file=out, flush=True)
    else:
        print(f"{what}: cleared ({len(removed)} mark{'s' if len(removed) > 1 else ''}); agents "
              "started now join again (e.g. `systemctl start elasticd` on each node)",
              file=out, flush=True)
    return 0


def _remaining(client: EtcdClient, keys: JobKeys, node: str | None) -> dict[str, NodeRecord | None]:
    live = live_nodes(client, keys)
    return {n: r for n, r in live.items() if node is None or n == node}


def _read(client: EtcdClient, key: str, cls: Any) -> Any:
    kv = client.get(key)
    if kv is None:
        return None
    try:
        return cls.from_json(kv.value)
    except RecordError:
        return None


def progress_line(remaining: dict[str, NodeRecord | None], step: int | None, elapsed_s: float,
                  wait_s: float) -> str:
    """One progress line: who is still there, in what state, at which step. Pure."""
    nodes = ", ".join(f"{n} ({r.state})" if r else n for n, r in sorted(remaining.items()))
    at = f"; step {step}" if step is not None else ""
    return (f"waiting for {len(remaining)} node{'s' if len(remaining) != 1 else ''} to drain "
            f"and leave: {nodes}{at} ({elapsed_s:.0f}s of {wait_s:g}s)")


def wait_for_drain(client: EtcdClient, keys: JobKeys, node: str | None, wait_s: float, *,
                   err: IO[str], prog: str, sleep: Callable[[float], None] = time.sleep,
                   clock: Callable[[], float] = time.monotonic) -> bool:
    """Poll until no live node (``node`` None) or ``node`` is gone; print progress.

    A line is printed when the nodes' states or the step change, and at least every
    5 seconds. Returns True when done, False once ``wait_s`` passed.
    """
    start = clock()
    shown: tuple[Any, ...] | None = None
    shown_at = 0.0
    while True:
        remaining = _remaining(client, keys, node)
        if not remaining:
            return True
        now = clock()
        if now - start >= wait_s:
            return False
        progress = _read(client, keys.progress, Progress)
        step = progress.step if progress else None
        state = (tuple(sorted((n, r.state if r else "?") for n, r in remaining.items())), step)
        if state != shown or now - shown_at >= _PROGRESS_EVERY_S:
            print(f"{prog}: {progress_line(remaining, step, now - start, wait_s)}", file=err, flush=True)
            shown, shown_at = state, now
        sleep(0.25)


def _done_line(client: EtcdClient, keys: JobKeys, node: str | None) -> str:
    pointer = _read(client, keys.checkpoint_latest, CheckpointPointer)
    ckpt = (f"newest checkpoint at step {pointer.step}" if pointer
            else "no checkpoint committed through etcd")
    if node is None:
        return (f"job {keys.job!r} stopped: every node left; {ckpt}. Agents started now exit 0; "
                f"`elasticd start --job {keys.job}` lets them join again")
    return (f"node {node!r} drained and left job {keys.job!r} ({ckpt}); the job goes on "
            f"without it. It stays out until `elasticd start --job {keys.job} --node {node}`")
