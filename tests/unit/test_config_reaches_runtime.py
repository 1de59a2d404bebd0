"""Every configuration key reaches the runtime, and its default is defined once.

The walk below sets each schema key to a non-default value, loads it through the one
pipeline (``load_config``), maps it with the one function (``elasticd.agent.settings.
node_spec``) and finds the value in the object the runner uses. A key added to the
schema without a row here fails ``test_the_walk_covers_every_key``: a key that does
nothing cannot exist.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from elasticd.agent.elastic_agent import SupervisionSettings
from elasticd.agent.runner import NodeSpec
from elasticd.agent.settings import node_spec
from elasticd.config import load_config, model, render_effective
from elasticd.config.flags import FLAGS, NO_FLAG
from elasticd.config.schema import KEYS, REQUIRED
from elasticd.etcd.client import EtcdClient
from elasticd.rendezvous.settings import RendezvousSettings

BASE = {"job.name": "walk", "workers.command": ("train.py",), "etcd.endpoints": "10.0.0.1:2379"}

Check = Callable[[NodeSpec], Any]


def _client(spec: NodeSpec) -> EtcdClient:
    """The client the runner builds from the spec (construction connects to nothing)."""
    return EtcdClient.from_config(spec.etcd)


def _rows(tmp_path) -> dict[str, tuple[dict[str, Any], Check, Any]]:
    """key -> (overrides, how to read the runtime value, expected runtime value)."""
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    ca, cert, key = (tmp_path / "ca.pem", tmp_path / "c.pem", tmp_path / "k.pem")
    for f in (ca, cert, key):
        f.write_text("-----BEGIN X-----\n")  # read when the client is built, parsed on connecting
    auth = {"etcd.user": "u", "etcd.ca_file": str(ca)}  # auth needs TLS
    tls = {"etcd.ca_file": str(ca), "etcd.cert_file": str(cert), "etcd.key_file": str(key)}
    return {
        "job.name": ({"job.name": "other"}, lambda s: s.job, "other"),
        "job.nnodes": ({"job.nnodes": "2:4"}, lambda s: (s.rendezvous.min_nodes, s.rendezvous.max_nodes), (2, 4)),
        "job.checkpoint_url": ({"job.checkpoint_url": "s3://b/x"},
                               lambda s: s.supervision.checkpoint_url, "s3://b/x"),
        "job.standalone": ({"job.standalone": "true", "etcd.endpoints": ""},
                           lambda s: (s.etcd.embedded, s.rendezvous.local_addr), (True, "127.0.0.1")),
        "job.resume": ({"job.resume": "require"}, lambda s: s.resume, "require"),
        "checkpoint.every": ({"checkpoint.every": "auto"}, lambda s: s.supervision.checkpoint_every,
                             "auto"),
        "etcd.endpoints": ({"etcd.endpoints": "h1:1,h2:2"}, lambda s: _client(s).endpoints, [("h1", 1), ("h2", 2)]),
        "etcd.ca_file": ({"etcd.ca_file": str(ca)}, lambda s: _client(s).tls.ca_file, str(ca)),
        "etcd.cert_file": (tls, lambda s: _client(s).tls.cert_file, str(cert)),
        "etcd.key_file": (tls, lambda s: _client(s).tls.key_file, str(key)),
        "etcd.user": ({**auth, "etcd.password_file": str(pw)}, lambda s: s.etcd.user, "u"),
        "etcd.password": ({**auth, "etcd.password": "pw2"}, lambda s: s.etcd.resolved_password(), "pw2"),
        "etcd.password_file": ({**auth, "etcd.password_file": str(pw)},
                               lambda s: s.etcd.resolved_password(), "s3cret"),
        "etcd.insecure_allow_plaintext_auth": ({"etcd.user": "u", "etcd.password": "pw2",
                                                "etcd.insecure_allow_plaintext_auth": "true"},
                                               lambda s: s.etcd.insecure_allow_plaintext_auth, True),
        "etcd.timeout_s": ({"etcd.timeout_s": "7"}, lambda s: _client(s).timeout_s, 7.0),
        "etcd.connect_timeout_s": ({"etcd.connect_timeout_s": "9"},
                                   lambda s: s.etcd.connect_timeout_s, 9.0),
        "etcd.election_timeout_s": ({"etcd.election_timeout_s": "2"},
                                    lambda s: s.rendezvous.election_timeout_s, 2.0),
        "etcd.data_dir": ({"etcd.data_dir": "/var/lib/e"}, lambda s: s.etcd.data_dir, "/var/lib/e"),
        "node.id": ({"node.id": "n7"}, lambda s: s.node_id, "n7"),
        "node.local_addr": ({"node.local_addr": "10.1.2.3"}, lambda s: s.rendezvous.local_addr, "10.1.2.3"),
        "node.ttl_s": ({"node.ttl_s": "9"},
                       lambda s: (s.rendezvous.node_ttl_s, s.supervision.attribution_window_s), (9, 10.0)),
        "rendezvous.join_timeout_s": ({"rendezvous.join_timeout_s": "11"},
                                      lambda s: s.rendezvous.join_timeout_s, 11.0),
        "rendezvous.last_call_timeout_s": ({"rendezvous.last_call_timeout_s": "0.5"},
                                           lambda s: s.rendezvous.last_call_timeout_s, 0.5),
        "rendezvous.start_settle_s": ({"rendezvous.start_settle_s": "2.5"},
                                      lambda s: s.rendezvous.start_settle_s, 2.5),
        "rendezvous.close_timeout_s": ({"rendezvous.close_timeout_s": "12"},
                                       lambda s: s.rendezvous.close_timeout_s, 12.0),
        "rendezvous.store_timeout_s": ({"rendezvous.store_timeout_s": "13"},
                                       lambda s: s.rendezvous.store_timeout_s, 13.0),
        "rendezvous.liveness_probe": ({"rendezvous.liveness_probe": "false"},
                                      lambda s: s.rendezvous.liveness_probe, False),
        "rendezvous.valid_sizes": ({"job.nnodes": "1:4", "rendezvous.valid_sizes": "4,2"},
                                   lambda s: s.rendezvous.valid_sizes, (2, 4)),
        "rendezvous.global_batch_size": ({"job.nnodes": "1:4", "workers.nproc_per_node": "2",
                                          "rendezvous.global_batch_size": "8"},
                                         lambda s: s.rendezvous.valid_sizes, (1, 2, 4)),
        "rendezvous.hang_eject_s": ({"rendezvous.hang_eject_s": "7"},
                                    lambda s: s.rendezvous.hang_eject_s, 7.0),
        "rendezvous.straggler_factor": ({"rendezvous.straggler_factor": "1.5"},
                                        lambda s: s.rendezvous.straggler_factor, 1.5),
        "rendezvous.straggler_window_s": ({"rendezvous.straggler_window_s": "60"},
                                          lambda s: s.rendezvous.straggler_window_s, 60.0),
        "rendezvous.straggler_probation_s": ({"rendezvous.straggler_probation_s": "90"},
                                             lambda s: s.rendezvous.straggler_probation_s, 90.0),
        "workers.command": ({"workers.command": "other.py --x 1"}, lambda s: s.command,
                            ("other.py", "--x", "1")),
        "workers.nproc_per_node": ({"workers.nproc_per_node": "3"}, lambda s: s.nproc_per_node, 3),
        "workers.workdir": ({"workers.workdir": str(tmp_path)}, lambda s: s.workdir, str(tmp_path)),
        "workers.env": ({"workers.env": {"A": "1"}}, lambda s: s.supervision.worker_env, {"A": "1"}),
        "workers.monitor_interval_s": ({"workers.monitor_interval_s": "0.3"},
                                       lambda s: s.supervision.monitor_interval_s, 0.3),
        "workers.hang_timeout_s": ({"workers.hang_timeout_s": "100"},
                                   lambda s: s.supervision.hang_timeout_s, 100.0),
        "workers.warm_start": ({"workers.warm_start": "false"},
                               lambda s: s.supervision.warm_start, False),
        "workers.standby_refill": ({"workers.standby_refill": "false"},
                                   lambda s: s.supervision.standby_refill, False),
        "workers.spare_prebuild": ({"workers.spare_prebuild": "true"},
                                   lambda s: s.supervision.spare_prebuild, True),
        "workers.live_reform": ({"workers.live_reform": "false"},
                                lambda s: s.supervision.live_reform, False),
        "workers.live_reform_timeout_s": ({"workers.live_reform_timeout_s": "7"},
                                          lambda s: s.supervision.live_reform_timeout_s, 7.0),
        "workers.user": ({"workers.user": "trainer"}, lambda s: s.supervision.workers_user,
                         "trainer"),
        "restart.max_restarts": ({"restart.max_restarts": "5"},
                                 lambda s: s.supervision.max_restarts, 5),
        "restart.backoff_s": ({"restart.backoff_s": "2"},
                              lambda s: s.supervision.restart_backoff_s, 2.0),
        "restart.backoff_max_s": ({"restart.backoff_max_s": "40"},
                                  lambda s: s.supervision.restart_backoff_max_s, 40.0),
        "drain.grace_s": ({"drain.grace_s": "20"}, lambda s: s.supervision.drain_grace_s, 20.0),
        "drain.resize_grace_s": ({"drain.resize_grace_s": "4"},
                                 lambda s: s.supervision.resize_grace_s, 4.0),
        "drain.plain_stop_s": ({"drain.plain_stop_s": "7"},
                               lambda s: s.supervision.plain_stop_s, 7.0),
        "drain.done_exit_s": ({"drain.done_exit_s": "8"}, lambda s: s.supervision.done_exit_s, 8.0),
        "preemption.provider": ({"preemption.provider": "aws"},
                                lambda s: type(s.preemption.source).__name__, "AwsSpotSource"),
        "preemption.base_url": ({"preemption.provider": "aws",
                                 "preemption.base_url": "http://127.0.0.1:9"},
                                lambda s: s.preemption.source.base_url, "http://127.0.0.1:9"),
        "preemption.poll_interval_s": ({"preemption.provider": "gcp",
                                        "preemption.poll_interval_s": "5"},
                                       lambda s: s.preemption.poll_interval_s, 5.0),
        "preemption.drain_lead_s": ({"preemption.provider": "gcp", "preemption.drain_lead_s": "45"},
                                    lambda s: s.preemption.drain_lead_s, 45.0),
        "logging.format": ({"logging.format": "json"}, lambda s: s.log_format, "json"),
        "logging.level": ({"logging.level": "warning"}, lambda s: s.log_level, "warning"),
        "logging.worker_log_dir": ({"logging.worker_log_dir": "/var/log/w"},
                                   lambda s: s.log_dir, "/var/log/w"),
        "metrics.port": ({"metrics.port": "9400"}, lambda s: s.metrics_port, 9400),
        "metrics.addr": ({"metrics.addr": "10.0.0.9"}, lambda s: s.metrics_addr, "10.0.0.9"),
    }


def test_the_walk_covers_every_key(tmp_path):
    """The table below has a row for exactly the schema's keys (a new key needs one)."""
    assert set(_rows(tmp_path)) == set(KEYS)


