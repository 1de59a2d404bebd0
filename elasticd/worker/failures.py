"""Which failures are a peer's death and which a stale group's: by type first, and the
one place in the worker half where an exception's text is matched.

A live re-formation must tell a peer that died (re-form) from a bug in the script
(re-raise). torch's ``DistError`` family (``DistNetworkError``, ``DistBackendError``, ...)
and ``ConnectionError`` say so by type; gloo and NCCL still raise a bare ``RuntimeError``
on some paths, and torch refuses a destroyed group with a plain ``ValueError``. Their
wording is matched in :func:`failure_text` only, each pinned by a unit test with a message
the backend printed (tests/unit/test_worker_failures.py).
"""

from __future__ import annotations

import enum

import torch.distributed as dist


class FailureText(enum.Enum):
    """What a known message says (the text fallback's answer)."""

    NCCL_PEER_GONE = "nccl"
    GLOO_PEER_GONE = "gloo"
    STALE_GROUP = "stale-group"  # torch refused a group a re-formation destroyed


# Lower case, in order: the stale group first (a torch message, no backend's), then NCCL
# (its abort message says "aborted", which gloo's needles would claim), then gloo.
_NEEDLES: tuple[tuple[FailureText, tuple[str, ...]], ...] = (
    (FailureText.STALE_GROUP, ("not initialized in the world group map",)),
    (FailureText.NCCL_PEER_GONE, ("nccl",)),
    (FailureText.GLOO_PEER_GONE, ("connection closed", "connection reset", "broken pipe", "timed out",
                                  "socket", "abort", "gloo")),
)


def failure_text(text: str) -> FailureText | None:
    """What a known failure message ``text`` says, else None (the one text match)."""
    lowered = text.lower()
    for kind, needles in _NEEDLES:
        if any(n in lowered for n in needles):
            return kind
    return None


def peer_failure_text(text: str) -> str | None:
    """The backend whose known peer-gone message ``text`` holds ("gloo", "nccl"), else None."""
    kind = failure_text(text)
    return kind.value if kind in (FailureText.GLOO_PEER_GONE, FailureText.NCCL_PEER_GONE) else None


def is_peer_failure(exc: BaseException) -> bool:
    """A failure caused by a peer (gone, reset, timed out), not by the script.

    By type first: torch's ``DistError`` family and ``ConnectionError``; a bare
    ``RuntimeError`` only by its text.
    """
    if isinstance(exc, (dist.DistError, ConnectionError)):
        return True
    return type(exc) is RuntimeError and peer_failure_text(str(exc)) is not None


def stale_group_error(exc: BaseException) -> bool:
    """Did torch refuse a process group that no longer exists (destroyed by a re-formation)?

    torch raises a plain ``ValueError`` naming the group; only that type is read by text.
    """
    return isinstance(exc, ValueError) and failure_text(str(exc)) is FailureText.STALE_GROUP
