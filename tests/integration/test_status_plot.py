"""`elasticd status --plot` and the history writer against a real etcd."""

from __future__ import annotations

import importlib.util
import io
import time

import pytest
from synthetic_job import SyntheticJob, write_synthetic_job

from elasticd.agent.history import EtcdHistoryWriter
from elasticd.etcd.txn import CreateRevision
from elasticd.history import History
from elasticd.keys import JobKeys
from elasticd.status.cli import build_parser, run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def etcd_server(module_etcd):
    """This module's tests share one etcd: none stops it, each writes jobs of its own."""
    return module_etcd


def status(endpoint: str, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    args = build_parser().parse_args(["status", "--etcd", endpoint, "--timeout", "3", *argv])
    return run(args, out=out, err=err), out.getvalue(), err.getvalue()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_of_a_synthetic_job_is_a_valid_image(etcd_server, etcd_client, tmp_path, suffix):
    """A job with history, events and checkpoints is drawn into a real PNG/SVG and its path printed."""
    pytest.importorskip("matplotlib", reason="the [plot] extra (matplotlib) is not installed")
    job = f"pic-{suffix[1:]}"  # a job per parameter: the etcd is the module's
    write_synthetic_job(etcd_client, SyntheticJob(job, nodes=4, events=40, history=120,
                                                  recent_failure=True), now=time.time())
    target = tmp_path / f"pic{suffix}"
    code, out, err = status(etcd_server.endpoint, "--job", job, "--plot", str(target))
    assert code == 0, err
    assert out.startswith(str(target)) and "120 samples" in out
    head = target.read_bytes()[:400]
    if suffix == ".png":
        assert head.startswith(PNG_MAGIC)
    else:
        assert b"<svg" in head
    assert target.stat().st_size > 5_000


@pytest.mark.timeout(60)
def test_plot_without_history_or_loss_still_draws(etcd_server, etcd_client, tmp_path):
    """No history record (an older agent) or no loss gives a picture and a note, not an error."""
    pytest.importorskip("matplotlib", reason="the [plot] extra (matplotlib) is not installed")
    write_synthetic_job(etcd_client, SyntheticJob("bare", nodes=2, events=5), now=time.time())
    write_synthetic_job(etcd_client, SyntheticJob("noloss", nodes=2, events=5, history=10,
                                                  history_loss=False), now=time.time())
    code, out, _ = status(etcd_server.endpoint, "--job", "bare", "--plot", str(tmp_path / "b.png"))
    assert code == 0 and "no history yet" in out
    code, out, _ = status(etcd_server.endpoint, "--job", "noloss", "--plot", str(tmp_path / "n.svg"))
    assert code == 0 and (tmp_path / "n.svg").read_bytes().find(b"<svg") >= 0
    code, _, err = status(etcd_server.endpoint, "--job", "ghost", "--plot", str(tmp_path / "g.png"))
    assert code == 3 and "unknown" in err and not (tmp_path / "g.png").exists()


@pytest.mark.timeout(60)
def test_history_writer_appends_when_due_and_is_fenced(etcd_client):
    """The agent's writer appends due samples with the checkpoint step and the step time of the
    interval each closes, skips early ones, and a failed fence writes nothing."""
    keys = JobKeys("hist")
    etcd_client.put(keys.checkpoint_latest, '{"step": 40, "round": 1, "manifest_url": "m", '
                                            '"committed_at": 1.0}')
    etcd_client.put("/fence", "x")
    rev = etcd_client.get("/fence").create_revision
    live = EtcdHistoryWriter(etcd_client, keys, lambda: [CreateRevision("/fence", rev)])
    t0 = time.time()
    assert live.append(t0, 10, 2, 100.0, 1, loss=0.5, step_s=0.05)
    assert not live.append(t0 + 1, 11, 2, 100.0, 1, step_s=0.06)  # not due: interval 5 s
    # A resize is due at once; it closes an interval at 2 workers: their newest step time.
    assert live.append(t0 + 2, 12, 1, 50.0, 2, step_s=0.5)
    zombie = EtcdHistoryWriter(etcd_client, keys, lambda: [CreateRevision("/fence", rev + 1000)])
    assert not zombie.append(t0 + 60, 99, 2, 1.0, 3)
    h = History.from_json(etcd_client.get(keys.history).value)
    assert [(s.step, s.world_size, s.loss, s.checkpoint_step, s.step_s) for s in h.samples] == [
        (10, 2, 0.5, 40, 0.05), (12, 1, None, 40, 0.06)]


@pytest.mark.timeout(60)
def test_history_writer_and_plot_survive_a_deeply_nested_record(etcd_server, etcd_client, tmp_path):
    """A 100,000-deep value at /elasticd/<job>/history: the writer replaces it with a valid
    record (no RecursionError) and `status --plot` notes it as unreadable and draws."""
    keys = JobKeys("deep")
    write_synthetic_job(etcd_client, SyntheticJob("deep", nodes=1, events=2, history=0),
                        now=time.time())
    etcd_client.put(keys.history, b"[" * 100_000 + b"]" * 100_000)
    if importlib.util.find_spec("matplotlib") is not None:
        code, out, err = status(etcd_server.endpoint, "--job", "deep", "--plot",
                                str(tmp_path / "d.svg"))
        assert code == 0 and "unreadable" in out, err
    writer = EtcdHistoryWriter(etcd_client, keys, lambda: [])
    assert writer.append(time.time(), 5, 1, 10.0, 0)
    h = History.from_json(etcd_client.get(keys.history).value)
    assert [s.step for s in h.samples] == [5]


@pytest.mark.timeout(30)
def test_history_writer_deletes_an_escaped_quote_record_even_when_fenced(etcd_client):
    """A 64 KB run of escaped quotes at /elasticd/<job>/history is read in milliseconds and
    deleted by any writer, a fenced one included; a valid record written meanwhile stays."""
    keys = JobKeys("esc")
    etcd_client.put(keys.history, b'"' + b'\\"' * 32_000)
    etcd_client.put("/fence-esc", "x")
    rev = etcd_client.get("/fence-esc").create_revision
    zombie = EtcdHistoryWriter(etcd_client, keys, lambda: [CreateRevision("/fence-esc", rev + 1)])
    start = time.process_time()
    assert not zombie.append(time.time(), 5, 1, 10.0, 0)  # fenced: writes no sample
    assert time.process_time() - start < 0.5
    assert etcd_client.get(keys.history) is None
    live = EtcdHistoryWriter(etcd_client, keys, lambda: [CreateRevision("/fence-esc", rev)])
    assert live.append(time.time(), 6, 1, 10.0, 0)
    assert not zombie.append(time.time() + 60, 7, 1, 10.0, 0)
    assert [s.step for s in History.from_json(etcd_client.get(keys.history).value).samples] == [6]


@pytest.mark.timeout(60)
def test_watch_shows_the_trend_line(etcd_server, etcd_client):
    """--watch draws steps/s and loss as a one-line sparkline from the history record."""
    import threading

    write_synthetic_job(etcd_client, SyntheticJob("tr", nodes=2, events=2, history=30),
                        now=time.time())
    out, stop = io.StringIO(), threading.Event()
    args = build_parser().parse_args(["status", "--etcd", etcd_server.endpoint, "--job", "tr",
                                      "--watch"])
    t = threading.Thread(target=run, args=(args,), kwargs={"out": out, "err": io.StringIO(),
                                                           "stop": stop})
    t.start()
    try:
        deadline = time.monotonic() + 10
        while "watching revision" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
        t.join(timeout=10)
    trend = [ln for ln in out.getvalue().splitlines() if ln.startswith("trend")]
    assert trend and "steps/s" in trend[0] and "loss" in trend[0], out.getvalue()[-2000:]
