"""`appliance bench pool`: goodput pooled over several `bench serve --json-out` reports per
server, and each server's pooled goodput against a baseline's.

One run of 48 requests is one draw of the load: with the same profile and rate, one seed's
summaries arrive spread out and another's in a burst that overloads a small box, and the two
runs' goodput ratios between two servers differ by 2x. Pooling several seeds per server counts
what a longer run would: the good requests of all its runs over the sum of their durations
(each run's `summary.seconds`, from its first arrival to its last request's end), so a seed
that lasts longer weighs more, as it would inside one long run.

Pooled goodput compares servers only on the same loads under the same SLOs: every group must
hold the same loads (profile, arrival, rate, seed, request count) as the first, and every
report the same SLOs; otherwise the error names the report and what differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass

import msgspec

from appliance.bench.serve import Result, pct


class PoolError(ValueError):
    """Reports that cannot be pooled or compared; the message names the file and the field."""


class RequestRecord(msgspec.Struct):
    """The fields of one request of a report that its SLOs are checked on."""

    index: int
    prompt_tokens: int
    output_tokens: int
    status: int | str
    ttft_s: float | None
    e2e_s: float | None
    kind: str = ""
    priority_class: str = ""

    def result(self) -> Result:
        return Result(
            index=self.index,
            priority_class=self.priority_class,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            status=self.status,
            ttft_s=self.ttft_s,
            e2e_s=self.e2e_s,
            kind=self.kind,
        )


class RunCounts(msgspec.Struct):
    """The part of a `bench serve` summary (the whole run's, or one kind's) that pooling needs."""

    requests: int
    good: int
    seconds: float


class ServeReport(msgspec.Struct):
    """The fields of a `bench serve --json-out` report that pooling reads (others are ignored)."""

    profile: str
    arrival: str
    rate: float
    num_requests: int
    seed: int
    slo: dict[str, float | None]
    summary: RunCounts
    slo_per_kind: dict[str, dict[str, float | None]] = {}
    per_kind: dict[str, RunCounts] = {}
    # Each request's latencies (a report written before they were kept has none).
    requests: list[RequestRecord] = []

    def load(self) -> tuple[str, str, float, int, int]:
        """What makes two runs the same load: the same requests at the same arrival times."""
        rate = self.rate if self.arrival == "poisson" else 0.0
        return (self.profile, self.arrival, rate, self.seed, self.num_requests)

    def slos(self) -> str:
        return json.dumps({"slo": self.slo, "slo_per_kind": self.slo_per_kind}, sort_keys=True)


@dataclass(frozen=True)
class Run:
    path: str
    report: ServeReport

    def results(self) -> list[Result]:
        """The run's requests as `bench serve` recorded them (none where the report keeps
        none)."""
        return [r.result() for r in self.report.requests]


def read_report(path: str) -> Run:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise PoolError(f"{path}: cannot read it ({exc.strerror})") from exc
    try:
        report = msgspec.json.decode(data, type=ServeReport)
    except msgspec.ValidationError as exc:
        raise PoolError(f"{path}: not a `bench serve --json-out` report: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise PoolError(f"{path}: not JSON: {exc}") from exc
    if report.summary.seconds <= 0:
        raise PoolError(f"{path}: summary.seconds is {report.summary.seconds}, not above 0")
    return Run(path, report)


# Printed under a table with an "at most" figure (`bench pool`, `bench slo-scale`).
AT_MOST_NOTE = "(at most: the ratio were every one of a group's requests good, in its seconds)"


def ceiling_ratio(requests: int, seconds: float, base_goodput: float) -> float | None:
    """The most a server's goodput could be against a baseline's: every one of its `requests`
    good, in its runs' `seconds`. Where the baseline meets most of the SLOs this bounds the
    ratio whatever the server does. None where the baseline has no good request."""
    return requests / seconds / base_goodput if base_goodput > 0 else None


@dataclass(frozen=True)
class Pooled:
    """One server's runs, pooled: good requests over the runs' total seconds."""

    name: str
    runs: tuple[Run, ...]

    @property
    def seconds(self) -> float:
        return sum(r.report.summary.seconds for r in self.runs)

    @property
    def good(self) -> int:
        return sum(r.report.summary.good for r in self.runs)

    @property
    def requests(self) -> int:
        return sum(r.report.summary.requests for r in self.runs)

    @property
    def goodput(self) -> float:
        return self.good / self.seconds

    def ceiling_vs(self, base: Pooled) -> float | None:
        return ceiling_ratio(self.requests, self.seconds, base.goodput)

    @property
    def attainment(self) -> float:
        """The share of requests sent that met every SLO."""
        return self.good / self.requests if self.requests else 0.0

    def kinds(self) -> list[str]:
        return sorted({k for r in self.runs for k in r.report.per_kind})

    def kind_goodput(self, kind: str) -> tuple[int, int, float]:
        """(good, requests, goodput) of one kind of request over all the runs' seconds."""
        counts = [r.report.per_kind.get(kind) for r in self.runs]
        good = sum(c.good for c in counts if c is not None)
        requests = sum(c.requests for c in counts if c is not None)
        return good, requests, good / self.seconds


