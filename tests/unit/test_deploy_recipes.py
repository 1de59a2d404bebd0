"""The launcher recipes in deploy/ cannot rot: every elasticd command in them parses with the
real CLI, and their stop/notice timing leaves the agent its drain grace + 30 s.

Kubernetes and SkyPilot cannot run here, so this is what is checked: ``#SBATCH`` lines
and the srun line of the Slurm script, the YAML of the Kubernetes manifests and the
SkyPilot task, and each ``elasticd`` command line against ``elasticd.cli.build_parser()``
with shell/Kubernetes variables replaced by sample values. Every recipe's full size (the
``--nnodes`` maximum, what ``elasticd status`` calls healthy) is the number of nodes it
starts. The Slurm script's shell logic also runs for real, under a stub ``srun``, in
tests/integration/test_slurm_recipe.py.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from elasticd.cli import build_parser
from elasticd.config.flags import flag_names, overrides_from_args
from elasticd.config.loader import load_config
from elasticd.config.model import AgentConfig

yaml = pytest.importorskip("yaml", reason="pyyaml (test extra) parses the deploy/ manifests")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
LEAVE_MARGIN_S = 30  # the agent's time to leave the rendezvous and exit after the drain
AWS_NOTICE_S = 120
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", ")"}
# Node counts (SLURM_JOB_NUM_NODES, SKYPILOT_NUM_NODES) come from each recipe itself.
SAMPLE = {"ETCD": "etcd-1:2379,etcd-2:2379", "JOB": "j", "CKPT": "s3://b/j",
          "ELASTICD": "elasticd", "SLURMD_NODENAME": "gpu-017", "MIN_NODES": "1",
          "NPROC_PER_NODE": "gpu", "SKYPILOT_NODE_RANK": "0", "MY_IP": "10.0.0.7",
          "POD_NAME": "elasticd-0", "POD_IP": "10.1.2.3"}


def _subst(text: str, sample: dict[str, str] | None = None) -> str:
    """Replace $VAR, ${VAR...}, $(VAR) with sample values (unknown names: 'x')."""
    values = {**SAMPLE, **(sample or {})}
    text = re.sub(r"\$\{(\w+)[^}]*\}", lambda m: values.get(m.group(1), "x"), text)
    text = re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), "x"), text)
    return re.sub(r"\$(\w+)", lambda m: values.get(m.group(1), "x"), text)


def _shell_commands(script: str, sample: dict[str, str] | None = None) -> list[list[str]]:
    """The elasticd command lines of a shell script (continuations joined), as argv after
    'elasticd'; also those inside a ``bash -c '...'`` string."""
    joined = re.sub(r"\\\n\s*", " ", script)
    out = []
    for line in joined.splitlines():
        if line.lstrip().startswith("#"):
            continue
        lexer = shlex.shlex(_subst(line, sample), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
        for i, w in enumerate(words):
            if w == "-c" and i > 0 and Path(words[i - 1]).name in ("bash", "sh") and i + 1 < len(words):
                out += _shell_commands(words[i + 1], sample)
                break
            if Path(w).name == "elasticd" and i + 1 < len(words) and words[i + 1] in ("run", "agent", "status"):
                rest = words[i + 1:]
                ends = [k for k, t in enumerate(rest) if t in SHELL_OPERATORS]
                out.append(rest[:ends[0]] if ends else rest)
                break
    return out


def _parse(argv: list[str]):
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits (78 here) on a flag the CLI no longer has
        raise AssertionError(f"elasticd {' '.join(argv)} does not parse (exit {exc.code})") from exc


def _config(args) -> AgentConfig:
    """The config the agent would run with: the flags' values validated by the real loader."""
    overrides = overrides_from_args(args)
    if getattr(args, "command", None):
        overrides["workers.command"] = tuple(args.command)
    return load_config(None, {}, overrides, check_files=False, hostname="node",
                       override_names=flag_names())


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_slurm_script_parses_and_drains_before_the_limit():
    """srun starts one agent per node with a valid command, full size = the allocation's
    nodes; --signal leads the limit by drain grace + 30 s; it requeues."""
    text = (DEPLOY / "slurm" / "elasticd.sbatch").read_text()
    sbatch = dict(re.findall(r"^#SBATCH\s+--([\w-]+)(?:=(\S+))?", text, re.M))
    assert sbatch["ntasks-per-node"] == "1" and "requeue" in sbatch
    sig = re.fullmatch(r"(?:[RB]:)?(?:SIG)?TERM@(\d+)", sbatch["signal"])
    assert sig, f"--signal={sbatch['signal']}: expected TERM@SECONDS sent to the job step"
    assert re.search(r"^srun .*\\\n\s+bash -c 'exec \"\$ELASTICD\" run ", text, re.M), \
        "the srun line starts the agents, each task expanding its own $SLURMD_NODENAME"
    commands = _shell_commands(text, {"SLURM_JOB_NUM_NODES": sbatch["nodes"]})
    runs = [c for c in commands if c[0] == "run"]
    assert len(runs) == 1 and any(c[0] == "status" for c in commands)
    cfg = _config(_parse(runs[0]))
    assert cfg.node.id == "gpu-017" and (cfg.job.min_nodes, cfg.job.max_nodes) == (1, int(sbatch["nodes"]))
    assert int(sig.group(1)) >= cfg.drain.grace_s + LEAVE_MARGIN_S
    assert "scontrol requeue" in text
    for argv in commands:
        _parse(argv)


