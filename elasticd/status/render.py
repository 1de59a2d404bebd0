"""Terminal rendering of `elasticd status` with rich: one screen, sensible in 80 columns.

Tables are ``FittedTable``s: at render time they measure their cells against the width
rich offers and give every column an exact width — long names and messages are cut with
an ellipsis, less important columns (version, host) are dropped on very narrow screens —
so a row is always one line and never wraps into a staircase. The full values are in
``--json``. Colour comes from rich, which turns it off by itself when stdout is not a
terminal or ``NO_COLOR`` is set (https://no-color.org); styles are only hints, every fact
is also in the text.

Everything shown comes from etcd, which training code or another tenant may write: a
node id, host or event message can carry terminal control sequences (``ESC [ 2 J`` clears
the screen; others retitle the window or fake lines). Every ``Text`` built here goes
through :func:`printable`, which shows control and bidi-format characters as visible
escapes (``\x1b``) instead of sending them to the terminal.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import IO, Any

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.segment import Segment
from rich.table import Table
from rich.text import Text as _RichText

from elasticd.status.jsondoc import redact_url
from elasticd.status.model import JobStatus, NodeStatus, exit_detail, format_age, unreadable_summary
from elasticd.status.snapshot import SeqEvent

STATE_STYLE = {
    "training": "bold green",
    "re-forming": "bold yellow",
    "rendezvous": "bold yellow",
    "draining": "bold yellow",
    "stopped": "bold",
    "failed": "bold red",
}
NODE_STATE_STYLE = {
    "training": "green",
    "re-forming": "yellow",
    "joining": "yellow",
    "spare": "cyan",
    "restarting": "yellow",
    "draining": "yellow",
    "stopped": "dim",
    "failed": "red",
    "lost": "red",
    "left": "dim",
}
EVENT_STYLE = {"failure": "red", "lost": "red", "hang": "red", "lease_lost": "red", "diverged": "red",
               "drain": "yellow", "notice": "yellow", "leave": "yellow"}
DEFAULT_MAX_ROWS = 40
# C0/C1 controls and DEL, plus Unicode format characters that reorder or hide text
# (bidi overrides/isolates, zero-width joiners): the characters a hostile record uses.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def printable(text: str) -> str:
    """``text`` with every control or format character replaced by a visible escape."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class Text(_RichText):
    """rich's ``Text`` whose content always passes through :func:`printable`."""

    def __init__(self, text: str = "", *args: Any, **kwargs: Any) -> None:
        super().__init__(printable(str(text)), *args, **kwargs)
_GAP = 3  # SIMPLE_HEAD, pad_edge=False: one pad, one divider, one pad between columns
# Output that is not a terminal (a pipe, a log, `watch`) has no width to fit: lines are as
# long as their content, so nothing is cut at rich's default of 80 columns.
UNBOUNDED_WIDTH = 1000


