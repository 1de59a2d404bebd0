"""The ``elasticd`` command line: ``run``, ``agent``, ``status``, ``checkpoints``, ``etcd``.

Exit codes shared by all subcommands: 0 success, 1 failure, 4 etcd unreachable,
78 configuration error (EX_CONFIG: systemd's ``RestartPreventExitStatus=78`` stops a
restart loop on a config that will never work). ``status`` adds its own health codes.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from elasticd import __version__
from elasticd.config import load_config
from elasticd.config.flags import add_config_flags, flag_names, overrides_from_args
from elasticd.config.loader import closest
from elasticd.errors import EX_CONFIG, ConfigError, ElasticdError
from elasticd.sensitive import scrub_text


def _add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a training script on this node (like torchrun)",
                       usage="%(prog)s [options] SCRIPT [ARGS...]  (or -m MODULE [ARGS...])",
                       description="Run a training script under elasticd on this node. "
                       "With --standalone, a private etcd is started on 127.0.0.1. Every flag "
                       "is a config key (docs/configuration.md); --config adds a TOML file "
                       "below the ELASTICD_* environment and the flags.")
    p.add_argument("--config", "-c", metavar="FILE", help="TOML config file (optional)")
    add_config_flags(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...] or -m MODULE [ARGS...]")


def _run_command(args: argparse.Namespace) -> int:
    overrides = overrides_from_args(args)
    command = tuple(args.command[1:] if args.command[:1] == ["--"] else args.command)
    if command:
        overrides["workers.command"] = command
    cfg = load_config(args.config, os.environ, overrides, override_names=flag_names())
    if cfg.etcd.embedded and not cfg.job.standalone:
        raise ConfigError("no etcd: pass --etcd HOST:PORT to join a job, or --standalone for a "
                          "single machine")
    # The first standbys start importing torch now; then the stop/drain check (`elasticd
    # stop`/`drain`: exit 0 at once) and the agent's own torch import (elasticd.agent.early).
    from elasticd.agent.early import run_node_with_early_standbys

    return run_node_with_early_standbys(cfg)


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad flags; we exit 78 (EX_CONFIG) like every config error,
    so a health check never reads a typo as "job not training" (status exit 2).

    No abbreviations (``--nproc 2`` is not silently ``--nproc-per-node 2``: a new flag
    must never change what an old command line means), and a typo gets "did you mean".
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.given: list[str] = []  # the command line, for the suggestion (set by main)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        hint = suggestion(self, self.given, message)
        sys.stderr.write(f"{self.prog}: error: {message}{hint}\n")
        raise SystemExit(EX_CONFIG)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def suggestion(parser: argparse.ArgumentParser, argv: Sequence[str], message: str) -> str:
    """``"; did you mean --nproc-per-node?"`` for an unknown flag or subcommand, or ``""``.

    The flag is looked for among the options of the subcommand on the command line (the
    top-level parser reports a subcommand's unknown flags). Pure but for argparse's
    parser objects.
    """
    subs = _subcommands(parser)
    bad = re.search(r"invalid choice: '([^']*)'", message)
    if bad and subs:
        hint = closest(bad.group(1), list(subs))
        return f"; did you mean `{parser.prog} {hint}`?" if hint else ""
    unknown = re.search(r"unrecognized arguments: (.*)", message)
    if not unknown:
        return ""
    target = next((subs[a] for a in argv if a in subs), parser)
    options = [o for a in target._actions for o in a.option_strings
               if o.startswith("--") and a.help != argparse.SUPPRESS]  # not torchrun's aliases
    pairs = []
    for word in unknown.group(1).split():
        flag = word.split("=", 1)[0]
        hint = closest(flag, options) if flag.startswith("--") else None
        if hint:
            pairs.append((flag, hint))
    if len(pairs) == 1:
        return f"; did you mean {pairs[0][1]}?"
    return f"; did you mean {', '.join(f'{h} (for {f})' for f, h in pairs)}?" if pairs else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="elasticd", description="The elasticd command line.")
    parser.add_argument("--version", action="version", version=f"elasticd {__version__}")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    _add_run_parser(sub)
    for name in ("elasticd.agent.cli", "elasticd.status.cli", "elasticd.cli.checkpoints",
                 "elasticd.cli.etcd", "elasticd.cli.control"):
        try:
            module = __import__(name, fromlist=["add_parser"])
        except ImportError:
            continue
        before = set(sub.choices)
        module.add_parser(sub)
        for new in set(sub.choices) - before:
            if sub.choices[new].get_default("func") is None:
                sub.choices[new].set_defaults(func=module.run)
    parser.description = f"The elasticd command line: {', '.join(sub.choices)}."
    return parser


def _error(args: argparse.Namespace, message: str) -> None:
    """The last line of a failed command; one JSON object when an agent logs JSON."""
    if args.subcommand in ("run", "agent"):
        from elasticd.logs import error_line

        error_line(message)
    else:
        sys.stderr.write(message + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    for p in (parser, *_subcommands(parser).values()):
        if isinstance(p, _Parser):
            p.given = given
    args = parser.parse_args(given)
    try:
        if args.subcommand == "run":
            return _run_command(args)
        return int(args.func(args))
    except ConfigError as exc:
        _error(args, f"elasticd: configuration error: {scrub_text(str(exc))}")
        return EX_CONFIG
    except ElasticdError as exc:
        _error(args, f"elasticd: {scrub_text(str(exc))}")
        return exc.exit_code
    except KeyboardInterrupt:
        return 130