def pool(groups: list[tuple[str, list[str]]]) -> list[Pooled]:
    """Reads each group's reports and checks that they can be compared (same SLOs everywhere,
    the same loads in every group)."""
    if not groups:
        raise PoolError("--reports: give at least one group: --reports NAME FILE [FILE ...]")
    names = [name for name, _ in groups]
    if dup := sorted(n for n, c in Counter(names).items() if c > 1):
        raise PoolError(f"--reports: the group name {dup[0]!r} is given twice")
    pooled = [Pooled(name, tuple(read_report(p) for p in paths)) for name, paths in groups]
    first = pooled[0].runs[0]
    for group in pooled:
        for run in group.runs:
            if run.report.slos() != first.report.slos():
                raise PoolError(
                    f"{run.path}: its SLOs {run.report.slos()} differ from {first.path}'s "
                    f"{first.report.slos()}; goodput under other SLOs is another measure"
                )
    loads = Counter(r.report.load() for r in pooled[0].runs)
    for group in pooled[1:]:
        other = Counter(r.report.load() for r in group.runs)
        if other != loads:
            missing = sorted((loads - other).elements())
            extra = sorted((other - loads).elements())
            raise PoolError(
                f"--reports {group.name}: its loads (profile, arrival, rate, seed, requests) "
                f"differ from {pooled[0].name}'s: missing {missing}, extra {extra}"
            )
    return pooled


QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class PooledLatency:
    """One server's completed requests of one kind over all its runs. One 48-request run has
    ~39 chats, whose p99 is its slowest chat; five runs' 190 put two chats above the p99."""

    group: str
    kind: str
    requests: int
    ttft_ms: tuple[float, ...]
    tpot_ms: tuple[float, ...]

    def at(self, metric: str, q: float) -> float | None:
        """The q-th percentile of "ttft" or "tpot", as `bench serve` computes its own."""
        return pct(list(self.ttft_ms if metric == "ttft" else self.tpot_ms), q)


def pooled_latency(pooled: list[Pooled]) -> list[PooledLatency]:
    """Every group's latencies per kind, from its reports' requests (none where a report keeps
    none)."""
    out = []
    for g in pooled:
        done = [r for run in g.runs for r in run.results() if r.ok]
        for kind in sorted({r.kind for r in done}):
            mine = [r for r in done if r.kind == kind]
            out.append(
                PooledLatency(
                    g.name,
                    kind,
                    len(mine),
                    tuple(1000 * r.ttft_s for r in mine if r.ttft_s is not None),
                    tuple(1000 * t for r in mine if (t := r.tpot_s) is not None),
                )
            )
    return out


def _ratio(mine: float | None, base: float | None) -> float | None:
    return None if mine is None or not base else mine / base


def print_latency(latency: list[PooledLatency], baseline: str | None) -> None:
    if not latency:
        return
    base = {x.kind: x for x in latency if x.group == baseline}
    cols = [(m, q) for m in ("ttft", "tpot") for q in QUANTILES]
    print()
    print("pooled latency per kind, ms (percentiles over every run's completed requests)")
    head = f"{'pooled':<14} {'kind':<8} {'reqs':>5}"
    head += "".join(f" {f'{m.upper()} p{q}':>10}" for m, q in cols)
    if base:
        head += f" {'TTFT p99 vs ' + str(baseline):>22} {'TPOT p99 vs ' + str(baseline):>22}"
    print(head)
    print("-" * len(head))
    for x in latency:
        line = f"{x.group:<14} {x.kind or '-':<8} {x.requests:>5}"
        line += "".join(f" {_fmt(x.at(m, q)):>10}" for m, q in cols)
        if base and (b := base.get(x.kind)) is not None:
            for m in ("ttft", "tpot"):
                r = _ratio(x.at(m, 99), b.at(m, 99))
                line += f" {'-' if r is None else f'{r:.2f}x':>22}"
        print(line)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def latency_json(latency: list[PooledLatency], group: str, baseline: str | None) -> dict:
    base = {x.kind: x for x in latency if x.group == baseline}
    out: dict[str, dict[str, object]] = {}
    for x in latency:
        if x.group != group:
            continue
        entry: dict[str, object] = {"requests": x.requests}
        for m in ("ttft", "tpot"):
            entry[f"{m}_ms"] = {f"p{q}": _round(x.at(m, q)) for q in QUANTILES}
            b = base.get(x.kind)
            ratio = _ratio(x.at(m, 99), b.at(m, 99)) if b is not None else None
            entry[f"{m}_p99_vs_baseline"] = _round(ratio, 3)
        out[x.kind] = entry
    return out


