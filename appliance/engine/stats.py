"""Per-step records and the stats snapshot the API and console read."""

from __future__ import annotations

from collections import deque

import msgspec

from appliance.core.scheduler_stats import SchedulerCounters


class StepRecord(msgspec.Struct, kw_only=True, array_like=False):
    step: int
    time: float
    duration_s: float
    num_running: int
    num_waiting: int
    num_swapped: int
    num_seqs: int
    num_scheduled_tokens: int
    num_context_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    kv_usage: float
    # none | token_budget | max_num_seqs | kv_blocks
    bound_by: str


class EngineStats(msgspec.Struct, kw_only=True):
    model_name: str
    step: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_blocks: int
    block_size: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    kv_usage: float
    slots_holding_tokens: int
    slots_allocated: int
    slot_utilisation: float
    # Slot utilisation when the most blocks were in use (PagedAttention's waste figure).
    slot_utilisation_at_peak: float
    swap_blocks_total: int
    swap_blocks_used: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished: dict[str, int]
    counters: SchedulerCounters
    last_step: StepRecord | None
    # Per block id: U used, C cached (free, hit-able), F free; only when asked for (detail).
    block_states: str | None = None


class StepHistory:
    """The last `maxlen` step records (about a minute of steps for the console)."""

    def __init__(self, maxlen: int | None = 4096) -> None:
        self.records: deque[StepRecord] = deque(maxlen=maxlen)

    def append(self, record: StepRecord) -> None:
        self.records.append(record)

    def since(self, t: float) -> list[StepRecord]:
        return [r for r in self.records if r.time >= t]
