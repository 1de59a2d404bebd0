"""The agent's boot sequence (elasticd.agent.boot): its order, its outcomes, and what runs
again after the torch import, against a fake etcd client holding what the real writers
(`elasticd stop`/`drain`, the finishing agent, an admitted agent) put there."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from elasticd.agent import boot
from elasticd.agent.admission import AdmissionRefusedError, make_fingerprint
from elasticd.agent.boot import (
    AfterImport,
    BootCheck,
    BootOutcome,
    BootVerdict,
    boot_after_import,
    boot_before_import,
    checks_after_import,
    run_checks,
)
from elasticd.config import load_config
from elasticd.config.model import AgentConfig, EtcdConfig
from elasticd.errors import TransientError
from elasticd.etcd.kv import KV
from elasticd.etcd.txn import Exists, Put
from elasticd.keys import JobKeys
from elasticd.records import ClosedRecord, NodeRecord
from elasticd.rendezvous import session as session_module
from elasticd.rendezvous.session import DuplicateNodeIdError
from elasticd.stopmarks import write_drain, write_stop

pytestmark = pytest.mark.timeout(30)

JOB = "bootjob"
KEYS = JobKeys(JOB)


class _FakeEtcd:
    """The reads the boot checks make and the writes ``elasticd stop``/``drain`` make; no
    lease grant (no test here gets as far as registering)."""

    def __init__(self, fail_reads_under: str | None = None) -> None:
        self.kv: dict[str, KV] = {}
        self.rev = 0
        self.closed = False
        self.reads: list[str] = []
        self.fail_reads_under = fail_reads_under

    def _read(self, key: str) -> None:
        self.reads.append(key)
        if self.fail_reads_under is not None and key.startswith(self.fail_reads_under):
            raise TransientError("etcd at fake unreachable: injected")

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> None:
        self.rev += 1
        old = self.kv.get(key)
        raw = value.encode() if isinstance(value, str) else value
        self.kv[key] = KV(key, raw, self.rev, old.create_revision if old else self.rev, lease or 0)

    def get(self, key: str) -> KV | None:
        self._read(key)
        return self.kv.get(key)

    def get_prefix(self, prefix: str, *, keys_only: bool = False,
                   range_end: str | None = None) -> tuple[list[KV], int]:
        self._read(prefix)
        return [v for k, v in sorted(self.kv.items()) if k.startswith(prefix)], self.rev

    def txn(self, compares: Sequence[Exists], ops: Sequence[Put]) -> bool:
        if not all(c.key in self.kv for c in compares):
            return False
        for op in ops:
            self.put(op.key, op.value, op.lease)
        return True

    def grant_lease(self, ttl_s: float) -> int:
        raise AssertionError("the boot sequence registered this node")

    def endpoint_label(self) -> str:
        return "fake"

    def close(self) -> None:
        self.closed = True


def _cfg(tmp_path: Path, *, embedded: bool = False, node: str = "n1",
         script_body: str = "print('ours')\n") -> AgentConfig:
    script = tmp_path / "train.py"
    script.write_text(script_body)
    over = {"job.name": JOB, "job.nnodes": "1" if embedded else "1:2", "node.id": node,
            "workers.command": str(script)}
    if not embedded:
        over["etcd.endpoints"] = "http://127.0.0.1:2379"
    return load_config(None, {}, over)


def _connect(fake: _FakeEtcd) -> Callable[[EtcdConfig], _FakeEtcd]:
    return lambda _e: fake


def _job_ran(fake: _FakeEtcd) -> None:
    fake.put(KEYS.run_id, b"run-1")


def test_boot_sequence_answers_a_stopped_job_first_and_reads_nothing_else(tmp_path: Path) -> None:
    """`elasticd stop`: STOPPED with the operator's reason, the first check; nothing of
    the job's program or rounds is read and nothing is registered; close closes the client."""
    fake = _FakeEtcd()
    _job_ran(fake)
    write_stop(fake, KEYS, reason="maintenance", by="op")  # type: ignore[arg-type]
    out = boot_before_import(_cfg(tmp_path), connect=_connect(fake))  # type: ignore[arg-type]
    assert out.verdict is BootVerdict.STOPPED and out.done == frozenset()
    assert out.refused is not None and out.refused.node is None
    assert "maintenance" in out.refused.reason
    assert fake.reads == [KEYS.control_prefix] and out.session is None
    out.close()
    assert fake.closed


