"""The engine's figures: the ring buffer of per-step records and the one function that builds
the stats snapshot (`snapshot`) that the console, `/admin/stats`, `/metrics` and the benchmarks
read. The snapshot's types are in appliance.stats (plain msgspec, no engine needed to read)."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from appliance.core.request import Request
from appliance.core.wait_estimate import estimated_wait_s
from appliance.stats import (
    EngineStats,
    LiveRequest,
    QueueInfo,
    StatsSnapshot,
    StepCostStats,
    StepRecord,
)

if TYPE_CHECKING:
    from appliance.engine.llm_engine import Engine


class StepHistory:
    """The last `maxlen` step records (about a minute of steps for the console)."""

    def __init__(self, maxlen: int | None = 4096) -> None:
        self.records: deque[StepRecord] = deque(maxlen=maxlen)

    def append(self, record: StepRecord) -> None:
        self.records.append(record)

    def since(self, t: float) -> list[StepRecord]:
        return [r for r in self.records if r.time >= t]


def snapshot(engine: Engine, history_s: float = 0.0, detail: bool = False) -> StatsSnapshot:
    """Everything the engine reports, at this moment. `history_s`: seconds of step records to
    include (0: none, for a metrics scrape); `detail`: the block map, the preemption log, the
    live requests and the queues (the console's and /admin/stats' extras)."""
    snap = StatsSnapshot(engine=_engine_stats(engine, detail))
    if history_s > 0:
        snap.history = engine.history.since(time.time() - history_s)
    if detail:
        snap.preemptions = list(engine.scheduler.preemption_log)
        snap.requests = _live_requests(engine)
        snap.queues = _queues(engine)
    return snap


def _engine_stats(engine: Engine, detail: bool) -> EngineStats:
    kv = engine.kv
    usage = kv.usage()
    sched = engine.scheduler
    return EngineStats(
        model_name=engine.model_name,
        step=engine.step_count,
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_swapped=len(sched.swapped),
        num_blocks=usage.num_blocks,
        block_size=kv.block_size,
        blocks_used=usage.used,
        blocks_cached=usage.cached_free,
        blocks_free=usage.free,
        kv_usage=usage.usage,
        slots_holding_tokens=usage.slots_holding_tokens,
        slots_allocated=usage.slots_allocated,
        slot_utilisation=usage.slot_utilisation,
        slot_utilisation_at_peak=engine.slot_utilisation_at_peak,
        swap_blocks_total=usage.swap_blocks_total,
        swap_blocks_used=usage.swap_blocks_used,
        prefix_cache_queries=kv.prefix_queries,
        prefix_cache_hits=kv.prefix_hits,
        prompt_tokens_total=engine.prompt_tokens_total,
        generation_tokens_total=engine.generation_tokens_total,
        requests_finished=dict(engine.requests_finished),
        counters=sched.counters,
        last_step=engine.history.records[-1] if engine.history.records else None,
        block_states=kv.pool.state_string() if detail else None,
        step_cost=StepCostStats(**sched.cost.describe()),
        spec_decode=sched.spec.stats,
        max_loras=engine.config.lora.max_loras if engine.runner.lora is not None else 0,
        lora_running=_per_adapter(sched.running),
        lora_waiting=_per_adapter(sched.waiting + sched.swapped),
        lora_adapters=engine.lora_adapters(),
        lora_resident=sched.lora_slots.resident(),
    )


def _per_adapter(requests: list[Request]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_name:
            counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
    return counts


def _live_requests(engine: Engine) -> list[LiveRequest]:
    now = time.monotonic()
    return [
        LiveRequest(
            request_id=req.request_id,
            priority_class=req.priority_class,
            priority=req.priority,
            status=req.status.value,
            prompt_tokens=req.num_prompt_tokens,
            output_tokens=req.num_output_tokens,
            blocks_held=len(req.blocks),
            age_s=now - req.arrival_time,
            num_preemptions=req.num_preemptions,
        )
        for req in engine.scheduler.requests.values()
    ]


def _queues(engine: Engine) -> list[QueueInfo]:
    now = time.monotonic()
    cfg = engine.config
    sched = engine.scheduler
    waiting = sched.waiting
    free_slots = cfg.scheduler.max_num_seqs - len(sched.running)
    rate = engine.departures.rate
    out = []
    for name, cls in sorted(cfg.priority_classes.items(), key=lambda kv: kv[1].priority):
        queued = [r for r in waiting if r.priority_class == name]
        # Served before a new arrival of this class, as the policy says (the API's
        # estimated-wait check asks the same rule).
        ahead = sum(1 for r in waiting if sched.policy.counts_ahead(r.priority, cls.priority))
        limits = cfg.class_limits(name)
        out.append(
            QueueInfo(
                priority_class=name,
                waiting=len(queued),
                oldest_wait_s=max((now - r.arrival_time for r in queued), default=0.0),
                queue_timeout_s=limits.queue_timeout_s,
                max_waiting_requests=limits.max_waiting_requests,
                estimated_wait_s=estimated_wait_s(ahead, free_slots, rate),
            )
        )
    return out
