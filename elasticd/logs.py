"""structlog setup: JSON lines for journald and machines, readable lines on a terminal.

Every log line goes to stderr (stdout belongs to the commands' output, e.g. ``status
--json``). Bind job/node/round with ``structlog.contextvars.bind_contextvars`` or
``log.bind``; event names are past-tense facts (``rendezvous_completed``). Every event
passes through :func:`redact_secrets` (elasticd.sensitive's one masking rule), so a
token in a URL or a ``*_TOKEN`` field never reaches journald.

In JSON mode *every* line the agent writes is one JSON object: its own events, torch's
stdlib log records (rendered by the same processors), and its workers' output
(``elasticd.agent.worker_logs`` wraps each line with rank and stream). Workers started by
an agent in JSON mode get ``ELASTICD_LOG_FORMAT=json`` and configure structlog the same
way (:func:`configure_worker_logging`), so the worker API's own events
(``checkpoint_saved``...) are JSON too and pass through unwrapped.

Also where worker logs go (:func:`resolve_worker_log_dir`): never a predictable shared
path. ``/tmp/elasticd-logs-<job>`` could be created first by another local user, who
would then read (and swap) every worker's output.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import sys
import tempfile
from collections.abc import MutableMapping, Sequence
from typing import Any, TextIO

import structlog

from elasticd.errors import ConfigError
from elasticd.sensitive import scrub

_configured = False
_format: str | None = None  # "json" | "console" once configured
log = structlog.get_logger(__name__)
FORMATS = ("json", "console")


def redact_secrets(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: mask secret-named fields, URL userinfo and ``NAME=secret`` text."""
    for key, value in list(event.items()):
        event[key] = scrub(value, key)
    return event


def configure_logging(fmt: str = "auto", *, level: str = "info", stream: TextIO | None = None,
                      stdlib: bool = True) -> None:
    """Configure structlog and the stdlib root logger once.

    Args:
        fmt: ``"json"``, ``"console"``, or ``"auto"`` (console on a TTY, JSON otherwise).
        level: minimum level name.
        stream: where lines go (stderr by default).
        stdlib: also route the stdlib root logger (and ``warnings``) through the same
            rendering; False in workers, whose stdlib logging belongs to the user's script.
    """
    global _configured, _format
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    lvl = getattr(logging, level.upper(), logging.INFO)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        redact_secrets,
    ]
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # torch elastic logs through the stdlib; keep its INFO chatter out, warnings in.
    if stdlib and fmt == "json":
        # One JSON object per line there too: a plain-text torch warning would break
        # `journalctl -o cat | jq` at that line.
        _stdlib_to_json(stream, shared, renderer)
    elif stdlib:
        logging.basicConfig(stream=stream, level=logging.WARNING,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _configured, _format = True, fmt


def _stdlib_to_json(stream: TextIO, shared: list[Any], renderer: Any) -> None:
    formatter = structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared])
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.set_name("elasticd-json")
    # torch's registered loggers ("torch", ...) do not propagate: they have stream handlers
    # of their own with a glog-style format ("E1130 21:54:00.339 ... failed (exitcode: 1)").
    # Keep their routing and levels, render them as JSON.
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if (name == "torch" or name.startswith("torch.")) and isinstance(logger, logging.Logger):
            for h in logger.handlers:
                if type(h) is logging.StreamHandler:
                    h.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        if old.get_name() == "elasticd-json":  # configured again: replace ours, keep others'
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.captureWarnings(True)  # warnings.warn() goes through the same handler


def current_format() -> str | None:
    """``"json"`` or ``"console"``: what :func:`configure_logging` chose (None before)."""
    return _format


def configure_worker_logging(fmt: str | None) -> None:
    """In a worker: render the worker API's events as the agent renders its own.

    ``fmt`` is the agent's resolved format (``ELASTICD_LOG_FORMAT``, read by the
    launcher): ``"json"``, else (unset) console lines. Either way with the agent's UTC ISO
    timestamps: structlog's own default is local time in another format, so agent and
    worker lines of one terminal used to disagree by the time zone. Events go to stderr,
    as the agent's do (torch prefixes each line with ``[default<rank>]:``). The stdlib
    root logger is left alone: the user's script may configure it (its lines are wrapped
    by the agent like any output), and a script that configures structlog wins.
    """
    configure_logging("json" if fmt == "json" else "console", stdlib=False)


