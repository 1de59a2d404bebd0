"""`elasticd status --job J --plot FILE.png|svg`: a picture of the job over time.

Three panels on one time axis: world size, steps per second, and the loss the workers
reported (a note instead when they report none), with the job's events marked as
vertical lines (failures and lost nodes red, drains and notices orange, joins and
resizes green) and committed checkpoints as ticks on the steps/s panel.

The data is the bounded history record the agents keep (``elasticd/history.py``) plus
the event history ``status`` already reads; like the rest of ``status`` it reads etcd
only, so it works when every agent is down. Turning records into series is pure (tested
without matplotlib); drawing needs the optional ``[plot]`` extra, imported only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from elasticd.errors import ConfigError
from elasticd.etcd.client import EtcdClient
from elasticd.history import History
from elasticd.keys import JobKeys
from elasticd.records import Event
from elasticd.status.model import EXIT_OK, EXIT_UNKNOWN_JOB
from elasticd.status.options import StatusOptions, unknown_job_message
from elasticd.status.snapshot import read_job

FORMATS = (".png", ".svg")
MISSING_MATPLOTLIB = ("--plot needs matplotlib, which is the optional [plot] extra: "
                      "pip install 'elasticd[plot]' (or pip install matplotlib)")
# Event kind -> marker class; kinds not listed (round, restart, finished, ...) are not drawn.
MARKER_OF_KIND = {
    "failure": "failure", "lost": "failure", "hang": "failure", "lease_lost": "failure",
    "drain": "drain", "leave": "drain", "notice": "drain",
    "join": "join", "resize": "join",
}
MARKER_STYLE = {"failure": ("tab:red", "failure / lost"), "drain": ("tab:orange", "drain / notice"),
                "join": ("tab:green", "join / resize")}
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
    markers: tuple[tuple[float, str, str], ...]  # (time, marker class, event kind)

    @property
    def has_loss(self) -> bool:
        return any(v is not None for v in self.loss)


def plot_data(history: History, events: Sequence[Event] = ()) -> PlotData:
    """Turn a history record and events into plottable series (pure).

    Steps/s is the step difference over the time difference of consecutive samples; it is
    None where the step went backwards (a restart from an older checkpoint).
    """
    samples = history.samples
    start = samples[0].t if samples else min((e.time for e in events), default=0.0)
    rates: list[float | None] = [None]
    for a, b in zip(samples, samples[1:], strict=False):
        rates.append((b.step - a.step) / (b.t - a.t) if b.step >= a.step and b.t > a.t else None)
    ckpts: list[tuple[float, int]] = []
    seen: int | None = None
    for s in samples:
        if s.checkpoint_step is not None and s.checkpoint_step != seen:
            seen = s.checkpoint_step
            ckpts.append((s.t - start, s.checkpoint_step))
    end = samples[-1].t if samples else start
    markers = tuple((e.time - start, MARKER_OF_KIND[e.kind], e.kind) for e in events
                    if e.kind in MARKER_OF_KIND and start <= e.time <= end + 60)
    return PlotData(start=start, t=tuple(s.t - start for s in samples),
                    world_size=tuple(s.world_size for s in samples),
                    steps_per_s=tuple(rates[:len(samples)]), loss=tuple(s.loss for s in samples),
                    checkpoints=tuple(ckpts), markers=tuple(sorted(markers)))


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
    # Figure() without pyplot: no GUI backend, no global state, safe on a headless node.
    fig = Figure(figsize=(10, 7.5), layout="constrained")
    ax_w, ax_s, ax_l = fig.subplots(3, 1, sharex=True)
    minutes = [t / 60 for t in data.t]
    ax_w.step(minutes, data.world_size, where="post", color="tab:blue")
    ax_w.set_ylabel("world size")
    ax_w.set_ylim(bottom=0)
    ax_s.plot(minutes, [float("nan") if v is None else v for v in data.steps_per_s],
              marker=".", color="tab:purple")
    ax_s.set_ylabel("steps / s")
    for t, _step in data.checkpoints:
        ax_s.plot([t / 60], [0], marker="^", color="tab:gray", clip_on=False)
    if data.has_loss:
        ax_l.plot(minutes, [float("nan") if v is None else v for v in data.loss], color="tab:brown")
    else:
        ax_l.text(0.5, 0.5, "no loss reported by the workers",
                  ha="center", va="center", transform=ax_l.transAxes, color="tab:gray")
    ax_l.set_ylabel("loss")
    ax_l.set_xlabel("minutes since " + _utc(data.start))
    labelled: set[str] = set()
    for t, cls, _kind in data.markers:
        color, label = MARKER_STYLE[cls]
        for ax in (ax_w, ax_s, ax_l):
            ax.axvline(t / 60, color=color, alpha=0.6, linewidth=1,
                       label=label if ax is ax_w and cls not in labelled else None)
        labelled.add(cls)
    if data.checkpoints:
        ax_s.plot([], [], marker="^", linestyle="", color="tab:gray", label="checkpoint")
        ax_s.legend(loc="upper right", fontsize="small")
    if labelled:
        ax_w.legend(loc="upper right", fontsize="small")
    fig.suptitle(title)
    fig.savefig(str(target), format=target.suffix.lower().lstrip("."))


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
    kv = client.get(JobKeys(opts.job).history)
    history = History()
    note = ""
    if kv is None:
        note = " (no history yet: agents older than this CLI, or no progress reported)"
    else:
        try:
            history = History.from_json(kv.value)
        except ValueError as exc:
            note = f" (history record unreadable, skipped: {exc})"
    data = plot_data(history, [e.event for e in snap.events])
    try:
        draw(data, target, title=f"elasticd job {opts.job}: {len(data.t)} samples{note}")
    except OSError as exc:
        raise ConfigError(f"--plot {path!r}: cannot write it: {exc.strerror}") from exc
    print(f"{target} ({len(data.t)} samples, {len(data.markers)} events, "
          f"{len(data.checkpoints)} checkpoints){note}", file=out, flush=True)
    return EXIT_OK
