"""``PlainScriptWatch``: when a worker group counts as a plain script's (it will never
register for live re-formation, so a join must not wait for it)."""

from __future__ import annotations

from elasticd.agent.reform import PlainScriptWatch

GROUP = 100.0  # the group's start (monotonic)


class _Proc:
    """Which pids are past their imports, and how often /proc was read."""

    def __init__(self) -> None:
        self.past: set[int] = set()
        self.reads = 0

    def __call__(self, pid: int) -> bool:
        self.reads += 1
        return pid in self.past


def _watch() -> tuple[PlainScriptWatch, _Proc]:
    proc = _Proc()
    return PlainScriptWatch(proc, grace_s=2.0, look_every_s=0.5), proc


def test_workers_past_their_imports_without_the_marker_are_a_plain_script_after_the_grace():
    watch, proc = _watch()
    assert not watch.plain(now=101.0, group_started_at=GROUP, pids=[7, 8], on_api=lambda: False)
    proc.past = {7}
    assert not watch.plain(now=101.5, group_started_at=GROUP, pids=[7, 8], on_api=lambda: False)
    proc.past = {7, 8}
    assert not watch.plain(now=102.0, group_started_at=GROUP, pids=[7, 8], on_api=lambda: False)
    assert not watch.plain(now=103.9, group_started_at=GROUP, pids=[7, 8], on_api=lambda: False)
    assert watch.plain(now=104.0, group_started_at=GROUP, pids=[7, 8], on_api=lambda: False)


def test_the_worker_api_marker_means_never_plain():
    watch, proc = _watch()
    proc.past = {7}
    watch.plain(now=101.0, group_started_at=GROUP, pids=[7], on_api=lambda: False)
    asked = []

    def on_api() -> bool:
        asked.append(1)
        return True

    assert not watch.plain(now=110.0, group_started_at=GROUP, pids=[7], on_api=on_api)
    # Seen once, it stands for the group: no look at the control dir again.
    assert not watch.plain(now=120.0, group_started_at=GROUP, pids=[7], on_api=on_api)
    assert len(asked) == 1
    # A new group looks again.
    assert not watch.plain(now=121.0, group_started_at=121.0, pids=[7], on_api=lambda: False)


def test_no_workers_yet_is_not_plain_and_proc_is_read_at_most_every_look_interval():
    watch, proc = _watch()
    assert not watch.plain(now=101.0, group_started_at=GROUP, pids=[], on_api=lambda: False)
    proc.past = {7}
    for i in range(10):  # ten ticks within one look interval: one read
        watch.plain(now=101.6 + i * 0.01, group_started_at=GROUP, pids=[7], on_api=lambda: False)
    assert proc.reads == 1
    # Once past the imports, /proc is not read again.
    watch.plain(now=103.0, group_started_at=GROUP, pids=[7], on_api=lambda: False)
    watch.plain(now=104.0, group_started_at=GROUP, pids=[7], on_api=lambda: False)
    assert proc.reads == 1


def test_a_new_group_starts_over():
    watch, proc = _watch()
    proc.past = {7}
    watch.plain(now=101.0, group_started_at=GROUP, pids=[7], on_api=lambda: False)
    assert watch.plain(now=104.0, group_started_at=GROUP, pids=[7], on_api=lambda: False)
    proc.past = set()
    assert not watch.plain(now=105.0, group_started_at=105.0, pids=[9], on_api=lambda: False)


def test_the_worker_api_writes_its_marker_and_the_agent_forgets_it_with_the_group(tmp_path, monkeypatch):
    from elasticd.control import ControlChannel
    from elasticd.worker import context

    chan = ControlChannel(directory=tmp_path)
    assert not chan.workers_on_api()
    monkeypatch.setenv("ELASTICD_CONTROL_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "3")
    context._announce_api()
    assert (tmp_path / "api-3").exists() and chan.workers_on_api()
    chan.clear_round()  # the next worker group starts without it
    assert not chan.workers_on_api()
    monkeypatch.setenv("ELASTICD_CONTROL_DIR", str(tmp_path / "gone"))
    context._announce_api()  # the agent's directory is gone: nothing raised