def error_line(message: str, *, event: str = "agent_error", level: str = "error",
               **fields: Any) -> None:
    """Write a final error line: one JSON event in JSON mode, else the plain text on stderr.

    For the lines printed outside any event (a failure summary, an exit reason, what a
    standalone start does about its last run), which would otherwise be the one non-JSON
    line in a JSON log. ``level``: the JSON event's level (``info`` for a notice).
    """
    if _format == "json":
        getattr(structlog.get_logger("elasticd"), level)(event, message=message, **fields)
    else:
        sys.stderr.write(message if message.endswith("\n") else message + "\n")
        sys.stderr.flush()


def ensure_configured() -> None:
    """Configure with defaults if nobody did (library use, e.g. under torchrun)."""
    if not _configured:
        configure_logging()


_LOG_DIR = ("worker log dir", "logging.worker_log_dir (--log-dir)")


def _refuse_unsafe(path: str, st: os.stat_result, *, leaf: bool,
                   what: tuple[str, str] = _LOG_DIR) -> None:
    """Raise if another user controls ``path`` (owner, or write access without sticky bit)."""
    name, setting = what
    me = os.geteuid()
    if st.st_uid not in (me, 0) or (leaf and st.st_uid != me):
        raise ConfigError(
            f"{name} {path!r} is owned by uid {st.st_uid}, not by this user (uid {me}): "
            f"that user could read and replace its files; set {setting} to a directory of "
            "your own, or remove this one"
        )
    loose = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if loose and (leaf or not st.st_mode & stat.S_ISVTX):
        raise ConfigError(
            f"{name} {path!r} is writable by group/others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): anyone could plant or swap its files; "
            f"`chmod go-w {path}` (0700 is best), or set {setting} elsewhere"
        )


def default_state_root(xdg_state_home: str | None, home: str | None) -> str:
    """Where an agent outside systemd keeps state that outlives it (commit intents).

    ``$XDG_STATE_HOME/elasticd`` when that is an absolute path (the XDG rule), else
    ``~/.local/state/elasticd`` (``$HOME``, else the user's home from the password
    database). Never a predictable name in a shared temp dir: ``<tmp>/elasticd-<uid>``
    could be made first by another user (blocking every agent of this uid) or be a planted
    symlink.
    """
    if xdg_state_home and os.path.isabs(xdg_state_home):
        return os.path.join(xdg_state_home, "elasticd")
    if not (home and os.path.isabs(home)):
        home = pwd.getpwuid(os.geteuid()).pw_dir
    return os.path.join(home, ".local", "state", "elasticd")


def ensure_private_tree(base: str, parts: Sequence[str], what: tuple[str, str]) -> str:
    """Create ``base/parts[0]/parts[1]/...`` private to this user, level by level.

    ``base`` and every level below it are checked with ``lstat``: a symbolic link (never
    followed), a non-directory, or a directory owned by another user or writable by
    group/others is refused; each is made (or tightened to) 0700. Missing ancestors of
    ``base`` are created 0700 too (``os.makedirs`` gave them 0755, so job names were
    listable). Existing ancestors must be owned by this user or root and not writable by
    group/others unless sticky; a symlink among them is followed only if this user or root
    owns it.

    Args:
        base: the root elasticd owns (e.g. ``~/.local/state/elasticd``).
        parts: the levels below it (e.g. ``("commit-intents", job)``).
        what: (its name, the setting that moves it), for the error message.

    Returns:
        The absolute path of the deepest level.

    Raises:
        ConfigError: naming the level and the fix.
    """
    name, setting = what
    me = os.geteuid()
    base = os.path.abspath(base)
    ancestors = []
    parent = os.path.dirname(base)
    while True:
        ancestors.append(parent)
        if parent == os.path.dirname(parent):
            break
        parent = os.path.dirname(parent)
    for level in reversed(ancestors):
        st = _lstat_or_mkdir(level, what)
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (me, 0):
                raise ConfigError(f"{name}: {level!r} is a symbolic link owned by uid {st.st_uid}; "
                                  f"it could point anywhere; remove it, or set {setting}")
            st = os.stat(level)
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{name}: {level!r} is not a directory; set {setting}")
        _refuse_unsafe(level, st, leaf=False, what=what)
    path = base
    for level in (base, *(os.path.join(base, *parts[:i + 1]) for i in range(len(parts)))):
        st = _lstat_or_mkdir(level, what)
        if stat.S_ISLNK(st.st_mode):
            raise ConfigError(f"{name}: {level!r} is a symbolic link, which elasticd does not "
                              f"follow there (one planted by another user redirects its files); "
                              f"remove it, or set {setting}")
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{name}: {level!r} exists but is not a directory; set {setting}")
        _refuse_unsafe(level, st, leaf=True, what=what)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(level, 0o700)
        path = level
    return path