@pytest.mark.parametrize("dotted", sorted(KEYS))
def test_every_key_reaches_the_runtime(dotted, tmp_path):
    """Setting a key changes the value the runner acts on, through load_config + node_spec."""
    overrides, read, expected = _rows(tmp_path)[dotted]
    cfg = load_config(None, {}, {**BASE, **overrides}, check_files=False, hostname="h")
    assert read(node_spec(cfg, {})) == expected
    default = load_config(None, {}, BASE, check_files=False, hostname="h")
    if dotted not in BASE:  # the default differs, so the row really observed the key
        try:
            assert read(node_spec(default, {})) != expected
        except AttributeError:  # e.g. no preemption watcher at all by default
            pass


def test_every_key_but_secrets_and_tables_has_a_flag():
    """`run` and `agent` can set every key from the command line, except the password
    (visible in `ps`), the worker env table and the positional command."""
    assert {f.dotted for f in FLAGS} == set(KEYS) - NO_FLAG


def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}


@pytest.mark.parametrize("section", sorted({k.section for k in KEYS.values()}))
def test_model_defaults_equal_the_schema(section):
    """The typed sections' dataclass defaults are the schema's (defined once, checked here)."""
    cls = {"job": model.JobConfig, "checkpoint": model.CheckpointConfig, "etcd": model.EtcdConfig, "node": model.NodeConfig,
           "rendezvous": model.RendezvousConfig, "workers": model.WorkersConfig,
           "restart": model.RestartConfig, "drain": model.DrainConfig,
           "preemption": model.PreemptionConfig, "logging": model.LoggingConfig,
           "metrics": model.MetricsConfig}[section]
    defaults = _defaults(cls)
    for key in KEYS.values():
        if key.section == section and key.name in defaults and key.default is not REQUIRED:
            assert defaults[key.name] == key.default, key.dotted


