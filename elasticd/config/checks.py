"""Checks of a whole configuration: cross-key validation, and the warnings
``--check-config`` prints.

Single keys are parsed and range-checked by the schema (``schema.py``) while the layers
are merged (``loader.py``); what needs several keys at once, or the file system, is here.
"""

from __future__ import annotations

import math
import os
from typing import Any

from elasticd.config.model import MASK, AgentConfig
from elasticd.errors import ConfigError, shown
from elasticd.keys import validate_job_name, validate_node_id
from elasticd.rendezvous.sizes import resolve_valid_sizes
from elasticd.sensitive import loose_secret_file, mask_value, scrub_text

# node.ttl_s against the etcd members' election timeout E: below 1.5 E a leader stall that
# triggers no election can expire a healthy node's lease (an error); 3 E leaves a keep-alive
# interval of margin (a warning below it).
MIN_TTL_PER_ELECTION = 1.5
SAFE_TTL_PER_ELECTION = 3.0


def availability_warnings(config: AgentConfig) -> list[str]:
    """Settings that keep a job from riding through an etcd member failure (one line each).

    An agent talks to one etcd member at a time and moves to the next listed endpoint when
    a call fails; given one endpoint it has nowhere to go (docs/deployment.md, "The etcd
    cluster: members, failover, backup").
    """
    endpoints, out = config.etcd.endpoints, []
    if len(endpoints) == 1 and not config.etcd.embedded:
        out.append(f"etcd.endpoints names one endpoint ({endpoints[0]}): if etcd runs as a "
                   "cluster, list every member (e.g. --etcd etcd-1:2379,etcd-2:2379,etcd-3:2379) "
                   "so the agent can move to another member when this one fails")
    election, ttl = config.etcd.election_timeout_s, config.node.ttl_s
    if not config.etcd.embedded and ttl < SAFE_TTL_PER_ELECTION * election:
        out.append(f"node.ttl_s = {ttl} is below {SAFE_TTL_PER_ELECTION:g} x "
                   f"etcd.election_timeout_s = {election:g} s: a leader stall just short of an "
                   "election plus one slow keep-alive could drop a healthy node; prefer "
                   f"node.ttl_s >= {math.ceil(SAFE_TTL_PER_ELECTION * election)}")
    return out


# Variables that make the dynamic loader or Python load code: under workers.user the
# launcher and the warm standbys start as root with [workers.env] (docs/security.md).
ROOT_LOADER_ENV = frozenset({"LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH", "PYTHONPATH",
                             "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE"})


def security_warnings(config: AgentConfig) -> list[str]:
    """The insecure settings ``config`` shows, one line each (``--check-config`` prints them).

    None of them is an error: each is a choice an operator may make on purpose, but
    should make knowingly (docs/security.md).
    """
    out: list[str] = []
    etcd, origins = config.etcd, config.origins
    if etcd.insecure_allow_plaintext_auth and etcd.user is not None and not etcd.tls:
        out.append("etcd.insecure_allow_plaintext_auth = true: the etcd password crosses the "
                   "network in clear text; serve etcd over TLS and set etcd.ca_file")
    if etcd.password is not None:
        where = origins.get("etcd.password", "")
        out.append(f"etcd.password is set in the {'environment' if where.startswith('env') else 'config'}"
                   " (readable by whoever reads it, and inherited by child processes); "
                   "use etcd.password_file (chmod 0600) instead")
    if etcd.password_file is not None:
        loose = loose_secret_file(etcd.password_file)
        if loose:
            out.append(f"etcd.password_file: {loose}")
    if etcd.key_file is not None:
        loose = loose_secret_file(etcd.key_file)
        if loose:
            out.append(f"etcd.key_file: {loose}")
    if any(e.startswith("https://") for e in etcd.endpoints) and etcd.ca_file is None:
        out.append("etcd.endpoints are https:// without etcd.ca_file: etcd's certificate is "
                   "verified against the system's root CAs (fine for a publicly signed "
                   "certificate; set etcd.ca_file for a private CA)")
    if not etcd.embedded and not etcd.tls:
        out.append("etcd.endpoints are plaintext (no etcd.ca_file, no https://): anyone on the "
                   "network path can read and change the job's keys; serve etcd over TLS")
    if config.metrics.enabled and config.metrics.addr in ("0.0.0.0", "::"):
        out.append(f"metrics.addr = {config.metrics.addr!r}: the metrics listen on every "
                   "interface; set the address Prometheus scrapes, or 127.0.0.1")
    log_dir = config.logging.worker_log_dir
    if log_dir is not None:
        from elasticd.logs import check_log_root  # keeps structlog out of plain config loads

        try:
            check_log_root(log_dir)
        except ConfigError as exc:
            out.append(f"logging.worker_log_dir: {exc}")
    for name, value in config.workers.env.items():
        if config.workers.user is not None and name in ROOT_LOADER_ENV:
            out.append(f"workers.env.{name} with workers.user: the workers' launcher and warm "
                       "standbys load it as root before they switch to the user, so whoever "
                       f"can write what it names runs code as root; drop {name} from "
                       "[workers.env] or point it only at root-owned, unwritable files")
        if mask_value(name, value) != value:
            out.append(f"workers.env.{name} looks like a secret: every worker (training code) "
                       "sees it; prefer the storage's own credential chain (e.g. instance roles)")
    return out