def test_boot_sequence_answers_a_drain_of_this_node_and_not_of_another(tmp_path: Path) -> None:
    """`elasticd drain n1` keeps n1 out (STOPPED, its node named); n2 is not drained by it
    and goes on to the finished-job check."""
    fake = _FakeEtcd()
    _job_ran(fake)
    fake.put(KEYS.node("n1"), b"{}")  # a live n1, as write_drain requires
    write_drain(fake, KEYS, "n1", reason="disk swap")  # type: ignore[arg-type]
    ours = boot_before_import(_cfg(tmp_path, node="n1"), connect=_connect(fake))  # type: ignore[arg-type]
    assert ours.verdict is BootVerdict.STOPPED
    assert ours.refused is not None and ours.refused.node == "n1"
    fake.put(KEYS.rdzv_closed, ClosedRecord(finished_at=time.time(), node="n1", round=0).to_json())
    other = boot_before_import(_cfg(tmp_path, node="n2"), connect=_connect(fake))  # type: ignore[arg-type]
    assert other.verdict is BootVerdict.FINISHED, other


def test_boot_sequence_answers_a_finished_job_before_admission(tmp_path: Path) -> None:
    """A closed job: FINISHED after the stop check, with when and who closed it; the
    fingerprint is never read and nothing registers."""
    fake = _FakeEtcd()
    _job_ran(fake)
    fake.put(KEYS.rdzv_closed, ClosedRecord(finished_at=123.0, node="n0", round=4).to_json())
    out = boot_before_import(_cfg(tmp_path), connect=_connect(fake))  # type: ignore[arg-type]
    assert out.verdict is BootVerdict.FINISHED and out.done == frozenset({BootCheck.STOP})
    assert out.finished is not None and out.finished.finished_at == 123.0
    assert KEYS.fingerprint not in fake.reads


def test_boot_sequence_refuses_a_foreign_program_before_registering(tmp_path: Path) -> None:
    """A live agent of the job runs another script: AdmissionRefusedError (exit 78) from
    the precheck, nothing written, the client closed."""
    fake = _FakeEtcd()
    other = tmp_path / "other.py"
    other.write_text("print('theirs')\n")
    theirs = make_fingerprint([str(other)], min_nodes=1, max_nodes=2, checkpoint_url=None,
                              live_reform=True)
    fake.put(KEYS.fingerprint, theirs.to_json())
    fake.put(KEYS.node("n0"), NodeRecord(node="n0", host="h", pid=1, version="v", started_at=0.0,
                                         fingerprint=theirs.digest).to_json())
    before = dict(fake.kv)
    with pytest.raises(AdmissionRefusedError):
        boot_before_import(_cfg(tmp_path), connect=_connect(fake))  # type: ignore[arg-type]
    assert fake.kv == before and fake.closed


