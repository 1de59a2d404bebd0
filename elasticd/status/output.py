"""Printing one status answer: the JSON document or the rich screen, to any stream."""

from __future__ import annotations

from typing import IO

from elasticd.status import jsondoc
from elasticd.status.model import JobStatus
from elasticd.status.options import StatusOptions
from elasticd.status.render import (
    DEFAULT_MAX_ROWS,
    make_console,
    print_screen,
    render_job,
    render_job_list,
)


def emit_job(status: JobStatus, opts: StatusOptions, out: IO[str], *, pretty: bool = True) -> None:
    """Print one job as JSON or as the rich screen."""
    if opts.json:
        doc = jsondoc.job_document(status, endpoints=opts.endpoint_list)
        print(jsondoc.dumps(doc, pretty=pretty), file=out, flush=True)
        return
    print_screen(make_console(out), render_job(
        status, max_rows=DEFAULT_MAX_ROWS if opts.max_rows is None else opts.max_rows))


def emit_job_list(statuses: list[JobStatus], opts: StatusOptions, out: IO[str], *,
                  revision: int | None, now: float, pretty: bool = True) -> None:
    """Print the job list as JSON or as a table."""
    if opts.json:
        doc = jsondoc.job_list_document(statuses, endpoints=opts.endpoint_list,
                                        revision=revision, now=now)
        print(jsondoc.dumps(doc, pretty=pretty), file=out, flush=True)
        return
    make_console(out).print(render_job_list(statuses, now))