def _round(v: float | None, digits: int = 2) -> float | None:
    return None if v is None else round(v, digits)


def print_pool(pooled: list[Pooled], baseline: str | None) -> None:
    head = (
        f"{'group':<14} {'profile':<8} {'rate':>6} {'seed':>5} {'good':>5} {'reqs':>5} "
        f"{'seconds':>8} {'goodput/s':>10}"
    )
    print(head)
    print("-" * len(head))
    for group in pooled:
        for run in group.runs:
            r = run.report
            rate = f"{r.rate:g}" if r.arrival == "poisson" else "burst"
            print(
                f"{group.name:<14} {r.profile:<8} {rate:>6} {r.seed:>5} {r.summary.good:>5} "
                f"{r.summary.requests:>5} {r.summary.seconds:>8.1f} "
                f"{r.summary.good / r.summary.seconds:>10.3f}"
            )
    base = next((g for g in pooled if g.name == baseline), None)
    kinds = sorted({k for g in pooled for k in g.kinds()})
    print()
    head = f"{'pooled':<14} {'runs':>4} {'good':>5} {'reqs':>5} {'met %':>6} {'seconds':>8} {'goodput/s':>10}"
    head += "".join(f" {k + ' good/s':>12}" for k in kinds)
    if base is not None:
        head += f" {'vs ' + base.name:>14} {'at most':>8}"
    print(head)
    print("-" * len(head))
    for g in pooled:
        line = (
            f"{g.name:<14} {len(g.runs):>4} {g.good:>5} {g.requests:>5} "
            f"{100 * g.attainment:>6.1f} {g.seconds:>8.1f} {g.goodput:>10.3f}"
        )
        line += "".join(f" {g.kind_goodput(k)[2]:>12.3f}" for k in kinds)
        if base is not None:
            ratio = f"{g.goodput / base.goodput:.2f}x" if base.goodput > 0 else "-"
            ceiling = g.ceiling_vs(base)
            line += f" {ratio:>14} {'-' if ceiling is None else f'{ceiling:.2f}x':>8}"
        print(line)
    if base is not None:
        print(AT_MOST_NOTE)
    print_latency(pooled_latency(pooled), baseline)


def as_json(pooled: list[Pooled], baseline: str | None) -> str:
    base = next((g for g in pooled if g.name == baseline), None)
    latency = pooled_latency(pooled)
    return json.dumps(
        {
            g.name: {
                "runs": [r.path for r in g.runs],
                "good": g.good,
                "requests": g.requests,
                "seconds": round(g.seconds, 3),
                "goodput": round(g.goodput, 4),
                "attainment": round(g.attainment, 4),
                "per_kind": {
                    k: dict(zip(("good", "requests", "goodput"), g.kind_goodput(k), strict=True))
                    for k in g.kinds()
                },
                "vs_baseline": (
                    round(g.goodput / base.goodput, 3) if base and base.goodput > 0 else None
                ),
                "ceiling_vs_baseline": _round(g.ceiling_vs(base), 3) if base else None,
                "latency": latency_json(latency, g.name, baseline),
            }
            for g in pooled
        }
    )


def add_report_groups(p: argparse.ArgumentParser, divided: str) -> None:
    """--reports NAME FILE... (repeated) and --baseline: the groups `bench pool` and
    `bench slo-scale` read."""
    p.add_argument(
        "--reports",
        nargs="+",
        action="append",
        metavar="NAME FILE",
        required=True,
        help="a group's name, then its reports (repeat for each server)",
    )
    p.add_argument("--baseline", help=f"the group the others' {divided} is divided by")


def report_groups(ns: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """The groups of add_report_groups' flags; PoolError names what is wrong with them."""
    groups: list[tuple[str, list[str]]] = []
    for group in ns.reports:
        if len(group) < 2:
            raise PoolError(f"--reports {group[0]} names no report file")
        groups.append((group[0], group[1:]))
    if ns.baseline is not None and ns.baseline not in {name for name, _ in groups}:
        raise PoolError(f"--baseline {ns.baseline!r} names no --reports group")
    return groups


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "pool",
        help="goodput pooled over `bench serve --json-out` reports of several seeds, per server",
    )
    add_report_groups(p, "pooled goodput")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    try:
        pooled = pool(report_groups(ns))
    except PoolError as exc:
        print(f"bench pool: {exc}", file=sys.stderr)
        return 2
    if ns.json:
        print(as_json(pooled, ns.baseline))
    else:
        print_pool(pooled, ns.baseline)
    return 0
