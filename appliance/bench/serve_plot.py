"""`appliance bench serve --plot FILE.png`: each request's TTFT and TPOT over its arrival time,
coloured by kind, with the SLO lines, so that the tail shows at a glance.

Two panels share the x axis (scheduled arrival, s after the start): TTFT on top (log scale
when the values span more than 20x), TPOT below. Requests refused or broken off are red
crosses along the top of the TTFT panel. Drawn on a bare matplotlib Figure (the Agg renderer,
no pyplot and no display).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from appliance.bench.goodput import SLOs
    from appliance.bench.serve import Result

COLOURS = {"short": "tab:blue", "medium": "tab:green", "long": "tab:orange"}
OTHER_COLOURS = ["tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]


def kind_colours(kinds: list[str]) -> dict[str, str]:
    spare = iter(OTHER_COLOURS * (1 + len(kinds) // len(OTHER_COLOURS)))
    return {k: COLOURS.get(k) or next(spare) for k in kinds}


def _panel(
    ax: Axes,
    metric: str,
    results: list[Result],
    slos: SLOs,
    colours: dict[str, str],
) -> None:
    values: list[float] = []
    for kind, colour in colours.items():
        pts = [
            (r.arrival_s, v * 1000)
            for r in results
            if r.ok and r.kind == kind and (v := getattr(r, f"{metric}_s")) is not None
        ]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.scatter(
                xs, ys, s=12, color=colour, alpha=0.75, label=f"{kind or 'requests'} ({len(pts)})"
            )
            values.extend(ys)
    # One dashed line per SLO value: black where it holds every kind, else in the kind's colour.
    lines: dict[float, list[str]] = {}
    for kind in colours:
        limit = slos.of(kind).limit(metric)
        if limit is not None:
            lines.setdefault(limit, []).append(kind)
    for limit, kinds in lines.items():
        every = len(kinds) == len(colours)
        ax.axhline(
            limit,
            linestyle="--",
            linewidth=1.2,
            color="black" if every else colours[kinds[0]],
            label=f"SLO {limit:g} ms" + ("" if every else f" ({', '.join(kinds)})"),
        )
        values.append(limit)
    positive = [v for v in values if v > 0]
    if positive and max(positive) > 20 * min(positive):
        ax.set_yscale("log")
    ax.set_ylabel(f"{metric.upper()} (ms)")
    ax.grid(True, which="major", alpha=0.3)


def plot_results(results: list[Result], slos: SLOs, title: str, path: str | None) -> Figure:
    """Draws the figure, writes it to `path` (PNG) when given, and returns it."""
    from matplotlib.figure import Figure

    order = list(COLOURS)
    kinds = sorted(
        {r.kind for r in results}, key=lambda k: (order.index(k) if k in order else 9, k)
    )
    colours = kind_colours(kinds)
    fig = Figure(figsize=(10, 7), layout="constrained")
    ttft, tpot = fig.subplots(2, 1, sharex=True)
    _panel(ttft, "ttft", results, slos, colours)
    _panel(tpot, "tpot", results, slos, colours)
    failed = [r.arrival_s for r in results if not r.ok]
    if failed:
        # Along the top whatever the y scale: x in data, y in axes coordinates.
        ttft.scatter(
            failed,
            [0.97] * len(failed),
            transform=ttft.get_xaxis_transform(),
            marker="x",
            s=30,
            color="red",
            label=f"failed ({len(failed)})",
        )
    ok = sum(r.ok for r in results)
    ttft.set_title(
        f"{title}\n{ok} of {len(results)} completed; SLO: {slos.describe()}", fontsize=10
    )
    tpot.set_xlabel("arrival time (s)")
    for ax in (ttft, tpot):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    if path:
        fig.savefig(path, dpi=110)
    return fig
