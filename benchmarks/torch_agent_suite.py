"""torch's own agent test suite against elasticd's ``etcd-v3`` rendezvous and torch's ``c10d``.

torch's ``test/distributed/elastic/agent/server/test/local_elastic_agent_test.py`` runs one
``LocalElasticAgentTest`` harness (real agents, real spawned workers, multi-agent jobs
whose agents are ``multiprocessing`` forks of the test process) against several rendezvous
backends. Its 28 scenarios (the methods its ``test_*`` wrappers call) are run here one by
one, each with the backend named, in a fresh interpreter in a session of its own, bounded
by ``--timeout-s`` (a hang is killed with its whole process group and counted as such).
``etcd-v3`` runs against one embedded etcd started here (127.0.0.1); ``c10d`` gets a free
localhost port per scenario, as torch's harness does.

The suite file is torch's and is not shipped. Without ``--suite`` it is taken from the
installed torch where that is a source checkout (``<checkout>/test/...`` beside
``<checkout>/torch``); a wheel has no tests, so otherwise pass a copy of the file from
torch's repository at the installed version's tag, e.g.
``https://raw.githubusercontent.com/pytorch/pytorch/v2.13.0/`` + SUITE_PATH (the ``test_*``
wrappers may be absent: only the scenario methods and the harness are used). The suite
imports three skip helpers from ``torch.testing._internal.common_utils``, which needs
``expecttest``; where that is not installed a one-class stand-in goes on the scenarios'
path (``shim_dir``).

Usage::

    .venv/bin/python benchmarks/torch_agent_suite.py --suite /tmp/local_elastic_agent_test.py \\
        --backends etcd-v3,c10d --timeout-s 300 --jobs 4 --json /tmp/suite.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import PY, machine_info, other_load  # noqa: E402

SUITE_PATH = "test/distributed/elastic/agent/server/test/local_elastic_agent_test.py"

# scenario name -> the suite's method (torch's test_* wrappers call these)
SCENARIOS = {
    "dummy_compute": "dummy_compute",
    "run_happy_function": "run_happy_function",
    "check_master_addr_port_override": "check_master_addr_port_override",
    "run_check_env_function": "run_check_env_function",
    "check_nccl_async_error_handling_env": "run_check_nccl_async_error_handling_env",
    "check_nccl_async_error_handling_env_default": "run_check_nccl_async_error_handling_env_default",
    "agent_local_watchdog_setup_enabled": "run_agent_local_watchdog_setup_enabled",
    "agent_local_watchdog_setup_disabled": "run_agent_local_watchdog_setup_disabled",
    "agent_healthcheck_setup_enabled": "run_agent_healthcheck_setup_enabled",
    "agent_healthcheck_setup_disabled": "run_agent_healthcheck_setup_disabled",
    "function_with_return_value": "run_function_with_return_value",
    "simple_dist_sum": "simple_dist_sum",
    "distributed_sum_homogeneous": "run_distributed_sum_homogeneous",
    "custom_log_lines": "run_with_custom_log_lines",
    "distributed_sum_heterogeneous": "run_distributed_sum_heterogeneous",
    "sad_function": "run_sad_function",
    "bipolar_function": "run_bipolar_function",
    "rank_assignment_heterogeneous": "correct_rank_assignment_heterogeneous",
    "rank_assignment_homogeneous": "correct_rank_assignment_homogeneous",
    "double_agent_fault_tolerance": "double_agent_fault_tolerance",
    "no_exit_barrier_on_failure": "no_exit_barrier_on_failure",
    "double_agent_elastic": "double_agent_elastic",
    "torch_rpc": "torch_rpc",
    "workers_drift_success": "workers_drift_success",
    "workers_drift_fail": "workers_drift_fail",
    "barrier_failed": "barrier_failed",
    "shutdown_called": "shutdown_called",
    "fail_rank_one_once": "fail_rank_one_once",
}

# Run in the child: load the suite, point the harness at the backend, run one scenario.
CHILD = r"""
import faulthandler, importlib.util, os, signal, sys, unittest
# SIGUSR1 dumps every thread's stack to the log: this process and its forked agents (a
# registration survives fork) say where they hung before the runner kills them.
faulthandler.register(signal.SIGUSR1, all_threads=True)
path, backend, endpoint, method = sys.argv[1:5]
if backend == "etcd-v3":
    import elasticd  # registers the etcd-v3 handler in torch's registry
