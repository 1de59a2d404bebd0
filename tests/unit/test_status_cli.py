"""Unit tests of the `elasticd status` command line: flag surface, validation, exit 78."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from elasticd.errors import EX_CONFIG, ConfigError
from elasticd.status.cli import add_parser, build_parser, run
from elasticd.status.options import StatusOptions, options_from_args

FROZEN_FLAGS = {
    "--job", "--etcd", "--etcd-ca", "--etcd-cert", "--etcd-key", "--etcd-user",
    "--etcd-password-file", "--etcd-insecure-plaintext-auth", "--timeout", "--json", "--watch", "--events", "--window",
    "--max-rows", "--plot", "--goodput", "--goodput-window", "-h", "--help",
}


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["status", *argv])


def test_flag_surface_is_frozen():
    """The public flags change only on purpose (other subcommands share the etcd ones)."""
    top = argparse.ArgumentParser()
    p = add_parser(top.add_subparsers())
    flags = {s for a in p._actions for s in a.option_strings}
    assert flags == FROZEN_FLAGS
    assert p.get_default("func") is run


def test_defaults():
    """Defaults: local etcd, 3 s timeout, 10 events, 1 h recovery window, table output."""
    o = options_from_args(parse())
    assert (o.endpoints, o.timeout_s, o.events, o.window_s, o.json, o.watch, o.job) == (
        "127.0.0.1:2379", 3.0, 10, 3600.0, False, False, None)


@pytest.mark.parametrize("argv", [["--timeout", "0"], ["--timeout", "x"], ["--events", "-1"],
                                  ["--window", "soon"], ["--max-rows", "1.5"], ["--bogus"]])
def test_bad_flags_exit_78_not_2(argv, capsys):
    """A flag typo exits 78 (config), never 2, which a health check reads as 'not training'."""
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == EX_CONFIG
    assert "error:" in capsys.readouterr().err


def test_invalid_job_name_exits_78_with_one_line():
    """A job name that could escape its prefix is refused before etcd is contacted."""
    out, err = io.StringIO(), io.StringIO()
    assert run(parse("--job", "../x"), out=out, err=err) == EX_CONFIG
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and "invalid job name" in lines[0] and out.getvalue() == ""


def test_bad_endpoint_with_json_prints_error_document():
    """With --json a config error also prints a kind=error document on stdout."""
    out, err = io.StringIO(), io.StringIO()
    assert run(parse("--etcd", "nohost", "--json", "--job", "j"), out=out, err=err) == EX_CONFIG
    doc = json.loads(out.getvalue())
    assert doc["kind"] == "error" and doc["exit_code"] == EX_CONFIG and doc["job_name"] is None
    assert "invalid etcd endpoint" in err.getvalue()


def test_user_needs_password_file_and_the_reverse(tmp_path):
    """etcd auth needs --etcd-user and --etcd-password-file together."""
    with pytest.raises(ConfigError, match="both"):
        options_from_args(parse("--etcd-user", "root"))
    pw = tmp_path / "pw"
    pw.write_text("s3cr3t\n")
    with pytest.raises(ConfigError, match="both"):
        options_from_args(parse("--etcd-password-file", str(pw)))


def test_password_file_is_read_and_never_shown(tmp_path):
    """The password comes from a file (trailing newline stripped) and is not in the repr."""
    pw = tmp_path / "pw"
    pw.write_text("s3cr3t\n")
    o = options_from_args(parse("--etcd-user", "root", "--etcd-password-file", str(pw)))
    assert o.password == "s3cr3t" and "s3cr3t" not in repr(o)


def test_unreadable_password_file_exits_78(tmp_path):
    """A missing password file is a config error naming the path."""
    err = io.StringIO()
    code = run(parse("--etcd-user", "root", "--etcd-password-file", str(tmp_path / "nope")),
               out=io.StringIO(), err=err)
    assert code == EX_CONFIG and "--etcd-password-file" in err.getvalue() and "cannot read" in err.getvalue()


def test_half_tls_pair_exits_78(tmp_path):
    """A client certificate without its key is refused by the client as a config error."""
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    err = io.StringIO()
    assert run(parse("--etcd-cert", str(cert)), out=io.StringIO(), err=err) == EX_CONFIG
    assert "cert_file and key_file" in err.getvalue()


def test_endpoint_list_normalises():
    """Endpoints are reported as HOST:PORT, schemes stripped."""
    assert StatusOptions(endpoints="http://a:1, b:2").endpoint_list == ["a:1", "b:2"]
