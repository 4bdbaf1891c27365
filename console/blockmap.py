"""The KV block map: one cell per block coloured by state, downsampled when blocks outnumber
the cells the widget has (tens of thousands of blocks on a large GPU).

Two sources, said on screen which one is in use:
- per-block states, one character per block id ("U" used, "C" cached, "F" free), when the
  server sends `EngineStats.block_states`;
- otherwise the used / cached / free counts, drawn as three contiguous regions: the proportions
  are true, the positions are not (it cannot show fragmentation).
"""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

USED, CACHED, FREE, NONE = "U", "C", "F", " "
# Glyphs differ as well as colours, so the map reads on a monochrome terminal and in tests.
GLYPHS = {USED: ("█", "#e06c75"), CACHED: ("▒", "#e5c07b"), FREE: ("·", "#5c8a5c"), NONE: (" ", "")}
LEGEND = Text.assemble(
    ("█", GLYPHS[USED][1]),
    " used  ",
    ("▒", GLYPHS[CACHED][1]),
    " cached  ",
    ("·", GLYPHS[FREE][1]),
    " free",
)


def _majority(used: int, cached: int, free: int) -> str:
    if used == cached == free == 0:
        return NONE
    # Ties go to the busier state: a cell half used must not look free.
    best = max(used, cached, free)
    return USED if used == best else CACHED if cached == best else FREE


def cells_from_states(states: str, n_cells: int) -> list[str]:
    n = len(states)
    if n_cells <= 0:
        return []
    if n <= n_cells:
        return [s if s in GLYPHS else FREE for s in states.upper()] + [NONE] * (n_cells - n)
    out = []
    for i in range(n_cells):
        chunk = states[i * n // n_cells : (i + 1) * n // n_cells].upper()
        out.append(_majority(chunk.count(USED), chunk.count(CACHED), chunk.count(FREE)))
    return out


def cells_from_counts(used: int, cached: int, free: int, n_cells: int) -> list[str]:
    n = used + cached + free
    if n_cells <= 0:
        return []
    if n <= n_cells:
        return [USED] * used + [CACHED] * cached + [FREE] * free + [NONE] * (n_cells - n)
    edges = (0, used, used + cached, n)
    out = []
    for i in range(n_cells):
        a, b = i * n // n_cells, (i + 1) * n // n_cells
        overlap = [max(0, min(b, edges[k + 1]) - max(a, edges[k])) for k in range(3)]
        out.append(_majority(*overlap))
    return out


class BlockMap(Widget):
    DEFAULT_CSS = """
    BlockMap { height: 2; width: 1fr; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.states: str | None = None
        self.counts = (0, 0, 0)

    def show(self, states: str | None, used: int, cached: int, free: int) -> None:
        self.states, self.counts = states, (used, cached, free)
        self.refresh()

    @property
    def num_blocks(self) -> int:
        return len(self.states) if self.states is not None else sum(self.counts)

    def caption(self, n_cells: int | None = None) -> str:
        n_cells = n_cells or max(1, self.size.width * self.size.height)
        n = self.num_blocks
        scale = "1 block/cell" if n <= n_cells else f"≈{n / n_cells:.0f} blocks/cell"
        # Said on screen: a map drawn from counts shows proportions, not where blocks lie.
        source = "per block" if self.states is not None else "from counts"
        return f"{scale} · {source}"

    def render(self) -> Text:
        width, height = self.size.width, self.size.height
        n_cells = width * height
        if self.states is not None:
            cells = cells_from_states(self.states, n_cells)
        else:
            cells = cells_from_counts(*self.counts, n_cells)
        text = Text(no_wrap=True, overflow="crop")
        for row in range(height):
            if row:
                text.append("\n")
            line = cells[row * width : (row + 1) * width]
            start = 0
            # One segment per run of equal cells, not per cell: thousands of cells a second.
            for i in range(1, len(line) + 1):
                if i == len(line) or line[i] != line[start]:
                    glyph, style = GLYPHS[line[start]]
                    text.append(glyph * (i - start), style)
                    start = i
        return text
