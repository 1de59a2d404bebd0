"""Secrets: the one reader of secret files and the one masking rule.

Why one module: three code paths used to read password files three ways (strip all
whitespace, strip one newline, strip CR/LF) and four places had their own idea of what a
secret looks like, so a numeric password was echoed in a config error and a token in a
URL's userinfo reached the logs. Every reader of a secret file calls
:func:`read_secret_file`; config errors, log lines, ``elasticd status`` and
``--check-config`` all mask through :func:`mask_value`, :func:`redact_url` and
:func:`scrub_text`.

The rule:

- A *name* is secret when it looks like a credential: it contains ``PASS``, ``SECRET``,
  ``TOKEN``, ``CREDENTIAL``, ``PRIVATE``, ``SIGNATURE`` or ``APIKEY``/``API_KEY``, ends
  a word in ``_KEY``, or has ``PAT`` or ``AUTH`` as a word (``HF_TOKEN``, ``GH_PAT``, ``NPM_AUTH``,
  ``AWS_SECRET_ACCESS_KEY``, ``etcd.password``). Names ending in ``_FILE``, ``_PATH`` or
  ``_DIR`` name a location, not a secret, and are shown (``etcd.key_file``).
- A *URL* loses its whole userinfo (``https://user:pw@h`` and ``https://TOKEN@h`` both
  become ``https://***@h``) and the values of its query (pre-signed URLs carry
  signatures there).
- Free *text* (an exception message, a log value) has every URL's userinfo and every
  ``NAME=value`` / ``NAME: value`` pair with a secret NAME masked.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from elasticd.errors import ConfigError

MASK = "***"
# The largest secret file read: a password or token is bytes, not megabytes; a bound
# keeps a mistaken path (/dev/zero, a log file) from being read forever.
MAX_SECRET_BYTES = 64 * 1024

_SECRET_NAME = re.compile(
    r"PASS|SECRET|TOKEN|CREDENTIAL|PRIVATE|SIGNATURE|API_?KEY|[_.\-]KEY($|[_.\-])"
    r"|(^|[_.\-])(PAT|AUTH)($|[_.\-])",
    re.I,
)
_LOCATION_NAME = re.compile(r"(_|\.)(FILE|PATH|DIR)$", re.I)
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)[^/\s@'\"]+@")
_NAME_VALUE = re.compile(
    r"(?P<name>\b[A-Za-z_][A-Za-z0-9_.\-]*)(?P<sep>\s*[=:]\s*)(?P<q>['\"]?)(?P<value>[^\s'\",;]+)"
)


def is_secret_name(name: str) -> bool:
    """True when a variable, config key or field called ``name`` holds a secret."""
    name = str(name)
    return bool(_SECRET_NAME.search(name)) and not _LOCATION_NAME.search(name)


def mask_value(name: str, value: Any) -> Any:
    """``value``, or ``MASK`` if ``name`` is secret (None and "" stay as they are)."""
    if value is None or value == "":
        return value
    return MASK if is_secret_name(name) else value


def redact_url(url: str, mask: str = MASK, query_mask: str | None = None) -> str:
    """Drop the userinfo and the query values of ``url``; keep scheme, host, path, names.

    ``mask`` replaces the userinfo, ``query_mask`` (default: ``mask``) each query value.
    """
    query_mask = mask if query_mask is None else query_mask
    try:
        parts = urlsplit(url)
    except ValueError:
        return mask
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{mask}@" + netloc.rsplit("@", 1)[1]
    query = parts.query
    if query:
        query = urlencode([(k, query_mask) for k, _ in parse_qsl(query, keep_blank_values=True)],
                          safe="<>*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def scrub_text(text: str) -> str:
    """Mask URL userinfo and ``SECRET_NAME=value`` pairs inside free text."""
    text = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{MASK}@", text)

    def pair(m: re.Match[str]) -> str:
        if not is_secret_name(m.group("name")) or m.group("value") == MASK:
            return m.group(0)
        return f"{m.group('name')}{m.group('sep')}{m.group('q')}{MASK}"

    return _NAME_VALUE.sub(pair, text)


def scrub(value: Any, name: str = "") -> Any:
    """Mask a log or output value: by its name, then URLs and pairs inside strings,
    recursively through dicts, lists and tuples."""
    if name and is_secret_name(name) and value not in (None, ""):
        return MASK
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, dict):
        return {k: scrub(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(scrub(v) for v in value)
    return value


def read_secret_file(path: str, what: str) -> str:
    """Read a password or token from ``path``: the one way elasticd reads secret files.

    The secret is the file's text with trailing CR/LF removed (``echo pw > file`` and
    editors add a newline; anything else, spaces included, is part of the secret).

    Args:
        path: the file.
        what: how the operator set the path, for messages (``etcd.password_file``,
            ``--etcd-password-file``).

    Returns:
        The secret (never logged or echoed by any caller).

    Raises:
        ConfigError: the file cannot be read, is not a regular file, is larger than
            ``MAX_SECRET_BYTES``, is not UTF-8, or holds no secret. The message names the
            path and the fix, never the content.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ConfigError(
            f"{what} = {path!r}: cannot read it ({exc.strerror or exc}); create it readable "
            "by the agent's user only (chmod 0600)"
        ) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{what} = {path!r}: not a regular file; point it at a file "
                              "holding only the secret")
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_BYTES:
        raise ConfigError(f"{what} = {path!r}: larger than {MAX_SECRET_BYTES} bytes, so not a "
                          "password file; point it at a file holding only the secret")
    try:
        secret = data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} = {path!r}: not UTF-8 text; write the secret as text") from None
    if not secret:
        raise ConfigError(f"{what} = {path!r}: the file is empty; write the secret into it")
    return secret


def loose_secret_file(path: str) -> str | None:
    """Why ``path`` is readable by others (a warning for --check-config), or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return f"mode {stat.S_IMODE(st.st_mode):04o} lets group/others read it; chmod 0600 {path}"
    return None
