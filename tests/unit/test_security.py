"""Unit tests of the trust-boundary policies: one masking rule, one secret-file reader,
names that cannot smuggle characters, typed records, the worker log dir, config bounds and
the --check-config security warnings."""

from __future__ import annotations

import argparse
import io
import json
import os
import stat
import tempfile
from pathlib import Path

import pytest
import structlog
import structlog.testing

from elasticd.config import load_config, security_warnings
from elasticd.errors import ConfigError
from elasticd.etcd.client import EtcdClient, endpoints_scheme, parse_endpoints
from elasticd.keys import (
    job_of_key,
    parse_ascii_int,
    round_of_key,
    validate_job_name,
    validate_node_id,
)
from elasticd.logs import redact_secrets, resolve_worker_log_dir
from elasticd.records import Event, NodeRecord, Progress, RecordError
from elasticd.sensitive import MASK, is_secret_name, read_secret_file, redact_url, scrub_text
from elasticd.status.options import options_from_args
from elasticd.status.render import make_console, printable, render_job

BASE = {"job.name": "demo", "workers.command": "train.py"}


def config_error(text: str, tmp_path: Path, overrides=None, **kw) -> str:
    path = tmp_path / "agent.toml"
    path.write_text('[job]\nname = "demo"\n[workers]\ncommand = ["train.py"]\n' + text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), {}, overrides, check_files=False, **kw)
    return str(info.value)


# --- one masking rule -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["HF_TOKEN", "GH_PAT", "NPM_AUTH", "AWS_SECRET_ACCESS_KEY",
                                  "DB_PASSWORD", "MYPASSWORDX", "SSH_KEY", "etcd.password",
                                  "api_key", "WANDB_API_KEY"])
def test_secret_names_are_masked(name):
    """*_PAT, *_AUTH, *_TOKEN, *_SECRET, *_KEY and *PASSWORD* names count as secrets."""
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["PATH", "AUTHOR", "MONKEY", "OMP_NUM_THREADS", "key",
                                  "etcd.key_file", "password_file", "PYTHONPATH"])
def test_ordinary_names_are_shown(name):
    """Locations (_file/_path/_dir) and words that merely contain the letters are not secrets."""
    assert not is_secret_name(name)


def test_url_userinfo_and_query_values_are_masked():
    """user:password@ and a bare token@ both lose the whole userinfo; query values go too."""
    assert redact_url("https://user:pw@h/x?sig=abc") == f"https://{MASK}@h/x?sig={MASK}"
    assert "ghp_123" not in redact_url("https://ghp_123@github.com/o/r")
    text = "fetch https://u:hunter2@h/x failed; HF_TOKEN=hf_abc; password: 12345; key=/elasticd/j"
    out = scrub_text(text)
    for secret in ("hunter2", "hf_abc", "12345"):
        assert secret not in out
    assert "key=/elasticd/j" in out


def test_log_lines_are_masked():
    """The structlog processor masks secret-named fields and secrets inside string values."""
    event = redact_secrets(None, "info", {"event": "x", "HF_TOKEN": "hf_abc",
                                          "url": "s3://AKIA:zzz@bucket/k", "step": 3,
                                          "env": {"GH_PAT": "ghp"}, "key": "/elasticd/j/progress"})
    assert "hf_abc" not in json.dumps(event) and "zzz" not in json.dumps(event)
    assert "ghp" not in json.dumps(event)
    assert event["step"] == 3 and event["key"] == "/elasticd/j/progress"


def test_numeric_password_is_not_echoed_in_a_config_error(tmp_path):
    """`password = 12345` (a TOML number) is refused without printing the number."""
    msg = config_error('[etcd]\nendpoints = ["https://e:2379"]\nuser = "u"\npassword = 987654\n',
                       tmp_path)
    assert "etcd.password" in msg and "987654" not in msg


def test_credentials_in_an_endpoint_url_are_refused_without_echo(tmp_path):
    """`https://user:pw@host` as an endpoint is a config error that does not repeat the password."""
    msg = config_error('[etcd]\nendpoints = ["https://u:hunter2@e:2379"]\n', tmp_path)
    assert "hunter2" not in msg and "etcd.user" in msg
    with pytest.raises(ConfigError) as info:
        parse_endpoints("https://u:hunter2@e:2379")
    assert "hunter2" not in str(info.value)


