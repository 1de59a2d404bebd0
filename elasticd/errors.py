"""elasticd's error hierarchy, grouped by who must act.

- ``ConfigError``: the operator must fix the config or command line. Never retried;
  the CLI exits 78 (EX_CONFIG) so systemd does not restart-loop on it.
- ``TransientError``: etcd or storage hiccups; retried with backoff (elasticd.retry).

Rendezvous errors reuse torch's hierarchy (``RendezvousError`` and subclasses) so that
torch's agent and launcher understand them.
"""

from __future__ import annotations

EX_CONFIG = 78
# The last words of every command that gave up on etcd (agent and CLI alike).
ETCD_UNREACHABLE_HINT = "check --etcd, the TLS/auth flags and that etcd is up"
SHOWN_CHARS = 80  # of a bad value quoted in an error (a 120k-character job name was echoed whole)


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters with its length."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return f"{text[:limit]}...{size}"


class ElasticdError(Exception):
    """Base class of all elasticd errors."""

    exit_code = 1


class ConfigError(ElasticdError):
    """Bad configuration or input. The message names the key, the value and the fix."""

    exit_code = EX_CONFIG


class TransientError(ElasticdError):
    """A failure that may go away on its own (etcd unreachable, storage throttled)."""


class EtcdUnavailableError(TransientError):
    """etcd could not be reached within the deadline."""

    exit_code = 4


class EtcdNoSpaceError(EtcdUnavailableError):
    """etcd raised its NOSPACE alarm: the database hit its quota and every write fails.

    A subclass of ``EtcdUnavailableError`` so that every caller keeps retrying (the agent
    survives until an operator frees space), but named on its own in logs and in
    ``elasticd status``: it does not go away by waiting (docs/deployment.md).
    """



class LeaseLostError(ElasticdError):
    """This node's etcd lease expired: it was frozen or cut off and the job moved on."""


class FencedError(ElasticdError):
    """A write was refused because the writer's round is no longer current."""
