"""Prometheus metrics under vLLM v1's names, so dashboards written for vLLM work unchanged.

One CollectorRegistry per app instance (tests run several). Counters are registered without
`_total` (prometheus_client appends it, as vLLM's exposition has it). Request-level figures are
observed in the API process as outputs stream by; engine figures (queues, KV blocks, prefix
cache, preemptions, rejections) come from the core's stats, copied in at each scrape. Engine
counters restart at zero when the engine is rebuilt (reload); `_CounterMirror` turns their
totals into increments so the exported counters stay monotonic across reloads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from appliance.metrics.labels import (
    BATCH_BUCKETS,
    CLASS_PAUSE_MODES,
    DRAIN_OUTCOMES,
    FINISH_REASONS,
    ITL_BUCKETS,
    KV_BLOCK_STATES,
    LATENCY_BUCKETS,
    PREEMPTION_MODES,
    REJECTION_REASONS,
    REQUEST_TOKEN_BUCKETS,
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
)
from appliance.metrics.spec_decode import SpecDecodeMetrics
from appliance.stats import EngineStats

__all__ = ["CONTENT_TYPE", "Metrics"]


class _CounterMirror:
    """Feeds a labelled Counter from totals that may restart at zero (a rebuilt engine)."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.last: dict[tuple[str, ...], float] = {}

    def set_total(self, labels: tuple[str, ...], total: float) -> None:
        prev = self.last.get(labels, 0.0)
        delta = total - prev if total >= prev else total  # below the last total: a restart
        if delta > 0:
            self.counter.labels(*labels).inc(delta)
        self.last[labels] = total

    def reset(self) -> None:
        self.last.clear()


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = reg = CollectorRegistry(auto_describe=True)
        m = ["model_name"]
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in model execution batches.", m, registry=reg
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be processed.", m, registry=reg
        )
        self.swapped = Gauge(
            "appliance_num_requests_swapped",
            "Requests swapped out to host memory.",
            m,
            registry=reg,
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            m,
            registry=reg,
        )
        # Dropped by vLLM v1 but still queried by the classic dashboards in the field.
        self.gpu_cache_usage = Gauge(
            "vllm:gpu_cache_usage_perc", "KV-cache usage (deprecated vLLM name).", m, registry=reg
        )
        self.kv_blocks = Gauge(
            "appliance_kv_blocks",
            "KV blocks by state (used, cached, free).",
            [*m, "state"],
            registry=reg,
        )
        # What the scheduler expects a step to cost here (core/step_cost.py): vLLM has no
        # such model, hence appliance_*.
        self.step_cost = Gauge(
            "appliance_step_cost_seconds",
            "The engine's fitted cost of a step, by term: the step itself, a decode row, a "
            "decode context token, a prefill token, a prefill query-key pair, a step with prefill.",
            [*m, "term"],
            registry=reg,
        )
        # vLLM's labels (no model_name): dashboards written for it read the adapters' names.
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
            registry=reg,
        )
        # Operator pauses per priority class (POST /admin/classes/{name}/pause): vLLM has none.
        self.class_paused = Gauge(
            "appliance_class_paused",
            "1 while the priority class refuses new requests (paused: its queue held; "
            "draining: its queue served), else 0.",
            [*m, "class", "mode"],
            registry=reg,
        )
        self.cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the cache configuration.",
            [
                *m,
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "num_gpu_blocks",
                "num_cpu_blocks",
                "swap_space_gib",
            ],
            registry=reg,
        )
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemptions.", m, registry=reg
        )
        self.preemptions_by = Counter(
            "appliance_preemptions",
            "Preemptions by mode and priority class.",
            [*m, "mode", "priority_class"],
            registry=reg,
        )
        self.cut_ins = Counter(
            "appliance_cut_in_steps",
            "Steps run while a prefill step was paused between half-layers for requests "
            "outranking it.",
            m,
            registry=reg,
        )
        self.interleaved_decodes = Counter(
            "appliance_interleaved_decode_steps",
            "Decode steps run while a prefill step that left them out was paused between "
            "half-layers.",
            m,
            registry=reg,
        )
        self.deferred_decodes = Counter(
            "appliance_deferred_decode_rows",
            "Decode rows of classes without a TPOT target left out of a decode step for the "
            "next one (scheduler.untimed_work_share).",
            m,
            registry=reg,
        )
        self.untimed_share_suspended = Counter(
            "appliance_untimed_share_suspended_steps",
            "Steps built without scheduler.untimed_work_share: a request without a TPOT target "
            "had waited past scheduler.untimed_share_max_wait_s for its first token.",
            m,
            registry=reg,
        )
        self.tpot_stretched = Counter(
            "appliance_tpot_stretched_steps",
            "Steps whose decodes' token interval stretched past their class's TPOT target, "
            "toward its tpot_ceiling_ms, for a queued request's ttft_goal_s.",
            m,
            registry=reg,
        )
        self.drain = Counter(
            "appliance_drain_requests",
            "Requests in flight when a drain began: drained (finished in time) or cut.",
            [*m, "outcome"],
            registry=reg,
        )
        self.rejections = Counter(
            "appliance_requests_rejected",
            "Requests refused, by reason and priority class.",
            [*m, "reason", "priority_class"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", m, registry=reg
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", m, registry=reg
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of finished requests.",
            [*m, "finished_reason"],
            registry=reg,
        )
        # vLLM has no embedding-specific series: these are ours. Each input also finishes as
        # one request in vllm:request_success and its tokens count in vllm:prompt_tokens.
        self.embedding_requests = Counter(
            "appliance_embedding_requests", "Answered /v1/embeddings requests.", m, registry=reg
        )
        self.embedding_inputs = Counter(
            "appliance_embedding_inputs",
            "Inputs embedded (one engine request each).",
            m,
            registry=reg,
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", m, registry=reg
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", m, registry=reg
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token in seconds.",
            m,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Inter-token latency in seconds.",
            m,
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        # vLLM v0's name for the same per-token interval; kept for the classic dashboards.
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time per output token in seconds (deprecated vLLM name).",
            m,
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End to end request latency in seconds.",
            m,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time spent in the WAITING phase.",
            m,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        # Per finished request, as vLLM's classic dashboard draws them.
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            m,
            buckets=REQUEST_TOKEN_BUCKETS,
            registry=reg,
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            m,
            buckets=REQUEST_TOKEN_BUCKETS,
            registry=reg,
        )
        self.request_max_generation_tokens = Histogram(
            "vllm:request_max_num_generation_tokens",
            "Maximum number of generated tokens among a request's choices.",
            m,
            buckets=REQUEST_TOKEN_BUCKETS,
            registry=reg,
        )
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds",
            "Time spent in the PREFILL phase (first scheduled to first token).",
            m,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.decode_time = Histogram(
            "vllm:request_decode_time_seconds",
            "Time spent in the DECODE phase (first token to last token).",
            m,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Number of tokens per engine step.",
            m,
            buckets=TOKEN_BUCKETS,
            registry=reg,
        )
        self.batch_size = Histogram(
            "appliance_batch_size",
            "Sequences per engine step.",
            m,
            buckets=BATCH_BUCKETS,
            registry=reg,
        )
        self.spec_decode = SpecDecodeMetrics(reg)
        self._mirrors = {
            "preemptions": _CounterMirror(self.preemptions),
            "preemptions_by": _CounterMirror(self.preemptions_by),
            "rejections": _CounterMirror(self.rejections),
            "prefix_queries": _CounterMirror(self.prefix_queries),
            "prefix_hits": _CounterMirror(self.prefix_hits),
            "cut_ins": _CounterMirror(self.cut_ins),
            "interleaved_decodes": _CounterMirror(self.interleaved_decodes),
            "deferred_decodes": _CounterMirror(self.deferred_decodes),
            "untimed_share_suspended": _CounterMirror(self.untimed_share_suspended),
            "tpot_stretched": _CounterMirror(self.tpot_stretched),
        }

    # -- request level (API process) -------------------------------------------------------------
    def observe_first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        self.ttft.labels(self.model_name).observe(ttft_s)
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)

    def observe_tokens(self, n: int, interval_s: float | None) -> None:
        self.generation_tokens.labels(self.model_name).inc(n)
        if interval_s is not None:
            self.itl.labels(self.model_name).observe(interval_s)
            self.tpot.labels(self.model_name).observe(interval_s)

    def observe_finish(self, reason: str, e2e_s: float, queue_s: float | None) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(e2e_s)
        if queue_s is not None:
            self.queue_time.labels(self.model_name).observe(queue_s)

    def observe_request(
        self,
        prompt_tokens: int,
        generation_tokens: int,
        prefill_s: float | None,
        decode_s: float | None,
    ) -> None:
        """One engine request finished by the engine (not aborted here)."""
        name = self.model_name
        self.request_prompt_tokens.labels(name).observe(prompt_tokens)
        self.request_generation_tokens.labels(name).observe(generation_tokens)
        if prefill_s is not None:
            self.prefill_time.labels(name).observe(max(0.0, prefill_s))
        if decode_s is not None:
            self.decode_time.labels(name).observe(decode_s)

    def observe_max_generation_tokens(self, tokens: int) -> None:
        """One API request finished: the longest of its choices (n > 1)."""
        self.request_max_generation_tokens.labels(self.model_name).observe(tokens)

    def count_embeddings(self, inputs: int) -> None:
        self.embedding_requests.labels(self.model_name).inc()
        self.embedding_inputs.labels(self.model_name).inc(inputs)

    def count_rejection(self, reason: str, priority_class: str) -> None:
        """Refusals the API decides itself (queue full before tokenization, draining)."""
        self.rejections.labels(self.model_name, reason, priority_class).inc()

    def count_drain(self, drained: int, cut: int) -> None:
        """One drain (SIGTERM, reload): requests in flight that finished in time, and those cut
        at drain_timeout_s."""
        if drained:
            self.drain.labels(self.model_name, "drained").inc(drained)
        if cut:
            self.drain.labels(self.model_name, "cut").inc(cut)

    def set_class_state(self, priority_class: str, state: str) -> None:
        """serving | paused | draining: 1 on the mode the class is in, 0 on the other."""
        for mode in CLASS_PAUSE_MODES:
            value = 1 if state == mode else 0
            self.class_paused.labels(self.model_name, priority_class, mode).set(value)

    def observe_steps(self, steps: list[tuple[int, int]]) -> None:
        it = self.iteration_tokens.labels(self.model_name)
        bs = self.batch_size.labels(self.model_name)
        for tokens, seqs in steps:
            it.observe(tokens)
            bs.observe(seqs)

    # -- engine level (copied from the core's stats at each scrape) ------------------------------
    def engine_rebuilt(
        self, model_name: str, cache: dict[str, Any], priority_classes: Sequence[str] = ()
    ) -> None:
        """A new engine: counters restart at zero there, labels may change. Every series of
        the new model name exists from here on (at zero until something happens)."""
        self.model_name = model_name
        for mirror in self._mirrors.values():
            mirror.reset()
        self.spec_decode.reset()
        self._prime(model_name, priority_classes)
        self.cache_info.clear()
        labels = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in cache.items()}
        names = [n for n in self.cache_info._labelnames if n != "model_name"]
        self.cache_info.labels(model_name=model_name, **{n: labels.get(n, "") for n in names}).set(
            1
        )

    def _prime(self, name: str, classes: Sequence[str]) -> None:
        """Create every labelled child with the label values known now. prometheus_client
        exports a labelled metric only once a child exists, so without this a counter or
        histogram first appears at the first event (a new dashboard shows "No data", and a
        rate() over a series that starts at its first increment misses that increment).
        Gauges get 0 until the first scrape copies the engine's figures in. Children that
        exist already keep their values: a reload must not reset exported counters."""
        for gauge in (self.running, self.waiting, self.swapped, self.kv_usage):
            gauge.labels(name)
        self.gpu_cache_usage.labels(name)
        self.spec_decode.prime(name)
        for state in KV_BLOCK_STATES:
            self.kv_blocks.labels(name, state)
        for counter in (
            self.preemptions,
            self.cut_ins,
            self.interleaved_decodes,
            self.prompt_tokens,
            self.generation_tokens,
            self.prefix_queries,
            self.prefix_hits,
            self.embedding_requests,
            self.embedding_inputs,
        ):
            counter.labels(name)
        for reason in FINISH_REASONS:
            self.request_success.labels(name, reason)
        for outcome in DRAIN_OUTCOMES:
            self.drain.labels(name, outcome)
        for cls in classes:
            for pause in CLASS_PAUSE_MODES:
                self.class_paused.labels(name, cls, pause)
            for mode in PREEMPTION_MODES:
                self.preemptions_by.labels(name, mode, cls)
            for reason in REJECTION_REASONS:
                self.rejections.labels(name, reason, cls)
        for histogram in (
            self.ttft,
            self.itl,
            self.tpot,
            self.e2e,
            self.queue_time,
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.request_max_generation_tokens,
            self.prefill_time,
            self.decode_time,
            self.iteration_tokens,
            self.batch_size,
        ):
            histogram.labels(name)

    def update_engine(self, s: EngineStats) -> None:
        name = self.model_name
        self.running.labels(name).set(s.num_running)
        self.waiting.labels(name).set(s.num_waiting)
        self.swapped.labels(name).set(s.num_swapped)
        self.kv_usage.labels(name).set(s.kv_usage)
        self.gpu_cache_usage.labels(name).set(s.kv_usage)
        self.kv_blocks.labels(name, "used").set(s.blocks_used)
        self.kv_blocks.labels(name, "cached").set(s.blocks_cached)
        self.kv_blocks.labels(name, "free").set(s.blocks_free)
        self.kv_blocks.labels(name, "swapped").set(s.swap_blocks_used)
        cost = s.step_cost
        if cost is not None and cost.fitted:
            for term, seconds in (
                ("step", cost.step_ms / 1e3),
                ("decode_row", cost.decode_row_ms / 1e3),
                ("decode_context_token", cost.decode_context_us_per_token / 1e6),
                ("prefill_token", cost.prefill_token_ms / 1e3),
                ("prefill_pair", cost.prefill_pair_ns / 1e9),
                ("prefill_step", cost.prefill_step_ms / 1e3),
            ):
                self.step_cost.labels(name, term).set(seconds)
        mir = self._mirrors
        mir["preemptions"].set_total((name,), s.counters.preemptions)
        for key, n in s.counters.preemptions_by.items():
            mode, _, cls = key.partition("/")
            mir["preemptions_by"].set_total((name, mode, cls), n)
        for key, n in s.counters.rejected_by.items():
            reason, _, cls = key.partition("/")
            mir["rejections"].set_total((name, reason, cls), n)
        mir["prefix_queries"].set_total((name,), s.prefix_cache_queries)
        mir["prefix_hits"].set_total((name,), s.prefix_cache_hits)
        mir["cut_ins"].set_total((name,), s.counters.cut_in_steps)
        mir["interleaved_decodes"].set_total((name,), s.counters.interleaved_decode_steps)
        mir["deferred_decodes"].set_total((name,), s.counters.deferred_decode_rows)
        mir["untimed_share_suspended"].set_total((name,), s.counters.untimed_share_suspended_steps)
        mir["tpot_stretched"].set_total((name,), s.counters.tpot_stretched_steps)
        self.spec_decode.update(name, s.spec_decode)
        if s.max_loras:
            # One series, the current one, stamped with the time (as vLLM does).
            self.lora_info.clear()
            self.lora_info.labels(
                ",".join(sorted(s.lora_running)), str(s.max_loras), ",".join(sorted(s.lora_waiting))
            ).set_to_current_time()

    def render(self) -> bytes:
        return generate_latest(self.registry)