def test_cli_main_masks_secrets_in_errors(capsys):
    """`elasticd agent` with credentials in an endpoint URL exits 78 without echoing them."""
    from elasticd.cli import main

    assert main(["agent", "--job", "j", "--etcd", "https://u:hunter2@e:2379", "--check-config"]) == 78
    err = capsys.readouterr().err
    assert "etcd.endpoints" in err and "hunter2" not in err


# --- one reader of secret files ---------------------------------------------------------

def test_every_path_reads_a_password_file_the_same_way(tmp_path):
    """the config (`elasticd run` and `elasticd agent` both load it) and `elasticd status`
    read the same secret from one file:
    trailing CR/LF removed, inner and leading/trailing spaces kept."""
    pw = tmp_path / "pw"
    pw.write_text(" pass word \r\n")
    pw.chmod(0o600)
    cfg = load_config(None, {}, {**BASE, "etcd.endpoints": "https://e:2379", "etcd.user": "u",
                                 "etcd.password_file": str(pw)})
    status_args = argparse.Namespace(etcd_user="u", etcd_password_file=str(pw), etcd="e:2379")
    assert cfg.etcd.resolved_password() == " pass word "
    assert options_from_args(status_args).password == " pass word "


def test_secret_file_reads_are_bounded(tmp_path):
    """/dev/zero, a directory and a huge file are refused at once, naming the path only."""
    big = tmp_path / "big"
    big.write_bytes(b"x" * (1 << 20))
    for path in ("/dev/zero", str(tmp_path), str(big)):
        with pytest.raises(ConfigError, match="etcd.password_file"):
            read_secret_file(path, "etcd.password_file")


# --- credentials and TLS ----------------------------------------------------------------

def test_auth_without_tls_is_refused_unless_the_insecure_flag_is_set(tmp_path):
    """A user on plaintext endpoints is a ConfigError naming the opt-in flag; the flag (or
    https://, or a CA) makes it valid; the client refuses the same without the flag."""
    msg = config_error('[etcd]\nendpoints = ["e:2379"]\nuser = "u"\npassword_file = "/f"\n', tmp_path)
    assert "insecure_allow_plaintext_auth" in msg
    ok = load_config(None, {}, {**BASE, "etcd.endpoints": "e:2379", "etcd.user": "u",
                                "etcd.password": "p", "etcd.insecure_allow_plaintext_auth": True})
    assert ok.etcd.insecure_allow_plaintext_auth
    https = load_config(None, {}, {**BASE, "etcd.endpoints": "https://e:2379", "etcd.user": "u",
                                   "etcd.password": "p"})
    assert https.etcd.tls and https.etcd.host_ports() == (("e", 2379),)
    with pytest.raises(ConfigError, match="clear text"):
        EtcdClient("e:2379", user="u", password="p")
    assert EtcdClient("https://e:2379").secure  # https:// is TLS even without a CA
    assert not EtcdClient("e:2379").secure
    assert endpoints_scheme("https://a:1,https://b:2") == "https"
    with pytest.raises(ConfigError, match="mix"):
        endpoints_scheme("https://a:1,b:2")


def test_check_config_warns_about_each_insecure_setting(tmp_path):
    """--check-config's warnings name plaintext auth, an inline password, a loose password
    file, metrics on 0.0.0.0, a loose log dir, plaintext endpoints and secret worker env."""
    pw = tmp_path / "pw"
    pw.write_text("p\n")
    pw.chmod(0o644)
    loose = tmp_path / "logs"
    loose.mkdir()
    loose.chmod(0o777)
    cfg = load_config(None, {}, {**BASE, "etcd.endpoints": "e:2379", "etcd.user": "u",
                                 "etcd.password_file": str(pw),
                                 "etcd.insecure_allow_plaintext_auth": True,
                                 "metrics.port": 9400, "metrics.addr": "0.0.0.0",
                                 "logging.worker_log_dir": str(loose),
                                 "workers.env": {"HF_TOKEN": "x"}}, check_files=False)
    text = "\n".join(security_warnings(cfg))
    for needle in ("insecure_allow_plaintext_auth", "0644", "metrics.addr", "worker_log_dir",
                   "plaintext", "workers.env.HF_TOKEN"):
        assert needle in text, needle
    inline = load_config(None, {}, {**BASE, "etcd.endpoints": "https://e:2379", "etcd.user": "u",
                                    "etcd.password": "p"})
    warnings = security_warnings(inline)
    assert any("etcd.password is set" in w for w in warnings)
    assert any("system's root CAs" in w for w in warnings)
    assert not any("plaintext" in w for w in warnings)
    clean = load_config(None, {}, {**BASE, "job.standalone": True})
    assert security_warnings(clean) == []


