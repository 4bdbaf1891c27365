"""The requests screen: what the engine holds (AdminStats.requests) and aborting one."""

from __future__ import annotations

from typing import Any

from appliance.console.client import ConsoleError
from appliance.console.dialogs import ConfirmScreen
from appliance.console.state import Snapshot, status_line
from appliance.console.widgets import BAD, DIM, OK, WARN, StatusLine, secs
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

# Short headers keep the table inside 80 columns; `?` help spells them out.
COLUMNS = ("request", "class", "status", "prompt", "out", "blocks", "age", "pre")
STATUS_STYLE = {"running": OK, "waiting": WARN, "preempted": BAD, "swapped": BAD}
# Running first, then what waits for the engine, each oldest first.
ORDER = {"running": 0, "swapped": 1, "preempted": 2, "waiting": 3}


class RequestsScreen(Screen[None]):
    DEFAULT_CSS = """
    RequestsScreen #summary { height: 1; padding: 0 1; }
    RequestsScreen DataTable { height: 1fr; }
    RequestsScreen #outcome { height: auto; max-height: 3; padding: 0 1; }
    """
    BINDINGS = [Binding("x", "abort", "Abort request")]

    def compose(self) -> ComposeResult:
        yield StatusLine(id="status")
        yield Static(id="summary")
        yield DataTable(id="requests", cursor_type="row", zebra_stripes=True)
        yield Static(id="outcome")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for col in COLUMNS:
            table.add_column(col, key=col)
        self.watch(self.app, "snapshot", self.show)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # False hides the binding from the footer: read-only consoles show no way to change the box.
        if action == "abort" and getattr(self.app, "readonly", False):
            return False
        return True

    def show(self, snap: Snapshot | None) -> None:
        text, cls = status_line(snap)
        status = self.query_one(StatusLine)
        status.update(text)
        status.set_classes(cls)
        stats = snap.stats if snap else None
        if stats is None:
            return
        reqs = sorted(stats.requests, key=lambda r: (ORDER.get(r.status, 9), -r.age_s))
        counts = {s: sum(1 for r in reqs if r.status == s) for s in ORDER}
        summary = Text.assemble(
            *(part for s in ORDER for part in ((f"{s} ", DIM), (f"{counts[s]}  ", "bold")))
        )
        self.query_one("#summary", Static).update(summary)
        table = self.query_one(DataTable)
        selected = self.selected_id()
        table.clear()
        for r in reqs:
            table.add_row(
                r.request_id,
                r.priority_class,
                Text(r.status, STATUS_STYLE.get(r.status, "")),
                r.prompt_tokens,
                r.output_tokens,
                r.blocks_held,
                secs(r.age_s),
                r.num_preemptions,
                key=r.request_id,
            )
        if selected is not None and selected in {r.request_id for r in reqs}:
            table.move_cursor(row=table.get_row_index(selected), animate=False)

    def selected_id(self) -> str | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        try:
            key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        except Exception:  # cursor outside the rows after a refresh
            return None
        return str(key.value) if key.value is not None else None

    def action_abort(self) -> None:
        if getattr(self.app, "readonly", False):
            return
        request_id = self.selected_id()
        if request_id is None:
            self.query_one("#outcome", Static).update(Text("no request selected", DIM))
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.abort(request_id)

        self.app.push_screen(
            ConfirmScreen(
                f"Abort request {request_id}?\nThe client receives what was generated so "
                "far with finish reason 'abort'; its KV blocks are freed.",
                yes="Abort",
            ),
            confirmed,
        )

    @work(exclusive=True, group="abort")
    async def abort(self, request_id: str) -> None:
        outcome = self.query_one("#outcome", Static)
        outcome.update(Text(f"aborting {request_id} …", WARN))
        app: Any = self.app
        try:
            result = await app.client.abort(request_id)
        except ConsoleError as exc:
            outcome.update(Text(f"abort failed: {exc}", BAD))
            return
        outcome.update(Text(f"aborted {', '.join(result.get('aborted', [request_id]))}", OK))
        app.refresh_now()
