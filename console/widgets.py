"""Small text renderers (bars, sparklines, histograms) and the status line every screen shows.

Drawn as Rich text rather than separate widgets so a panel stays a few lines high at 80x24 and
its figures stay readable in an SVG screenshot (text, not shapes).
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import Static

SPARK = "▁▂▃▄▅▆▇█"
OK, WARN, BAD, DIM = "#98c379", "#e5c07b", "#e06c75", "#7f848e"


def bar(parts: Sequence[tuple[int, str, str]], width: int) -> Text:
    """A stacked bar: (count, glyph, style) parts filling `width` cells in proportion."""
    total = sum(n for n, _, _ in parts)
    text = Text(no_wrap=True)
    if total <= 0 or width <= 0:
        return text.append("·" * max(width, 0), DIM)
    done = 0
    acc = 0
    for n, glyph, style in parts:
        acc += n
        cells = round(acc * width / total) - done  # cumulative rounding: widths add up exactly
        text.append(glyph * cells, style)
        done += cells
    return text


def meter(fraction: float, width: int, warn: float = 0.75, bad: float = 0.9) -> Text:
    fraction = min(max(fraction, 0.0), 1.0)
    style = BAD if fraction >= bad else WARN if fraction >= warn else OK
    filled = round(fraction * width)
    return Text.assemble(("█" * filled, style), ("·" * (width - filled), DIM))


def spark(values: Sequence[float | None], width: int, style: str = OK) -> Text:
    """The last `width` values as ▁..█ scaled to their maximum; None (no data) as a space."""
    vals: list[float | None] = list(values)[-width:] if width > 0 else []
    pad: list[float | None] = [None] * (width - len(vals))
    vals = pad + vals
    top = max((v for v in vals if v is not None), default=0.0)
    out = []
    for v in vals:
        if v is None:
            out.append(" ")
        elif top <= 0:
            out.append(SPARK[0])
        else:
            out.append(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))])
    return Text("".join(out), style=style, no_wrap=True)


def hbars(rows: Sequence[tuple[str, int]], width: int, style: str = OK) -> Text:
    """A histogram as one labelled horizontal bar per row."""
    label_w = max((len(label) for label, _ in rows), default=0)
    count_w = max((len(str(n)) for _, n in rows), default=1)
    bar_w = max(1, width - label_w - count_w - 2)
    top = max((n for _, n in rows), default=0)
    text = Text(no_wrap=True, overflow="crop")
    for i, (label, n) in enumerate(rows):
        if i:
            text.append("\n")
        filled = round(n / top * bar_w) if top else 0
        if n and not filled:
            filled = 1  # a bin with steps is never drawn empty
        text.append(f"{label:>{label_w}} ", DIM)
        text.append("█" * filled, style)
        text.append(" " * (bar_w - filled))
        text.append(f" {n:>{count_w}}")
    return text


def secs(s: float | None) -> str:
    """A latency or age in the unit an operator reads fastest."""
    if s is None:
        return "–"
    if s < 1.0:
        return f"{s * 1000:.0f}ms"
    if s < 120:
        return f"{s:.1f}s"
    return f"{s / 60:.0f}m"


def gib(n: float) -> str:
    return f"{n / 1024**3:.1f}G"


def rate(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


class StatusLine(Static):
    """One line: what the console is connected to, or why it is not, in words."""

    DEFAULT_CSS = """
    StatusLine { height: 1; width: 1fr; background: $boost; padding: 0 1; }
    /* An error is the one thing worth more than a line: shown whole, up to three lines. */
    StatusLine.-error { background: $error 40%; height: auto; max-height: 3; }
    StatusLine.-warn { background: $warning 30%; }
    """