class _StatusConsole(Console):
    """rich's console, but a closed pipe raises BrokenPipeError (rich's own default exits 1,
    which a health check reads as "degraded"): ``elasticd status`` ends it as exit 0."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError("the reader of the status output went away")


def make_console(file: IO[str] | None = None, *, width: int | None = None) -> Console:
    """A console for status output (rich decides colour from TTY-ness and NO_COLOR).

    A terminal is fitted to its width; other output (``COLUMNS`` unset) is not cut.
    """
    console = _StatusConsole(file=file, width=width, highlight=False, soft_wrap=False,
                             emoji=False)
    if width is None and not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = UNBOUNDED_WIDTH
    return console


class Unwrapped:
    """One line printed whole, never folded: a URL or path an operator copies.

    Printed with ``crop=False`` (``print_screen``) it runs past the right edge and the
    terminal shows it on several rows without a break in the copied text; in ``--watch``,
    whose screen must keep one row per line, it is cut at the edge instead.
    """

    def __init__(self, text: str, style: str = "", indent: int = 0) -> None:
        self.text = printable(text)
        self.style = style
        self.indent = indent

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Segment(" " * self.indent)
        yield Segment(self.text, console.get_style(self.style) if self.style else None)
        yield Segment.line()


def print_screen(console: Console, renderable: RenderableType) -> None:
    """Print a one-shot screen without cropping its ``Unwrapped`` lines."""
    console.print(renderable, crop=False)


@dataclass(frozen=True)
class Col:
    """A column of a ``FittedTable``.

    ``shrink``: columns with a higher value give up width first (0: never shrinks below
    its content). ``drop``: when shrinking is not enough, columns with a higher value are
    left out first (0: never dropped).
    """

    header: str
    justify: str = "left"
    min_width: int = 1
    shrink: int = 0
    drop: int = 0


def fit_widths(cols: Sequence[Col], natural: Sequence[int], width: int) -> list[int | None]:
    """Column widths that fit ``width`` (None: column dropped). Pure, unit-tested.

    Columns shrink in ``shrink`` order down to ``min_width``; if that is not enough,
    columns are dropped in ``drop`` order and the rest fitted again.
    """
    active = list(range(len(cols)))
    while True:
        widths = {i: natural[i] for i in active}
        excess = sum(widths.values()) + _GAP * (len(active) - 1) - width
        for i in sorted((i for i in active if cols[i].shrink), key=lambda i: -cols[i].shrink):
            if excess <= 0:
                break
            give = min(excess, max(widths[i] - cols[i].min_width, 0))
            widths[i] -= give
            excess -= give
        droppable = [i for i in active if cols[i].drop]
        if excess <= 0 or not droppable:
            return [widths.get(i) for i in range(len(cols))]
        active.remove(max(droppable, key=lambda i: cols[i].drop))


class FittedTable:
    """A one-line-per-row table whose columns are sized to the width at render time."""

    def __init__(self, cols: Sequence[Col], *, title: str | None = None) -> None:
        self.cols = list(cols)
        self.rows: list[list[Text]] = []
        self.title = title

    def add_row(self, *cells: str | Text) -> None:
        self.rows.append([c if isinstance(c, Text) else Text(c) for c in cells])

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        natural = [max([cell_len(c.header)] + [r[i].cell_len for r in self.rows])
                   for i, c in enumerate(self.cols)]
        widths = fit_widths(self.cols, natural, options.max_width)
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, title=self.title,
                      title_justify="left", title_style="bold")
        keep = [i for i, w in enumerate(widths) if w is not None]
        for i in keep:
            c = self.cols[i]
            table.add_column(c.header, justify=c.justify, no_wrap=True,  # type: ignore[arg-type]
                             overflow="ellipsis", width=max(widths[i] or 1, 1))
        for r in self.rows:
            table.add_row(*(r[i] for i in keep))
        yield table


def format_ranks(ranks: Sequence[int]) -> str:
    """``[0,1,2,3,8]`` -> ``"0-3,8"``; empty -> ``"-"``."""
    if not ranks:
        return "-"
    ordered = sorted(set(ranks))
    parts = []
    start = prev = ordered[0]
    for r in ordered[1:]:
        if r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def format_time(ts: float, now: float) -> str:
    """UTC wall time: ``"12:03:04"`` within the last day, else ``"01-31 12:03"``."""
    dt = datetime.fromtimestamp(ts, timezone.utc)
    if 0 <= now - ts < 86400:
        return dt.strftime("%H:%M:%S")
    return dt.strftime("%m-%d %H:%M")


def _state_text(status: JobStatus) -> Text:
    text = Text(status.state.upper(), style=STATE_STYLE.get(status.state, ""))
    if status.state == "training" and not status.degraded:
        text.append(" at full size")
    elif status.degraded and status.state == "training":
        text.append(" (degraded)", style="yellow")
    return text


def round_cause_text(s: JobStatus) -> str:
    """``"; opened for member left: b"``, or ``""``. Pure.

    A round is opened because members left or were lost, and it keeps that cause once
    final. A node named there that is a member of the round again has come back (a node
    that drained and rejoined): it is said so, not reported as gone from a round it is in.
    """
    if not s.round_cause:
        return ""
    text = f"; opened for {s.round_cause.replace('_', ' ')}"
    if not s.round_changed:
        return text
    members = {n.node for n in s.nodes if n.member and n.state not in ("left", "lost")}
    gone = s.round_cause in ("member_left", "member_lost")
    named = [f"{n} (back in this round)" if gone and s.round_phase == "final" and n in members
             else n for n in s.round_changed[:3]]
    return f"{text}: {', '.join(named)}"


def render_header(s: JobStatus) -> Table:
    """Key/value grid: state, round, size, progress, checkpoint (long values fold; the
    checkpoint URL is printed whole below the grid by ``render_job``)."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    grid.add_row("job", Text(s.job))
    grid.add_row("state", _state_text(s))
    grid.add_row("", Text(s.reason))
    for why in s.degraded_reasons:
        if why != s.reason:
            grid.add_row("", Text(f"degraded: {why}", style="yellow"))
    if s.recovered_at is not None:
        grid.add_row("", Text(f"recovered {format_age(s.now - s.recovered_at)} ago "
                              f"(from {s.recovered_from})", style="dim"))
    if s.round is not None:
        since = ""
        if s.round_phase == "final" and s.round_completed_at:
            since = f", formed {format_age(s.now - s.round_completed_at)} ago"
        elif s.round_opened_at:
            since = f", opened {format_age(s.now - s.round_opened_at)} ago"
        since += round_cause_text(s)
        grid.add_row("round", Text(f"{s.round} ({s.round_phase}{since})"))
        if s.state == "stopped":
            # The round's member list outlives a stop or a finish; nobody trains in it.
            size = f"- nodes (min {s.min_nodes}, max {s.max_nodes}), world size -"
        else:
            size = f"{s.nodes_in_round} nodes (min {s.min_nodes}, max {s.max_nodes})"
            size += f", world size {s.world_size}" if s.world_size is not None else ""
        if s.waiting_nodes:
            size += f", {s.waiting_nodes} waiting to join"
        grid.add_row("size", Text(size))
    else:
        grid.add_row("round", Text("none yet"))
    p = s.progress
    if p is not None:
        line = f"step {p.step:,} · epoch {p.epoch} · {p.samples_per_s:,.1f} samples/s"
        if p.updated_at:
            line += f" · updated {format_age(s.now - p.updated_at)} ago"
        grid.add_row("progress", Text(line))
    else:
        grid.add_row("progress", Text("no progress reported yet", style="dim"))
    c = s.checkpoint
    if c is not None:
        grid.add_row("checkpoint", Text(
            f"step {c.step:,} · {format_age(s.now - c.committed_at)} ago · round {c.round}"))
    else:
        grid.add_row("checkpoint", Text("none committed yet", style="dim"))
    if p is not None and p.save_every:  # [checkpoint] every = "auto"
        grid.add_row("cadence", Text(f"auto: every {p.save_every:,} steps "
                                     f"(~{p.save_interval_s:.1f} s) · {p.cadence}"))
    if s.unreadable:
        grid.add_row("warning", Text(unreadable_summary(s.unreadable), style="yellow"))
    return grid


