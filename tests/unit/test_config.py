"""Unit tests of elasticd.config: precedence, validation errors, masking, rendering."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from elasticd.config import (
    MASK,
    AgentConfig,
    WorkersConfig,
    load_config,
    render_effective,
)
from elasticd.config.loader import tomllib  # tomli on Python 3.10
from elasticd.config.schema import KEYS, standalone_job_name
from elasticd.errors import EX_CONFIG, ConfigError
from elasticd.keys import validate_job_name

REPO = Path(__file__).resolve().parents[2]
MINIMAL = """
[job]
name = "demo"
[workers]
command = ["train.py"]
"""


def write(tmp_path: Path, text: str, name: str = "agent.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def load(tmp_path: Path, text: str = MINIMAL, env=None, overrides=None, **kw) -> AgentConfig:
    kw.setdefault("hostname", "host-a")
    return load_config(write(tmp_path, text), env or {}, overrides or {}, **kw)


def config_error(tmp_path: Path, text: str = MINIMAL, env=None, overrides=None, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, env, overrides, **kw)
    message = str(info.value)
    assert "\n" not in message, "config errors are one line"
    assert info.value.exit_code == EX_CONFIG
    return message


# --- defaults and precedence -------------------------------------------------------


def test_minimal_file_gets_documented_defaults(tmp_path):
    """A file with only job.name and workers.command yields the documented defaults."""
    config = load(tmp_path)
    assert config.job.name == "demo"
    assert (config.job.min_nodes, config.job.max_nodes) == (1, 1)
    assert config.etcd.embedded and config.etcd.endpoints == ()
    assert config.node.id == "host-a" and config.node.ttl_s == 5
    assert config.workers.command == ("train.py",)
    assert config.workers.nproc_per_node == 1
    assert config.workers.hang_timeout_s == 0.0
    assert config.restart.max_restarts == 3
    assert (config.restart.backoff_s, config.restart.backoff_max_s) == (1.0, 30.0)
    assert config.rendezvous.join_timeout_s == 600.0
    assert config.etcd.timeout_s == 3.0 and config.etcd.connect_timeout_s == 30.0
    assert config.workers.monitor_interval_s == 0.1
    assert config.logging.worker_log_dir is None
    assert config.drain.grace_s == 60.0
    assert config.drain.resize_grace_s == 30.0
    assert (config.drain.plain_stop_s, config.drain.done_exit_s) == (3.0, 30.0)
    assert config.preemption.provider == "none"
    assert config.logging.format == "auto" and not config.metrics.enabled
    assert config.origins["node.ttl_s"] == "default"


def test_environment_overrides_file_and_flags_override_environment(tmp_path):
    """Precedence is file < ELASTICD_* environment < overrides, and origins say which."""
    text = MINIMAL + "[node]\nttl_s = 6\n[drain]\ngrace_s = 30\n[restart]\nmax_restarts = 1\n"
    env = {"ELASTICD_NODE_TTL_S": "7", "ELASTICD_DRAIN_GRACE_S": "45"}
    config = load(tmp_path, text, env, {"drain.grace_s": 90})
    assert config.restart.max_restarts == 1
    assert config.node.ttl_s == 7
    assert config.drain.grace_s == 90.0
    assert config.origins["restart.max_restarts"].startswith("file ")
    assert config.origins["node.ttl_s"] == "env ELASTICD_NODE_TTL_S"
    assert config.origins["drain.grace_s"] == "override"


def test_resize_grace_zero_turns_drain_on_join_off(tmp_path):
    """drain.resize_grace_s accepts 0 (restart at once on a join) from the file, env or a flag."""
    config = load(tmp_path, MINIMAL + "[drain]\nresize_grace_s = 0\n", {}, {})
    assert config.drain.resize_grace_s == 0.0
    config = load(tmp_path, MINIMAL, {"ELASTICD_DRAIN_RESIZE_GRACE_S": "5"}, {"drain.resize_grace_s": "12"})
    assert config.drain.resize_grace_s == 12.0
    assert config.origins["drain.resize_grace_s"] == "override"


def test_plain_stop_and_done_exit_come_from_file_env_and_flags(tmp_path):
    """drain.plain_stop_s and drain.done_exit_s load with the usual precedence."""
    config = load(tmp_path, MINIMAL + "[drain]\nplain_stop_s = 1.5\ndone_exit_s = 10\n", {}, {})
    assert (config.drain.plain_stop_s, config.drain.done_exit_s) == (1.5, 10.0)
    config = load(tmp_path, MINIMAL, {"ELASTICD_DRAIN_PLAIN_STOP_S": "2"}, {"drain.plain_stop_s": "4"})
    assert config.drain.plain_stop_s == 4.0 and config.origins["drain.plain_stop_s"] == "override"


def test_config_without_file_comes_from_environment_and_overrides():
    """path=None works: everything from the environment and flags."""
    config = load_config(
        None,
        {"ELASTICD_JOB_NAME": "envjob"},
        {"workers.command": "-m train --lr '0.1 0.2'"},
        hostname="h",
    )
    assert config.job.name == "envjob"
    assert config.workers.command == ("-m", "train", "--lr", "0.1 0.2")
    assert config.path is None


def test_none_overrides_and_empty_environment_values_are_skipped(tmp_path):
    """Overrides of None (flag not given) and empty env values leave lower layers alone."""
    config = load(
        tmp_path,
        MINIMAL + '[etcd]\nendpoints = "e1:2379"\n',
        {"ELASTICD_ETCD_ENDPOINTS": "", "ELASTICD_JOB_NAME": ""},
        {"job.name": None, "node.ttl_s": None},
    )
    assert config.job.name == "demo"
    assert config.etcd.endpoints == ("e1:2379",)
    assert config.node.ttl_s == 5


def test_environment_text_is_converted_per_key_type(tmp_path):
    """Env values are converted: lists from commas, shell words, booleans, numbers."""
    env = {
        "ELASTICD_ETCD_ENDPOINTS": "h1:2379, h2 ,[::1]:2380",
        "ELASTICD_WORKERS_COMMAND": "train.py 'a b' c",
        "ELASTICD_JOB_NNODES": "2:8",
        "ELASTICD_WORKERS_NPROC_PER_NODE": "4",
        "ELASTICD_METRICS_PORT": "9400",
        "ELASTICD_PREEMPTION_PROVIDER": "AWS",
        "ELASTICD_ETCD_TIMEOUT_S": "2.5",
    }
    config = load(tmp_path, env=env)
    assert config.etcd.endpoints == ("h1:2379", "h2:2379", "[::1]:2380")
    assert config.etcd.host_ports() == (("h1", 2379), ("h2", 2379), ("::1", 2380))
    assert config.workers.command == ("train.py", "a b", "c")
    assert (config.job.min_nodes, config.job.max_nodes) == (2, 8)
    assert config.workers.nproc_per_node == 4
    assert config.metrics.port == 9400 and config.metrics.enabled
    assert config.preemption.provider == "aws"
    assert config.etcd.timeout_s == 2.5


def test_boolean_from_environment(tmp_path):
    """ELASTICD_JOB_STANDALONE accepts yes/no style words."""
    assert load(tmp_path, env={"ELASTICD_JOB_STANDALONE": "yes"}).job.standalone is True
    assert load(tmp_path, env={"ELASTICD_JOB_STANDALONE": "0"}).job.standalone is False


def test_unrelated_elasticd_variables_are_ignored(tmp_path):
    """ELASTICD_SOAK and the variables the agent hands its workers are not config errors."""
    worker_contract = {
        "ELASTICD_JOB": "other", "ELASTICD_NODE": "n", "ELASTICD_ROUND": "3",
        "ELASTICD_AGENT_PID": "1", "ELASTICD_CONTROL_DIR": "/run/x",
        "ELASTICD_CONTROL_SOCKET": "/run/x/s", "ELASTICD_CHECKPOINT_URL": "memory://c",
    }
    env = {"ELASTICD_SOAK": "1", "ELASTICD_CONFIG": "/x", "PATH": "/bin", **worker_contract}
    config = load(tmp_path, env=env)
    assert config.job.name == "demo" and config.job.checkpoint_url is None


def test_nnodes_single_count_means_fixed_size(tmp_path):
    """nnodes = 4 (int) and "4" both mean exactly four nodes."""
    shared = MINIMAL + '[etcd]\nendpoints = "etcd:2379"\n'
    assert load(tmp_path, shared.replace('"demo"', '"d"\nnnodes = 4')).job.max_nodes == 4
    config = load(tmp_path, shared, overrides={"job.nnodes": "3"})
    assert (config.job.min_nodes, config.job.max_nodes) == (3, 3)


def test_worker_env_merges_file_and_overrides(tmp_path):
    """[workers.env] values become strings; override mappings merge per variable."""
    text = MINIMAL + "[workers.env]\nOMP_NUM_THREADS = 4\nNCCL_DEBUG = \"WARN\"\nX = true\n"
    config = load(tmp_path, text, overrides={"workers.env": {"NCCL_DEBUG": "INFO"}})
    assert dict(config.workers.env) == {"OMP_NUM_THREADS": "4", "NCCL_DEBUG": "INFO", "X": "1"}
    with pytest.raises(TypeError):
        config.workers.env["Y"] = "1"  # type: ignore[index]


def test_node_id_is_derived_from_hostname(tmp_path):
    """The default node id is the host name with unsafe characters replaced."""
    assert load(tmp_path, hostname="gpu node#7.example").node.id == "gpu-node-7.example"
    config = load(tmp_path, env={"ELASTICD_NODE_ID": "n1"}, hostname="ignored")
    assert config.node.id == "n1"


def test_standalone_defaults_job_name_and_loopback_address(tmp_path):
    """A standalone job needs no name (it is derived from the script and the directory)
    and its workers use 127.0.0.1."""
    config = load(tmp_path, '[job]\nstandalone = true\n[workers]\ncommand = ["t.py"]\n')
    assert config.job.name == standalone_job_name(("t.py",), os.getcwd()) and config.etcd.embedded
    assert config.job.name.startswith("t-")
    assert config.node.local_addr == "127.0.0.1"
    assert config.origins["job.name"].startswith("default (standalone")


def test_standalone_job_names_differ_by_script_and_directory():
    """Two standalone jobs never share a name by accident: another directory or another
    script is another job; the same script in the same directory is the same job."""
    a = standalone_job_name(("train.py", "--lr", "1"), "/home/ana/exp1")
    assert a == standalone_job_name(("train.py", "--lr", "2"), "/home/ana/exp1")
    assert a != standalone_job_name(("train.py",), "/home/ana/exp2")
    assert a != standalone_job_name(("eval.py",), "/home/ana/exp1")
    assert standalone_job_name(("-m", "pkg.train"), "/x").startswith("train-")
    validate_job_name(standalone_job_name(("weird name!.py",), "/x"))


def test_rendezvous_and_logging_keys_from_environment(tmp_path):
    """[rendezvous] and logging.worker_log_dir map to ELASTICD_* like every key."""
    env = {"ELASTICD_RENDEZVOUS_JOIN_TIMEOUT_S": "120",
           "ELASTICD_RENDEZVOUS_LAST_CALL_TIMEOUT_S": "0",
           "ELASTICD_LOGGING_WORKER_LOG_DIR": "/var/log/w"}
    config = load(tmp_path, env=env)
    assert config.rendezvous.join_timeout_s == 120.0
    assert config.rendezvous.last_call_timeout_s == 0.0
    assert config.logging.worker_log_dir == "/var/log/w"


def test_command_is_optional_when_not_required(tmp_path):
    """require_command=False lets read-only tools load a config without workers.command."""
    config = load(tmp_path, '[job]\nname = "demo"\n', require_command=False)
    assert config.workers.command == ()


# --- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ('[job]\nnname = "x"\n', ["job.nname", "did you mean job.name"]),
        ("[job]\nttl_s = 5\n", ["job.ttl_s", "node.ttl_s", "[node]"]),
        ("[jobs]\nname = 1\n", ["[jobs]", "did you mean [job]"]),
        ('name = "demo"\n', ["name (file ", "job.name"]),
        ('job = "demo"\n', ["job", "section"]),
        ("[etcd]\nfoo_bar_baz = 1\n", ["etcd.foo_bar_baz", "[etcd] takes"]),
    ],
)
def test_unknown_keys_are_named_with_a_suggestion(tmp_path, text, fragments):
    """Unknown sections/keys fail with the dotted key and a did-you-mean suggestion."""
    message = config_error(tmp_path, text)
    for fragment in fragments:
        assert fragment in message


def test_unknown_environment_key_in_known_section_is_an_error(tmp_path):
    """A misspelt ELASTICD_ETCD_ENDPOINT names the variable and suggests etcd.endpoints."""
    message = config_error(tmp_path, env={"ELASTICD_ETCD_ENDPOINT": "h:1"})
    assert "ELASTICD_ETCD_ENDPOINT" in message and "etcd.endpoints" in message


def test_unknown_override_key_is_an_error(tmp_path):
    """A bad override key (a CLI wiring bug) is reported, not ignored."""
    message = config_error(tmp_path, overrides={"node.ttl": 3})
    assert "node.ttl" in message and "node.ttl_s" in message


def test_worker_env_cannot_come_from_environment(tmp_path):
    """ELASTICD_WORKERS_ENV is refused with the reason and the alternative."""
    message = config_error(tmp_path, env={"ELASTICD_WORKERS_ENV": "A=1"})
    assert "inherit" in message


@pytest.mark.parametrize(
    ("text", "missing"),
    [("[workers]\ncommand = [\"x\"]\n", "job.name"), ('[job]\nname = "d"\n', "workers.command")],
)
def test_missing_required_keys_name_key_and_env_var(tmp_path, text, missing):
    """A missing required key names the key, an example line and its environment variable."""
    message = config_error(tmp_path, text)
    assert missing in message and KEYS[missing].env_var in message and "[" in message


@pytest.mark.parametrize(
    ("extra", "env", "key", "fragment"),
    [
        ('[node]\nttl_s = "5"\n', {}, "node.ttl_s", "without quotes"),
        ("[node]\nttl_s = 1\n", {}, "node.ttl_s", "between 2 and"),
        ("", {"ELASTICD_NODE_TTL_S": "five"}, "node.ttl_s", "ELASTICD_NODE_TTL_S"),
        ("", {"ELASTICD_JOB_NNODES": "4:2"}, "job.nnodes", "larger than the maximum"),
        ("", {"ELASTICD_JOB_NNODES": "0:2"}, "job.nnodes", "below 1"),
        ("", {"ELASTICD_JOB_NNODES": "a:b"}, "job.nnodes", "min:max"),
        ("", {"ELASTICD_JOB_NAME": "a/b"}, "job.name", "no '/'"),
        ("", {"ELASTICD_JOB_NAME": ".."}, "job.name", "invalid job name"),
        ("", {"ELASTICD_NODE_ID": "bad id"}, "node.id", "invalid node id"),
        ("", {"ELASTICD_PREEMPTION_PROVIDER": "gce"}, "preemption.provider", "'gcp'"),
        ("", {"ELASTICD_METRICS_PORT": "70000"}, "metrics.port", "between 0 and 65535"),
        ("", {"ELASTICD_WORKERS_NPROC_PER_NODE": "0"}, "workers.nproc_per_node", "between 1 and"),
        ("", {"ELASTICD_WORKERS_NPROC_PER_NODE": "cpu"}, "workers.nproc_per_node", '"gpu"'),
        ("", {"ELASTICD_WORKERS_COMMAND": "train.py 'oops"}, "workers.command", "quotation"),
        ("", {"ELASTICD_WORKERS_COMMAND": "-m"}, "workers.command", "module name"),
        ("", {"ELASTICD_LOGGING_FORMAT": "xml"}, "logging.format", "'json'"),
        ("", {"ELASTICD_DRAIN_GRACE_S": "0"}, "drain.grace_s", "greater than 0"),
        ("", {"ELASTICD_DRAIN_RESIZE_GRACE_S": "-1"}, "drain.resize_grace_s", "at least 0"),
        ("", {"ELASTICD_DRAIN_PLAIN_STOP_S": "0"}, "drain.plain_stop_s", "greater than 0"),
        ("", {"ELASTICD_DRAIN_DONE_EXIT_S": "-1"}, "drain.done_exit_s", "greater than 0"),
        ("", {"ELASTICD_ETCD_TIMEOUT_S": "nan"}, "etcd.timeout_s", "finite"),
        ("", {"ELASTICD_ETCD_ENDPOINTS": "h:99999"}, "etcd.endpoints", "invalid port"),
        ("", {"ELASTICD_ETCD_ENDPOINTS": "ftp://h:1"}, "etcd.endpoints", "scheme"),
        ("", {"ELASTICD_ETCD_ENDPOINTS": "h:1/path"}, "etcd.endpoints", "not host:port"),
        ("", {"ELASTICD_PREEMPTION_BASE_URL": "169.254.169.254"}, "preemption.base_url", "http"),
        ("", {"ELASTICD_JOB_STANDALONE": "maybe"}, "job.standalone", "true or false"),
        ('[job]\nnnodes = true\n', {}, "job.nnodes", "boolean"),
        ("[workers]\ncommand = []\n", {}, "workers.command", "script"),
        ("[workers]\ncommand = [1]\n", {}, "workers.command", "string"),
    ],
)
def test_invalid_values_name_key_value_origin_and_fix(tmp_path, extra, env, key, fragment):
    """Each invalid value gives one line naming section.key, the value and a fix."""
    text = MINIMAL
    if extra.startswith("[job]"):
        text = text.replace("[job]\n", extra)
    elif extra.startswith("[workers]"):
        text = '[job]\nname = "demo"\n' + extra
    else:
        text = MINIMAL + extra
    message = config_error(tmp_path, text, env)
    assert message.startswith(key), message
    assert fragment in message, message
    assert " = " in message  # the value is shown


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ('[etcd]\nendpoints = ["e:2379"]\nuser = "u"\npassword = "p"\npassword_file = "/f"\n',
         "etcd.password_file", "keep only one"),
        ('[etcd]\nendpoints = ["e:2379"]\npassword = "p"\n', "etcd.password", "set etcd.user"),
        ('[etcd]\nendpoints = ["e:2379"]\nuser = "u"\n', "etcd.user", "password"),
        ('[etcd]\nendpoints = ["e:2379"]\nca_file = "/ca"\ncert_file = "/c"\n',
         "etcd.cert_file", "etcd.key_file"),
        ('[etcd]\nendpoints = ["e:2379"]\ncert_file = "/c"\nkey_file = "/k"\n',
         "etcd.cert_file", "etcd.ca_file"),
        ('[etcd]\nca_file = "/ca"\n', "etcd.ca_file", "embedded"),
        ('[etcd]\nendpoints = ["https://e:2379", "e2:2379"]\n', "etcd.endpoints", "mix schemes"),
        ('[etcd]\nendpoints = ["e:2379"]\nuser = "u"\npassword_file = "/f"\n', "etcd.user",
         "insecure_allow_plaintext_auth"),
        ('[job]\nname = "d"\nstandalone = true\n[etcd]\nendpoints = "e"\n',
         "job.standalone", "etcd.endpoints"),
        ('[job]\nname = "d"\nstandalone = true\nnnodes = "1:4"\n', "job.standalone", "nnodes"),
        ("[restart]\nbackoff_s = 10\nbackoff_max_s = 5\n", "restart.backoff_max_s", ">="),
        ('[job]\nname = "d"\nnnodes = "2:4"\n', "job.nnodes", "no other node can reach"),
    ],
)
def test_inconsistent_keys_are_rejected(tmp_path, text, key, fragment):
    """Cross-key rules (auth pairs, TLS pairs, embedded vs TLS, standalone) fail clearly."""
    base = MINIMAL if not text.startswith("[job]") else '[workers]\ncommand = ["x"]\n'
    message = config_error(tmp_path, base + text, check_files=False)
    assert message.startswith(key), message
    assert fragment in message, message


def test_password_is_masked_in_error_messages(tmp_path):
    """An auth error about etcd.password does not print the password."""
    message = config_error(
        tmp_path, MINIMAL + '[etcd]\nendpoints = ["e"]\npassword = "hunter2"\n'
    )
    assert "hunter2" not in message


def test_reserved_worker_variables_are_refused(tmp_path):
    """[workers.env] cannot set RANK and friends, which the agent sets per worker."""
    message = config_error(tmp_path, MINIMAL + "[workers.env]\nRANK = 0\n")
    assert "workers.env.RANK" in message and "remove it" in message
    message = config_error(tmp_path, MINIMAL + '[workers.env]\n"1BAD" = "x"\n')
    assert "not a valid environment variable name" in message


def test_file_problems_are_config_errors(tmp_path):
    """Missing, unreadable (a directory) and unparsable files give one clear message each."""
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"), {}, {})
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(str(tmp_path), {}, {})
    message = config_error(tmp_path, '[job]\nname = demo\n')
    assert "not valid TOML" in message and "line 2" in message
    (tmp_path / "bin.toml").write_bytes(b'[job]\nname = "\xff"\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(tmp_path / "bin.toml"), {}, {})


def test_tls_and_password_files_are_checked_when_asked(tmp_path):
    """check_files=True refuses missing TLS/password files; False skips the check."""
    text = MINIMAL + (
        '[etcd]\nendpoints = ["e:2379"]\nca_file = "/nonexistent/ca.pem"\n'
    )
    message = config_error(tmp_path, text)
    assert message.startswith("etcd.ca_file") and "no such readable file" in message
    assert load(tmp_path, text, check_files=False).etcd.ca_file == "/nonexistent/ca.pem"


def test_password_file_is_read_and_validated(tmp_path):
    """password_file: read lazily without its trailing newline; empty files refused."""
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    text = MINIMAL + f'[etcd]\nendpoints = ["https://e"]\nuser = "u"\npassword_file = "{secret}"\n'
    config = load(tmp_path, text)
    assert config.etcd.resolved_password() == "s3cret"
    assert "s3cret" not in render_effective(config)
    secret.write_text("")
    assert "empty" in config_error(tmp_path, text)


def test_workdir_must_exist_when_checking_files(tmp_path):
    """workers.workdir that does not exist is refused before anything starts."""
    message = config_error(tmp_path, env={"ELASTICD_WORKERS_WORKDIR": str(tmp_path / "nope")})
    assert message.startswith("workers.workdir")
    assert load(tmp_path, env={"ELASTICD_WORKERS_WORKDIR": str(tmp_path)}).workers.workdir


# --- nproc_per_node resolution -----------------------------------------------------


def test_nproc_per_node_resolution():
    """"gpu" needs GPUs, "auto" falls back to 1, a number is used as is."""
    assert WorkersConfig(nproc_per_node=3).resolve_nproc_per_node(lambda: 8) == 3
    assert WorkersConfig(nproc_per_node="gpu").resolve_nproc_per_node(lambda: 8) == 8
    assert WorkersConfig(nproc_per_node="auto").resolve_nproc_per_node(lambda: 0) == 1
    with pytest.raises(ConfigError, match="workers.nproc_per_node.*no GPU"):
        WorkersConfig(nproc_per_node="gpu").resolve_nproc_per_node(lambda: 0)


# --- masking and rendering ---------------------------------------------------------

SECRET_TEXT = MINIMAL.replace('"demo"', '"demo"\ncheckpoint_url = "s3://b/x?X-Amz-Signature=topsecret"') + (
    '[etcd]\nendpoints = ["https://e1:2379"]\nuser = "root"\npassword = "hunter2"\n'
    '[workers.env]\nHF_TOKEN = "hf_abc"\nAWS_SECRET_ACCESS_KEY = "zzz"\nOMP_NUM_THREADS = "4"\n'
)


def test_masked_hides_passwords_url_credentials_and_secret_env(tmp_path):
    """masked() replaces passwords, URL query values and secret-looking env values with ***
    (credentials inside a checkpoint URL are refused: test_security)."""
    masked = load(tmp_path, SECRET_TEXT).masked()
    assert masked.etcd.password == MASK
    assert masked.job.checkpoint_url == f"s3://b/x?X-Amz-Signature={MASK}"
    assert masked.workers.env["HF_TOKEN"] == MASK
    assert masked.workers.env["AWS_SECRET_ACCESS_KEY"] == MASK
    assert masked.workers.env["OMP_NUM_THREADS"] == "4"


def test_render_effective_masks_secrets_and_reloads(tmp_path):
    """--check-config output has no secrets, shows origins, and loads back to the same config."""
    config = load(tmp_path, SECRET_TEXT, {"ELASTICD_NODE_TTL_S": "9"})
    text = render_effective(config)
    for secret in ("hunter2", "topsecret", "hf_abc", "zzz"):
        assert secret not in text
    assert "ttl_s = 9  # env ELASTICD_NODE_TTL_S" in text
    assert "# ca_file = (unset)" in text
    assert "hunter2" not in repr(config)
    tomllib.loads(text)
    again = load_config(write(tmp_path, text, "rendered.toml"), {}, {}, hostname="other")
    assert again == config.masked()


# --- docs --------------------------------------------------------------------------


def test_every_key_is_documented_with_its_environment_variable():
    """docs/configuration.md documents every key and its ELASTICD_* variable."""
    doc = (REPO / "docs" / "configuration.md").read_text()
    for key in KEYS.values():
        assert re.search(rf"`{re.escape(key.dotted)}`", doc), f"{key.dotted} undocumented"
        if key.dotted != "workers.env":
            assert key.env_var in doc, f"{key.env_var} undocumented"


def test_module_docstring_lists_every_override_key():
    """The override key list in the package docstring matches the schema."""
    import elasticd.config

    doc = elasticd.config.__doc__ or ""
    for key in KEYS:
        assert key in doc, f"override key {key} missing from elasticd.config docstring"


def test_config_package_does_not_read_os_environ():
    """Only callers pass the environment in: the config package never reads os.environ."""
    reads_env = re.compile(r"os\.environ(\.|\[)|getenv\(")
    for path in (REPO / "elasticd" / "config").glob("*.py"):
        assert not reads_env.search(path.read_text()), path


@pytest.mark.parametrize(("value", "expected"), [('"auto"', "auto"), ("200", 200), ('""', None)])
def test_checkpoint_every_is_auto_or_steps(tmp_path, value, expected):
    """[checkpoint] every takes "auto" or a whole number of steps (empty: the script's)."""
    assert load(tmp_path, MINIMAL + f"[checkpoint]\nevery = {value}\n").checkpoint.every == expected
    assert load(tmp_path, env={"ELASTICD_CHECKPOINT_EVERY": value.strip('"')}).checkpoint.every == expected


@pytest.mark.parametrize("value", ['"often"', "0", "1.5", "true"])
def test_a_bad_checkpoint_every_names_the_key_and_the_fix(tmp_path, value):
    """Anything else is a ConfigError naming checkpoint.every and the accepted forms."""
    with pytest.raises(ConfigError, match=r'checkpoint\.every.*every = "auto"'):
        load(tmp_path, MINIMAL + f"[checkpoint]\nevery = {value}\n")


def test_the_workers_checkpoint_url_variable_is_not_read_as_a_config_key(tmp_path):
    """ELASTICD_CHECKPOINT_URL (what the agent hands its workers) falls under the
    [checkpoint] prefix but is not a key: an agent started from a worker's environment
    still loads."""
    assert load(tmp_path, env={"ELASTICD_CHECKPOINT_URL": "file:///c"}).checkpoint.every is None