def test_runtime_defaults_equal_the_schema():
    """Library-level defaults (NodeSpec, SupervisionSettings, RendezvousSettings) agree with
    the schema, so code that builds them directly behaves like the CLI."""
    d = {k: v.default for k, v in KEYS.items()}
    node, sup, rdzv = _defaults(NodeSpec), _defaults(SupervisionSettings), _defaults(RendezvousSettings)
    assert rdzv["node_ttl_s"] == d["node.ttl_s"]
    assert rdzv["join_timeout_s"] == d["rendezvous.join_timeout_s"]
    assert rdzv["last_call_timeout_s"] == d["rendezvous.last_call_timeout_s"]
    assert rdzv["close_timeout_s"] == d["rendezvous.close_timeout_s"]
    assert rdzv["start_settle_s"] == d["rendezvous.start_settle_s"]
    assert rdzv["store_timeout_s"] == d["rendezvous.store_timeout_s"]
    assert rdzv["liveness_probe"] == d["rendezvous.liveness_probe"]
    assert rdzv["valid_sizes"] == () and d["rendezvous.valid_sizes"] is None  # None: all sizes
    assert rdzv["hang_eject_s"] == d["rendezvous.hang_eject_s"]
    assert rdzv["straggler_factor"] == d["rendezvous.straggler_factor"]
    assert rdzv["straggler_window_s"] == d["rendezvous.straggler_window_s"]
    assert rdzv["straggler_probation_s"] == d["rendezvous.straggler_probation_s"]
    assert rdzv["election_timeout_s"] == d["etcd.election_timeout_s"]
    assert node["log_format"] == d["logging.format"] and node["log_level"] == d["logging.level"]
    assert node["metrics_addr"] == d["metrics.addr"]
    assert sup["max_restarts"] == d["restart.max_restarts"]
    assert sup["restart_backoff_s"] == d["restart.backoff_s"]
    assert sup["restart_backoff_max_s"] == d["restart.backoff_max_s"]
    assert sup["drain_grace_s"] == d["drain.grace_s"]
    assert sup["resize_grace_s"] == d["drain.resize_grace_s"]
    assert sup["plain_stop_s"] == d["drain.plain_stop_s"]
    assert sup["done_exit_s"] == d["drain.done_exit_s"]
    assert sup["hang_timeout_s"] == d["workers.hang_timeout_s"]
    assert sup["monitor_interval_s"] == d["workers.monitor_interval_s"]
    assert sup["warm_start"] == d["workers.warm_start"]
    assert sup["standby_refill"] == d["workers.standby_refill"]
    assert sup["live_reform"] == d["workers.live_reform"]
    assert sup["spare_prebuild"] == d["workers.spare_prebuild"]
    assert sup["live_reform_timeout_s"] == d["workers.live_reform_timeout_s"]
    assert sup["workers_user"] == d["workers.user"]
    assert node["resume"] == d["job.resume"]


