"""The audit log file on its own: two lines per action joined into one record, an action
without outcome when the process died in between, rotation by size without losing recent
actions, 0640 whatever the umask, a torn last line skipped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from appliance.server.audit import FILE_NAME, AuditLog


def test_action_writes_a_started_and_an_outcome_line(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    with log.action("alice", "knob_change", {"via": "console"}) as act:
        assert len(log.lines()) == 1 and log.lines()[0].event == "started"  # before the work
        act.diff = [{"key": "scheduler.max_num_seqs", "before": 16, "after": 8}]
    with pytest.raises(RuntimeError), log.action("bob", "template_apply"):
        raise RuntimeError("engine failed")
    records = log.read()
    assert [(r.actor, r.action, r.outcome) for r in records] == [
        ("alice", "knob_change", "ok"),
        ("bob", "template_apply", "failed"),
    ]
    assert records[0].diff[0]["after"] == 8 and records[0].what == {"via": "console"}
    assert "engine failed" in records[1].error


def test_an_action_that_never_ended_reads_without_outcome(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    log.start("systemd", "reload")  # the process dies here
    with (tmp_path / FILE_NAME).open("ab") as f:
        f.write(b'{"id":"torn","ti')  # and its last write was cut short
    (record,) = AuditLog(tmp_path).read()
    assert (record.action, record.outcome, record.duration_s) == ("reload", None, None)


def test_rotation_by_size_keeps_recent_actions_and_mode_0640(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        log = AuditLog(tmp_path / "state", max_bytes=4096)
        for i in range(100):
            with log.action("alice", "class_pause", {"n": i}):
                pass
    finally:
        os.umask(old)
    files = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert files == [FILE_NAME, f"{FILE_NAME}.1", f"{FILE_NAME}.2", f"{FILE_NAME}.3"]
    for p in (tmp_path / "state").iterdir():
        assert p.stat().st_size <= 4096
    assert oct((tmp_path / "state" / FILE_NAME).stat().st_mode & 0o777) == "0o640"
    kept = [r.what["n"] for r in log.read()]
    assert kept == list(range(kept[0], 100)) and len(kept) > 20  # the newest, in order
    assert all(r.outcome == "ok" for r in log.read()[1:])  # (the oldest may lose its start)


def test_since_filters_by_start_time(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    with log.action("a", "class_pause"):
        pass
    cut = log.lines()[-1].time
    with log.action("b", "class_resume"):
        pass
    assert [r.actor for r in log.read(since=cut + 1e-6)] == ["b"]
