"""Registration of the ``etcd-v3`` backend with torch elastic.

``torchrun --rdzv-backend etcd-v3 --rdzv-endpoint h1:2379,h2:2379 --rdzv-id JOB
--rdzv-conf node_ttl=5,ca_file=...`` finds us through the ``torchrun.handlers`` entry
point, which torch calls with no arguments and which must return the creator.

Recognised ``--rdzv-conf`` keys: ``node_ttl`` (s), ``join_timeout``, ``last_call_timeout``,
``close_timeout``, ``store_timeout``, ``etcd_timeout``, ``ca_file``, ``cert_file``,
``key_file``, ``user``, ``password``, ``password_file``, ``insecure_plaintext_auth``
(``true`` to send the password without TLS), ``node_id``; and ``timeout``, the join timeout's name in torch's own etcd backend (``join_timeout`` wins if both are given).
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from elasticd.errors import ConfigError
from elasticd.etcd.client import EtcdClient, TLSFiles
from elasticd.keys import validate_job_name
from elasticd.sensitive import read_secret_file

BACKEND = "etcd-v3"
_KNOWN = {"node_ttl", "join_timeout", "last_call_timeout", "close_timeout", "store_timeout",
          "etcd_timeout", "ca_file", "cert_file", "key_file", "user", "password",
          "password_file", "node_id", "timeout", "insecure_plaintext_auth"}


def _number(params: RendezvousParameters, key: str, default: float) -> float:
    raw = params.get(key, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"rendezvous option {key}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ConfigError(f"rendezvous option {key}={raw!r} must be positive")
    return value


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build an ``EtcdRendezvousHandler`` from torch's ``RendezvousParameters``.

    Raises:
        ConfigError: unknown option, bad number, invalid job name, unreadable TLS files.
    """
    # Imported here, not at module level: when elasticd's handler module is what first
    # imports torch's rendezvous package, torch loads this module (our torchrun.handlers
    # entry point) while etcd_handler is still half-initialised; a top-level import then
    # fails as circular, leaving etcd-v3 unregistered and a traceback in every log.
    from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler, RendezvousSettings

    unknown = set(params.config) - _KNOWN - {"rank", "is_host", "local_addr"}
    if unknown:
        raise ConfigError(f"unknown etcd-v3 rendezvous option(s) {sorted(unknown)}; "
                          f"known: {sorted(_KNOWN)}")
    job = validate_job_name(params.run_id)
    password = params.get("password")
    if params.get("password_file"):
        password = read_secret_file(params.get("password_file"), "rdzv-conf password_file")
    ttl = int(_number(params, "node_ttl", 5))
    if ttl < 2:
        raise ConfigError(f"node_ttl={ttl} is below etcd's minimum lease TTL of 2 s")
    client = EtcdClient(
        params.endpoint,
        timeout_s=_number(params, "etcd_timeout", 3.0),
        tls=TLSFiles(params.get("ca_file"), params.get("cert_file"), params.get("key_file")),
        user=params.get("user"),
        password=password,
        allow_plaintext_auth=str(params.get("insecure_plaintext_auth", "")).lower() in ("1", "true"),
    )
    settings = RendezvousSettings(
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        node_ttl_s=ttl,
        # `timeout` is what torch's etcd backend calls it: honour it for users switching over.
        join_timeout_s=_number(params, "join_timeout", _number(params, "timeout", 600.0)),
        last_call_timeout_s=_number(params, "last_call_timeout", 1.0),
        close_timeout_s=_number(params, "close_timeout", 30.0),
        store_timeout_s=_number(params, "store_timeout", 300.0),
        local_addr=params.local_addr,
    )
    return EtcdRendezvousHandler(client, job, settings, node_id=params.get("node_id"))


def register() -> None:
    """Register ``etcd-v3`` in torch's handler registry (idempotent)."""
    try:
        rendezvous_handler_registry.register(BACKEND, create_handler)
    except ValueError:
        pass  # already registered with this creator (torchrun's entry-point loading)


def torchrun_handler():
    """Entry point for ``torchrun.handlers``: called with no arguments, returns the creator."""
    return create_handler
