"""Admission: an agent whose job fingerprint differs from the running job's is refused.

Why: a different script started under the same ``--job`` used to be admitted; both sides
then failed in DDP ("expects same model across all ranks") and the innocent job retrained
steps from its last checkpoint. Now the first agent of a run publishes the job's
fingerprint at ``/elasticd/<job>/fingerprint`` and every later agent compares its own
before it joins a round; a mismatch exits 78 naming both commands, the settings that
differ, and the fix. Nothing of the running job is touched.

What the fingerprint holds (docs/failure-model.md#admission) -- what must agree across
the nodes of one job, and nothing that may legitimately differ per node:

- the **elasticd version**: the round protocol and the live re-formation messages are
  not promised across versions;
- the **training script's content** (sha256; ``-m module``: the module name) and its
  **arguments**, not its path (checkouts live in different directories on different
  nodes; an edited copy under the same path is still another program);
- ``min_nodes`` / ``max_nodes``: the round state carries them, and which node coordinates
  must not change when a round closes;
- the **checkpoint URL** (redacted): nodes resuming from, and committing to, different
  places lose or repeat work;
- **live re-formation** on or off: one node re-forming in place while another restarts
  from the checkpoint breaks every membership change;
- the **valid world sizes** (resolved, in nodes): nodes disagreeing on them would close
  rounds at sizes the others refuse.

Left out on purpose: ``nproc_per_node`` (torch's rank table takes per-node local world
sizes, the sampler shards by global rank), the node TTL, warm start, the worker
environment (``NCCL_SOCKET_IFNAME`` differs per host), log settings, the workdir.

Lifetime: the fingerprint is per run and is never deleted; it *binds* while a live node
record of the job (on its lease) carries its digest, and is replaced by the next agent
when none does. So a job that finished, was stopped (``elasticd stop``) or died whole
starts again with a changed command or a new elasticd version; a new version rolled out
node by node into a running job is refused (mixed versions in one job are not supported:
``elasticd stop``, upgrade every node, ``elasticd start``; the workers resume from the
newest checkpoint).

Concurrency: every agent registers its node record (with its digest) first, then decides
and writes the fingerprint key in one transaction on the key's mod_revision -- a
publish, a replace, or a confirm that rewrites the same value. Every admission thus
bumps the key's revision, so of two agents with different commands deciding at once,
one's write fails, it reads again, and sees the other's record. A refusal before
registering (:func:`precheck`) is the common case and touches nothing; one found after
registering (a race) leaves only this node's record, revoked as the agent exits.

This module must not import torch (``elasticd.agent.boot`` calls it first).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from functools import partial

import structlog

from elasticd import __version__
from elasticd.errors import ConfigError, TransientError
from elasticd.etcd.client import EtcdClient
from elasticd.keys import JobKeys
from elasticd.records import JobFingerprint, NodeRecord, RecordError
from elasticd.retry import call_with_retry
from elasticd.sensitive import redact_url

log = structlog.get_logger(__name__)

_ATTEMPTS = 8  # lost compare-and-swaps in a row before giving up (agents starting at once)


class AdmissionRefusedError(ConfigError):
    """This agent's fingerprint differs from the job's, and an agent of the job runs it.

    A configuration error (exit 78: systemd does not restart-loop on it).
    """


def make_fingerprint(command: Sequence[str], *, min_nodes: int, max_nodes: int,
                     checkpoint_url: str | None, live_reform: bool,
                     workdir: str | None = None, node: str = "",
                     version: str = __version__, extra: dict[str, object] | None = None,
                     now: float | None = None) -> JobFingerprint:
    """This agent's fingerprint.

    Args:
        command: the training command, ``script [args...]`` or ``-m module [args...]``.
        workdir: where a relative script path is found (the agent's cwd when None).
        extra: further settings that must agree (JSON values), compared by name.

    Raises:
        ConfigError: the script cannot be read.
    """
    cmd = list(command)
    if cmd and cmd[0] == "-m":
        program, args = f"module:{cmd[1] if len(cmd) > 1 else ''}", cmd[2:]
    else:
        path = cmd[0] if cmd else ""
        if workdir and not os.path.isabs(path):
            path = os.path.join(workdir, path)
        program, args = f"sha256:{_file_sha256(path)}", cmd[1:]
    fp = JobFingerprint(version=version, command=cmd, program=program, args=args,
                        min_nodes=min_nodes, max_nodes=max_nodes,
                        checkpoint_url=redact_url(checkpoint_url) if checkpoint_url else "",
                        live_reform=bool(live_reform), node=node,
                        published_at=time.time() if now is None else now,
                        extra=dict(extra or {}))
    blob = json.dumps(fp.compared(), sort_keys=True, separators=(",", ":"))
    return replace(fp, digest=hashlib.sha256(blob.encode()).hexdigest()[:32])


def sizes_fingerprint(valid_sizes: Sequence[int]) -> dict[str, object]:
    """The fingerprint's share of the valid world sizes (``rendezvous.sizes``): every
    node must form rounds at the same sizes. Empty when every size is valid, so a job
    that declares none keeps the digest it had."""
    return {"valid_sizes": list(valid_sizes)} if valid_sizes else {}


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as exc:
        raise ConfigError(f"training script {path!r} cannot be read ({exc.strerror}); "
                          "check the path or the working directory") from exc
    return h.hexdigest()


def differences(ours: JobFingerprint, theirs: JobFingerprint) -> list[str]:
    """One line per compared setting that differs, ``name: theirs (job) vs ours``. Pure."""
    a, b = theirs.compared(), ours.compared()
    out = []
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            if name == "program":
                what = ("the script's content differs" if str(a.get(name)).startswith("sha256:")
                        and str(b.get(name)).startswith("sha256:") else "the program differs")
                out.append(f"program: {what} ({_short(a.get(name))} vs {_short(b.get(name))})")
            else:
                out.append(f"{name}: {a.get(name)!r} (job) vs {b.get(name)!r} (this agent)")
    return out


def _short(program: object) -> str:
    text = str(program)
    return text[:len("sha256:") + 12] if text.startswith("sha256:") else text


class AdmissionVerdict(Enum):
    """What an agent does with the job's stored fingerprint."""

    PUBLISH = "publish"  # none yet: this agent's becomes the job's
    MATCH = "match"  # the same: admitted
    REPLACE = "replace"  # a different one no live agent runs (the run ended): replaced
    REFUSE = "refuse"  # a different one a live agent runs: this agent exits 78


def decide(ours: JobFingerprint, stored: JobFingerprint | None,
           live_digests: Iterable[str]) -> AdmissionVerdict:
    """Admit, publish, replace or refuse. Pure.

    Args:
        ours: this agent's fingerprint.
        stored: the job's, or None (no key, or a key that is not a fingerprint).
        live_digests: the fingerprint digest of every *other* live agent of the job.
    """
    if stored is None:
        return AdmissionVerdict.PUBLISH
    if stored.digest == ours.digest:
        return AdmissionVerdict.MATCH
    if stored.digest and stored.digest in set(live_digests):
        return AdmissionVerdict.REFUSE
    return AdmissionVerdict.REPLACE


def refusal_message(job: str, ours: JobFingerprint, theirs: JobFingerprint,
                    holders: Sequence[str]) -> str:
    """The refused agent's error: both commands, what differs, and the fix. Pure."""
    diff = "; ".join(differences(ours, theirs)) or "the fingerprints differ"
    who = ", ".join(sorted(holders)[:5]) + (" ..." if len(holders) > 5 else "")
    return (f"job {job!r} is running another program: it runs `{shlex.join(theirs.command)}` "
            f"(elasticd {theirs.version}, published by {theirs.node or '?'}; live nodes {who}), "
            f"this agent was given `{shlex.join(ours.command)}` (elasticd {ours.version}). "
            f"Differs: {diff}. Nothing of the running job was touched. Fix: start this node "
            f"with a different --job for a different program, or stop the old job first "
            f"(`elasticd stop --job {job}`; once its agents are gone the next start runs the "
            "new command)")


@dataclass(frozen=True)
class Admission:
    """What :func:`admit` did."""

    verdict: AdmissionVerdict
    replaced: JobFingerprint | None = None  # the stale fingerprint a REPLACE overwrote


def _read(client: EtcdClient, keys: JobKeys, node_id: str,
          ) -> tuple[JobFingerprint | None, int, bytes | None, dict[str, str]]:
    """The stored fingerprint (None if absent or unreadable), its mod_revision and raw
    value, and node -> digest of the other live agents."""
    kv = client.get(keys.fingerprint)
    stored: JobFingerprint | None = None
    if kv is not None:
        try:
            stored = JobFingerprint.from_json(kv.value)
        except RecordError as exc:  # not ours, or torn: replaced, and said so
            log.warning("job_fingerprint_unreadable", key=keys.fingerprint, error=str(exc))
    nodes, _ = client.get_prefix(keys.nodes_prefix)
    live: dict[str, str] = {}
    for n in nodes:
        name = n.key[len(keys.nodes_prefix):]
        if name == node_id:
            continue
        try:
            live[name] = NodeRecord.from_json(n.value).fingerprint
        except RecordError:
            continue
    raw = kv.value if kv is not None else None
    return stored, kv.mod_revision if kv is not None else 0, raw, live


def precheck(client: EtcdClient, keys: JobKeys, node_id: str, ours: JobFingerprint, *,
             deadline_s: float = 30.0) -> None:
    """Refuse before registering, when a live agent runs another fingerprint (two reads,
    no write: the running job sees nothing of this agent).

    Raises:
        AdmissionRefusedError: refused (exit 78).
        TransientError: etcd stayed unreachable for ``deadline_s``.
    """
    stored, _, _, live = call_with_retry(lambda: _read(client, keys, node_id),
                                         what="read the job fingerprint",
                                         deadline=time.monotonic() + deadline_s)
    if decide(ours, stored, live.values()) is AdmissionVerdict.REFUSE:
        assert stored is not None
        _refuse(keys, ours, stored, live)


def _refuse(keys: JobKeys, ours: JobFingerprint, stored: JobFingerprint,
            live: dict[str, str]) -> None:
    holders = [n for n, d in live.items() if d == stored.digest]
    log.error("agent_refused", reason="job fingerprint differs",
              job_command=stored.command, command=ours.command,
              differs=differences(ours, stored), live_nodes=sorted(holders))
    raise AdmissionRefusedError(refusal_message(keys.job, ours, stored, holders))


def admit(client: EtcdClient, keys: JobKeys, node_id: str, ours: JobFingerprint, *,
          deadline_s: float = 30.0) -> Admission:
    """Publish, confirm or replace the job's fingerprint, or refuse this agent.

    Call it once this node's record (carrying ``ours.digest``) is registered and before
    it joins any round: the write is one transaction on the key's mod_revision, so two
    agents deciding at once are serialised (module docstring).

    Raises:
        AdmissionRefusedError: refused (exit 78).
        TransientError: etcd stayed unreachable, or the key kept changing.
    """
    deadline = time.monotonic() + deadline_s
    for _ in range(_ATTEMPTS):
        stored, rev, raw, live = call_with_retry(lambda: _read(client, keys, node_id),
                                                 what="read the job fingerprint",
                                                 deadline=deadline)
        verdict = decide(ours, stored, live.values())
        if verdict is AdmissionVerdict.REFUSE:
            assert stored is not None
            _refuse(keys, ours, stored, live)
        # MATCH rewrites the stored value unchanged: only its revision moves (module doc).
        value: bytes | str = raw if verdict is AdmissionVerdict.MATCH and raw is not None else ours.to_json()
        written = call_with_retry(partial(client.put_if, keys.fingerprint, value, mod_revision=rev),
                                  what="write the job fingerprint", deadline=deadline)
        if written:
            if verdict is AdmissionVerdict.REPLACE:
                log.info("job_fingerprint_replaced", command=ours.command,
                         previous_command=stored.command if stored else None,
                         reason="no live agent of the job runs the previous one")
            elif verdict is AdmissionVerdict.PUBLISH:
                log.info("job_fingerprint_published", command=ours.command,
                         digest=ours.digest)
            return Admission(verdict, stored if verdict is AdmissionVerdict.REPLACE else None)
    raise TransientError(f"the job fingerprint at {keys.fingerprint} kept changing "
                         f"({_ATTEMPTS} tries); is something rewriting it?")
