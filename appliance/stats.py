"""The stats snapshot's types: what the engine reports and the console, `/admin/stats`,
`/metrics` and the benchmarks read. Plain msgspec Structs, so that every reader (the console
included) imports them without the engine, torch or Litestar."""

from __future__ import annotations

from collections import Counter

import msgspec


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
    # Steps run while a prefill step was paused between two half-layers, for the requests that
    # outranked it (Scheduler.schedule_cut_in).
    cut_in_steps: int = 0
    # Steps of the running decodes that a paused prefill step left out
    # (scheduler.interleave_decodes).
    interleaved_decode_steps: int = 0
    # Decode rows of classes without a TPOT target left out of a chats' decode step for the
    # next one (scheduler.untimed_work_share).
    deferred_decode_rows: int = 0
    # Steps built without the share because a summary had waited past
    # scheduler.untimed_share_max_wait_s for its first token (core/untimed_share.py).
    untimed_share_suspended_steps: int = 0
    # Steps whose decodes' token interval stretched past their TPOT target, toward their
    # tpot_ceiling_ms, for a queued request's ttft_goal_s (core/first_token_goal.py).
    tpot_stretched_steps: int = 0

    def count_preemption(self, mode: str, priority_class: str) -> None:
        self.preemptions += 1
        key = f"{mode}/{priority_class}"
        self.preemptions_by[key] = self.preemptions_by.get(key, 0) + 1

    def count_rejected(self, priority_class: str, reason: str) -> None:
        key = f"{reason}/{priority_class}"
        self.rejected_by[key] = self.rejected_by.get(key, 0) + 1

    def by_mode(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for key, n in self.preemptions_by.items():
            out[key.split("/", 1)[0]] += n
        return dict(out)


class SpecDecodeStats(msgspec.Struct, kw_only=True):
    """Speculative decoding's totals (vLLM's spec_decode_* counters) and its current decision."""

    method: str = ""
    # Requests-steps that drafted, tokens drafted, drafted tokens accepted.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Accepted drafts by their position in the draft (index 0: the first drafted token).
    accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    # The last step's decision: requests that drafted / decode rows that could have.
    drafting_rows: int = 0
    decode_rows: int = 0
    # Why the last step drafted or not (adaptive: the cost model's verdict).
    decision: str = "off"

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafting request gained per step: 1 + accepted drafts (vLLM's figure)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


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


class StepCostStats(msgspec.Struct, kw_only=True):
    """The engine's cost model of a step on this box (core/step_cost.py), in readable units."""

    fitted: bool
    # Fitted from decode-only steps and steps with prefill: only then does it bound chunks.
    ready: bool
    observations: int
    step_ms: float
    decode_row_ms: float
    decode_context_us_per_token: float
    prefill_token_ms: float
    prefill_pair_ns: float
    mean_abs_error_ms: float
    # Once per step with any prefill (the torch forward instead of the fused native decode).
    prefill_step_ms: float = 0.0


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
    step_cost: StepCostStats | None = None
    # Speculative decoding's totals and current decision (None: an engine that reports none).
    spec_decode: SpecDecodeStats | None = None
    # LoRA (0 slots: off): requests per adapter, running and waiting; the adapters requests
    # may name, and which of them hold a device slot now.
    max_loras: int = 0
    lora_running: dict[str, int] = {}
    lora_waiting: dict[str, int] = {}
    lora_adapters: list[str] = []
    lora_resident: list[str] = []


class LiveRequest(msgspec.Struct, kw_only=True):
    """A request the engine holds (waiting, running, preempted or swapped)."""

    # The engine's id: the API request id plus "-<choice index>" (e.g. "cmpl-1a000012-0").
    request_id: str
    priority_class: str
    # Lower is more urgent.
    priority: int
    # waiting | running | preempted | swapped
    status: str
    prompt_tokens: int
    output_tokens: int
    # KV blocks on the device (a swapped request holds host swap blocks instead).
    blocks_held: int
    # Seconds since the request arrived at the API.
    age_s: float
    num_preemptions: int


class QueueInfo(msgspec.Struct, kw_only=True):
    """One priority class's waiting queue against its admission limits."""

    priority_class: str
    waiting: int
    # Age of the oldest waiting request (0 when none waits); compare with queue_timeout_s.
    oldest_wait_s: float
    # 0 = no timeout for this class.
    queue_timeout_s: float
    # 0 = unlimited.
    max_waiting_requests: int
    # How long a request of this class arriving now would wait to be scheduled, from the
    # requests queued ahead of it and the measured departure rate (core/wait_estimate.py);
    # None until enough requests have finished to measure it.
    estimated_wait_s: float | None = None


class StatsSnapshot(msgspec.Struct, kw_only=True):
    """What the engine reports at one moment (engine/stats.py `snapshot` builds it)."""

    engine: EngineStats
    # Step records of the asked-for window, oldest first.
    history: list[StepRecord] = []
    # The rest only in a detailed snapshot (the console's and /admin/stats').
    preemptions: list[PreemptionEvent] = []
    requests: list[LiveRequest] = []
    # One entry per priority class, most urgent first.
    queues: list[QueueInfo] = []


class ReplicaLoad(msgspec.Struct, kw_only=True):
    """What a cluster replica reports to the directory, several times a second, and what a
    cluster ingress lists at GET /cluster/replicas (the console reads it there)."""

    replica_id: str
    url: str
    # The appliance server's phase: only "ready" takes new requests.
    phase: str
    template: str
    num_waiting: int = 0
    num_running: int = 0
    # How long a request arriving now would wait to be scheduled (None: not measured yet).
    estimated_wait_s: float | None = None
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Which deployment (pool) the replica belongs to: "default" or "long".
    pool: str = "default"
    pid: int = 0
    node: str = ""
    reported_at: float = 0.0