def _healthy(n: NodeStatus) -> bool:
    return n.state == "training" and n.member


def render_nodes(s: JobStatus, *, max_rows: int = DEFAULT_MAX_ROWS) -> RenderableType:
    """The nodes table. Beyond ``max_rows`` (0: no limit) healthy rows are cut first:
    an operator must see the lost node, not rank 999."""
    rows = list(s.nodes)
    hidden = 0
    if max_rows and len(rows) > max_rows:
        keep = sorted(range(len(rows)), key=lambda i: (_healthy(rows[i]), i))[:max_rows]
        hidden = len(rows) - max_rows
        rows = [rows[i] for i in sorted(keep)]
    # Node ids are usually the host names: then a host column only repeats them.
    show_host = any(n.host and n.host != n.node for n in rows)
    cols = [
        Col("node", min_width=16, shrink=2),
        Col("host", min_width=8, shrink=3, drop=2),
        Col("state"),
        Col("ranks", min_width=5, shrink=1),
        Col("rst", justify="right"),
        Col("step", justify="right", drop=3),
        Col("beat", justify="right"),
        Col("version", min_width=5, shrink=4, drop=1),
    ]
    if not show_host:
        del cols[1]
    table = FittedTable(cols, title=f"nodes ({len(s.nodes)})")
    for n in rows:
        state = n.state
        if n.state == "lost" and n.lost_at:
            state = f"lost {format_age(s.now - n.lost_at)}"
        elif n.state == "left" and n.left:
            state = f"left ({n.left})"
        elif not n.member and n.state == "training":
            state = "training*"  # trains, but is not in the current round's member list
        cells: list[str | Text] = [
            n.node, n.host or "-", Text(state, style=NODE_STATE_STYLE.get(n.state, "")),
            format_ranks(n.ranks), "-" if n.restarts is None else str(n.restarts),
            "-" if n.step is None else f"{n.step:,}",
            format_age(s.now - n.heartbeat_at) if n.heartbeat_at else "-",
            n.version or "-",
        ]
        if not show_host:
            del cells[1]
        table.add_row(*cells)
    notes: list[RenderableType] = []
    if any(not n.member and n.state == "training" for n in rows):
        notes.append(Text("* trains, but is not a member of the current round (a stale round: "
                          "its workers should be re-formed or stopped)", style="dim"))
    for n in rows:
        if n.state == "spare" and n.spare_reason:
            notes.append(Text(f"{n.node} is a spare: {n.spare_reason}", style="dim"))
    if hidden:
        notes.append(Text(f"... and {hidden} more healthy nodes (--max-rows 0: all)",
                          style="dim"))
    return Group(table, *notes) if notes else table


