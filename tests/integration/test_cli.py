"""The command line: its public surface (frozen on purpose) and its exit codes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elasticd.cli import build_parser
from elasticd.config.flags import FLAGS, SECTION_TITLES

pytestmark = pytest.mark.timeout(60)

# Changing the CLI is a user-visible change: update this list, the docs and the CHANGELOG.
# `run` and `agent` share one flag per config key (elasticd.config.flags).
NODE_FLAGS = ["--standalone", "--job", "--nnodes", "--checkpoint-url", "--checkpoint-every", "--resume", "--etcd", "--etcd-ca",
              "--etcd-cert", "--etcd-key", "--etcd-user", "--etcd-password-file",
              "--etcd-insecure-plaintext-auth", "--etcd-timeout", "--etcd-connect-timeout", "--etcd-election-timeout", "--etcd-data-dir", "--node-id",
              "--local-addr", "--node-ttl", "--join-timeout", "--last-call-timeout", "--start-settle",
              "--close-timeout", "--store-timeout", "--no-liveness-probe", "--valid-sizes", "--global-batch",
              "--hang-eject", "--straggler-factor", "--straggler-window",
              "--straggler-probation",
              "--nproc-per-node", "--workdir", "--monitor-interval", "--hang-timeout",
              "--no-warm-start", "--no-standby-refill", "--no-live-reform", "--live-reform-timeout", "--workers-user", "--spare-prebuild", "--max-restarts", "--restart-backoff", "--restart-backoff-max",
              "--drain-grace", "--resize-grace", "--plain-stop", "--done-exit", "--preemption", "--preemption-url",
              "--preemption-poll", "--drain-lead", "--log-format", "--log-level", "--log-dir", "--metrics-port",
              "--metrics-addr"]
# torchrun's spelling of each multi-word flag (--nproc_per_node), accepted, hidden from --help.
TORCHRUN_SPELLINGS = ["--" + f[2:].replace("-", "_") for f in NODE_FLAGS if "-" in f[2:]]
# `status`, `stop`, `drain`, `start`: one connection path (elasticd.status.options).
ETCD_CLIENT_FLAGS = ["--etcd", "--etcd-ca", "--etcd-cert", "--etcd-key", "--etcd-user",
                     "--etcd-password-file", "--etcd-insecure-plaintext-auth", "--timeout"]
SURFACE = {
    "run": ["--config", *NODE_FLAGS, *TORCHRUN_SPELLINGS],
    "agent": ["--config", "--check-config", *NODE_FLAGS, *TORCHRUN_SPELLINGS],
    "status": ["--job", "--etcd", "--etcd-ca", "--etcd-cert", "--etcd-key", "--etcd-user",
               "--etcd-password-file", "--etcd-insecure-plaintext-auth", "--timeout", "--json", "--watch", "--events", "--window",
               "--max-rows", "--goodput", "--goodput-window", "--plot"],
    "checkpoints": None,  # owned by elasticd.cli.checkpoints; only its presence is pinned here
    "etcd": ["--members", "--data-dir"],
    "stop": ["--job", *ETCD_CLIENT_FLAGS, "--wait", "--reason"],
    "drain": ["--job", "--node", *ETCD_CLIENT_FLAGS, "--wait", "--reason"],
    "start": ["--job", "--node", *ETCD_CLIENT_FLAGS],
}


def _flags(parser):
    return sorted(o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help")


def test_cli_surface_is_frozen():
    """The subcommands and their flags are exactly the documented ones."""
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert set(sub.choices) == set(SURFACE)
    for name, flags in SURFACE.items():
        if flags is not None:
            assert _flags(sub.choices[name]) == sorted(flags), name


# `run --help` and `agent --help`: one group per config section, in this order.
FLAG_GROUPS = ["job ([job])", "checkpoints ([checkpoint])", "etcd connection ([etcd])", "this node ([node])",
               "rendezvous ([rendezvous])", "workers ([workers])", "restarts ([restart])",
               "stopping and resizing ([drain])", "preemption notices ([preemption])",
               "logging ([logging])", "metrics ([metrics])"]


def _parsers():
    top = build_parser()
    sub = next(a for a in top._actions if a.__class__.__name__ == "_SubParsersAction")
    return top, sub.choices


def test_every_parser_refuses_abbreviations_and_groups_node_flags_by_section():
    """No parser takes `--nproc` for `--nproc-per-node`; run/agent flags sit in section groups."""
    top, subs = _parsers()
    assert not top.allow_abbrev and not any(p.allow_abbrev for p in subs.values())
    for name in ("run", "agent"):
        titles = [g.title for g in subs[name]._action_groups if g._group_actions]
        assert titles[-len(FLAG_GROUPS):] == FLAG_GROUPS, titles
    assert set(SECTION_TITLES) == {f.dotted.split(".")[0] for f in FLAGS}, "a section without a --help title"
    assert "(default: 5)" in subs["run"].format_help()  # --node-ttl's schema default


def test_top_level_help_names_every_command():
    """The description line lists all subcommands, not the first five."""
    top, subs = _parsers()
    assert top.description == f"The elasticd command line: {', '.join(subs)}."
    assert len(subs) == 8


@pytest.mark.parametrize("args,hint", [
    (["run", "--standalone", "--nproc", "2", "train.py"], "did you mean --nproc-per-node?"),
    (["status", "--jbo", "x"], "did you mean --job?"),
    (["stauts"], "did you mean `elasticd status`?"),
])
def test_a_typo_or_abbreviation_exits_78_with_did_you_mean(args, hint):
    """An abbreviated or misspelt flag or command is refused (exit 78) with the likely one."""
    proc = run(*args)
    assert proc.returncode == 78, proc.stderr
    assert hint in proc.stderr, proc.stderr


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "elasticd.cli", *args], capture_output=True,
                          text=True, timeout=50, **kw)


@pytest.mark.parametrize("args,needle", [
    (["run", "--job", "x", "train.py"], "no etcd"),
    (["run", "--standalone", "--job", "a/b", "train.py"], "invalid job name"),
    (["run", "--standalone", "--nnodes", "3:1", "train.py"], "--nnodes"),
    (["run", "--standalone", "--node-ttl", "1", "train.py"], "minimum lease TTL is 2 s"),
    (["run", "--bogus"], "unrecognized arguments"),
])
def test_bad_input_exits_78_with_a_clear_message(args, needle):
    """Bad flags or values exit 78 (EX_CONFIG) and name the problem."""
    proc = run(*args)
    assert proc.returncode == 78, proc.stderr
    assert needle in proc.stderr


def test_malformed_agent_config_exits_78_naming_the_key(tmp_path):
    """An unknown key in the agent's TOML exits 78 naming the key, before anything starts."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[job]\nname = "x"\n[workers]\ncommand = ["t.py"]\nnproc_per_nod = 2\n')
    proc = run("agent", "--config", str(cfg))
    assert proc.returncode == 78
    assert "workers.nproc_per_nod" in proc.stderr and "nproc_per_node" in proc.stderr


