"""Counters and the preemption log the metrics and the console show."""

from __future__ import annotations

from collections import Counter

import msgspec

from appliance.core.request import FinishReason


class PreemptionEvent(msgspec.Struct, kw_only=True):
    time: float
    request_id: str
    priority_class: str
    priority: int
    mode: str  # swap | recompute
    # Swap was asked for but the swap pool was full: recomputed instead.
    swap_fallback: bool
    cause: str  # out_of_blocks | kv_pressure | max_num_seqs
    tokens_to_recompute: int
    blocks_swapped: int
    blocks_held: int
    kv_usage_before: float
    kv_usage_after: float
    times_preempted: int


class SchedulerCounters(msgspec.Struct, kw_only=True):
    preemptions: int = 0
    # "mode/class" -> count, e.g. "recompute/batch".
    preemptions_by: dict[str, int] = msgspec.field(default_factory=dict)
    swap_fallbacks: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    tokens_recomputed: int = 0
    # "reason/class" -> count, e.g. "queue_full/realtime".
    rejected_by: dict[str, int] = msgspec.field(default_factory=dict)
    time_preempted_s: float = 0.0

    def count_preemption(self, mode: str, priority_class: str) -> None:
        self.preemptions += 1
        key = f"{mode}/{priority_class}"
        self.preemptions_by[key] = self.preemptions_by.get(key, 0) + 1

    def count_rejected(self, priority_class: str, reason: FinishReason) -> None:
        key = f"{reason.value}/{priority_class}"
        self.rejected_by[key] = self.rejected_by.get(key, 0) + 1

    def by_mode(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for key, n in self.preemptions_by.items():
            out[key.split("/", 1)[0]] += n
        return dict(out)