def test_metrics_addr_defaults_to_loopback_and_must_be_an_ip():
    """metrics.addr is 127.0.0.1 unless set, and a non-address is a config error."""
    assert load_config(None, {}, BASE).metrics.addr == "127.0.0.1"
    with pytest.raises(ConfigError, match="metrics.addr"):
        load_config(None, {}, {**BASE, "metrics.addr": "everywhere"})


def test_config_file_size_is_bounded(tmp_path):
    """A config larger than 1 MiB is refused without reading it all; /dev/zero (not a
    regular file) without reading it at all."""
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config("/dev/zero", {}, BASE)
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (2 << 20))
    with pytest.raises(ConfigError, match="larger than"):
        load_config(str(big), {}, BASE)


# --- names ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["r1\n", "a/b", "..", "", "x" * 65, "r\u0661"])
def test_job_names_match_in_full(bad):
    """A trailing newline, a slash or a non-ASCII digit never makes a valid job name."""
    with pytest.raises(ConfigError):
        validate_job_name(bad)


def test_node_ids_and_key_parts_use_full_ascii_matches():
    """Node ids match in full; rounds and event sequence numbers are ASCII digits only."""
    with pytest.raises(ConfigError):
        validate_node_id("n1\n")
    assert round_of_key("/r/\u0661\u0662/x", "/r/") is None  # Arabic-Indic 12
    assert round_of_key("/r/0000000012/x", "/r/") == 12
    assert parse_ascii_int("\u0663") is None and parse_ascii_int("-1") is None
    assert parse_ascii_int("42") == 42
    assert job_of_key("/elasticd/bad\nname/x") is None
    assert job_of_key("/elasticd/good/x") == "good"


def test_checkpoint_names_use_ascii_digits():
    """A step directory spelled with Arabic-Indic digits is not a step."""
    from elasticd.checkpoint.manifest import STEP_DIR_RE

    assert STEP_DIR_RE.fullmatch("step-000000000012")
    assert not STEP_DIR_RE.fullmatch("step-" + "\u0661" * 12)
    assert not STEP_DIR_RE.fullmatch("step-000000000012\n")


# --- records ----------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [b"[1,2]", b'"s"', b"3", b"null", b"{", b"\xff",
                                 b'{"node": 1, "host": "h", "pid": 1, "version": "v", "started_at": 1}',
                                 b'{"node": "n", "host": "h", "pid": true, "version": "v", "started_at": 1}',
                                 b'{"node": "n", "host": "h", "pid": 1, "version": "v", "started_at": 1,'
                                 b' "ranks": ["0"]}',
                                 b'{"node": "n"}'])
def test_node_records_are_validated_by_type(raw):
    """JSON that is not an object, or fields of the wrong type, raise RecordError (a ValueError)."""
    with pytest.raises(RecordError):
        NodeRecord.from_json(raw)
    assert issubclass(RecordError, ValueError)


def test_valid_records_round_trip_and_ints_pass_as_floats():
    """A written record reads back equal; an int where a float is declared is accepted."""
    rec = NodeRecord(node="n", host="h", pid=1, version="v", started_at=1.5, ranks=[0, 1])
    assert NodeRecord.from_json(rec.to_json()) == rec
    assert Progress.from_json(b'{"round": 1, "step": 2, "samples_per_s": 3}').samples_per_s == 3.0
    with pytest.raises(RecordError):
        Event.from_json(b'{"time": 1, "kind": "x", "node": "n", "round": 0, "message": "m",'
                        b' "detail": []}')


# --- status output ----------------------------------------------------------------------