spec = importlib.util.spec_from_file_location("local_elastic_agent_test", path)
mod = importlib.util.module_from_spec(spec)
sys.modules["local_elastic_agent_test"] = mod
spec.loader.exec_module(mod)

class Scenario(mod.LocalElasticAgentTest):
    def test_scenario(self):
        self._backend = backend
        if backend == "c10d":  # torch's harness: a free localhost port per test
            self._endpoint = f"localhost:{mod.acquire_available_port()}"
        else:
            self._endpoint = endpoint
        if method == "run_with_custom_log_lines":  # torch's test_run_with_custom_log_lines
            self.run_distributed_sum_homogeneous("[${role_name}-${local_rank}:${rank}]:")
        else:
            getattr(self, method)()

for name in ("setUpClass", "tearDownClass"):  # torch's starts an etcd v2 server
    setattr(Scenario, name, classmethod(lambda cls: None))
result = unittest.TextTestRunner(verbosity=0).run(Scenario("test_scenario"))
sys.stdout.flush()
sys.stderr.flush()
# The verdict is in: at a high load the interpreter's own teardown can outlast the bound.
os._exit(0 if result.wasSuccessful() else 1)
"""


def installed_suite() -> Path | None:
    """The suite file of the installed torch when it runs from a source checkout, else None."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).resolve().parents[1] / SUITE_PATH
    return path if path.is_file() else None


# process groups of the scenarios running now (a stopped run kills them)
RUNNING: set[int] = set()


def shim_dir(log_dir: Path) -> list[str]:
    """The suite imports three skip helpers from torch's test utilities, which import
    ``expecttest`` (not a dependency of elasticd or torch's wheel). Where it is missing, a
    stand-in with the one name those utilities need at import goes on the path of the
    scenario and of its spawned workers (which import the suite to unpickle its functions)."""
    if importlib.util.find_spec("expecttest") is not None:
        return []
    shim = log_dir / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "expecttest.py").write_text(
        "import unittest\n\nACCEPT = False\n\n\nclass TestCase(unittest.TestCase):\n    pass\n")
    return [str(shim)]


def dump_stacks(pgid: int, grace_s: float = 3.0) -> None:
    """Ask a hung scenario's processes for their stacks (SIGUSR1, see CHILD); wait for the
    dumps to reach the log, at most ``grace_s``. Spawned workers have no handler and die."""
    try:
        os.killpg(pgid, signal.SIGUSR1)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:  # a dump is a few ms of writes; nothing to poll for
        time.sleep(0.1)


def settled(outcome: str, log: Path) -> str:
    """A scenario killed at the bound after unittest reported it OK passed: only its exit
    was slow (``pass, slow exit``)."""
    if outcome != "timeout":
        return outcome
    lines = log.read_text(errors="replace").splitlines()
    return "pass, slow exit" if any(line.strip() == "OK" for line in lines) else outcome


