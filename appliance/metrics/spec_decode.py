"""Speculative decoding's series under vLLM v1's names (vllm:spec_decode_*, counters without
`_total`, which prometheus_client appends; accepted tokens per draft position labelled
`position`), and the appliance's own gauge of the current decision."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from appliance.stats import SpecDecodeStats


class SpecDecodeMetrics:
    def __init__(self, reg: CollectorRegistry) -> None:
        m = ["model_name"]
        self.num_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", m, registry=reg
        )
        self.num_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", m, registry=reg
        )
        self.num_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Number of accepted tokens.",
            m,
            registry=reg,
        )
        self.accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*m, "position"],
            registry=reg,
        )
        self.drafting_rows = Gauge(
            "appliance_spec_decode_drafting_rows",
            "Decode rows that drafted in the last step (0: speculation off or not paying).",
            m,
            registry=reg,
        )
        # Last totals seen per series: an engine rebuilt (reload) restarts its counters at 0.
        self._last: dict[tuple[str, ...], float] = {}

    def prime(self, name: str) -> None:
        for counter in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens):
            counter.labels(name)
        self.drafting_rows.labels(name)

    def reset(self) -> None:
        self._last.clear()

    def _total(self, counter: Counter, labels: tuple[str, ...], total: float) -> None:
        key = (str(id(counter)), *labels)
        prev = self._last.get(key, 0.0)
        delta = total - prev if total >= prev else total  # below the last total: a restart
        if delta > 0:
            counter.labels(*labels).inc(delta)
        self._last[key] = total

    def update(self, name: str, s: SpecDecodeStats | None) -> None:
        if s is None:
            return
        self._total(self.num_drafts, (name,), s.num_drafts)
        self._total(self.num_draft_tokens, (name,), s.num_draft_tokens)
        self._total(self.num_accepted_tokens, (name,), s.num_accepted_tokens)
        for pos, n in enumerate(s.accepted_per_pos):
            self._total(self.accepted_per_pos, (name, str(pos)), n)
        self.drafting_rows.labels(name).set(s.drafting_rows)
