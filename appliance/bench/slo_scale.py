"""`appliance bench slo-scale`: each server's goodput as its SLOs tighten, from the requests of
`bench serve --json-out` reports: every latency limit the reports were run with, times a factor
(DistServe's "SLO scale", OSDI '24), for the kinds `--kinds` names (default: all).

Goodput at one set of SLOs says little where both servers meet them all: at 1 s / 100 ms for
a chat, a server whose chats see 20 ms a token and one whose chats see 40 ms tie, and the best
server's goodput is bounded by the load's own rate. Scaled down, the limits find how tight a
target each server still meets, and at which the one serves how many times the other's good
requests. The reports are grouped and checked as `bench pool` does (the same loads in every
group, the same SLOs in every report), and pooled the same way: good requests over the runs'
seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from appliance.bench.goodput import METRICS, SLO, SLOs, count
from appliance.bench.pool import (
    AT_MOST_NOTE,
    Pooled,
    PoolError,
    add_report_groups,
    ceiling_ratio,
    pool,
    report_groups,
)

DEFAULT_SCALES = (2.0, 1.5, 1.0, 0.75, 0.5, 0.4, 0.3, 0.25, 0.2)


def stated_slos(group: Pooled) -> SLOs:
    """The SLOs the reports were run with (`bench pool` checked that they agree)."""
    report = group.runs[0].report
    return SLOs(SLO(**report.slo), {kind: SLO(**slo) for kind, slo in report.slo_per_kind.items()})


def scaled(slos: SLOs, factor: float, kinds: frozenset[str] | None) -> SLOs:
    """Every limit of the kinds in `kinds` (None: every kind, and the default) times `factor`."""

    def times(slo: SLO) -> SLO:
        return SLO(*(v * factor if (v := slo.limit(m)) is not None else None for m in METRICS))

    return SLOs(
        slos.default if kinds is not None else times(slos.default),
        {k: times(s) if kinds is None or k in kinds else s for k, s in slos.kinds.items()},
    )


@dataclass(frozen=True)
class Point:
    """One server's pooled goodput at one scale."""

    group: str
    scale: float
    good: int
    requests: int
    seconds: float

    @property
    def goodput(self) -> float:
        return self.good / self.seconds


def curve(
    pooled: list[Pooled], scales: list[float], kinds: frozenset[str] | None
) -> tuple[list[Point], SLOs]:
    """Every group's point at every scale, and the stated SLOs."""
    slos = stated_slos(pooled[0])
    if not slos.given():
        raise PoolError(
            f"{pooled[0].runs[0].path}: it was run without SLOs: nothing to scale "
            "(bench serve --slo-ttft-ms / --slo-tpot-ms)"
        )
    results = {run.path: run.results() for g in pooled for run in g.runs}
    if missing := next((p for p, r in results.items() if not r), None):
        raise PoolError(f"{missing}: it keeps no requests to check the SLOs on")
    points = []
    for factor in scales:
        at = scaled(slos, factor, kinds)
        for g in pooled:
            good = sum(count(results[run.path], at)[0] for run in g.runs)
            points.append(Point(g.name, factor, good, g.requests, g.seconds))
    return points, slos