def test_status_screen_escapes_terminal_control_characters():
    """Control and bidi characters from records are shown escaped, never sent raw."""
    from elasticd.etcd.client import KV
    from elasticd.keys import JobKeys
    from elasticd.status.model import derive_status
    from elasticd.status.snapshot import parse_job_kvs

    evil = "a\x1b]0;owned\x07\x1b[2Jb\u202e"
    rec = NodeRecord(node="n", host=evil, pid=1, version=evil, started_at=1.0, state="training",
                     last_exit=evil)
    kvs = [KV(JobKeys("j").node("n"), rec.to_json().encode(), 2, 2, 0)]
    status = derive_status(parse_job_kvs("j", kvs, 2), 10.0)
    out = io.StringIO()
    make_console(out, width=120).print(render_job(status))
    assert "\x1b" not in out.getvalue() and "\u202e" not in out.getvalue()
    assert printable(evil) == "a\\x1b]0;owned\\x07\\x1b[2Jb\\u202e"


# --- worker log dir ---------------------------------------------------------------------

def test_default_worker_log_dir_is_fresh_private_and_unpredictable():
    """Without a setting, each start gets a new 0700 directory of its own in the temp dir,
    and the choice is logged."""
    with structlog.testing.capture_logs() as logs:
        a = resolve_worker_log_dir(None, "jobx")
        b = resolve_worker_log_dir(None, "jobx")
    assert [e["path"] for e in logs if e["event"] == "worker_log_dir_chosen"] == [a, b]
    try:
        assert a != b and os.path.basename(a).startswith("elasticd-logs-jobx-")
        assert stat.S_IMODE(os.stat(a).st_mode) == 0o700
    finally:
        os.rmdir(a)
        os.rmdir(b)


def test_state_directory_is_the_default_log_root(tmp_path):
    """Under systemd ($STATE_DIRECTORY) logs go to <state>/worker-logs/<job>, created 0700."""
    with structlog.testing.capture_logs():
        path = resolve_worker_log_dir(None, "j", state_dir=str(tmp_path))
    assert path == str(tmp_path / "worker-logs" / "j")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


def test_loose_or_foreign_log_dirs_are_refused(tmp_path):
    """A log root writable by group/others, or owned by another user, is a ConfigError
    naming the path and the fix."""
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(ConfigError, match="chmod go-w"):
        resolve_worker_log_dir(str(loose), "j")
    if os.geteuid() != 0:
        print("skipped the foreign-owner half: chown needs root")
        return
    foreign = Path(tempfile.mkdtemp())
    try:
        os.chown(foreign, 65534, 65534)
        with pytest.raises(ConfigError, match="owned by uid 65534"):
            resolve_worker_log_dir(str(foreign), "j")
        with pytest.raises(ConfigError, match="owned by uid 65534"):
            resolve_worker_log_dir(str(foreign / "sub"), "j")  # under a foreign parent
    finally:
        os.rmdir(foreign)


def test_agent_check_config_prints_warnings_on_stderr_and_no_secret(tmp_path, capsys):
    """`elasticd agent --check-config` keeps stdout a loadable config and warns on stderr."""
    from elasticd.cli import main

    cfg = tmp_path / "agent.toml"
    cfg.write_text('[job]\nname = "demo"\n[workers]\ncommand = ["train.py"]\n'
                   '[etcd]\nendpoints = ["https://e:2379"]\nuser = "u"\npassword = "hunter2"\n'
                   '[metrics]\nport = 9400\naddr = "0.0.0.0"\n')
    assert main(["agent", "--config", str(cfg), "--check-config"]) == 0
    out, err = capsys.readouterr()
    assert "hunter2" not in out + err
    warnings = [ln for ln in err.splitlines() if ln.startswith("elasticd: warning: insecure setting")]
    assert any("metrics.addr" in w for w in warnings) and any("etcd.password" in w for w in warnings)


# --- the commit-intent root (issue 21, item 5) ------------------------------------------

def test_state_root_defaults_to_xdg_state_home_else_local_state():
    """$XDG_STATE_HOME/elasticd when absolute, else ~/.local/state/elasticd; never <tmp>."""
    from elasticd.logs import default_state_root

    assert default_state_root("/x/state", "/home/u") == "/x/state/elasticd"
    assert default_state_root("relative", "/home/u") == "/home/u/.local/state/elasticd"
    assert default_state_root(None, "/home/u") == "/home/u/.local/state/elasticd"
    assert default_state_root(None, None).endswith("/.local/state/elasticd")
    assert not default_state_root(None, None).startswith(tempfile.gettempdir())