def test_unreadable_agent_config_exits_78(tmp_path):
    """A config file that cannot be read exits 78."""
    proc = run("agent", "--config", str(tmp_path / "missing.toml"))
    assert proc.returncode == 78 and "missing.toml" in proc.stderr


def test_unreachable_etcd_exits_4_within_the_connect_timeout(tmp_path):
    """`elasticd agent` with an etcd nobody answers on exits 4 with a message, bounded in time."""
    script = tmp_path / "t.py"
    script.write_text("print('never')\n")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[job]\nname = "x"\n[etcd]\nendpoints = ["127.0.0.1:9"]\nconnect_timeout_s = 2\n'
                   f'timeout_s = 0.5\n[workers]\ncommand = ["{script}"]\n')
    proc = run("agent", "--config", str(cfg))
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "unreachable" in proc.stderr


def test_unreachable_etcd_says_what_it_waits_for_and_ends_with_the_status_hint(tmp_path):
    """The first failed try names the endpoint and the wait (up to --etcd-connect-timeout);
    the last line is `status`'s hint."""
    script = tmp_path / "t.py"
    script.write_text("print('never')\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = run("run", "--etcd", "127.0.0.1:9", "--job", "x", "--etcd-connect-timeout", "2",
               "--etcd-timeout", "0.5", "--log-format", "console", "--no-warm-start", str(script),
               env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode == 4, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    waiting = [ln for ln in lines if "waiting up to 2s for it (--etcd-connect-timeout)" in ln]
    assert len(waiting) == 1 and waiting[0].startswith("elasticd: etcd at 127.0.0.1:9 does not answer")
    assert lines.index(waiting[0]) < len(lines) - 1
    last = [ln for ln in lines if ln.startswith("elasticd: etcd at 127.0.0.1:9 unreachable for 2s")]
    assert len(last) == 1, lines
    assert last[0].endswith("; check --etcd, the TLS/auth flags and that etcd is up")
    # No worker started: no empty private log dir is left behind.
    assert not list(tmp.glob("elasticd-logs-*")), list(tmp.iterdir())


@pytest.mark.timeout(120)
def test_an_unwritable_checkpoint_url_exits_78_before_anything_starts(tmp_path):
    """A --checkpoint-url the storage refuses (a path through a file): exit 78 with one error
    line naming the URL, before etcd or a worker starts, claiming no intact checkpoint."""
    import json

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    url = f"file://{blocker}/checkpoints"
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train.py")
    proc = subprocess.run(
        [sys.executable, "-m", "elasticd.cli", "run", "--standalone", "--no-warm-start",
         "--log-format", "json", "--nproc-per-node", "1", "--checkpoint-url", url, script,
         "--steps", "3"], capture_output=True, text=True, timeout=100,
        env={**os.environ, "STATE_DIRECTORY": str(tmp_path / "state")})
    rows = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    errors = [r for r in rows if r.get("level") == "error"]
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert len(errors) == 1 and url in errors[0]["message"], proc.stderr[-3000:]
    assert "not writable" in errors[0]["message"] and "intact" not in proc.stderr
    started = {r.get("event") for r in rows} & {"embedded_etcd_started", "agent_started"}
    assert not started, started
