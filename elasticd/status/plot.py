"""`elasticd status --job J --plot FILE.png|svg`: a picture of the job over time.

Three panels on one time axis: world size (whole numbers), steps per second, and the loss
the workers reported (log scale; a note instead when they report none), with the job's
events marked as labelled vertical lines (worker failures red, lost nodes purple, drains
and notices orange, joins and resizes green), committed checkpoints as ticks on the
steps/s panel, time nobody trained (a stop, every agent down) shaded grey instead of
drawn as the last world size, and a mark where work was rolled back (the step went
backwards: steps retrained from an older checkpoint).

The data is the bounded history record the agents keep (``elasticd/history.py``) plus
the event history ``status`` already reads; like the rest of ``status`` it reads etcd
only, so it works when every agent is down. Turning records into series is pure (tested
without matplotlib); drawing needs the optional ``[plot]`` extra, imported only here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from elasticd.errors import ConfigError
from elasticd.etcd.client import EtcdClient
from elasticd.history import History
from elasticd.records import Event
from elasticd.status.goodput import IDLE_INTERVALS, rolled_back_steps
from elasticd.status.model import EXIT_OK, EXIT_UNKNOWN_JOB
from elasticd.status.options import StatusOptions, unknown_job_message
from elasticd.status.snapshot import read_history, read_job

FORMATS = (".png", ".svg")
MISSING_MATPLOTLIB = ("--plot needs matplotlib, which is the optional [plot] extra: "
                      "pip install 'elasticd[plot]' (or pip install matplotlib)")
# Event kind -> marker class; kinds not listed (round, restart, finished, ...) are not drawn.
MARKER_OF_KIND = {
    "failure": "failure", "hang": "failure",
    "lost": "lost", "lease_lost": "lost",
    "drain": "drain", "leave": "drain", "notice": "drain",
    "join": "join", "resize": "join",
    "hung": "eject", "straggler_ejected": "eject",  # an ejection (elasticd.agent.elastic_agent)
}
MARKER_STYLE = {"failure": ("tab:red", "worker failure / hang"),
                "lost": ("tab:purple", "node lost"),
                "drain": ("tab:orange", "drain / notice"),
                "join": ("tab:green", "join / resize"),
                "eject": ("tab:olive", "node ejected (hung / straggler)")}
SPARK = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class PlotData:
    """The series of one picture; times are seconds since ``start`` (Unix seconds)."""

    start: float
    t: tuple[float, ...]
    world_size: tuple[int, ...]
    steps_per_s: tuple[float | None, ...]  # None for the first sample and across a step reset
    loss: tuple[float | None, ...]
    checkpoints: tuple[tuple[float, int], ...]  # (time, step) where a newer checkpoint appeared
    markers: tuple[tuple[float, str, str], ...]  # (time, marker class, label: "kind node")
    idle: tuple[tuple[float, float], ...] = ()  # (from, to): nobody trained
    rollbacks: tuple[tuple[float, int], ...] = ()  # (time, steps retrained)

    @property
    def has_loss(self) -> bool:
        return any(v is not None for v in self.loss)


def plot_data(history: History, events: Sequence[Event] = ()) -> PlotData:
    """Turn a history record and events into plottable series (pure).

    Steps/s is the step difference over the time difference of consecutive samples; it is
    None where the step went backwards (a restart from an older checkpoint: a rollback,
    with the steps retrained) and across an idle span (samples more than
    ``IDLE_INTERVALS`` intervals apart: nobody trained, nothing to interpolate).
    """
    samples = history.samples
    start = samples[0].t if samples else min((e.time for e in events), default=0.0)
    rates: list[float | None] = [None]
    idle: list[tuple[float, float]] = []
    rollbacks: list[tuple[float, int]] = []
    gap_s = IDLE_INTERVALS * history.interval_s
    reported = [e for e in events if rolled_back_steps(e)]  # the agents' rollback events
    for a, b in zip(samples, samples[1:], strict=False):
        gap = b.t - a.t > gap_s
        if gap:
            idle.append((a.t - start, b.t - start))
        inner = [e for e in reported if a.t < e.time <= b.t]
        if b.step < a.step or inner:  # each reported one, else the step back the samples show
            rollbacks += ([(e.time - start, rolled_back_steps(e)) for e in inner]
                          or [(b.t - start, a.step - b.step)])
        rates.append((b.step - a.step) / (b.t - a.t)
                     if b.step >= a.step and b.t > a.t and not gap else None)
    ckpts: list[tuple[float, int]] = []
    seen: int | None = None
    for s in samples:
        if s.checkpoint_step is not None and s.checkpoint_step != seen:
            seen = s.checkpoint_step
            ckpts.append((s.t - start, s.checkpoint_step))
    end = samples[-1].t if samples else start
    markers = tuple((e.time - start, MARKER_OF_KIND[e.kind], f"{e.kind} {e.node}".strip())
                    for e in events if e.kind in MARKER_OF_KIND and start <= e.time <= end + 60)
    return PlotData(start=start, t=tuple(s.t - start for s in samples),
                    world_size=tuple(s.world_size for s in samples),
                    steps_per_s=tuple(rates[:len(samples)]), loss=tuple(s.loss for s in samples),
                    checkpoints=tuple(ckpts), markers=tuple(sorted(markers)), idle=tuple(idle),
                    rollbacks=tuple(rollbacks))


def marker_labels(markers: Sequence[tuple[float, str, str]], *,
                  min_gap_s: float) -> list[tuple[float, str, str]]:
    """One label per cluster of events closer than ``min_gap_s``: ``(time, "lost b,
    failure a", marker class of the first)``, so labels of events seconds apart do not
    print over each other (pure)."""
    out: list[tuple[float, str, str]] = []
    for t, cls, text in markers:
        if out and t - out[-1][0] < min_gap_s:
            first_t, joined, first_cls = out[-1]
            out[-1] = (first_t, f"{joined}, {text}", first_cls)
        else:
            out.append((t, text, cls))
    return out


def training_runs(data: PlotData) -> list[range]:
    """Indexes of the samples in each stretch of training between idle spans (pure): the
    world size is drawn per stretch, never across a span nobody trained in."""
    runs: list[range] = []
    begin = 0
    idle_starts = {a for a, _ in data.idle}
    for i, t in enumerate(data.t):
        if t in idle_starts:
            runs.append(range(begin, i + 1))
            begin = i + 1
    if begin < len(data.t):
        runs.append(range(begin, len(data.t)))
    return runs


def sparkline(values: Sequence[float | None], width: int = 24) -> str:
    """The last ``width`` values as a one-line trend (``▁▂▃▅▇``); a space where None."""
    vals = list(values)[-width:]
    nums = [v for v in vals if v is not None]
    if not nums:
        return ""
    lo, hi = min(nums), max(nums)
    span = (hi - lo) or 1.0
    return "".join(" " if v is None else SPARK[min(int((v - lo) / span * len(SPARK)), len(SPARK) - 1)]
                   for v in vals)


def trend_line(record: bytes | str, width: int = 24) -> str:
    """``--watch``'s one-line trend of steps/s and loss from a history record ("" if none).

    An unreadable record gives "" (the screen is not the place for that error).
    """
    try:
        data = plot_data(History.from_json(record))
    except ValueError:
        return ""
    rates = [v for v in data.steps_per_s if v is not None]
    if not rates:
        return ""
    line = f"trend       steps/s {sparkline(data.steps_per_s, width)} {rates[-1]:.3g}"
    losses = [v for v in data.loss if v is not None]
    if losses:
        line += f"   loss {sparkline(data.loss, width)} {losses[-1]:.4g}"
    return line


def check_target(path: str) -> Path:
    """Validate ``--plot FILE`` and that matplotlib is importable.

    Raises:
        ConfigError: the suffix is not .png/.svg, the directory does not exist, or
            matplotlib is missing (names the ``[plot]`` extra).
    """
    target = Path(path)
    if target.suffix.lower() not in FORMATS:
        raise ConfigError(f"--plot {path!r}: the file name must end in .png or .svg, "
                          "e.g. --plot job.png")
    if not target.parent.resolve().is_dir():
        raise ConfigError(f"--plot {path!r}: directory {str(target.parent)!r} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigError(MISSING_MATPLOTLIB) from exc
    return target


def draw(data: PlotData, target: Path, *, title: str) -> None:
    """Draw ``data`` into ``target`` (.png or .svg) with matplotlib's Agg canvas.

    Raises:
        ConfigError: matplotlib is missing.
        OSError: the file cannot be written.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError(MISSING_MATPLOTLIB) from exc
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    # Figure() without pyplot: no GUI backend, no global state, safe on a headless node.
    fig = Figure(figsize=(10, 7.5), layout="constrained")
    ax_w, ax_s, ax_l = fig.subplots(3, 1, sharex=True)
    minutes = [t / 60 for t in data.t]
    for run in training_runs(data):  # no line across a span nobody trained in
        ax_w.step([minutes[i] for i in run], [data.world_size[i] for i in run], where="post",
                  color="tab:blue")
    ax_w.set_ylabel("world size")
    ax_w.set_ylim(bottom=0, top=max(data.world_size, default=1) + 0.5)
    ax_w.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_s.plot(minutes, [float("nan") if v is None else v for v in data.steps_per_s],
              marker=".", color="tab:blue")
    ax_s.set_ylabel("steps / s")
    for t, _step in data.checkpoints:
        ax_s.plot([t / 60], [0], marker="^", color="tab:gray", clip_on=False)
    losses = [v for v in data.loss if v is not None]
    if losses:
        for run in training_runs(data):
            ax_l.plot([minutes[i] for i in run],
                      [float("nan") if data.loss[i] is None else data.loss[i] for i in run],
                      color="tab:brown")
        if min(losses) > 0:  # a log axis: the first values do not flatten the rest
            ax_l.set_yscale("log")
            ax_l.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            ax_l.yaxis.set_minor_formatter(FuncFormatter(_minor_loss_label))
    else:
        ax_l.text(0.5, 0.5, "no loss reported by the workers",
                  ha="center", va="center", transform=ax_l.transAxes, color="tab:gray")
    ax_l.set_ylabel("loss")
    ax_l.set_xlabel("minutes since " + _utc(data.start))
    for n, (a, b) in enumerate(data.idle):
        for ax in (ax_w, ax_s, ax_l):
            ax.axvspan(a / 60, b / 60, color="tab:gray", alpha=0.2, linewidth=0,
                       label="not training" if ax is ax_w and n == 0 else None)
    labelled: set[str] = set()
    for t, cls, _text in data.markers:
        color, label = MARKER_STYLE[cls]
        for ax in (ax_w, ax_s, ax_l):
            ax.axvline(t / 60, color=color, alpha=0.6, linewidth=1,
                       label=label if ax is ax_w and cls not in labelled else None)
        labelled.add(cls)
    span = max([*data.t, *(t for t, _, _ in data.markers)], default=0.0)
    for t, text, cls in marker_labels(data.markers, min_gap_s=span / 60):
        ax_w.annotate(text, (t / 60, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                      va="top", ha="right", fontsize="x-small", color=MARKER_STYLE[cls][0])
    for n, (t, steps) in enumerate(data.rollbacks):
        ax_s.axvline(t / 60, color="black", linestyle="--", linewidth=1,
                     label="rolled back" if n == 0 else None)
        ax_s.annotate(f"{steps} steps retrained", (t / 60, 1.0),
                      xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                      fontsize="x-small")
    if data.checkpoints:
        ax_s.plot([], [], marker="^", linestyle="", color="tab:gray", label="checkpoint")
    handles, names = [], []
    for ax in (ax_w, ax_s):
        h, n = ax.get_legend_handles_labels()
        handles += h
        names += n
    if handles:  # below the panels: it never hides a line or an event's label
        fig.legend(handles, names, loc="outside lower center", ncol=min(len(names), 4),
                   fontsize="small")
    fig.suptitle(title)
    fig.savefig(str(target), format=target.suffix.lower().lstrip("."))


def _minor_loss_label(v: float, _pos: int) -> str:
    """Label the 2s and 5s between the powers of ten of the log loss axis, nothing else."""
    if v <= 0:
        return ""
    lead = round(v / 10 ** math.floor(math.log10(v)))
    return f"{v:g}" if lead in (2, 5) else ""


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def run_plot(client: EtcdClient, opts: StatusOptions, path: str, *, out: IO[str],
             fail: Any) -> int:
    """`elasticd status --job J --plot FILE`: read the job once, draw it, print the path.

    Returns:
        0 when the picture was written; 3 for an unknown job; 78 for bad flags or a
        missing matplotlib (via ``fail``, which prints the reason).

    Raises:
        EtcdUnavailableError: etcd did not answer (the caller maps it to exit 4).
    """
    if opts.job is None:
        raise ConfigError("--plot draws one job: add --job NAME")
    if opts.watch:
        raise ConfigError("--plot draws once: drop --watch")
    target = check_target(path)
    snap = read_job(client, opts.job)
    if snap is None:
        return int(fail(EXIT_UNKNOWN_JOB, unknown_job_message(opts), job=opts.job))
    history, why = read_history(client, opts.job)
    note = f" ({why})" if why else ""
    data = plot_data(history, [e.event for e in snap.events])
    try:
        draw(data, target, title=f"elasticd job {opts.job}: {len(data.t)} samples{note}")
    except OSError as exc:
        raise ConfigError(f"--plot {path!r}: cannot write it: {exc.strerror}") from exc
    print(f"{target} ({len(data.t)} samples, {len(data.markers)} events, "
          f"{len(data.checkpoints)} checkpoints, {len(data.rollbacks)} rollbacks){note}",
          file=out, flush=True)
    return EXIT_OK
