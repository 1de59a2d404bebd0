"""The etcd key space of elasticd, built in one place.

Every key elasticd reads or writes lives under ``/elasticd/<job>/``. Building keys
anywhere else is a bug: a typo in a prefix would leak keys or, worse, touch another
job's keys. Job names are validated here so a name can never escape its prefix.

Layout (see docs/architecture.md)::

    /elasticd/<job>/nodes/<node>            node record (JSON), on the node's lease
    /elasticd/<job>/rdzv/state              round state (JSON), txn-guarded by mod_revision
    /elasticd/<job>/rdzv/closed             present once the job is closed
    /elasticd/<job>/rdzv/coordinator        node id of the round coordinator, on its lease
    /elasticd/<job>/rdzv/waiting            late joiners the coordinator announces (JSON)
    /elasticd/<job>/rdzv/joins/<round>/<node>  a node asking to be in <round>, on its lease
    /elasticd/<job>/rdzv/failures/<round>/<node>  a node's worker failure in <round>, on its lease
    /elasticd/<job>/store/<round>/<key>     the c10d store of one round
    /elasticd/<job>/progress                step, epoch, samples/s (JSON)
    /elasticd/<job>/history                 bounded progress samples for plots (elasticd/history.py)
    /elasticd/<job>/checkpoint/latest       fenced pointer to the newest committed checkpoint
    /elasticd/<job>/run_id                  this run's id (created once; checkpoints carry it)
    /elasticd/<job>/fingerprint             what every agent of the job must match (admission)
    /elasticd/<job>/events/<seq>            bounded event history (JSON)
    /elasticd/<job>/control/stop            the job is stopped (`elasticd stop`); agents leave/stay out
    /elasticd/<job>/control/drain/<node>    that node is drained (`elasticd drain`); it leaves/stays out
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from elasticd.errors import ConfigError, shown

ROOT = "/elasticd/"
# Matched with fullmatch: ``$`` also matches before a trailing newline, so "r1\n" passed.
JOB_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
NODE_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
# ASCII digits only: ``\d`` and ``str.isdigit`` accept Arabic-Indic and other digits.
_ROUND_RE = re.compile(r"[0-9]{1,19}")


def validate_job_name(job: str) -> str:
    """Return ``job`` if it is a valid job name.

    Raises:
        ConfigError: the name is empty, too long, or has characters other than
            letters, digits and ``-_.`` (``/`` and ``..`` would escape the prefix).
    """
    if not isinstance(job, str) or not JOB_NAME_RE.fullmatch(job) or job in (".", ".."):
        raise ConfigError(
            f"invalid job name {shown(job)}: use 1-64 letters, digits, '-', '_' or '.' "
            "(no '/', not '.' or '..'), e.g. --job my-run-1"
        )
    return job


def validate_node_id(node: str) -> str:
    """Return ``node`` if it is a valid node id, else raise ConfigError."""
    if not isinstance(node, str) or not NODE_ID_RE.fullmatch(node) or node in (".", ".."):
        raise ConfigError(
            f"invalid node id {shown(node)}: use 1-128 letters, digits, '-', '_', '.' or ':'"
        )
    return node


@dataclass(frozen=True)
class JobKeys:
    """Key builder for one job. ``JobKeys("demo").node("a")`` -> ``/elasticd/demo/nodes/a``."""

    job: str

    def __post_init__(self) -> None:
        validate_job_name(self.job)

    @property
    def prefix(self) -> str:
        return f"{ROOT}{self.job}/"

    # membership
    @property
    def nodes_prefix(self) -> str:
        return f"{self.prefix}nodes/"

    def node(self, node_id: str) -> str:
        return f"{self.nodes_prefix}{validate_node_id(node_id)}"

    @property
    def beats_prefix(self) -> str:
        return f"{self.prefix}beats/"

    def beat(self, node_id: str) -> str:
        return f"{self.beats_prefix}{validate_node_id(node_id)}"

    # rendezvous
    @property
    def rdzv_prefix(self) -> str:
        return f"{self.prefix}rdzv/"

    @property
    def rdzv_state(self) -> str:
        return f"{self.rdzv_prefix}state"

    @property
    def rdzv_closed(self) -> str:
        return f"{self.rdzv_prefix}closed"

    @property
    def rdzv_coordinator(self) -> str:
        """The coordinator's key: the one node that watches ``nodes/`` and every join."""
        return f"{self.rdzv_prefix}coordinator"

    @property
    def rdzv_waiting(self) -> str:
        return f"{self.rdzv_prefix}waiting"

    @property
    def rdzv_attribution(self) -> str:
        """The coordinator's verdict on a round's worker failures: who reported, in order
        (sorts before ``failures/``: every node watches it, only the coordinator those)."""
        return f"{self.rdzv_prefix}attribution"

    @property
    def joins_root(self) -> str:
        return f"{self.rdzv_prefix}joins/"

    def joins_prefix(self, round_: int) -> str:
        return f"{self.joins_root}{round_:010d}/"

    def join(self, round_: int, node_id: str) -> str:
        return f"{self.joins_prefix(round_)}{validate_node_id(node_id)}"

    @property
    def failures_root(self) -> str:
        return f"{self.rdzv_prefix}failures/"

    def failures_prefix(self, round_: int) -> str:
        return f"{self.failures_root}{round_:010d}/"

    def failure(self, round_: int, node_id: str) -> str:
        return f"{self.failures_prefix(round_)}{validate_node_id(node_id)}"

    # clean leaves: written (no lease) just before a leaving node revokes its lease
    @property
    def left_root(self) -> str:
        return f"{self.rdzv_prefix}left/"

    def left(self, round_: int, node_id: str) -> str:
        return f"{self.left_root}{round_:010d}/{validate_node_id(node_id)}"

    # stragglers on probation: on a lease of the probation's length (the coordinator's)
    @property
    def probation_root(self) -> str:
        return f"{self.rdzv_prefix}probation/"

    def probation(self, node_id: str) -> str:
        return f"{self.probation_root}{validate_node_id(node_id)}"

    # per-round c10d store
    @property
    def store_root(self) -> str:
        return f"{self.prefix}store/"

    def store_prefix(self, round_: int) -> str:
        return f"{self.store_root}{round_:010d}/"

    # job-level records
    @property
    def progress(self) -> str:
        return f"{self.prefix}progress"

    @property
    def history(self) -> str:
        return f"{self.prefix}history"

    @property
    def checkpoint_latest(self) -> str:
        return f"{self.prefix}checkpoint/latest"

    @property
    def run_id(self) -> str:
        return f"{self.prefix}run_id"

    @property
    def fingerprint(self) -> str:
        """The job's fingerprint (elasticd.agent.admission): no lease; it binds while a
        live node record carries the same digest, and is replaced when none does."""
        return f"{self.prefix}fingerprint"

    @property
    def events_prefix(self) -> str:
        return f"{self.prefix}events/"

    def event(self, seq: int) -> str:
        return f"{self.events_prefix}{seq:016d}"

    # operator control (`elasticd stop` / `drain` / `start`): no lease, cleared by `start`
    @property
    def control_prefix(self) -> str:
        return f"{self.prefix}control/"

    @property
    def stop_mark(self) -> str:
        return f"{self.control_prefix}stop"

    @property
    def drain_marks_prefix(self) -> str:
        return f"{self.control_prefix}drain/"

    def drain_mark(self, node_id: str) -> str:
        return f"{self.drain_marks_prefix}{validate_node_id(node_id)}"


def round_of_key(key: str, root: str) -> int | None:
    """Parse the zero-padded round number right after ``root`` in ``key``, or None."""
    if not key.startswith(root):
        return None
    head = key[len(root):].split("/", 1)[0]
    return int(head) if _ROUND_RE.fullmatch(head) else None


def parse_ascii_int(text: str) -> int | None:
    """``int(text)`` for a string of 1-19 ASCII digits, else None (no sign, no spaces,
    no other scripts' digits: names read from etcd or storage are never trusted)."""
    return int(text) if isinstance(text, str) and _ROUND_RE.fullmatch(text) else None


def job_of_key(key: str) -> str | None:
    """Return the job name of a key under ``/elasticd/``, or None."""
    if not key.startswith(ROOT):
        return None
    job = key[len(ROOT):].split("/", 1)[0]
    return job if JOB_NAME_RE.fullmatch(job) and job not in (".", "..") else None