def test_private_tree_creates_every_level_0700_and_refuses_symlinks(tmp_path):
    """Missing ancestors and every level are made 0700 (not 0755 under umask 022); a symlink
    at any level elasticd owns is refused, never followed; a loose existing level is tightened."""
    from elasticd.logs import ensure_private_tree

    what = ("commit intent dir", "$XDG_STATE_HOME")
    old = os.umask(0o022)
    try:
        got = ensure_private_tree(str(tmp_path / "home/.local/state/elasticd"),
                                  ("commit-intents", "job"), what)
    finally:
        os.umask(old)
    assert got == str(tmp_path / "home/.local/state/elasticd/commit-intents/job")
    level = tmp_path
    for part in ("home", ".local", "state", "elasticd", "commit-intents", "job"):
        level = level / part
        assert stat.S_IMODE(os.lstat(level).st_mode) == 0o700, level
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "home/.local/state/elasticd/commit-intents/j2")
    with pytest.raises(ConfigError, match="symbolic link"):
        ensure_private_tree(str(tmp_path / "home/.local/state/elasticd"), ("commit-intents", "j2"),
                            what)
    os.symlink(tmp_path / "elsewhere", tmp_path / "linked-root")
    with pytest.raises(ConfigError, match="symbolic link"):
        ensure_private_tree(str(tmp_path / "linked-root"), ("commit-intents", "j"), what)
    os.chmod(tmp_path / "home/.local/state/elasticd", 0o755)
    ensure_private_tree(str(tmp_path / "home/.local/state/elasticd"), ("commit-intents", "job"), what)
    assert stat.S_IMODE(os.lstat(tmp_path / "home/.local/state/elasticd").st_mode) == 0o700


# --- the "Low" list of issue 21 ----------------------------------------------------------

def test_worker_count_and_hang_timeout_are_bounded():
    """nproc_per_node = 100000 and hang_timeout_s = 1e-300 are config errors; 0 (off) and
    sane values pass."""
    with pytest.raises(ConfigError, match="nproc_per_node.*between 1 and 1024"):
        load_config(None, {}, {**BASE, "workers.nproc_per_node": 100000})
    with pytest.raises(ConfigError, match="hang_timeout_s.*at least 1"):
        load_config(None, {}, {**BASE, "workers.hang_timeout_s": 1e-300})
    assert load_config(None, {}, {**BASE, "workers.hang_timeout_s": 0}).workers.hang_timeout_s == 0
    assert load_config(None, {}, {**BASE, "workers.hang_timeout_s": 1800}).workers.hang_timeout_s == 1800


def test_etcd_endpoint_with_port_zero_is_refused():
    """`--etcd 127.0.0.1:0` is a config error naming the endpoint (it was read as 2379)."""
    with pytest.raises(ConfigError, match="port 0"):
        load_config(None, {}, {**BASE, "etcd.endpoints": "127.0.0.1:0"})
    assert load_config(None, {}, {**BASE, "etcd.endpoints": "127.0.0.1"}).etcd.endpoints == (
        "127.0.0.1:2379",)


def test_non_pem_tls_file_is_a_config_error(tmp_path):
    """A CA file that is not PEM is a ConfigError naming the file, before gRPC sees it."""
    from elasticd.etcd.endpoints import read_tls_file

    der = tmp_path / "ca.der"
    der.write_bytes(b"\x30\x82\x01\x0a" + os.urandom(64))
    with pytest.raises(ConfigError, match="not a PEM file"):
        read_tls_file(str(der), "CA file")
    pem = tmp_path / "ca.pem"
    pem.write_bytes(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    assert read_tls_file(str(pem), "CA file").startswith(b"-----BEGIN")


def test_checkpoint_url_with_inline_credentials_is_refused_without_echoing_them():
    """s3://KEY:SECRET@bucket is refused like etcd credentials in an endpoint, by the config
    loader and by the checkpoint store, and the secret is never in the message."""
    from elasticd.checkpoint.store import open_filesystem

    url = "s3://AKIAEXAMPLE:hunter2secret@bucket/run"
    for attempt in (lambda: load_config(None, {}, {**BASE, "job.checkpoint_url": url}),
                    lambda: open_filesystem(url)):
        with pytest.raises(ConfigError, match="credentials") as info:
            attempt()
        assert "hunter2secret" not in str(info.value) and "AKIAEXAMPLE" not in str(info.value)
    assert load_config(None, {}, {**BASE, "job.checkpoint_url": "s3://bucket/run"}).job.checkpoint_url
