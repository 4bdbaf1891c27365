"""The dashboard's derived figures, as pure functions of what the server sent (no Textual here,
so they are testable on their own).

Time: step records and preemption events carry the server's Unix time; windows are measured
against the server's `AdminStats.time`, so a skewed console clock changes nothing.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence

from prometheus_client.parser import text_string_to_metric_families

from appliance.server.admin_schema import PreemptionEvent, StepRecord

WINDOW_S = 60.0
BOUNDS = ("token_budget", "time_budget", "max_num_seqs", "kv_blocks")
TTFT = "vllm:time_to_first_token_seconds"
# vLLM's TPOT: the time between two tokens of one request (inter-token latency).
TPOT = "vllm:inter_token_latency_seconds"
LATENCY_METRICS = (TTFT, TPOT)


class StepWindow:
    """The engine's step records of the last minute, merged from incremental polls.

    The console asks only for the last few seconds of history each second (a minute of steps
    is thousands of records on a GPU) and keeps the rest itself, keyed by step number.
    """

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.generation: int | None = None
        self._steps: dict[int, StepRecord] = {}

    def merge(self, history: Iterable[StepRecord], generation: int, now: float) -> None:
        if generation != self.generation:  # a reload rebuilt the engine: step numbers restart
            self._steps.clear()
            self.generation = generation
        for rec in history:
            self._steps[rec.step] = rec
        cutoff = now - self.window_s
        for step in [s for s, r in self._steps.items() if r.time < cutoff]:
            del self._steps[step]

    @property
    def steps(self) -> list[StepRecord]:
        return [self._steps[s] for s in sorted(self._steps)]

    @property
    def newest_time(self) -> float | None:
        return max((r.time for r in self._steps.values()), default=None)


def batch_bins(max_num_seqs: int) -> list[tuple[int, int]]:
    """Power-of-two bins of sequences per step up to max_num_seqs: 1, 2, 3-4, 5-8, ..."""
    bins: list[tuple[int, int]] = [(1, 1)]
    lo = 2
    while lo <= max(max_num_seqs, 1):
        hi = 2 if lo == 2 else lo * 2 - 2
        bins.append((lo, min(hi, max_num_seqs)))
        lo = hi + 1
    return bins


def batch_histogram(steps: Sequence[StepRecord], max_num_seqs: int) -> list[tuple[str, int]]:
    bins = batch_bins(max_num_seqs)
    counts = [0] * len(bins)
    for rec in steps:
        for i, (lo, hi) in enumerate(bins):
            if lo <= rec.num_seqs <= hi:
                counts[i] += 1
                break
        else:
            if rec.num_seqs > max_num_seqs:  # a reload lowered the limit mid-window
                counts[-1] += 1
    return [
        (str(lo) if lo == hi else f"{lo}-{hi}", n) for (lo, hi), n in zip(bins, counts, strict=True)
    ]


def bound_shares(steps: Sequence[StepRecord]) -> dict[str, float]:
    """Share of steps each limit bound (the rest were bound by nothing: not enough work)."""
    if not steps:
        return {}
    n = len(steps)
    shares = {b: sum(1 for r in steps if r.bound_by == b) / n for b in BOUNDS}
    shares["none"] = 1.0 - sum(shares.values())
    return shares


def tokens_per_second(
    steps: Sequence[StepRecord], now: float, seconds: int = int(WINDOW_S)
) -> tuple[list[float], list[float]]:
    """Prompt and generation tokens per second, one value per second, oldest first."""
    prompt = [0.0] * seconds
    gen = [0.0] * seconds
    for rec in steps:
        age = now - rec.time
        if 0 <= age < seconds:
            i = seconds - 1 - int(age)
            prompt[i] += rec.num_prompt_tokens
            gen[i] += rec.num_generation_tokens
    return prompt, gen


def recent_mean(values: Sequence[float], n: int = 5) -> float:
    """Tokens/s over the last n full seconds (the current second is still filling)."""
    tail = list(values[-n - 1 : -1]) if len(values) > n else list(values)
    return sum(tail) / len(tail) if tail else 0.0


def preemption_rate(
    events: Sequence[PreemptionEvent], now: float, window_s: float = WINDOW_S
) -> tuple[int, bool]:
    """Preemptions in the last window from the server's bounded log; True when the log's
    oldest entry is itself inside the window (the log overflowed: the count is a lower bound)."""
    recent = [e for e in events if now - e.time <= window_s]
    overflowed = bool(events) and len(recent) == len(events) and len(events) >= 256
    return len(recent), overflowed


def split_counts(by: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """ "mode/class" -> n into totals by mode and by class."""
    modes: dict[str, int] = {}
    classes: dict[str, int] = {}
    for key, n in by.items():
        mode, _, cls = key.partition("/")
        modes[mode] = modes.get(mode, 0) + n
        classes[cls or "?"] = classes.get(cls or "?", 0) + n
    return modes, classes


# -- latency quantiles from /metrics histograms ---------------------------------------------------

Buckets = list[tuple[float, float]]  # (upper bound, cumulative count), ascending


def parse_histograms(text: str, names: Sequence[str] = LATENCY_METRICS) -> dict[str, Buckets]:
    """Cumulative buckets of the named histograms, summed over their label sets."""
    out: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in names:
            continue
        acc = out.setdefault(family.name, {})
        for s in family.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                acc[le] = acc.get(le, 0.0) + s.value
    return {name: sorted(acc.items()) for name, acc in out.items()}


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket; None if empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):  # beyond the last finite bound: report that bound
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def bucket_delta(new: Buckets, old: Buckets) -> Buckets:
    old_map = dict(old)
    if any(count < old_map.get(le, 0.0) for le, count in new):
        return new  # the counters restarted (engine rebuilt or server restarted)
    return [(le, count - old_map.get(le, 0.0)) for le, count in new]


class LatencyWindow:
    """p50/p99 of TTFT and TPOT over a sliding window, one point per scrape, for sparklines."""

    def __init__(self, window_s: float = 30.0, points: int = 60) -> None:
        self.window_s = window_s
        self._scrapes: deque[tuple[float, dict[str, Buckets]]] = deque()
        self.series: dict[tuple[str, float], deque[float | None]] = {
            (name, q): deque(maxlen=points) for name in LATENCY_METRICS for q in (0.5, 0.99)
        }

    def add(self, t: float, metrics_text: str) -> None:
        hist = parse_histograms(metrics_text)
        self._scrapes.append((t, hist))
        while len(self._scrapes) > 2 and t - self._scrapes[1][0] >= self.window_s:
            self._scrapes.popleft()
        # Until a scrape a window old exists, the first one is the base; with a single scrape
        # the quantiles cover everything since the server started.
        base = self._scrapes[0][1] if len(self._scrapes) > 1 else {}
        for (name, q), series in self.series.items():
            window = bucket_delta(hist.get(name, []), base.get(name, []))
            series.append(histogram_quantile(q, window))

    def latest(self, name: str, q: float) -> float | None:
        series = self.series[(name, q)]
        return series[-1] if series else None
