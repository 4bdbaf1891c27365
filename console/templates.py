"""The templates screen: shipped and operator templates, the diff of the chosen one against the
running configuration, applying it through /admin/reload, and rolling back; and live knobs
(`k`: PATCH /admin/config, no rebuild) after a confirmation that shows their diff."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from appliance.console.catalog import (
    TemplateInfo,
    config_diff,
    is_running,
    scan_templates,
    show_value,
)
from appliance.console.client import ConsoleError
from appliance.console.dialogs import ConfirmScreen, InputScreen
from appliance.console.knobs import KNOB_PLACEHOLDER, parse_knobs, patch_body, running_value
from appliance.console.state import Snapshot, status_line
from appliance.console.widgets import BAD, DIM, OK, WARN, StatusLine, secs
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.coordinate import Coordinate
from textual.screen import Screen
from textual.widgets import DataTable, Footer, ProgressBar, Static

from appliance.config import ConfigError

MAX_DIFF_LINES = 40


class TemplatesScreen(Screen[None]):
    DEFAULT_CSS = """
    TemplatesScreen DataTable { height: auto; max-height: 9; }
    TemplatesScreen #details { height: 1fr; padding: 0 1; }
    TemplatesScreen #progress { display: none; padding: 0 1; height: 1; }
    TemplatesScreen.-applying #progress { display: block; }
    TemplatesScreen #outcome { height: auto; padding: 0 1; }
    """
    BINDINGS = [
        Binding("a", "apply", "Apply"),
        Binding("b", "rollback", "Roll back"),
        Binding("k", "knob", "Knob"),
        Binding("ctrl+l", "rescan", "Rescan", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.templates: list[TemplateInfo] = []
        # (template, overrides) that was running before the last apply: what `b` restores.
        self.previous: tuple[str | None, dict[str, Any]] | None = None
        self.applying: str | None = None

    def compose(self) -> ComposeResult:
        yield StatusLine(id="status")
        yield DataTable(id="templates", cursor_type="row")
        yield ProgressBar(id="progress", total=None, show_eta=False)
        yield Static(id="outcome")
        with VerticalScroll(id="details"):
            yield Static(id="diff")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for col in ("template", "source", "model", "TP", "memory plan"):
            table.add_column(col, key=col)
        self.watch(self.app, "snapshot", self.show)
        self.action_rescan()

    @property
    def readonly(self) -> bool:
        return bool(getattr(self.app, "readonly", False))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("apply", "rollback", "knob"):
            if self.readonly:
                return False  # hidden: a read-only console offers no way to change the box
            if self.applying is not None:
                return None  # shown, greyed out, while a reload is in progress
            if action == "rollback" and self.previous is None:
                return None
        return True

    @work(exclusive=True, group="scan", thread=True)
    def action_rescan(self) -> None:
        # load_config and the memory plan read files: off the event loop.
        templates = scan_templates()
        self.app.call_from_thread(self._fill, templates)

    def _fill(self, templates: list[TemplateInfo]) -> None:
        self.templates = templates
        table = self.query_one(DataTable)
        table.clear()
        for t in templates:
            table.add_row(
                t.name,
                t.source,
                t.model,
                "-" if t.tp is None else str(t.tp),
                Text(t.error, BAD) if t.error else t.plan,
                key=t.name,
            )
        self.show(getattr(self.app, "snapshot", None))

    def selected(self) -> TemplateInfo | None:
        table = self.query_one(DataTable)
        if not self.templates or table.row_count == 0:
            return None
        row = min(table.cursor_row, len(self.templates) - 1)
        name = table.coordinate_to_cell_key(Coordinate(row, 0)).row_key.value
        return next((t for t in self.templates if t.name == name), None)

    def select(self, name: str) -> None:
        table = self.query_one(DataTable)
        table.move_cursor(row=table.get_row_index(name), animate=False)

    def on_data_table_row_highlighted(self, _: DataTable.RowHighlighted) -> None:
        self.show(getattr(self.app, "snapshot", None))

    # -- what is shown ---------------------------------------------------------------------------
    def show(self, snap: Snapshot | None) -> None:
        text, cls = status_line(snap)
        status = self.query_one(StatusLine)
        status.update(text)
        status.set_classes(cls)
        stats = snap.stats if snap else None
        if self.applying is not None and stats is not None:
            detail = f" ({stats.server.phase_detail})" if stats.server.phase_detail else ""
            self.query_one("#outcome", Static).update(
                Text(f"applying {self.applying}: server {stats.server.phase}{detail} …", WARN)
            )
        self._mark_running(
            stats.config.template if stats else None, stats.config.path if stats else ""
        )
        self.query_one("#diff", Static).update(self._details(snap))

    def _mark_running(self, template: str | None, path: str) -> None:
        table = self.query_one(DataTable)
        for t in self.templates:
            label = f"▶ {t.name}" if is_running(t, template, path) else f"  {t.name}"
            table.update_cell(t.name, "template", label)

    def _details(self, snap: Snapshot | None) -> Text:
        t = self.selected()
        if t is None:
            return Text("no templates found", DIM)
        text = Text.assemble((t.name, "bold"), (f"  {t.path}", DIM))
        if t.config is not None and t.config.description:
            text.append(f"\n{t.config.description}")
        if t.error or t.config is None:
            return text.append(f"\ninvalid: {t.error}", BAD)
        text.append(f"\nmemory plan (weights · KV blocks · verdict): {t.plan}", DIM)
        running = snap.running if snap else None
        if not running:
            return text.append("\nrunning configuration unknown (server not reached yet)", DIM)
        diff = config_diff(t.config, running.get("config", {}))
        if not diff:
            return text.append("\nsame as the running configuration", OK)
        text.append(
            f"\n{len(diff)} settings differ from the running configuration "
            f"({running.get('template') or 'defaults'}):"
        )
        for key, old, new in diff[:MAX_DIFF_LINES]:
            text.append(f"\n  {key}: ").append(show_value(old), BAD).append(" → ").append(
                show_value(new), OK
            )
        if len(diff) > MAX_DIFF_LINES:
            text.append(f"\n  … and {len(diff) - MAX_DIFF_LINES} more", DIM)
        return text

    def _outcome(self, text: Text) -> None:
        self.query_one("#outcome", Static).update(text)

    # -- actions ---------------------------------------------------------------------------------
    def action_apply(self) -> None:
        t = self.selected()
        if self.readonly or self.applying is not None or t is None:
            return
        snap: Snapshot | None = getattr(self.app, "snapshot", None)
        running = snap.running if snap else None
        n = len(config_diff(t.config, running.get("config", {}))) if t.config and running else None
        changes = (
            f"{n} settings change." if n is not None else "The running configuration is unknown."
        )
        question = (
            f"Apply template [b]{t.name}[/b] to {getattr(self.app, 'url', 'the server')}?\n\n"
            "The server stops taking new requests, drains the ones in flight, restarts the "
            f"engine with this template and resumes. {changes}"
        )

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.apply(t.name, None, rollback=False)

        self.app.push_screen(ConfirmScreen(question, yes="Apply"), confirmed)

    def action_rollback(self) -> None:
        if self.readonly or self.applying is not None or self.previous is None:
            return
        template, overrides = self.previous
        question = f"Roll back to [b]{template or 'defaults'}[/b]" + (
            f" with overrides {overrides}?" if overrides else "?"
        )

        def confirmed(yes: bool | None) -> None:
            if yes and self.previous is not None:
                self.apply(template, overrides, rollback=True)

        self.app.push_screen(ConfirmScreen(question, yes="Roll back"), confirmed)

    def action_knob(self) -> None:
        if self.readonly or self.applying is not None:
            return

        def typed(line: str | None) -> None:
            if not line:
                return
            try:
                knobs = parse_knobs(line)
            except ConfigError as exc:
                self._outcome(Text(f"✗ {exc}", BAD))
                return
            snap: Snapshot | None = getattr(self.app, "snapshot", None)
            running = snap.running if snap else None
            lines = "\n".join(
                f"  {key}: {show_value(running_value(running, key))} → {show_value(value)}"
                for key, value in knobs.items()
            )
            question = (
                f"Change live knobs on {getattr(self.app, 'url', 'the server')}?\n\n{lines}\n\n"
                "The engine takes them at its next step: nothing is drained or restarted."
            )

            def confirmed(yes: bool | None) -> None:
                if yes:
                    self.change_knobs(knobs)

            self.app.push_screen(ConfirmScreen(question, yes="Change"), confirmed)

        prompt = (
            "Live knob (scheduler limits, preemption, per-class timeouts and SLOs), as\n"
            "KEY = VALUE[, KEY = VALUE]; Enter to review, Escape to cancel"
        )
        self.app.push_screen(InputScreen(prompt, KNOB_PLACEHOLDER), typed)

    @work(exclusive=True, group="knob")
    async def change_knobs(self, knobs: dict[str, Any]) -> None:
        app: Any = self.app
        try:
            result = await app.client.patch_config(patch_body(knobs))
        except ConsoleError as exc:
            self._outcome(Text.assemble(("✗ nothing changed: ", BAD), str(exc)))
            return
        changed = ", ".join(
            f"{c['key']} {show_value(c['before'])} → {show_value(c['after'])}"
            for c in result["changed"]
        )
        step = result.get("applied_after_step")
        when = f" from engine step {step + 1}" if step is not None else ""
        self._outcome(
            Text.assemble(("✓ ", OK), changed or "already so: nothing changed", (when, DIM))
        )
        await app.read_config_now()
        self.show(app.snapshot)

    @work(exclusive=True, group="apply")
    async def apply(
        self, template: str | None, overrides: dict[str, Any] | None, rollback: bool
    ) -> None:
        app: Any = self.app
        snap: Snapshot | None = app.snapshot
        before = (
            (snap.stats.config.template, dict(snap.stats.config.overrides))
            if snap and snap.stats
            else None
        )
        label = template or "defaults"
        self.applying = label
        self.add_class("-applying")
        self.refresh_bindings()
        self._outcome(Text(f"applying {label}: sent to the server …", WARN))
        t0 = time.monotonic()
        try:
            result = await app.client.reload(template, overrides, rollback=rollback)
        except ConsoleError as exc:
            self._outcome(
                Text.assemble(
                    ("✗ apply failed", BAD),
                    f" after {secs(time.monotonic() - t0)}; ",
                    ("the previous configuration is still running", "bold"),
                    f".\n{exc}",
                )
            )
        else:
            took = result.get("seconds", time.monotonic() - t0)
            self.previous = before
            what = "rolled back to" if rollback else "applied"
            back = (
                f" · b rolls back to {before[0] or 'defaults'}"
                if before and not self.readonly
                else ""
            )
            self._outcome(Text.assemble(("✓ ", OK), f"{what} {label} in {secs(took)}", (back, DIM)))
        finally:
            self.applying = None
            self.remove_class("-applying")
            self.refresh_bindings()
            app.refresh_now()
            # The running config is re-read when the engine generation changes; give it a beat.
            await asyncio.sleep(0)
