"""The audit log: who changed what on this box, when, how it ended and how long it took.

One JSON line per event in `<state dir>/audit.jsonl` (server.state_dir; by default systemd's
$STATE_DIRECTORY, /var/lib/appliance under the shipped unit). Every action writes two lines
with one `id`: "started" before it touches anything, then its outcome (ok, failed,
rolled_back, refused) with the diff and the seconds it took. A process killed in between leaves
the first line alone: `read` reports that action with `outcome` None, the trace of a crash
mid-apply. Each line is fsync'd before the action goes on; the file is created 0640 (the
service's user and the `appliance` group read it, nobody else) and rotated past
server.audit_max_bytes (audit.jsonl.1 ... .3 kept, oldest dropped).

Any code can record through `AuditLog.action(...)` (template applies, live knobs, class
pause/resume, drains, `appliance inspect`, and later adapter loads); another process on the
box (the inspect timer) appends to the same file with O_APPEND, whole lines at a time.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

FILE_NAME = "audit.jsonl"
KEPT_ROTATIONS = 3
FILE_MODE = 0o640
DEFAULT_MAX_BYTES = 16 * 1024 * 1024


class AuditLine(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One line of the file."""

    id: str
    time: float
    # "started", or the outcome: ok | failed | rolled_back | refused.
    event: str
    actor: str
    # template_apply | reload | rollback | knob_change | class_pause | class_resume |
    # class_drain | drain | inspect | adapter_load | ...
    action: str
    # What the action is about: a template, a class, the checks run, ...
    what: dict[str, Any] = {}
    # Outcome lines: [{"key", "before", "after"}] where values changed.
    diff: list[dict[str, Any]] = []
    duration_s: float | None = None
    error: str = ""


class AuditRecord(msgspec.Struct, kw_only=True):
    """One action as `GET /admin/audit` serves it: its started line and outcome joined."""

    id: str
    time: float
    actor: str
    action: str
    what: dict[str, Any]
    # None: the action started and never ended (the process died mid-way).
    outcome: str | None
    diff: list[dict[str, Any]] = []
    duration_s: float | None = None
    error: str = ""


def default_state_dir() -> Path:
    """systemd's StateDirectory= (its first entry), else the XDG state home."""
    systemd = os.environ.get("STATE_DIRECTORY", "")
    if systemd:
        return Path(systemd.split(":")[0])
    xdg = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(xdg) / "appliance"


def state_dir(configured: str) -> Path:
    return Path(os.path.expanduser(configured)) if configured else default_state_dir()


@dataclass
class AuditAction:
    """An action in progress: set `diff`, `what` or `outcome` before it ends."""

    id: str
    started: float
    actor: str
    action: str
    what: dict[str, Any]
    diff: list[dict[str, Any]] = field(default_factory=list)
    outcome: str = ""
    error: str = ""

    def fail(self, outcome: str, error: str) -> None:
        self.outcome, self.error = outcome, error


class AuditLog:
    def __init__(self, directory: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.directory = directory
        self.path = directory / FILE_NAME
        self.max_bytes = max_bytes

    # -- writing ---------------------------------------------------------------------------------
    def _append(self, line: AuditLine) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        data = msgspec.json.encode(line) + b"\n"
        with contextlib.suppress(FileNotFoundError):
            if self.path.stat().st_size + len(data) > self.max_bytes:
                self._rotate()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # whatever the umask left
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _rotate(self) -> None:
        for n in range(KEPT_ROTATIONS, 0, -1):
            older = self.directory / f"{FILE_NAME}.{n}"
            newer = self.directory / (f"{FILE_NAME}.{n - 1}" if n > 1 else FILE_NAME)
            if newer.exists():
                os.replace(newer, older)

    def start(self, actor: str, action: str, what: dict[str, Any] | None = None) -> AuditAction:
        act = AuditAction(uuid.uuid4().hex[:16], time.time(), actor, action, dict(what or {}))
        self._append(AuditLine(id=act.id, time=act.started, event="started", actor=actor,
                               action=action, what=act.what))  # fmt: skip
        return act

    def finish(self, act: AuditAction, outcome: str | None = None) -> None:
        now = time.time()
        self._append(
            AuditLine(
                id=act.id,
                time=now,
                event=outcome or act.outcome or "ok",
                actor=act.actor,
                action=act.action,
                what=act.what,
                diff=act.diff,
                duration_s=round(now - act.started, 6),
                error=act.error,
            )
        )

    @contextlib.contextmanager
    def action(
        self, actor: str, action: str, what: dict[str, Any] | None = None
    ) -> Iterator[AuditAction]:
        """Record an action around the block: "started" now, the outcome when it ends ("failed"
        with the error if it raises, unless the block set another outcome first)."""
        act = self.start(actor, action, what)
        try:
            yield act
        except BaseException as exc:
            if not act.outcome:
                act.fail("failed", f"{type(exc).__name__}: {exc}")
            self.finish(act)
            raise
        self.finish(act)

    # -- reading ---------------------------------------------------------------------------------
    def files(self) -> list[Path]:
        rotated = [self.directory / f"{FILE_NAME}.{n}" for n in range(KEPT_ROTATIONS, 0, -1)]
        return [p for p in [*rotated, self.path] if p.exists()]

    def lines(self) -> list[AuditLine]:
        out: list[AuditLine] = []
        decoder = msgspec.json.Decoder(AuditLine)
        for path in self.files():
            for raw in path.read_bytes().splitlines():
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    out.append(decoder.decode(raw))  # a torn last line is skipped
        return out

    def read(self, since: float = 0.0, limit: int = 1000) -> list[AuditRecord]:
        """Actions started at or after `since` (Unix seconds), oldest first, the last `limit`."""
        records: dict[str, AuditRecord] = {}
        for line in self.lines():
            if line.event == "started":
                if line.time >= since:
                    records[line.id] = AuditRecord(
                        id=line.id, time=line.time, actor=line.actor, action=line.action,
                        what=line.what, outcome=None,
                    )  # fmt: skip
                continue
            rec = records.get(line.id)
            if rec is None:  # a one-line event, or its start was rotated away
                if line.time < since:
                    continue
                rec = records[line.id] = AuditRecord(
                    id=line.id, time=line.time, actor=line.actor, action=line.action,
                    what=line.what, outcome=None,
                )  # fmt: skip
            rec.outcome, rec.diff, rec.error = line.event, line.diff, line.error
            rec.duration_s = line.duration_s
            rec.what = line.what or rec.what
        return sorted(records.values(), key=lambda r: r.time)[-limit:] if limit else []