def run_one(suite: Path, backend: str, endpoint: str, scenario: str, timeout_s: float,
            log_dir: Path) -> dict:
    """One scenario in a fresh interpreter and session; a hang past ``timeout_s`` is killed
    with its process group (agents and workers) and reported as ``timeout``."""
    log = log_dir / f"{backend}-{scenario}.log"
    started = time.monotonic()
    with open(log, "w") as out:
        # The agents spawn workers that unpickle the suite's functions: they import it by name.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(suite.parent), *shim_dir(log_dir), *filter(None, [os.environ.get("PYTHONPATH")])])}
        proc = subprocess.Popen([PY, "-c", CHILD, str(suite), backend, endpoint, SCENARIOS[scenario]],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        RUNNING.add(proc.pid)
        try:
            rc = proc.wait(timeout=timeout_s)
            outcome = "pass" if rc == 0 else "fail"
        except subprocess.TimeoutExpired:
            outcome, rc = "timeout", None
            dump_stacks(proc.pid)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the scenario's own group
            except ProcessLookupError:
                pass
            proc.wait()
            RUNNING.discard(proc.pid)
    outcome = settled(outcome, log)
    return {"backend": backend, "scenario": scenario, "outcome": outcome, "rc": rc,
            "seconds": round(time.monotonic() - started, 1), "log": str(log)}


def table(rows: list[dict], backends: list[str]) -> str:
    """A Markdown table: one line per scenario, one column per backend."""
    by = {(r["scenario"], r["backend"]): r for r in rows}
    out = ["| scenario | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        cells = []
        for b in backends:
            r = by.get((scenario, b))
            cells.append("—" if r is None else f"{r['outcome']} ({r['seconds']:.0f} s)")
        out.append(f"| {scenario} | " + " | ".join(cells) + " |")
    totals = [sum(1 for r in rows if r["backend"] == b and r["outcome"].startswith("pass")) for b in backends]
    counts = [sum(1 for r in rows if r["backend"] == b) for b in backends]
    out.append("| **passed** | " + " | ".join(f"**{p}/{n}**" for p, n in zip(totals, counts, strict=True)) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", type=Path, help="a local copy of torch's local_elastic_agent_test.py "
                   "(default: the installed torch's, where it is a source checkout)")
    p.add_argument("--backends", default="etcd-v3,c10d", help="comma-separated: etcd-v3, c10d")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset, run in this order")
    p.add_argument("--timeout-s", type=float, default=180.0, help="bound of one scenario, s")
    p.add_argument("--jobs", type=int, default=1,
                   help="scenarios run at once (each in its own session; a loaded machine gives each less)")
    p.add_argument("--json", type=Path, help="write the results here (rewritten after every scenario)")
    args = p.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    scenarios = [s for s in args.scenarios.split(",") if s]
    bad = [b for b in backends if b not in ("etcd-v3", "c10d")] + [s for s in scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"unknown backend/scenario {bad}")
    if args.suite is None:
        args.suite = installed_suite()
        if args.suite is None:
            p.error(f"torch's {SUITE_PATH} is not installed (a wheel has no tests): pass --suite, "
                    "a copy from https://github.com/pytorch/pytorch at the installed version's tag")
    if not args.suite.is_file():
        p.error(f"--suite {args.suite}: no such file (a copy of torch's local_elastic_agent_test.py)")
    log_dir = Path(tempfile.mkdtemp(prefix="elasticd-agent-suite-"))
    print(f"logs under {log_dir}", flush=True)
    info, busy = machine_info(), other_load()
    rows: list[dict] = []
    from elasticd.etcd.embedded import EmbeddedEtcd

    etcd = EmbeddedEtcd(data_dir=str(log_dir / "etcd")) if "etcd-v3" in backends else None
    # SIGTERM (a bounded caller's timeout) unwinds: every scenario's group and etcd stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    order = {(s, b): i for i, (s, b) in enumerate((s, b) for s in scenarios for b in backends)}
    try:
        if etcd is not None:
            etcd.start()
        endpoint = etcd.endpoint if etcd else ""
        # both backends per scenario, in order: a cut-short run stays comparable
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(run_one, args.suite, b, endpoint, s, args.timeout_s, log_dir)
                       for (s, b) in order]
            try:
                for future in as_completed(futures):
                    rows.append(future.result())
                    rows.sort(key=lambda r: order[(r["scenario"], r["backend"])])
                    print(json.dumps(future.result()), flush=True)
                    if args.json:
                        args.json.write_text(json.dumps(
                            {"machine": info, "busy_at_start": busy, "argv": sys.argv[1:], "rows": rows}, indent=1))
            except BaseException:  # stopped: nothing more starts, what runs is killed
                for future in futures:
                    future.cancel()
                for pgid in list(RUNNING):
                    try:
                        os.killpg(pgid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                raise
    finally:
        if etcd is not None:
            etcd.stop()
    print(table(rows, backends))
    return 0


if __name__ == "__main__":
    sys.exit(main())
