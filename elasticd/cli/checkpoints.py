"""`elasticd checkpoints URL`: what is stored, and would a worker load it.

Reads storage directly (fsspec), so it works without etcd or any agent. One row per save
directory: job, step, save time, size, saving world size, and validity as a reader would
judge it (manifest verifies, belongs to the job, every file present with its size);
``--verify`` also re-reads every file, checks its CRC and loads the state file as the loader does
(weights_only). Exit codes::

    0  every checkpoint listed is valid     3  no checkpoints found
    1  some are invalid (readers skip them) 78 bad flags, URL or job name (EX_CONFIG)
       or storage could not be read

The CLI parser imports nothing heavy: torch is loaded only by ``--verify``.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from typing import IO, Any

from elasticd.errors import EX_CONFIG, ConfigError

PROG = "elasticd checkpoints"
EXIT_OK, EXIT_INVALID, EXIT_NONE = 0, 1, 3
JSON_VERSION = 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``checkpoints`` subcommand to an argparse subparsers object.

    Returns:
        The new parser (its ``func`` default is :func:`run`).
    """
    p = subparsers.add_parser(
        "checkpoints", help="list stored checkpoints and check they are loadable",
        description="List the checkpoints under an fsspec URL (file://, s3://, gs://, "
                    "memory://) with step, time, size, world size and validity. Exit "
                    "codes: 0 all valid, 1 some invalid or storage unreadable, 3 none "
                    "found, 78 bad flags.",
    )
    p.add_argument("url", metavar="URL", help="checkpoint root, e.g. s3://bucket/ckpt "
                                              "(the agent's --checkpoint-url)")
    p.add_argument("--job", metavar="NAME", help="one job; without it, every job under URL")
    p.add_argument("--json", action="store_true", help="print a JSON document instead of a table")
    p.add_argument("--verify", action="store_true",
                   help="re-read every data file, check its checksum and that it loads "
                        "(weights_only; reads everything)")
    p.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option, repeatable, e.g. -o endpoint_url=http://minio:9000 "
                        "(VALUE is parsed as JSON when it can be: anon=true)")
    p.set_defaults(func=run)
    return p


def parse_storage_options(items: list[str]) -> dict[str, Any]:
    """``["endpoint_url=http://x", "anon=true"]`` -> ``{"endpoint_url": "http://x", "anon": True}``.

    Raises:
        ConfigError: an item without ``=`` or with an empty key.
    """
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--storage-option {item!r}: expected KEY=VALUE, "
                              "e.g. endpoint_url=http://127.0.0.1:9000")
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value
    return options


def run(args: argparse.Namespace, *, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Run ``elasticd checkpoints`` with parsed ``args``; returns the exit code (never raises).

    Args:
        args: namespace from the parser built by :func:`add_parser`.
        out, err: where to print (default: stdout and stderr).
    """
    out = out or sys.stdout
    err = err or sys.stderr
    # Imported here so `elasticd --help` and other subcommands stay fast.
    from elasticd.checkpoint.catalog import list_checkpoints

    try:
        options = parse_storage_options(list(getattr(args, "storage_option", None) or []))
        infos = list_checkpoints(args.url, args.job, storage_options=options,
                                 verify=bool(args.verify))
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=err, flush=True)
        return EX_CONFIG
    except Exception as exc:  # noqa: BLE001 - storage errors become one line, not a trace
        print(f"{PROG}: cannot read checkpoints under {args.url}: {exc!r}", file=err, flush=True)
        return EXIT_INVALID
    if args.json:
        doc = {"version": JSON_VERSION, "url": args.url, "job": args.job,
               "verified": bool(args.verify), "checkpoints": [i.to_dict() for i in infos]}
        print(json.dumps(doc, indent=2), file=out, flush=True)
    else:
        _print_table(infos, out)
    if not infos:
        where = f"job {args.job!r} under {args.url}" if args.job else args.url
        print(f"{PROG}: no checkpoints found for {where}", file=err, flush=True)
        return EXIT_NONE
    invalid = [i for i in infos if not i.valid]
    if invalid:
        print(f"{PROG}: {len(invalid)} of {len(infos)} checkpoints are invalid and will be "
              "skipped by workers", file=err, flush=True)
        return EXIT_INVALID
    return EXIT_OK


def _time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # unreachable


def _print_table(infos: list[Any], out: IO[str]) -> None:
    # VALID goes last: when invalid it carries the reason, which can be long.
    header = ("JOB", "STEP", "SAVED (UTC)", "SIZE", "WORLD", "RUN", "SAVE ID", "VALID")
    rows = [(i.job, str(i.step), _time(i.committed_at or i.created_at), _size(i.size),
             str(i.world_size or "-"), i.run_id or "-", i.save_id,
             "yes" if i.valid else f"no: {i.reason}")
            for i in infos]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip(), file=out)