def test_kubernetes_agents_parse_and_outlast_the_drain():
    """The agent StatefulSet's command parses; terminationGracePeriodSeconds >= drain grace + 30 s; preStop drains."""
    docs = {d["kind"] + "/" + d["metadata"]["name"]: d for d in _docs(DEPLOY / "kubernetes" / "elasticd.yaml")}
    sts = docs["StatefulSet/elasticd"]
    pod = sts["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    argv = [_subst(str(a)) for a in agent["args"]]
    assert agent["command"] == ["elasticd"] and argv[0] == "run"
    cfg = _config(_parse(argv))
    assert cfg.node.id == "elasticd-0" and cfg.node.local_addr == "10.1.2.3"
    assert cfg.job.max_nodes == sts["spec"]["replicas"], \
        "--nnodes max is the replicas the StatefulSet starts (status: degraded below it)"
    assert pod["terminationGracePeriodSeconds"] >= cfg.drain.grace_s + LEAVE_MARGIN_S
    pre_stop = " ".join(agent["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -TERM 1" in pre_stop
    assert cfg.metrics.port in {p["containerPort"] for p in agent["ports"]}


def test_kubernetes_etcd_has_three_members_beside_the_agents():
    """etcd is a 3-member StatefulSet whose initial cluster and Service match the agents' endpoints."""
    docs = {d["kind"] + "/" + d["metadata"]["name"]: d for d in _docs(DEPLOY / "kubernetes" / "etcd.yaml")}
    sts = docs["StatefulSet/etcd"]
    assert sts["spec"]["replicas"] == 3 and docs["Service/etcd"]["spec"]["clusterIP"] == "None"
    cmd = " ".join(sts["spec"]["template"]["spec"]["containers"][0]["command"])
    members = re.search(r"--initial-cluster=(\S+)", cmd).group(1).split(",")
    assert len(members) == 3
    agents = next(d for d in _docs(DEPLOY / "kubernetes" / "elasticd.yaml") if d["kind"] == "StatefulSet")
    argv = agents["spec"]["template"]["spec"]["containers"][0]["args"]
    endpoints = argv[argv.index("--etcd") + 1].split(",")
    assert sorted(endpoints) == sorted(f"etcd-{i}.etcd:2379" for i in range(3))


def test_skypilot_task_parses_and_drains_within_the_spot_notice():
    """The SkyPilot task is spot with recovery on N nodes; its run command parses; drain grace + 30 s fits the notice."""
    (task,) = _docs(DEPLOY / "skypilot" / "elasticd.yaml")
    assert task["num_nodes"] >= 2
    res = task["resources"]
    assert res["use_spot"] is True and res["job_recovery"]["strategy"]
    (argv,) = _shell_commands(task["run"], {"SKYPILOT_NUM_NODES": str(task["num_nodes"])})
    cfg = _config(_parse(argv))
    assert cfg.preemption.provider == "auto"
    assert (cfg.job.min_nodes, cfg.job.max_nodes) == (1, task["num_nodes"])
    assert cfg.drain.grace_s + LEAVE_MARGIN_S <= AWS_NOTICE_S


def test_skypilot_task_brings_the_script_and_elasticd_to_the_nodes():
    """workdir carries train.py to every node (run starts there); setup installs elasticd
    from a checkout that file_mounts copies (elasticd is not on PyPI)."""
    (task,) = _docs(DEPLOY / "skypilot" / "elasticd.yaml")
    assert task.get("workdir"), "no workdir: the run command's train.py would not reach the nodes"
    (argv,) = _shell_commands(task["run"])
    script = _parse(argv).command[0]
    assert not Path(script).is_absolute(), f"{script}: the script is expected in the workdir"
    mounts = task.get("file_mounts") or {}
    installs = re.findall(r"pip install \"?([^\s\"]+)", task["setup"])
    assert installs and all(any(i.startswith(m) for m in mounts) for i in installs), (installs, mounts)


def test_a_stale_flag_would_be_caught():
    """The check can fail: a flag the CLI does not have is refused."""
    with pytest.raises(AssertionError, match="does not parse"):
        _parse(["run", "--drain-grace-s", "90", "train.py"])
