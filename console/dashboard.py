"""The dashboard screen: six panels in a grid at 80x24, a large block map and an engine panel
when the terminal is at least 120x36."""

from __future__ import annotations

from collections.abc import Callable

from appliance.console import panels
from appliance.console.blockmap import BlockMap
from appliance.console.replicas import HOST_TITLE, REPLICAS_TITLE, host_or_replicas_text
from appliance.console.state import Snapshot, status_line
from appliance.console.widgets import StatusLine
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Container, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

WIDE_MIN = (120, 36)
NARROW_ROW_H = 7  # 3 rows of panels + status + footer = 23 lines: fits 80x24
WIDE_ROW_H = 11

Renderer = Callable[[Snapshot, int, int], Text]


class Panel(Static):
    DEFAULT_CSS = """
    Panel { border: round $primary 60%; border-title-color: $text; padding: 0 1; height: 1fr;
            text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(
        self, title: str, render_fn: Renderer, *, id: str | None = None, classes: str | None = None
    ) -> None:
        super().__init__(id=id, classes=classes)
        self.border_title = title
        self.render_fn = render_fn

    def show(self, snap: Snapshot) -> None:
        # Before the first layout the size is 0: assume the 80x24 column width.
        width = self.size.width or 36
        rows = self.size.height or NARROW_ROW_H - 2
        # Lines are cropped, never wrapped (CSS text-wrap): a wrapped line would push the
        # panel's last lines out of sight.
        self.update(self.render_fn(snap, width, rows))


class KVPanel(Container):
    DEFAULT_CSS = """
    KVPanel { border: round $primary 60%; border-title-color: $text; padding: 0 1; height: 1fr; }
    KVPanel > Static { height: 3; text-wrap: nowrap; text-overflow: ellipsis; }
    KVPanel > BlockMap { height: 1fr; }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="kv-text")
        yield BlockMap(id="blockmap")

    def on_mount(self) -> None:
        self.border_title = "KV cache"

    def show(self, snap: Snapshot) -> None:
        text = self.query_one("#kv-text", Static)
        width = text.size.width or 36
        text.update(panels.kv_text(snap, width))
        bm = self.query_one(BlockMap)
        e = snap.stats.engine if snap.stats else None
        if e is None:
            bm.show(None, 0, 0, 0)
            self.border_subtitle = ""
            return
        # `block_states` is not in the schema yet: read it when the server sends it.
        states = getattr(e, "block_states", None)
        bm.show(states, e.blocks_used, e.blocks_cached, e.blocks_free)
        self.border_subtitle = bm.caption()


class DashboardScreen(Screen[None]):
    DEFAULT_CSS = f"""
    DashboardScreen #grid {{ layout: grid; grid-size: 2; grid-rows: {NARROW_ROW_H}; height: auto; }}
    DashboardScreen #engine {{ display: none; }}
    DashboardScreen.-wide #grid {{ grid-size: 3; }}
    DashboardScreen.-wide #kv {{ column-span: 3; }}
    DashboardScreen.-wide #engine {{ display: block; }}
    """
    # The grid rows last set by _layout ("": none yet, the CSS's).
    _grid_rows = ""

    def compose(self) -> ComposeResult:
        yield StatusLine(id="status")
        with VerticalScroll(id="body"), Container(id="grid"):
            yield KVPanel(id="kv")
            yield Panel("Batch", panels.batch_text, id="batch")
            yield Panel("Preemptions", panels.preemption_text, id="preempt")
            yield Panel("Throughput · latency", panels.throughput_text, id="throughput")
            yield Panel("Why slow (last 60 s)", panels.slow_text, id="slow")
            yield Panel(HOST_TITLE, host_or_replicas_text, id="host")
            yield Panel("Engine", panels.engine_text, id="engine")
        yield Footer()

    def on_mount(self) -> None:
        self.watch(self.app, "snapshot", self.show)

    def on_resize(self) -> None:
        self._layout()
        self.call_after_refresh(self._redraw)

    def _layout(self) -> None:
        w, h = self.size
        wide = w >= WIDE_MIN[0] and h >= WIDE_MIN[1]
        self.set_class(wide, "-wide")
        if not wide:
            rows = f"{NARROW_ROW_H}"
        else:
            # The block map gets the rows its blocks need (one cell each while they fit), up to
            # what two rows of panels leave; the panels share the rest.
            snap = getattr(self.app, "snapshot", None)
            engine = snap.stats.engine if snap and snap.stats else None
            blocks = engine.num_blocks if engine else 0
            map_w = max(1, w - 4)
            most = max(2, h - 2 - 2 * WIDE_ROW_H - 5)
            kv_h = 5 + min(most, max(2, -(-blocks // map_w)))
            row_h = (h - 2 - kv_h) // 2
            rows = f"{kv_h} {row_h} {row_h}"
        # Re-layout only when the shape changes. (The styles give the rows back parsed, as
        # scalars: compared with this string they always differed.)
        if rows != self._grid_rows:
            self._grid_rows = rows
            self.query_one("#grid").styles.grid_rows = rows

    def _redraw(self) -> None:
        self.show(getattr(self.app, "snapshot", None))

    def show(self, snap: Snapshot | None) -> None:
        text, cls = status_line(snap)
        status = self.query_one(StatusLine)
        status.update(text)
        status.set_classes(cls)
        if snap is None:
            return
        self._layout()
        self.query_one(KVPanel).show(snap)
        self.query_one("#host", Panel).border_title = (
            REPLICAS_TITLE if snap.replicas is not None else HOST_TITLE
        )
        for panel in self.query(Panel):
            panel.show(snap)