def test_boot_sequence_refuses_a_node_id_a_live_agent_holds(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A live elasticd on this host holds n1: DuplicateNodeIdError (exit 78) at REGISTER,
    before any lease is granted; its record is untouched and the client closed."""
    holder = os.getpid() + 1
    monkeypatch.setattr(session_module, "_is_live_elasticd", lambda pid: pid == holder)
    fake = _FakeEtcd()
    fake.put(KEYS.node("n1"), NodeRecord(node="n1", host=socket.gethostname(), pid=holder,
                                         version="v", started_at=0.0).to_json(), lease=7)
    before = dict(fake.kv)
    with pytest.raises(DuplicateNodeIdError, match="n1"):
        boot_before_import(_cfg(tmp_path), connect=_connect(fake))  # type: ignore[arg-type]
    assert fake.kv == before and fake.closed


def test_boot_sequence_is_deferred_for_an_embedded_etcd_and_the_runner_runs_every_check(
        tmp_path: Path) -> None:
    """--standalone: the private etcd is not running before the import, so nothing is
    tried (no client) and every check but the early join runs after it."""
    def no_client(_e: EtcdConfig) -> _FakeEtcd:
        raise AssertionError("connected before the embedded etcd runs")

    out = boot_before_import(_cfg(tmp_path, embedded=True), connect=no_client)  # type: ignore[arg-type]
    assert out.verdict is BootVerdict.DEFERRED and out.client is None
    assert checks_after_import(out) == AfterImport(
        runner=(BootCheck.STOP, BootCheck.PRECHECK),
        handler=(BootCheck.FINISHED, BootCheck.REGISTER, BootCheck.ADMIT))
    out.close()  # nothing to release


def test_boot_sequence_that_failed_early_leaves_every_check_to_the_runner(tmp_path: Path) -> None:
    """etcd failing mid-sequence (the fingerprint read): DEFERRED, the client closed, and
    after the import the runner prechecks and the handler registers and admits."""
    fake = _FakeEtcd(fail_reads_under=KEYS.fingerprint)
    out = boot_before_import(_cfg(tmp_path), connect=_connect(fake))  # type: ignore[arg-type]
    assert out.verdict is BootVerdict.DEFERRED and "injected" in out.reason
    assert fake.closed
    plan = checks_after_import(out)
    assert plan.runner == (BootCheck.STOP, BootCheck.PRECHECK) and plan.admit_on_register
    assert checks_after_import(None) == plan


def test_boot_sequence_after_an_early_admission_rechecks_only_what_others_write() -> None:
    """Registered and admitted early: after the import only the stop marks (runner) and
    the finished job (handler) are checked again; admission is never re-run."""
    early = BootOutcome(BootVerdict.JOIN, frozenset(boot.SEQUENCE))
    plan = checks_after_import(early)
    assert plan == AfterImport(runner=(BootCheck.STOP,), handler=(BootCheck.FINISHED,))
    assert not plan.admit_on_register


def test_boot_sequence_after_the_import_sees_a_stop_written_during_it(tmp_path: Path) -> None:
    """A stop written while torch was imported: the runner's share ends STOPPED before
    joining; the admission precheck the early path made is not read again."""
    fake = _FakeEtcd()
    _job_ran(fake)
    write_stop(fake, KEYS, reason="during import")  # type: ignore[arg-type]
    fp = make_fingerprint(["-m", "x"], min_nodes=1, max_nodes=2, checkpoint_url=None,
                          live_reform=True)
    plan = checks_after_import(BootOutcome(BootVerdict.JOIN, frozenset(boot.SEQUENCE)))
    out = boot_after_import(fake, KEYS, "n1", fp, plan, deadline_s=1.0)  # type: ignore[arg-type]
    assert out.verdict is BootVerdict.STOPPED and out.refused is not None
    fake.kv.pop(KEYS.stop_mark)
    fake.reads.clear()
    out = boot_after_import(fake, KEYS, "n1", fp, plan, deadline_s=1.0)  # type: ignore[arg-type]
    assert out.verdict is BootVerdict.JOIN and out.done == frozenset({BootCheck.STOP})
    assert fake.reads == [KEYS.control_prefix]


def test_boot_sequence_runs_in_order_and_never_skips_a_check_without_a_step() -> None:
    """The executor runs checks in the given order, stops at the first refusal it returns
    or raises, and a check with no step is an error, not a skip."""
    ran: list[BootCheck] = []

    def step(check: BootCheck, raises: Exception | None = None) -> Callable[[], None]:
        def run() -> None:
            ran.append(check)
            if raises is not None:
                raise raises
        return run

    steps = {c: step(c) for c in boot.SEQUENCE}
    assert run_checks(steps, boot.SEQUENCE).verdict is BootVerdict.JOIN
    assert tuple(ran) == boot.SEQUENCE
    ran.clear()
    steps[BootCheck.REGISTER] = step(BootCheck.REGISTER, DuplicateNodeIdError("held"))
    with pytest.raises(DuplicateNodeIdError):
        run_checks(steps, boot.SEQUENCE)
    assert ran[-1] is BootCheck.REGISTER and BootCheck.ADMIT not in ran
    with pytest.raises(KeyError):
        run_checks({BootCheck.STOP: step(BootCheck.STOP)}, (BootCheck.STOP, BootCheck.PRECHECK))
