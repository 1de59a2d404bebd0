"""Registration of the ``etcd-v3`` backend with torch elastic.

``torchrun --rdzv-backend etcd-v3 --rdzv-endpoint h1:2379,h2:2379 --rdzv-id JOB
--rdzv-conf node_ttl=5,ca_file=...`` finds us through the ``torchrun.handlers`` entry
point, which torch calls with no arguments and which must return the creator.

Recognised ``--rdzv-conf`` keys (:data:`RDZV_CONF_KEYS`): ``node_ttl`` (s),
``join_timeout``, ``last_call_timeout``, ``start_settle``, ``close_timeout``, ``store_timeout``,
``etcd_timeout``, ``ca_file``, ``cert_file``, ``key_file``, ``user``, ``password``,
``password_file``, ``insecure_plaintext_auth`` (``true`` to send the password without
TLS), ``node_id``; and ``timeout``, the join timeout's name in torch's own etcd
backend (``join_timeout`` wins if both are given). Each is a layer over the same typed
configuration as ``elasticd agent`` (defaults, bounds and cross-checks from the schema);
``ELASTICD_*`` variables apply below it.
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from elasticd.config import load_config
from elasticd.errors import ConfigError
from elasticd.etcd.client import EtcdClient
from elasticd.logs import ensure_configured

BACKEND = "etcd-v3"
# --rdzv-conf key -> configuration key: torchrun's options are one more layer of the same
# typed configuration (elasticd.config), validated by the same schema.
RDZV_CONF_KEYS = {
    "node_ttl": "node.ttl_s",
    "join_timeout": "rendezvous.join_timeout_s",
    "timeout": "rendezvous.join_timeout_s",  # torch's own etcd backend calls it this
    "last_call_timeout": "rendezvous.last_call_timeout_s",
    "start_settle": "rendezvous.start_settle_s",
    "close_timeout": "rendezvous.close_timeout_s",
    "store_timeout": "rendezvous.store_timeout_s",
    "liveness_probe": "rendezvous.liveness_probe",
    "etcd_timeout": "etcd.timeout_s",
    "ca_file": "etcd.ca_file",
    "cert_file": "etcd.cert_file",
    "key_file": "etcd.key_file",
    "user": "etcd.user",
    "password": "etcd.password",
    "password_file": "etcd.password_file",
    "insecure_plaintext_auth": "etcd.insecure_allow_plaintext_auth",
    "node_id": "node.id",
}
# Set by torchrun itself, not by the user.
_TORCHRUN_KEYS = {"rank", "is_host", "local_addr"}


def rdzv_conf_overrides(params: RendezvousParameters) -> tuple[dict[str, Any], dict[str, str]]:
    """torch's ``RendezvousParameters`` as configuration overrides, and how each was spelled.

    Raises:
        ConfigError: an unknown ``--rdzv-conf`` key.
    """
    unknown = set(params.config) - set(RDZV_CONF_KEYS) - _TORCHRUN_KEYS
    if unknown:
        raise ConfigError(f"unknown etcd-v3 rendezvous option(s) {sorted(unknown)}; "
                          f"known: {sorted(RDZV_CONF_KEYS)}")
    overrides: dict[str, Any] = {
        "etcd.endpoints": params.endpoint,
        "job.name": params.run_id,
        "job.nnodes": f"{params.min_nodes}:{params.max_nodes}",
    }
    names = {"etcd.endpoints": "--rdzv-endpoint", "job.name": "--rdzv-id",
             "job.nnodes": "--nnodes"}
    # `join_timeout` wins over `timeout` when both are given: apply `timeout` first.
    for option in sorted(params.config, key=lambda k: k != "timeout"):
        if option in _TORCHRUN_KEYS or params.config[option] is None:
            continue
        dotted = RDZV_CONF_KEYS[option]
        overrides[dotted] = str(params.config[option])
        names[dotted] = f"--rdzv-conf {option}"
    if params.local_addr:
        overrides["node.local_addr"] = params.local_addr
        names["node.local_addr"] = "--local-addr"
    return overrides, names


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build an ``EtcdRendezvousHandler`` from torch's ``RendezvousParameters``.

    Raises:
        ConfigError: unknown option, bad number, invalid job name, unreadable TLS files.
    """
    # Imported here, not at module level: when elasticd's handler module is what first
    # imports torch's rendezvous package, torch loads this module (our torchrun.handlers
    # entry point) while etcd_handler is still half-initialised; a top-level import then
    # fails as circular, leaving etcd-v3 unregistered and a traceback in every log.
    from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler
    from elasticd.rendezvous.settings import RendezvousSettings

    # Under plain torchrun nobody else configures structlog; importing the package must not.
    ensure_configured()
    overrides, names = rdzv_conf_overrides(params)
    # torchrun passes no training command to the rendezvous; the environment layer
    # (ELASTICD_*) applies as under `elasticd agent`.
    cfg = load_config(None, os.environ, overrides, require_command=False, override_names=names)
    if cfg.rendezvous.global_batch_size:
        # The rendezvous does not know torchrun's --nproc-per-node: it would derive sizes
        # for 1 worker a node and admit rounds whose batch does not split.
        raise ConfigError("rendezvous.global_batch_size is not supported under plain torchrun "
                          "(the rendezvous does not see --nproc-per-node); set "
                          "ELASTICD_RENDEZVOUS_VALID_SIZES to the valid node counts instead")
    client = EtcdClient.from_config(cfg.etcd)
    settings = RendezvousSettings.from_config(cfg)
    # Without a node_id, torchrun's agents keep torch's own semantics: one id per agent
    # process (HOST-PID), so several agents on one host are several nodes.
    node_id = cfg.node.id if "node.id" in names or cfg.origins["node.id"].startswith("env") else None
    # Nobody else holds this client: the handler closes it on shutdown().
    return EtcdRendezvousHandler(client, cfg.job.name, settings, node_id=node_id,
                                 owns_client=True)


def register() -> None:
    """Register ``etcd-v3`` in torch's handler registry (idempotent)."""
    try:
        rendezvous_handler_registry.register(BACKEND, create_handler)
    except ValueError:
        pass  # already registered with this creator (torchrun's entry-point loading)


def torchrun_handler():
    """Entry point for ``torchrun.handlers``: called with no arguments, returns the creator."""
    return create_handler
