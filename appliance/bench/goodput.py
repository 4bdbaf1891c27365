"""Goodput for `appliance bench serve`: completed requests per second that met every SLO given,
as `vllm bench serve --goodput` counts them, with SLOs per kind of request (short, long).

`--slo-ttft-ms 2000` holds every request to 2 s; `--slo-ttft-ms 1000,long=20000` holds the
long ones to 20 s and the rest to 1 s; `--goodput ttft:1000 tpot:100` is vLLM's spelling
(every kind). A request with a single output token has no TPOT and meets any TPOT SLO (vLLM
counts its TPOT as 0); one refused or broken off meets none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.bench.serve import Result, Summary

# The metrics an SLO can bound, their flags and their names in vLLM's --goodput.
METRICS = ("ttft", "tpot", "e2e")
FLAGS = {"ttft": "--slo-ttft-ms", "tpot": "--slo-tpot-ms", "e2e": "--slo-e2e-ms"}
VLLM_NAMES = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e", "e2e": "e2e"}


class SLOError(ValueError):
    """A bad SLO flag; the message names the flag and the part of it that is wrong."""


def value_ms(r: Result, metric: str) -> float | None:
    v = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}[metric]
    return None if v is None else v * 1000


@dataclass
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def limit(self, metric: str) -> float | None:
        limit: float | None = getattr(self, f"{metric}_ms")
        return limit

    def limits(self) -> dict[str, float]:
        return {m: v for m in METRICS if (v := self.limit(m)) is not None}

    def misses(self, r: Result) -> list[str]:
        """The metrics of a completed request that are over their limits."""
        out = []
        for metric, limit in self.limits().items():
            v = value_ms(r, metric)
            if v is None and metric == "tpot":
                continue  # one output token: no time per output token to hold to a limit
            if v is None or v > limit:
                out.append(metric)
        return out

    def met(self, r: Result) -> bool:
        return r.ok and not self.misses(r)


@dataclass
class SLOs:
    """The SLO of each kind of request; a kind not named in `kinds` is held to `default`."""

    default: SLO = field(default_factory=SLO)
    kinds: dict[str, SLO] = field(default_factory=dict)

    def of(self, kind: str) -> SLO:
        return self.kinds.get(kind, self.default)

    def given(self) -> bool:
        return bool(self.default.limits()) or any(s.limits() for s in self.kinds.values())

    def describe(self) -> str:
        """`TTFT <= 1000 ms (long 20000 ms); TPOT <= 100 ms`: for titles and table headers."""
        parts = []
        for metric in METRICS:
            base = self.default.limit(metric)
            other = {
                k: v
                for k, s in self.kinds.items()
                if (v := s.limit(metric)) is not None and v != base
            }
            if base is None and not other:
                continue
            each = ", ".join(f"{k} {v:g} ms" for k, v in other.items())
            if base is None:
                parts.append(f"{metric.upper()}: {each}")
            else:
                parts.append(f"{metric.upper()} <= {base:g} ms" + (f" ({each})" if each else ""))
        return "; ".join(parts) or "none"


def _ms(flag: str, part: str, text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise SLOError(f"{flag}: {part!r}: {text!r} is not a number of milliseconds") from None
    if not math.isfinite(v) or v <= 0:
        raise SLOError(f"{flag}: {part!r}: an SLO must be a number of milliseconds > 0")
    return v


def parse_per_kind(flag: str, text: str, kinds: list[str]) -> dict[str | None, float]:
    """`1000`, `short=1000,long=20000` or `1000,long=20000` (every kind 1000 ms, long 20000):
    {None: default, kind: limit}."""
    out: dict[str | None, float] = {}
    for part in text.split(","):
        part = part.strip()
        kind, eq, ms = part.rpartition("=")
        key: str | None = kind.strip() if eq else None
        if not ms.strip():
            raise SLOError(f"{flag}: {part!r}: expected MS or KIND=MS (kinds: {', '.join(kinds)})")
        if key is not None and key not in kinds:
            raise SLOError(
                f"{flag}: {part!r}: no kind {key!r} in this profile (kinds: {', '.join(kinds)})"
            )
        if key in out:
            raise SLOError(f"{flag}: {part!r}: {key or 'the default'} is given twice")
        out[key] = _ms(flag, part, ms.strip())
    return out


def parse_slos(
    ttft: str | None,
    tpot: str | None,
    e2e: str | None,
    goodput: list[str] | None,
    kinds: list[str],
) -> SLOs:
    """The SLOs of --slo-ttft-ms / --slo-tpot-ms / --slo-e2e-ms and of vLLM's --goodput."""
    given: dict[str, dict[str | None, float]] = {}
    for metric, text in zip(METRICS, (ttft, tpot, e2e), strict=True):
        if text is not None:
            given[metric] = parse_per_kind(FLAGS[metric], text, kinds)
    for part in goodput or []:
        name, colon, ms = part.partition(":")
        m = VLLM_NAMES.get(name.strip().lower())
        if not colon or m is None:
            raise SLOError(f"--goodput: {part!r}: expected KEY:MS with KEY one of ttft, tpot, e2el")
        if m in given:
            raise SLOError(
                f"--goodput: {part!r}: the {m.upper()} SLO is already given "
                f"(by {FLAGS[m]} or an earlier {name.strip()}:)"
            )
        given[m] = {None: _ms("--goodput", part, ms.strip())}

    def slo(kind: str | None) -> SLO:
        def get(metric: str) -> float | None:
            per = given.get(metric, {})
            return per.get(kind, per.get(None))

        return SLO(get("ttft"), get("tpot"), get("e2e"))

    return SLOs(slo(None), {k: slo(k) for k in kinds})


def count(results: list[Result], slos: SLOs) -> tuple[int, dict[str, dict[str, int]]]:
    """Requests that met every SLO of their kind, and per metric bounded (for any kind) how
    many completed requests met and missed it."""
    good = 0
    per: dict[str, dict[str, int]] = {}
    for r in results:
        if not r.ok:
            continue
        slo = slos.of(r.kind)
        misses = slo.misses(r)
        good += not misses
        for metric in slo.limits():
            c = per.setdefault(metric, {"met": 0, "missed": 0})
            c["missed" if metric in misses else "met"] += 1
    return good, {m: per[m] for m in METRICS if m in per}


def print_goodput(rows: list[tuple[str, Summary]], slos: SLOs) -> None:
    metrics = [m for m in METRICS if any(m in s.slo_counts for _, s in rows)]
    print(f"\ngoodput: requests that met every SLO ({slos.describe()})")
    head = f"{'':<16} {'reqs':>5} {'failed':>6} {'good':>5} {'goodput/s':>10}"
    head += "".join(f" {m.upper() + ' met/missed':>17}" for m in metrics)
    print(head)
    print("-" * len(head))
    for name, s in rows:
        line = f"{name:<16} {s.requests:>5} {s.requests - s.ok:>6} {s.good:>5} {s.goodput:>10.3f}"
        for m in metrics:
            c = s.slo_counts.get(m)
            cell = f"{c['met']}/{c['missed']}" if c else "-"
            line += f" {cell:>17}"
        print(line)