def _lstat_or_mkdir(level: str, what: tuple[str, str]) -> os.stat_result:
    try:
        return os.lstat(level)
    except FileNotFoundError:
        pass
    try:
        os.mkdir(level, 0o700)
    except FileExistsError:
        pass  # lost a race: whoever made it is checked below like any existing level
    except OSError as exc:
        raise ConfigError(f"cannot create {what[0]} {level!r} ({exc.strerror}); set {what[1]} "
                          "to a writable directory") from exc
    return os.lstat(level)


def check_log_root(path: str, *, what: tuple[str, str] = _LOG_DIR) -> None:
    """Check that ``path`` (existing or not) and its existing ancestors are ours.

    Every existing ancestor must be owned by this user or root, and not writable by
    group/others unless sticky (like /tmp); ``path`` itself, if it exists, must be a
    directory owned by this user and not writable by group/others.

    Raises:
        ConfigError: naming the path and the fix.
    """
    path = os.path.abspath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{what[0]} {path!r} exists but is not a directory; set "
                              f"{what[1]} to a directory")
        _refuse_unsafe(path, st, leaf=True, what=what)
    parent = os.path.dirname(path)
    while True:
        try:
            _refuse_unsafe(parent, os.stat(parent), leaf=False, what=what)
        except FileNotFoundError:
            pass
        if parent == os.path.dirname(parent):
            return
        parent = os.path.dirname(parent)


def resolve_worker_log_dir(configured: str | None, job: str, *, state_dir: str | None = None) -> str:
    """Choose, check and create the directory the workers' logs go to.

    In order: ``configured`` (``logging.worker_log_dir`` / ``--log-dir``); else
    ``<state_dir>/worker-logs/<job>`` (systemd's ``$STATE_DIRECTORY`` with
    ``StateDirectory=elasticd``: logs outlive the agent); else a fresh ``mkdtemp``
    directory ``elasticd-logs-<job>-XXXXXXXX`` in the system temp dir (unpredictable,
    created 0700 by us, so nobody can have made it first). A created directory is 0700.
    The choice is logged (``worker_log_dir_chosen``) so an operator can find the logs.

    Args:
        configured: the configured directory, or None.
        job: the job name (already validated: no ``/``).
        state_dir: ``$STATE_DIRECTORY`` (first entry), or None.

    Returns:
        The absolute directory.

    Raises:
        ConfigError: the directory or an ancestor is controlled by another user, or it is
            writable by group/others, or it cannot be created.
    """
    if configured:
        path, how = os.path.abspath(configured), "configured"
    elif state_dir:
        path, how = os.path.join(os.path.abspath(state_dir.split(":")[0]), "worker-logs", job), "state_dir"
    else:
        path = tempfile.mkdtemp(prefix=f"elasticd-logs-{job}-")
        how = "private temp dir"
    check_log_root(path)
    if not os.path.isdir(path):
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create worker log dir {path!r} ({exc.strerror}); set "
                              "logging.worker_log_dir (--log-dir) to a writable directory") from exc
        os.chmod(path, 0o700)
        check_log_root(path)  # lost a race with someone who made it first: refuse theirs
    log.info("worker_log_dir_chosen", path=path, how=how)
    return path