def event_summary(se: SeqEvent) -> str:
    """The message of an event, led by its exit code or signal when it has one."""
    detail = se.event.detail if isinstance(se.event.detail, dict) else {}
    cause = exit_detail(detail)
    return f"{cause}: {se.event.message}" if cause else se.event.message


def render_events(s: JobStatus) -> FittedTable:
    """The newest events, oldest first, with UTC times."""
    table = FittedTable([
        Col("time"),
        Col("kind"),
        Col("node", min_width=16, shrink=3),  # the message matters more than a long id
        Col("message", min_width=12, shrink=2),
    ], title=f"last {len(s.events)} events (times UTC)")
    for se in s.events:
        table.add_row(format_time(se.event.time, s.now),
                      Text(se.event.kind, style=EVENT_STYLE.get(se.event.kind, "")),
                      se.event.node or "-", event_summary(se))
    return table


def render_job(s: JobStatus, *, max_rows: int = DEFAULT_MAX_ROWS) -> RenderableType:
    """The whole one-job screen: header, nodes, events."""
    parts: list[RenderableType] = [render_header(s)]
    if s.checkpoint is not None:
        parts.append(Unwrapped(redact_url(s.checkpoint.manifest_url), style="dim", indent=12))
    if s.nodes:
        parts += [Text(""), render_nodes(s, max_rows=max_rows)]
    if s.events:
        parts += [Text(""), render_events(s)]
    return Group(*parts)


def render_job_list(statuses: Sequence[JobStatus], now: float) -> RenderableType:
    """One row per job: state, size, step, checkpoint age, and why (cut to fit)."""
    if not statuses:
        return Text("no elasticd jobs found")
    table = FittedTable([
        Col("job", min_width=12, shrink=2),
        Col("state"),
        Col("round", justify="right", drop=2),
        Col("nodes", justify="right"),
        Col("world", justify="right", drop=3),
        Col("step", justify="right"),
        Col("ckpt", justify="right"),
        Col("reason", min_width=24, shrink=3, drop=1),
    ])
    for s in statuses:
        # "degraded" reads better here than "training" plus a flag; JSON keeps both facts.
        shown = "degraded" if s.state == "training" and s.degraded else s.state
        state = Text(shown, style="bold yellow" if shown == "degraded" else STATE_STYLE.get(s.state, ""))
        stopped = s.state == "stopped"  # the old round's sizes are not what trains now
        nodes = f"{s.nodes_in_round}/{s.max_nodes}" if s.max_nodes is not None and not stopped else "-"
        reason = "; ".join(s.degraded_reasons) if s.state == "training" and s.degraded else s.reason
        table.add_row(
            s.job, state, "-" if s.round is None else str(s.round), nodes,
            "-" if s.world_size is None or stopped else str(s.world_size),
            f"{s.progress.step:,}" if s.progress else "-",
            format_age(now - s.checkpoint.committed_at) if s.checkpoint else "-",
            reason,
        )
    return table
