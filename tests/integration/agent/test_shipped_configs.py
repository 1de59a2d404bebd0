"""The configs in agents/ run end to end, and keys once dropped on the way now act.

Each shipped config runs under a real ``elasticd agent`` against examples/train.py. Only
what ties it to its target machines is replaced: the etcd endpoints (and with them its
TLS and auth files), the training command, its paths (workdir, checkpoint URL, log dir),
the GPU count, the node count's minimum (one node here), the metrics port and the cloud's
metadata URL. Every other key (restart budget, drain timing, TTL, log format, worker env,
hang timeout, preemption provider...) is the shipped value.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from harness import ROOT, read_jsonl

from elasticd.config.schema import format_value
from elasticd.etcd.embedded import free_port
from elasticd.history import History
from elasticd.keys import JobKeys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

AGENTS = sorted((ROOT / "agents").glob("*.toml"))
STEPS = 12


def _write_toml(data: dict, path: Path) -> None:
    lines = []
    for section, table in data.items():
        nested = {k: v for k, v in table.items() if isinstance(v, dict)}
        lines.append(f"[{section}]")
        lines += [f"{k} = {format_value(v)}" for k, v in table.items() if k not in nested]
        for name, sub in nested.items():
            lines.append(f"[{section}.{name}]")
            lines += [f"{k} = {format_value(v)}" for k, v in sub.items()]
    path.write_text("\n".join(lines) + "\n")


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _localised(config: Path, tmp_path: Path, etcd_endpoint: str) -> tuple[Path, int]:
    data = tomllib.loads(config.read_text())
    job, workers = data["job"], data["workers"]
    if not job.get("standalone"):
        data["etcd"] = {"endpoints": [etcd_endpoint]}
        _, _, hi = str(job.get("nnodes", "1")).partition(":")
        job["nnodes"] = f"1:{hi or job.get('nnodes', 1)}"
    job["checkpoint_url"] = str(tmp_path / "ckpt")
    trace = tmp_path / "trace.jsonl"
    workers.update(command=["examples/train.py", "--steps", str(STEPS), "--checkpoint-every", "5",
                            "--trace", str(trace)],
                   workdir=str(ROOT), nproc_per_node=1)
    data.setdefault("logging", {})["worker_log_dir"] = str(tmp_path / "logs")
    port = free_port()
    if "metrics" in data:
        data["metrics"]["port"] = port
    if "preemption" in data:
        data["preemption"]["base_url"] = _closed_port_url()
    out = tmp_path / config.name
    _write_toml(data, out)
    return out, port


@pytest.mark.parametrize("config", AGENTS, ids=lambda p: p.stem)
def test_shipped_config_trains_the_example_to_the_end(config, tmp_path, etcd_server, etcd_client):
    """`elasticd agent --config agents/X.toml` (machine-specific values localised) trains
    examples/train.py to its last step and exits 0, every step trained once; with a shared
    etcd, the job's history holds the loss the example reports (for --plot and --watch)."""
    path, _ = _localised(config, tmp_path, etcd_server.endpoint)
    proc = subprocess.run([sys.executable, "-m", "elasticd.cli", "agent", "--config", str(path)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=100,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = sorted({r["step"] for r in read_jsonl(tmp_path / "trace.jsonl")})
    assert steps == list(range(STEPS)), steps
    job = tomllib.loads(path.read_text())["job"]
    if not job.get("standalone"):
        kv = etcd_client.get(JobKeys(job["name"]).history)
        samples = History.from_json(kv.value).samples if kv is not None else ()
        assert samples and all(sm.loss is not None and sm.loss >= 0 for sm in samples), samples


def test_single_machine_config_command_is_accepted_by_the_example():
    """agents/single-machine.toml's own command line parses with examples/train.py's flags
    (it once passed --check-config but failed at once: the example has no --epochs)."""
    command = tomllib.loads((ROOT / "agents" / "single-machine.toml").read_text())["workers"]["command"]
    assert command[0] == "examples/train.py"
    spec = importlib.util.spec_from_file_location("example_train", ROOT / command[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.parse_args(command[1:])  # argparse exits 2 on an unknown flag


def test_log_level_metrics_addr_and_etcd_data_dir_reach_the_agent(tmp_path):
    """`--log-level`, `--metrics-addr` and `--etcd-data-dir` (once validated, then dropped)
    act on a real standalone run: no info lines, the exporter answers on the given
    loopback address, the embedded etcd keeps its data where asked."""
    port, data_dir = free_port(), tmp_path / "etcd-data"
    script = tmp_path / "probe.py"
    script.write_text(
        "import urllib.request\n"
        f"body = urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=10).read()\n"
        "print('METRICS_OK', len(body) > 0, flush=True)\n")
    proc = subprocess.run(
        [sys.executable, "-m", "elasticd.cli", "run", "--standalone", "--no-warm-start",
         "--log-format", "json", "--log-level", "warning", "--metrics-port", str(port),
         "--metrics-addr", "127.0.0.1", "--etcd-data-dir", str(data_dir),
         "--log-dir", str(tmp_path / "logs"), str(script)],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=100, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "METRICS_OK True" in proc.stdout + proc.stderr
    levels = set()
    for line in proc.stderr.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        # The agent's own events obey --log-level; its workers' output is the script's.
        if rec.get("event") != "worker_output" and rec.get("source") != "worker":
            levels.add(rec.get("level"))
    assert "info" not in levels, proc.stderr[-2000:]
    assert (data_dir / "member").is_dir()