def print_curve(
    points: list[Point], slos: SLOs, kinds: frozenset[str] | None, baseline: str | None
) -> None:
    groups = list(dict.fromkeys(p.group for p in points))
    scales = list(dict.fromkeys(p.scale for p in points))
    which = "every kind" if kinds is None else ", ".join(sorted(kinds))
    print(f"goodput/s (good of requests) with the SLOs of {which} times the scale")
    print(f"stated (scale 1): {slos.describe()}")
    others = [g for g in groups if g != baseline]
    head = f"{'scale':>6} {'SLOs scaled':<34}"
    head += "".join(f" {g:>20}" for g in groups)
    if baseline in groups:
        head += "".join(f" {g + ' vs ' + baseline + ' (at most)':>32}" for g in others)
    print(head)
    print("-" * len(head))
    for factor in scales:
        at = {p.group: p for p in points if p.scale == factor}
        shown = scaled(slos, factor, kinds)
        limits = "; ".join(
            f"{k} " + "/".join(f"{v:g}" for v in s.limits().values())
            for k, s in shown.kinds.items()
            if s.limits()
        ) or "/".join(f"{v:g}" for v in shown.default.limits().values())
        line = f"{factor:>6g} {limits:<34}"
        for g in groups:
            p = at[g]
            line += f" {p.goodput:>9.3f} ({p.good:>3}/{p.requests:<3})"
        if baseline in groups:
            base = at[baseline]
            for g in others:
                ceiling = ceiling_ratio(at[g].requests, at[g].seconds, base.goodput)
                ratio = f"{at[g].goodput / base.goodput:.2f}x" if base.good else "-"
                bound = "" if ceiling is None else f" ({ceiling:.2f}x)"
                line += f" {ratio + bound:>32}"
        print(line)
    print("(limits per kind as ttft/tpot/e2e ms where given)")
    if baseline in groups:
        print(AT_MOST_NOTE)


def plot_curve(points: list[Point], path: str, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for g in dict.fromkeys(p.group for p in points):
        mine = [p for p in points if p.group == g]
        ax.plot([p.scale for p in mine], [p.goodput for p in mine], marker="o", label=g)
    scales = sorted({p.scale for p in points})
    ax.set_xscale("log")
    ax.set_xticks(scales, [f"{v:g}" for v in scales])
    ax.minorticks_off()
    ax.invert_xaxis()
    ax.set_xlabel("SLO scale (the stated limits times this; tighter to the right)")
    ax.set_ylabel("goodput (good requests / s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "slo-scale",
        help="each server's goodput as the SLOs of `bench serve --json-out` reports tighten",
    )
    add_report_groups(p, "goodput")
    p.add_argument(
        "--scales",
        default=",".join(f"{s:g}" for s in DEFAULT_SCALES),
        help="comma-separated factors, each > 0 (default %(default)s)",
    )
    p.add_argument(
        "--kinds",
        help="comma-separated kinds whose SLOs are scaled (default: every kind's); "
        "the others keep their stated SLOs",
    )
    p.add_argument("--plot", metavar="FILE.png", help="draw goodput against the scale")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def parse_scales(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"--scales: {part.strip()!r} is not a number") from None
        if not v > 0 or v == float("inf"):
            raise ValueError(f"--scales: {part.strip()!r}: a scale must be a finite number > 0")
        out.append(v)
    return out


def main(ns: argparse.Namespace) -> int:
    try:
        groups = report_groups(ns)
        scales = parse_scales(ns.scales)
        pooled = pool(groups)
        kinds = None if ns.kinds is None else frozenset(k.strip() for k in ns.kinds.split(","))
        known = {k for g in pooled for run in g.runs for k in run.report.slo_per_kind}
        if kinds is not None and (unknown := sorted(kinds - known)):
            raise ValueError(
                f"--kinds: {unknown[0]!r} is not a kind of these reports "
                f"(kinds: {', '.join(sorted(known)) or 'none'})"
            )
        points, slos = curve(pooled, scales, kinds)
    except (PoolError, ValueError) as exc:
        print(f"bench slo-scale: {exc}", file=sys.stderr)
        return 2
    if ns.json:
        rounded = [
            {**asdict(p), "seconds": round(p.seconds, 3), "goodput": round(p.goodput, 4)}
            for p in points
        ]
        print(json.dumps(rounded))
    else:
        print_curve(points, slos, kinds, ns.baseline)
    if ns.plot:
        which = "every kind" if kinds is None else ", ".join(sorted(kinds))
        title = f"goodput as the SLOs of {which} tighten\n(scale 1: {slos.describe()})"
        plot_curve(points, ns.plot, title)
    return 0