def test_an_unset_drain_lead_follows_the_recovery_path():
    """``preemption.drain_lead_s`` unset: 20 s under live re-formation (a live drain writes
    no checkpoint), 60 s on the restart path (its drain saves); a value set is kept on both."""
    watch = {**BASE, "preemption.provider": "aws"}

    def lead(**extra: str) -> float:
        cfg = load_config(None, {}, {**watch, **extra}, check_files=False, hostname="h")
        return node_spec(cfg, {}).preemption.drain_lead_s

    assert lead() == model.LIVE_DRAIN_LEAD_S == 20.0
    shown = render_effective(load_config(None, {}, watch, check_files=False, hostname="h"))
    assert "# drain_lead_s = (unset: 20 s under live re-formation)" in shown
    assert lead(**{"workers.live_reform": "false"}) == model.RESTART_DRAIN_LEAD_S == 60.0
    for live in ("true", "false"):
        assert lead(**{"workers.live_reform": live, "preemption.drain_lead_s": "90"}) == 90.0


def test_every_flag_is_documented():
    """docs/configuration.md's flag table names every flag and its key."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for f in FLAGS:
        assert f"`{f.option}`" in doc and f"`{f.dotted}" in doc, f.option


# -- the worker side: every worker-side setting travels through control/ ----------------
def _worker_env_of(cfg: Any) -> dict[str, str]:
    """The environment the agent of ``cfg`` hands its workers (the runner's pure path)."""
    from elasticd.agent.run_identity import check_resume
    from elasticd.agent.worker_env import supervised_worker_env
    from elasticd.control.api import ENV_CONTROL_DIR, ENV_CONTROL_SOCKET, ENV_ROUND

    spec = node_spec(cfg, {})
    sup = check_resume(spec.supervision, spec.job, "0123456789abcdef", spec.resume)
    env = supervised_worker_env(sup, job=spec.job, node="n0", agent_pid=1,
                                control_env={ENV_CONTROL_DIR: "/d", ENV_CONTROL_SOCKET: "/d/s"})
    return {**env, ENV_ROUND: "3"}


WORKER_SIDE = {  # key -> (overrides, what the worker reads, expected)
    "workers.live_reform_timeout_s": ({"workers.live_reform_timeout_s": "7"},
                                      lambda e: e.live_timeout_s, 7.0),
    "workers.live_reform": ({"workers.live_reform": "false"}, lambda e: e.live, False),
    "job.resume": ({"job.resume": "require"}, lambda e: e.resume, "require"),
}


@pytest.mark.parametrize("dotted", sorted(WORKER_SIDE))
def test_worker_side_keys_reach_the_worker(dotted):
    """A worker-side key set in the agent's config is what the worker parses from the
    environment its agent hands it (control.environment), not a literal of its own."""
    from elasticd.control.environment import agent_environment

    overrides, read, expected = WORKER_SIDE[dotted]
    cfg = load_config(None, {}, {**BASE, **overrides}, check_files=False, hostname="h")
    env = agent_environment(_worker_env_of(cfg))
    assert env is not None and read(env) == expected
    default = agent_environment(_worker_env_of(load_config(None, {}, BASE, check_files=False,
                                                           hostname="h")))
    assert default is not None and read(default) != expected
    assert env.run_id == "0123456789abcdef"


def test_live_state_waits_as_long_as_its_agent(monkeypatch):
    """LiveState bounds a re-formation by the agent's workers.live_reform_timeout_s (it
    waited a literal 60 s while the agent gave up after 30 s); the worker's default equals
    the schema's."""
    import torch

    import elasticd.worker.context as wctx
    from elasticd.control.api import LIVE_TIMEOUT_DEFAULT_S
    from elasticd.control.environment import agent_environment
    from elasticd.worker.live import LiveState

    cfg = load_config(None, {}, {**BASE, "workers.live_reform_timeout_s": "7"},
                      check_files=False, hostname="h")
    env = agent_environment(_worker_env_of(cfg))
    ctx = wctx.WorkerContext(rank=0, world_size=1, local_rank=0, local_world_size=1,
                             device=torch.device("cpu"), backend="gloo", restart_count=0,
                             round=3, job="walk", node="n0", checkpoint_url=None, under_agent=True)
    monkeypatch.setattr(wctx, "_RUNTIME", wctx.WorkerRuntime(ctx))
    monkeypatch.setattr(wctx, "agent_environment", lambda: env)
    assert LiveState({}).timeout_s == 7.0
    monkeypatch.setattr(wctx, "agent_environment", lambda: None)
    assert LiveState({}).timeout_s == LIVE_TIMEOUT_DEFAULT_S == KEYS["workers.live_reform_timeout_s"].default


def test_the_etcd_client_is_built_from_the_section_with_its_credentials(tmp_path):
    """EtcdClient.from_config hands over user, password and the plaintext opt-in: a
    password without TLS is refused unless the section opts in (so all three arrived)."""
    from elasticd.errors import ConfigError

    base = {**BASE, "etcd.user": "u", "etcd.password": "pw"}
    refused = load_config(None, {}, {**base, "etcd.insecure_allow_plaintext_auth": "true"},
                          check_files=False, hostname="h")
    client = EtcdClient.from_config(refused.etcd)  # opted in: built
    assert client.endpoints == [("10.0.0.1", 2379)] and not client.secure
    no_password = dataclasses.replace(refused.etcd, password=None)
    with pytest.raises(ConfigError, match="both a user and a password"):
        EtcdClient.from_config(no_password)
    no_opt_in = dataclasses.replace(refused.etcd, insecure_allow_plaintext_auth=False)
    with pytest.raises(ConfigError, match="clear text"):
        EtcdClient.from_config(no_opt_in)


def test_torchrun_and_the_agent_build_the_same_rendezvous_settings():
    """The agent's NodeSpec and torchrun's handler get RendezvousSettings from one mapping."""
    cfg = load_config(None, {}, {**BASE, "etcd.election_timeout_s": "2", "node.ttl_s": "9"},
                      check_files=False, hostname="h")
    assert node_spec(cfg, {}).rendezvous == RendezvousSettings.from_config(cfg)
    assert RendezvousSettings.from_config(cfg).election_timeout_s == 2.0


def test_torchruns_underscore_spellings_are_accepted():
    """Every flag torchrun also has is accepted in torchrun's underscore spelling
    (``--nproc_per_node 2``), setting the same key; --help lists only the hyphen form."""
    import argparse

    from torch.distributed.run import get_args_parser

    from elasticd.cli import build_parser

    parser = build_parser()
    run = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
    ours = {o for a in run._actions for o in a.option_strings}
    torchrun = {o for a in get_args_parser()._actions for o in a.option_strings}
    shared = {o for o in torchrun if "_" in o and o.replace("_", "-") in ours}
    assert "--nproc_per_node" in shared and shared <= ours, shared - ours
    args = parser.parse_args(["run", "--nproc_per_node", "2", "--max_restarts", "5",
                              "--monitor_interval", "0.5", "train.py"])
    dest = vars(args)
    assert (dest["workers.nproc_per_node"], dest["restart.max_restarts"],
            dest["workers.monitor_interval_s"]) == ("2", "5", "0.5")
    assert "--nproc_per_node" not in run.format_help()
