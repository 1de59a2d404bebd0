"""How many etcd writes one elasticd node makes per second in steady state.

Starts ``elasticd run --standalone`` with examples/train.py, waits for training to settle,
reads the embedded etcd's revision, waits ``--window`` seconds, reads it again. Every
write (put, delete, txn with writes) bumps the revision by one; lease keep-alives do not
write (they are counted separately from the lease, not from the key space). The result
sizes an external etcd's compaction and quota (docs/deployment.md).

    python benchmarks/etcd_write_rate.py --window 60
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _event(log: Path, name: str) -> dict | None:
    for line in log.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == name:
            return rec
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=float, default=60.0, help="seconds measured")
    p.add_argument("--settle", type=float, default=20.0, help="seconds skipped after training starts")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--checkpoint-every", type=int, default=100)
    args = p.parse_args()

    from elasticd.etcd.client import EtcdClient, TLSFiles

    work = Path(tempfile.mkdtemp(prefix="elasticd-wr-"))
    log = work / "agent.log"
    argv = [sys.executable, "-m", "elasticd.cli", "run", "--standalone", "--job", "wr",
            "--nproc-per-node", str(args.nproc), "--log-format", "json",
            "--checkpoint-url", f"file://{work}/ckpt", str(ROOT / "examples" / "train.py"),
            "--steps", "10000000", "--step-sleep", str(args.step_sleep),
            "--checkpoint-every", str(args.checkpoint_every)]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 120
        etcd = None
        while time.monotonic() < deadline and etcd is None:
            etcd = _event(log, "embedded_etcd_started")
            time.sleep(0.5)
        if etcd is None:
            print(log.read_text()[-3000:], file=sys.stderr)
            return 1
        tls = etcd["tls_dir"]
        client = EtcdClient(etcd["endpoint"], timeout_s=3,
                            tls=TLSFiles(f"{tls}/ca.pem", f"{tls}/client.pem", f"{tls}/client-key.pem"))
        while time.monotonic() < deadline and client.get("/elasticd/wr/progress") is None:
            time.sleep(0.5)
        time.sleep(args.settle)
        rev0 = client.get_prefix("/elasticd/wr/", keys_only=True)[1]
        t0 = time.monotonic()
        time.sleep(args.window)
        kvs, rev1 = client.get_prefix("/elasticd/wr/", keys_only=True)
        dt = time.monotonic() - t0
        client.close()
        print(json.dumps({"writes": rev1 - rev0, "seconds": round(dt, 1),
                          "writes_per_s_per_node": round((rev1 - rev0) / dt, 2),
                          "keys": len(kvs), "nproc_per_node": args.nproc,
                          "step_sleep_s": args.step_sleep,
                          "checkpoint_every": args.checkpoint_every}))
        return 0
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