# --- cross-key validation --------------------------------------------------------


def validate_config(config: AgentConfig, *, check_files: bool) -> None:
    """Checks that involve more than one key, or the file system.

    Args:
        config: the merged configuration (every key already parsed and range-checked).
        check_files: also check that the files and directories it names are readable.

    Raises:
        ConfigError: naming the key, its value (secrets masked), where it came from and
            the fix.
    """
    origins = config.origins

    def bad(dotted: str, value: Any, problem_and_fix: str) -> ConfigError:
        text = scrub_text(shown(mask_value(dotted, value)))
        return ConfigError(f"{dotted} = {text} ({origins.get(dotted, 'default')}): {problem_and_fix}")

    job, etcd, node, workers = config.job, config.etcd, config.node, config.workers
    try:
        validate_job_name(job.name)
    except ConfigError as exc:
        raise bad("job.name", job.name, str(exc)) from None
    try:
        validate_node_id(node.id)
    except ConfigError as exc:
        raise bad("node.id", node.id, f"{exc}; set [node] id explicitly") from None
    if job.standalone and etcd.endpoints:
        raise bad(
            "job.standalone", True,
            "a standalone job uses an embedded etcd, but etcd.endpoints is set too; "
            "remove etcd.endpoints, or set standalone = false for a multi-node job",
        )
    if job.standalone and job.max_nodes > 1:
        raise bad(
            "job.standalone", True,
            f'a standalone job runs on one node, but job.nnodes allows {job.max_nodes}; '
            'set nnodes = 1, or standalone = false with etcd.endpoints',
        )
    if etcd.embedded and not job.standalone and job.max_nodes > 1:
        raise bad(
            "job.nnodes", f"{job.min_nodes}:{job.max_nodes}",
            "etcd.endpoints is empty, so this agent starts a private etcd on 127.0.0.1 "
            "that no other node can reach; set etcd.endpoints to an etcd all nodes share, "
            "or nnodes = 1 for a one-machine job",
        )
    if node.ttl_s < MIN_TTL_PER_ELECTION * etcd.election_timeout_s:
        # A leader stalled for S < election timeout E triggers no election (no new leader
        # restarts the TTLs) and answers no keep-alive meanwhile; a lease last renewed up
        # to TTL/3 before the stall expires once TTL/3 + S >= TTL. So TTL >= 1.5 E, or a
        # healthy node is dropped as "lost" (docs/deployment.md, the TTL rule).
        raise bad(
            "node.ttl_s", node.ttl_s,
            f"shorter than {MIN_TTL_PER_ELECTION:g} x etcd.election_timeout_s = "
            f"{etcd.election_timeout_s:g} s: a leader stall too short to trigger an election "
            "could expire a healthy node's lease; set node.ttl_s >= "
            f"{math.ceil(SAFE_TTL_PER_ELECTION * etcd.election_timeout_s)} (or lower the members' "
            "--election-timeout and etcd.election_timeout_s with it)",
        )
    rdzv = config.rendezvous
    if rdzv.valid_sizes or rdzv.global_batch_size:
        nproc = workers.nproc_per_node  # "gpu"/"auto": checked once resolved (node_spec)
        try:
            resolve_valid_sizes(rdzv.valid_sizes or (), rdzv.global_batch_size,
                                nproc if isinstance(nproc, int) else 1,
                                min_nodes=job.min_nodes, max_nodes=job.max_nodes)
        except ConfigError as exc:
            dotted = "rendezvous.valid_sizes" if rdzv.valid_sizes else "rendezvous.global_batch_size"
            value = list(rdzv.valid_sizes) if rdzv.valid_sizes else rdzv.global_batch_size
            raise bad(dotted, value, str(exc).split(": ", 1)[1]) from None
    if config.restart.backoff_max_s < config.restart.backoff_s:
        raise bad(
            "restart.backoff_max_s", config.restart.backoff_max_s,
            f"smaller than restart.backoff_s = {config.restart.backoff_s}; "
            "make backoff_max_s >= backoff_s",
        )
    if etcd.password is not None and etcd.password_file is not None:
        raise bad(
            "etcd.password_file", etcd.password_file,
            "etcd.password is set too; keep only one (password_file keeps the secret "
            "out of the config and the environment)",
        )
    has_password = etcd.password is not None or etcd.password_file is not None
    if has_password and etcd.user is None:
        key = "etcd.password" if etcd.password is not None else "etcd.password_file"
        raise bad(key, MASK if key == "etcd.password" else etcd.password_file,
                  "a password needs a user; set etcd.user too")
    if etcd.user is not None and not has_password:
        raise bad("etcd.user", etcd.user,
                  "a user needs a password; set etcd.password_file (or etcd.password)")
    if (etcd.cert_file is None) != (etcd.key_file is None):
        given, missing = (
            ("etcd.cert_file", "etcd.key_file") if etcd.cert_file else
            ("etcd.key_file", "etcd.cert_file")
        )
        raise bad(given, getattr(etcd, given.split(".")[1]),
                  f"client TLS needs both a certificate and its key; set {missing} too")
    if etcd.cert_file is not None and etcd.ca_file is None:
        raise bad("etcd.cert_file", etcd.cert_file,
                  "client certificates are only sent over TLS; set etcd.ca_file too")
    if etcd.embedded:
        for dotted in ("etcd.ca_file", "etcd.cert_file", "etcd.user"):
            value = getattr(etcd, dotted.split(".")[1])
            if value is not None:
                raise bad(
                    dotted, value,
                    "etcd.endpoints is empty, so the agent starts a private embedded etcd "
                    "(TLS with its own generated client certificate) and this would be "
                    "ignored; set etcd.endpoints to "
                    "your etcd cluster, or remove the key",
                )
    elif etcd.user is not None and not etcd.tls and not etcd.insecure_allow_plaintext_auth:
        raise bad(
            "etcd.user", etcd.user,
            "a user and password without TLS would cross the network in clear text; serve "
            "etcd over TLS and set etcd.ca_file (or write the endpoints https:// for a "
            "publicly signed certificate), or, on a network you trust, opt in with "
            "etcd.insecure_allow_plaintext_auth = true",
        )
    if check_files:
        for dotted in ("etcd.ca_file", "etcd.cert_file", "etcd.key_file", "etcd.password_file"):
            file_path = getattr(etcd, dotted.split(".")[1])
            if file_path is not None and not (
                os.path.isfile(file_path) and os.access(file_path, os.R_OK)
            ):
                raise bad(dotted, file_path,
                          "no such readable file; fix the path or the file's permissions "
                          "for the agent's user")
        if etcd.password_file is not None:
            try:
                etcd.resolved_password()
            except ConfigError as exc:
                raise ConfigError(f"{exc} ({origins.get('etcd.password_file')})") from None
        log_dir = config.logging.worker_log_dir
        if log_dir is not None:
            from elasticd.logs import check_log_root

            check_log_root(log_dir)
        if workers.workdir is not None and not os.path.isdir(workers.workdir):
            raise bad("workers.workdir", workers.workdir,
                      "no such directory; create it or fix the path")
