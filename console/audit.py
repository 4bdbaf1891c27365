"""The audit screen: the priority classes with their state (pause, drain, resume one of them)
and the audit log of the box (GET /admin/audit): who changed what, when, how it ended."""

from __future__ import annotations

import time
from typing import Any

from appliance.console.client import ConsoleError
from appliance.console.dialogs import ConfirmScreen
from appliance.console.state import Snapshot, status_line
from appliance.console.widgets import BAD, DIM, OK, WARN, StatusLine
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

# The audit log is re-read at most this often (each poll of the stats is 1 s).
AUDIT_REFRESH_S = 2.0
AUDIT_ROWS = 200
STATE_STYLE = {"serving": OK, "paused": WARN, "draining": WARN}
OUTCOME_STYLE = {"ok": OK, "refused": WARN, "rolled_back": WARN, "failed": BAD}


def describe(record: dict[str, Any]) -> str:
    """What an action changed, in one line: its diff, else what it was about."""
    diff = record.get("diff") or []
    if diff:
        shown = [f"{d['key']} {d['before']}→{d['after']}" for d in diff[:2]]
        more = f" +{len(diff) - 2}" if len(diff) > 2 else ""
        return ", ".join(shown) + more
    what = record.get("what") or {}
    if record.get("error"):
        return str(record["error"])
    if "priority_class" in what:
        return str(what["priority_class"])
    if "template" in what:
        return f"template {what['template']}"
    return ""


class AuditScreen(Screen[None]):
    DEFAULT_CSS = """
    AuditScreen #classes { height: auto; max-height: 6; }
    AuditScreen #log-title { height: 1; padding: 0 1; }
    AuditScreen #audit { height: 1fr; }
    AuditScreen #outcome { height: auto; max-height: 3; padding: 0 1; }
    """
    BINDINGS = [
        Binding("p", "pause", "Pause class"),
        Binding("g", "drain", "Drain class"),
        Binding("u", "resume", "Resume class"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []
        self._fetched = 0.0

    def compose(self) -> ComposeResult:
        yield StatusLine(id="status")
        yield DataTable(id="classes", cursor_type="row")
        yield Static(Text("audit log (newest first)", "bold"), id="log-title")
        yield DataTable(id="audit", cursor_type="none", zebra_stripes=True)
        yield Static(id="outcome")
        yield Footer()

    def on_mount(self) -> None:
        classes = self.query_one("#classes", DataTable)
        for col in ("class", "state", "waiting", "queue timeout"):
            classes.add_column(col, key=col)
        log = self.query_one("#audit", DataTable)
        for col in ("time", "actor", "action", "outcome", "took", "change"):
            log.add_column(col, key=col)
        self.watch(self.app, "snapshot", self.show)
        classes.focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("pause", "drain", "resume") and getattr(self.app, "readonly", False):
            return False
        return True

    # -- what is shown ---------------------------------------------------------------------------
    def show(self, snap: Snapshot | None) -> None:
        text, cls = status_line(snap)
        status = self.query_one(StatusLine)
        status.update(text)
        status.set_classes(cls)
        stats = snap.stats if snap else None
        if stats is not None:
            self._fill_classes(
                stats.server.class_states, {q.priority_class: q for q in stats.queues}
            )
        if time.monotonic() - self._fetched >= AUDIT_REFRESH_S:
            self._fetched = time.monotonic()
            self.fetch_audit()

    def _fill_classes(self, states: dict[str, str], queues: dict[str, Any]) -> None:
        table = self.query_one("#classes", DataTable)
        rows = list(states.items())
        if [str(k.value) for k in table.rows] != [name for name, _ in rows]:
            table.clear()
            for name, _ in rows:
                table.add_row(name, "", "", "", key=name)
        for name, how in rows:
            q = queues.get(name)
            table.update_cell(name, "state", Text(how, STATE_STYLE.get(how, "")))
            table.update_cell(name, "waiting", str(q.waiting) if q else "-")
            timeout = f"{q.queue_timeout_s:g} s" if q and q.queue_timeout_s else "none"
            table.update_cell(name, "queue timeout", timeout)

    @work(exclusive=True, group="audit")
    async def fetch_audit(self) -> None:
        try:
            self.records = await self.app.client.audit(limit=AUDIT_ROWS)  # type: ignore[attr-defined]
        except ConsoleError as exc:
            self.query_one("#log-title", Static).update(Text(f"audit log: {exc}", BAD))
            return
        self.query_one("#log-title", Static).update(Text("audit log (newest first)", "bold"))
        table = self.query_one("#audit", DataTable)
        table.clear()
        for r in reversed(self.records):
            outcome = r.get("outcome") or "no outcome"
            took = r.get("duration_s")
            table.add_row(
                time.strftime("%m-%d %H:%M:%S", time.localtime(r["time"])),
                r.get("actor", ""),
                r.get("action", ""),
                Text(outcome, OUTCOME_STYLE.get(outcome, BAD)),
                "-" if took is None else f"{took:.2f}s",
                describe(r),
            )

    # -- actions ---------------------------------------------------------------------------------
    def selected_class(self) -> str | None:
        table = self.query_one("#classes", DataTable)
        if table.row_count == 0:
            return None
        row = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        return str(row) if row is not None else None

    def _ask(self, verb: str, question: str, run: Any) -> None:
        name = self.selected_class()
        if name is None or getattr(self.app, "readonly", False):
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.change_class(name, verb, run)

        self.app.push_screen(ConfirmScreen(question.format(name=name), yes=verb), confirmed)

    def action_pause(self) -> None:
        self._ask(
            "Pause",
            "Pause class [b]{name}[/b]? Its new requests get 503 (class_paused) and its queued "
            "requests wait; running ones finish; other classes run on.",
            lambda c, n: c.pause_class(n),
        )

    def action_drain(self) -> None:
        self._ask(
            "Drain",
            "Drain class [b]{name}[/b]? Its new requests get 503 (class_paused); its queued "
            "and running requests are served to the end.",
            lambda c, n: c.pause_class(n, drain=True),
        )

    def action_resume(self) -> None:
        self._ask(
            "Resume",
            "Resume class [b]{name}[/b]? It takes new requests and its queue runs again.",
            lambda c, n: c.resume_class(n),
        )

    @work(exclusive=True, group="class")
    async def change_class(self, name: str, verb: str, run: Any) -> None:
        outcome = self.query_one("#outcome", Static)
        try:
            result = await run(self.app.client, name)  # type: ignore[attr-defined]
        except ConsoleError as exc:
            outcome.update(Text(f"✗ {verb.lower()} {name}: {exc}", BAD))
            return
        outcome.update(Text.assemble(("✓ ", OK), f"{name}: {result['state']}", (" · logged", DIM)))
        self._fetched = 0.0
        self.app.refresh_now()  # type: ignore[attr-defined]
