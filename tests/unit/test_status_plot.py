"""Unit tests of `elasticd status --plot`: series from history, markers, sparkline, flag checks."""

from __future__ import annotations

import io
import sys

import pytest

from elasticd.errors import EX_CONFIG, ConfigError
from elasticd.history import History, Sample
from elasticd.records import Event
from elasticd.status import plot
from elasticd.status.cli import build_parser, run


def _history() -> History:
    return History(interval_s=5.0, samples=(
        Sample(t=1000.0, step=0, world_size=2, checkpoint_step=None),
        Sample(t=1010.0, step=20, world_size=2, loss=0.5, checkpoint_step=None),
        Sample(t=1020.0, step=40, world_size=1, loss=0.4, checkpoint_step=20),
        Sample(t=1030.0, step=30, world_size=1, loss=0.45, checkpoint_step=20),  # resumed older
        Sample(t=1040.0, step=50, world_size=2, loss=0.3, checkpoint_step=40),
    ))


def _ev(t: float, kind: str) -> Event:
    return Event(time=t, kind=kind, node="n", round=1, message=kind)


def test_series_rates_checkpoints_and_markers():
    """Steps/s comes from consecutive samples (None across a step reset); checkpoints and events are marked."""
    d = plot.plot_data(_history(), [_ev(1015.0, "lost"), _ev(1035.0, "join"), _ev(1036.0, "round"),
                                    _ev(500.0, "failure")])
    assert d.t == (0.0, 10.0, 20.0, 30.0, 40.0)
    assert d.world_size == (2, 2, 1, 1, 2)
    assert d.steps_per_s == (None, 2.0, 2.0, None, 2.0)
    assert d.checkpoints == ((20.0, 20), (40.0, 40))
    assert d.markers == ((15.0, "lost", "lost n"), (35.0, "join", "join n"))  # round: not drawn
    assert d.rollbacks == ((30.0, 10),) and d.idle == ()
    assert d.has_loss and d.loss[0] is None


def test_no_loss_and_empty_history():
    """Without loss (workers report none) or without samples the series are still well formed."""
    h = History(samples=(Sample(t=1.0, step=1, world_size=1), Sample(t=2.0, step=3, world_size=1)))
    assert not plot.plot_data(h).has_loss
    empty = plot.plot_data(History(), [_ev(7.0, "drain")])
    assert empty.t == () and empty.markers == ((0.0, "drain", "drain n"),)


def test_sparkline_shows_the_trend():
    """The one-line trend maps the lowest value to the lowest bar and the highest to the highest."""
    assert plot.sparkline([0.0, 1.0, None, 2.0]) == "▁▅ █"
    assert plot.sparkline([None]) == "" and plot.sparkline([5.0, 5.0]) == "▁▁"
    assert len(plot.sparkline(list(range(100)), width=24)) == 24


@pytest.mark.parametrize("name", ["job.pdf", "job", "job.png.txt"])
def test_plot_file_must_be_png_or_svg(tmp_path, name):
    """Any other suffix is a config error naming the accepted ones."""
    with pytest.raises(ConfigError, match=r"\.png or \.svg"):
        plot.check_target(str(tmp_path / name))


def test_missing_matplotlib_exits_78_naming_the_extra(monkeypatch, tmp_path):
    """Without matplotlib, --plot exits 78 with one line that names the [plot] extra (before any etcd call)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    args = build_parser().parse_args(["status", "--etcd", "127.0.0.1:1", "--timeout", "0.2",
                                      "--job", "j", "--plot", str(tmp_path / "j.png")])
    out, err = io.StringIO(), io.StringIO()
    assert run(args, out=out, err=err) == EX_CONFIG
    assert "pip install 'elasticd[plot]'" in err.getvalue() and err.getvalue().count("\n") == 1
    assert not (tmp_path / "j.png").exists()


def test_plot_needs_a_job_and_no_watch(tmp_path):
    """--plot without --job, or with --watch, is a config error (exit 78)."""
    for extra in ([], ["--job", "j", "--watch"]):
        args = build_parser().parse_args(["status", "--etcd", "127.0.0.1:1", "--timeout", "0.2",
                                          "--plot", str(tmp_path / "j.svg"), *extra])
        err = io.StringIO()
        assert run(args, out=io.StringIO(), err=err) == EX_CONFIG, err.getvalue()


def test_trend_line_shows_steps_per_s_and_loss():
    """--watch's trend line has steps/s and loss sparklines with their last values; none without a usable record."""
    line = plot.trend_line(_history().to_json())
    assert line.startswith("trend") and "steps/s" in line and "loss" in line
    assert line.rstrip().endswith("0.3")
    no_loss = History(samples=(Sample(t=1.0, step=1, world_size=1), Sample(t=3.0, step=5, world_size=1)))
    assert "loss" not in plot.trend_line(no_loss.to_json()) and "2" in plot.trend_line(no_loss.to_json())
    assert plot.trend_line("garbage") == "" and plot.trend_line(History().to_json()) == ""


def _stopped_history() -> History:
    """Trains 20 s at world 2, stopped for 10 minutes, resumes at world 1 from an older step."""
    return History(interval_s=5.0, samples=(
        Sample(t=0.0, step=0, world_size=2, loss=2.0), Sample(t=5.0, step=10, world_size=2, loss=1.0),
        Sample(t=10.0, step=20, world_size=2, loss=0.5),
        Sample(t=610.0, step=15, world_size=1, loss=0.6), Sample(t=615.0, step=20, world_size=1, loss=0.4),
    ))


def test_a_stopped_interval_is_idle_with_no_rate_across_it_and_the_rollback_is_marked():
    """Nobody trained from 10 s to 610 s: an idle span, no steps/s across it, the world-size
    line broken there; the restart from step 15 after step 20 is a rollback of 5 steps."""
    d = plot.plot_data(_stopped_history())
    assert d.idle == ((10.0, 610.0),)
    assert d.steps_per_s == (None, 2.0, 2.0, None, 1.0)
    assert [list(r) for r in plot.training_runs(d)] == [[0, 1, 2], [3, 4]]
    assert d.rollbacks == ((610.0, 5),)


def test_worker_failures_and_lost_nodes_are_told_apart():
    """A failed worker and a lost node get different marker classes (and colours), each labelled."""
    d = plot.plot_data(_stopped_history(), [_ev(1.0, "failure"), _ev(2.0, "lost"), _ev(3.0, "hang")])
    assert [(cls, text) for _, cls, text in d.markers] == [
        ("failure", "failure n"), ("lost", "lost n"), ("failure", "hang n")]
    assert plot.MARKER_STYLE["failure"][0] != plot.MARKER_STYLE["lost"][0]


def test_labels_of_events_close_together_are_merged():
    """Events closer than the gap share one label, so their texts do not overprint."""
    labels = plot.marker_labels([(10.0, "lost", "lost b"), (11.0, "failure", "failure a"),
                                 (90.0, "join", "join b")], min_gap_s=5.0)
    assert labels == [(10.0, "lost b, failure a", "lost"), (90.0, "join b", "join")]
