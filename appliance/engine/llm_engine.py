"""The engine: requests in, one scheduled forward pass per `step()`, outputs out.

`Engine.generate()` is the offline API; `add_request` / `step` / `abort` is what the engine
core process drives for the server. The engine owns the scheduler and the runner; it emits
token ids, never text: detokenizing and stop strings are the output processor's, on the
caller's side (output_processor.py), for the server and `generate` alike.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from appliance.config import ApplianceConfig, ConfigError, load_config
from appliance.core.kv_cache_manager import KVCacheManager
from appliance.core.request import FinishReason, Request
from appliance.core.scheduler import Scheduler
from appliance.core.scheduler_output import SchedulerOutput
from appliance.core.wait_estimate import DepartureRate
from appliance.engine import request_checks
from appliance.engine.executor import load_model
from appliance.engine.loader import LoadedModel, StepExecutor
from appliance.engine.model_runner import RunnerOutput
from appliance.engine.output_processor import OutputProcessor
from appliance.engine.outputs import CompletionResult, EngineOutput, Logprob
from appliance.engine.pause_rule import PausedStep, PauseRule
from appliance.engine.pooling import PoolingSums
from appliance.engine.spec_verify import trim_forbidden_drafts
from appliance.engine.stats import StepHistory, snapshot
from appliance.engine.step_warmup import needs_seed, seed_step_costs
from appliance.sampling_params import SamplingParams
from appliance.stats import EngineStats, PreemptionEvent, StepRecord

log = logging.getLogger("appliance.engine")

Prompt = str | list[int]


class Engine:
    def __init__(self, config: ApplianceConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        # An engine closes what it loaded; a LoadedModel passed in (the bench reuses one across
        # engines) stays its caller's to close.
        self._owns_model = loaded is None
        self.loaded = loaded or load_model(config)
        loaded_tp = getattr(self.loaded.executor, "size", 1)
        if loaded_tp != config.parallel.tensor_parallel_size:
            raise ConfigError(
                f"parallel.tensor_parallel_size {config.parallel.tensor_parallel_size} differs "
                f"from the loaded model's {loaded_tp}"
            )
        if self.loaded.block_size != config.cache.block_size:
            raise ConfigError(
                f"cache.block_size {config.cache.block_size} differs from the loaded KV pool's "
                f"{self.loaded.block_size}"
            )
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.model_name
        self.max_model_len = self.loaded.max_model_len
        self.eos_token_ids = self.loaded.eos_token_ids
        # Fresh block bookkeeping per engine; the KV tensors belong to the loaded runner. An
        # engine over an already loaded model may use fewer of its blocks (benchmarks do).
        num_blocks = config.cache.num_blocks or self.loaded.num_blocks
        if num_blocks > self.loaded.num_blocks:
            raise ConfigError(
                f"cache.num_blocks {num_blocks} exceeds the {self.loaded.num_blocks} blocks "
                "the loaded KV pool holds"
            )
        self.kv = KVCacheManager(
            num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            self.loaded.num_swap_blocks,
        )
        self.runner = self.loaded.runner
        self.scheduler = Scheduler(
            config,
            self.kv,
            self.max_model_len,
            fused_decode_rows=self.runner.fused_max_batch,
            fused_prompt_rows=self.runner.fused_prompt_rows,
        )
        # runner.execute at TP 1; at TP > 1 it also drives the worker ranks (engine/tp.py).
        self.executor: StepExecutor = self.loaded.executor or self.loaded.runner
        self._ids = itertools.count()
        # Called with the requests scheduled for the first time, after scheduling and before
        # the forward pass (the core process tells the API at once: a long step must not make
        # a request that is being served look queued to the API's queue-timeout timer).
        self.on_started: Callable[[list[str]], None] | None = None
        self.history = StepHistory()
        # Takes the requests that arrived since it was last asked; True when any did (the core
        # process drains its pipe). Asked between half-layers of a step that prefills, so a request
        # that outranks the step's prefills cuts into it (step()). None: no step pauses.
        self.take_arrivals: Callable[[], bool] | None = None
        self._paused: PausedStep | None = None
        # A request added while a step is paused (the core process takes its pipe between two
        # step() calls): the resumed step's first question counts it as an arrival. Only
        # take_arrivals' own were counted: a chat arriving during the pause that served the
        # last decoding chat waited for the whole chunk, no decode left to pause for (0.77 s:
        # docs/benchmarks.md, "Sapphire Rapids, Dec 5, morning").
        self._added_while_paused = False
        # Embedding requests' pooled hidden states, summed over their prefill chunks.
        self.pooling_sums = PoolingSums()
        # Started requests leaving per busy second: the queue's estimated wait (wait_estimate).
        self.departures = DepartureRate()
        self.step_count = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_finished: dict[str, int] = {}
        self._peak_blocks = 0
        # Slot utilisation when the most blocks were in use (PagedAttention's waste figure).
        self.slot_utilisation_at_peak = 1.0
        if needs_seed(self):
            seed_step_costs(self)

    @classmethod
    def from_template(
        cls,
        name_or_path: str | os.PathLike[str] | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> Engine:
        return cls(load_config(name_or_path, overrides))

    def reconfigure(self, config: ApplianceConfig) -> None:
        """Live knobs (appliance/server/live_config.py), between two steps."""
        self.config = config
        self.scheduler.reconfigure(config)

    def close(self) -> None:
        """Stop the tensor-parallel workers of a model this engine loaded. Idempotent."""
        if self._owns_model:
            self.loaded.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int | str | None = None,
        arrival_time: float | None = None,
        lora_name: str = "",
    ) -> Request:
        """Validate and queue a request. Raises ValueError for bad input (naming the field and
        the limit: engine/request_checks.py); a request refused by admission control comes back
        already finished. The prompt is checked first: a prompt with no room left is refused
        as such whatever max_tokens says."""
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        request_checks.check_prompt(
            token_ids,
            self.loaded.args.vocab_size,
            self.max_model_len,
            self.kv.block_size,
            self.kv.num_blocks,
            pooling=bool(params.pooling),
        )
        params.validate()
        request_checks.check_structured(params)
        if lora_name and lora_name not in self.lora_adapters():
            raise ValueError(f"model: no LoRA adapter named {lora_name!r} is loaded")
        try:
            prio, cls_name = self.config.resolve_priority(priority, len(token_ids))
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        kwargs: dict[str, Any] = {}
        if arrival_time is not None:
            kwargs["arrival_time"] = arrival_time
        req = Request(
            request_id=rid,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=prio,
            priority_class=cls_name,
            lora_name=lora_name,
            **kwargs,
        )
        if not self.scheduler.add_request(req, interleave=self._interleaving()):
            self._count_finish(req.finish_reason or FinishReason.QUEUE_FULL)
        self._added_while_paused |= self._paused is not None
        return req

    def lora_adapters(self) -> list[str]:
        """The LoRA adapters requests may name (loaded on the host; the slots follow demand)."""
        pool = self.runner.lora
        return sorted(set(pool.adapters) - pool.draining) if pool is not None else []

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Finish a request now (its blocks return at once); STOP is how a stop string that the
        output processor found ends it. One in a paused step finishes when that step ends:
        its forward still writes the request's blocks."""
        if self._defer_past_pause(request_id, reason, ""):
            return request_id in self.scheduler.requests
        return self.scheduler.finish_request(request_id, reason)

    def expire(self, request_id: str, detail: str) -> bool:
        """The API's queue timer fired (Scheduler.expire); deferred as `abort` is."""
        if self._defer_past_pause(request_id, FinishReason.QUEUE_TIMEOUT, detail):
            return request_id in self.scheduler.requests
        return self.scheduler.expire(request_id, detail)

    def _defer_past_pause(self, request_id: str, reason: FinishReason, detail: str) -> bool:
        """Keep a finish of a paused step's request for that step's end (_resume); False when
        no paused step holds the request."""
        if self._paused is None or request_id not in self._paused.rule.request_ids:
            return False
        self._paused.finishes.append((request_id, reason, detail))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One step's outputs. A step that prefills may pause between two half-layers for requests
        that arrived during it and outrank its prefills (a chat behind a summary's chunk), and,
        where it left the running decodes out (scheduler.interleave_decodes), whenever their
        next token is due: then this call runs that cut-in step and returns its outputs, and
        the next call goes on with the paused step, which may pause again (each cut-in step
        takes the arrivals since the last)."""
        if self._paused is not None:
            return self._resume()
        started = time.perf_counter()
        self._added_while_paused = False  # schedule() below sees every request added so far
        sched = self.scheduler
        pausable = self._pausable()
        out = sched.schedule(interleave=self._interleaving())
        self._announce_started()
        trim_forbidden_drafts(out, self.runner.guided)
        rank = sched.cut_in_rank(out) if pausable and self.config.scheduler.cut_in else None
        slice_s = sched.interleave_slice_s(out)
        if rank is None and slice_s is None:
            return self._finish(out, self.executor.execute(out), started)
        rule = PauseRule.start(
            out.request_ids(), rank, slice_s, started, interval_s=out.decode_interval_s
        )
        result = self.runner.execute_or_pause(out, lambda: self._should_pause(rule))
        if result is not None:
            return self._finish(out, result, started)
        paused_at = time.perf_counter()
        self._paused = PausedStep(out, started, paused_at, rule)
        return self._cut_in(rule, paused_at)

    def _cut_in(self, rule: PauseRule, paused_at: float) -> list[EngineOutput]:
        """The step run while a step is paused: the decodes it left out, and the waiting
        requests that outrank it."""
        besides = rule.request_ids if rule.interval_s is not None else None
        step = self.scheduler.schedule_cut_in(rule.rank, besides)
        self._announce_started()
        return self._finish(step, self.executor.execute(step), paused_at)

    def _announce_started(self) -> None:
        first_scheduled = self.scheduler.take_started()
        if first_scheduled and self.on_started is not None:
            self.on_started(first_scheduled)

    def _pausable(self) -> bool:
        """Whether a step may pause between two half-layers: not where no arrivals can be taken
        mid-step (the offline API), nor in a tensor-parallel step (its ranks run the layers in
        lockstep)."""
        return self.take_arrivals is not None and self.executor is self.runner

    def _interleaving(self) -> bool:
        """Whether steps leave their decodes out to run them while paused."""
        return self._pausable() and self.config.scheduler.interleave_decodes

    def _should_pause(self, rule: PauseRule) -> bool:
        """Asked between two units of the forward (a layer's halves, run_layers): take the
        requests that arrived; pause for any of them that cuts in, or when the decodes the
        step left out are due their next token."""
        assert self.take_arrivals is not None
        arrived = self.take_arrivals() or self._added_while_paused
        self._added_while_paused = False
        if arrived and rule.rank is not None and self.scheduler.wants_cut_in(rule.rank):
            return True
        return rule.due(time.perf_counter()) and bool(
            self.scheduler.detached_decodes(rule.request_ids)
        )

    def _interval(self, paused: PausedStep) -> float | None:
        """The TPOT target the paused step's left-out decodes are due by: the step's own, or,
        where it left none out, that of the requests a cut-in admitted since (a chat arriving
        during a summary's prefill got its first token there, and its second waited for the
        step's end: up to 0.76 s at 1 req/s on 2 cores, docs/admission.md). None where the
        step carries rows of such a class itself (a chat's prompt and decode kept beside a
        summary's MIN_CHUNK, StepBuilder.detach_decodes): pauses for the cut-in's decodes held
        those chats' tokens for every pause (docs/benchmarks.md, "Sapphire Rapids, Dec 5")."""
        if paused.rule.interval_s is not None or not self._interleaving():
            return paused.rule.interval_s
        sched = self.scheduler
        carried = [r for rid in paused.rule.request_ids if (r := sched.requests.get(rid))]
        if sched.time_limit_s(carried) is not None:
            return None
        return sched.token_interval_s(sched.detached_decodes(paused.rule.request_ids))

    def _resume(self) -> list[EngineOutput]:
        paused, self._paused = self._paused, None
        assert paused is not None
        excluded = paused.excluded + time.perf_counter() - paused.paused_at
        # Pauses again only for requests that arrive from now on (take_arrivals says so), or
        # when the decodes it left out are due again.
        rule = paused.rule.resumed(time.perf_counter(), paused.paused_at, self._interval(paused))
        again = None if self.take_arrivals is None else lambda: self._should_pause(rule)
        result = self.runner.resume(again)
        if result is None:  # paused again
            paused_at = time.perf_counter()
            self._paused = replace(paused, paused_at=paused_at, excluded=excluded, rule=rule)
            return self._cut_in(rule, paused_at)
        outputs = self._finish(paused.out, result, paused.started, excluded)
        # Finishes asked for while the step was paused: its requests' blocks were in use.
        for request_id, reason, detail in paused.finishes:
            if reason is FinishReason.QUEUE_TIMEOUT:
                self.scheduler.expire(request_id, detail)  # counted where it still applies
            else:
                self.scheduler.finish_request(request_id, reason, detail)
        return outputs

    def _finish(
        self, out: SchedulerOutput, result: RunnerOutput, started: float, excluded: float = 0.0
    ) -> list[EngineOutput]:
        """A step's outputs from its runner output; `excluded`: seconds within the step's
        wall time that other steps took (a cut-in), not counted as its duration."""
        sched = self.scheduler
        self.pooling_sums.add(result.pooled)
        new_tokens = sched.update_from_output(out, result.sampled, result.accepted)

        outputs: dict[str, EngineOutput] = {}
        touched: dict[str, Request] = {}
        for req, token in new_tokens:
            rid = req.request_id
            touched[rid] = req
            # A drafting request gets its accepted drafts, then its sampled token, in order.
            eo = outputs.setdefault(rid, EngineOutput(request_id=rid, new_token_ids=[]))
            lps = [*result.accepted_logprobs.get(rid, []), result.logprobs.get(rid)]
            lp = lps[len(eo.new_token_ids)] if len(eo.new_token_ids) < len(lps) else None
            eo.new_token_ids.append(token)
            if lp is not None:
                top = list(zip(lp.top_ids, lp.top_logprobs, strict=True))
                eo.new_logprobs.append(Logprob(lp.token_id, lp.logprob, top))
        for rid, (start, entries) in result.prompt_logprobs.items():
            # A request whose last chunk sampled its last token has left the scheduler already.
            preq = touched.get(rid) or sched.requests.get(rid)
            # Entries already handed out (a recomputed prefill) are not sent twice.
            if preq is None or start != preq.num_prompt_logprobs:
                continue
            preq.num_prompt_logprobs += len(entries)
            touched[rid] = preq
            eo = outputs.setdefault(rid, EngineOutput(request_id=rid, new_token_ids=[]))
            eo.prompt_logprobs = [
                Logprob(e.token_id, e.logprob, list(zip(e.top_ids, e.top_logprobs, strict=True)))
                for e in entries
            ]

        departures = 0
        for fin in sched.take_finished():
            req = fin.request
            rid = req.request_id
            departures += req.first_scheduled_time is not None  # it held a slot
            touched[rid] = req
            eo = outputs.setdefault(rid, EngineOutput(request_id=rid, new_token_ids=[]))
            eo.finished = True
            eo.finish_reason = fin.reason.value
            eo.finish_detail = req.finish_detail
            if req.first_scheduled_time is not None:
                eo.queue_time_s = req.first_scheduled_time - req.arrival_time
            eo.num_preemptions = req.num_preemptions
            if req.sampling_params.pooling:
                kind, n = req.sampling_params.pooling, req.num_prompt_tokens
                eo.embedding = self.pooling_sums.finish(rid, kind, n)
            self._count_finish(fin.reason)
        for rid, eo in outputs.items():
            req = touched[rid]
            eo.num_prompt_tokens = req.num_prompt_tokens
            eo.num_cached_tokens = req.num_cached_prompt_tokens

        duration = time.perf_counter() - started - excluded
        if out.scheduled:
            sched.observe_step(out, duration)
        self._record_step(out, duration, sum(len(a) for a in result.accepted.values()))
        self.departures.observe(duration, departures)
        return list(outputs.values())

    def _count_finish(self, reason: FinishReason) -> None:
        self.requests_finished[reason.value] = self.requests_finished.get(reason.value, 0) + 1

    def _record_step(self, out: SchedulerOutput, duration: float, accepted: int = 0) -> None:
        self.step_count += 1
        usage = self.kv.usage()
        # A drafting row's tokens are its decode (and drafts), not prompt tokens.
        decode_tokens = sum(
            len(r.token_ids)
            for r in out.scheduled
            if r.draft_token_ids or (len(r.token_ids) == 1 and r.output_index)
        )
        prompt_tokens = out.num_scheduled_tokens - decode_tokens
        # (an embedding's last chunk ends its request without sampling a token)
        gen_tokens = accepted + sum(
            1 for r in out.scheduled if r.sample and not r.sampling_params.pooling
        )
        self.prompt_tokens_total += prompt_tokens
        self.generation_tokens_total += gen_tokens
        if usage.used >= self._peak_blocks and usage.slots_allocated:
            self._peak_blocks = usage.used
            self.slot_utilisation_at_peak = usage.slot_utilisation
        sched = self.scheduler
        record = StepRecord(
            step=self.step_count,
            time=time.time(),
            duration_s=duration,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            num_seqs=len(out.scheduled),
            num_scheduled_tokens=out.num_scheduled_tokens,
            num_context_tokens=out.num_context_tokens,
            num_prompt_tokens=prompt_tokens,
            num_generation_tokens=gen_tokens,
            blocks_used=usage.used,
            blocks_cached=usage.cached_free,
            blocks_free=usage.free,
            kv_usage=usage.usage,
            bound_by=out.bound_by,
        )
        self.history.append(record)

    # -- offline API -----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: int | str | None = None,
        lora_names: Sequence[str] | None = None,
    ) -> list[CompletionResult]:
        """Run prompts to completion; `lora_names` (one per prompt, "" for the base model)
        picks each prompt's LoRA adapter."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompt_list = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(
                    f"params: {len(param_list)} SamplingParams for {len(prompt_list)} prompts"
                )
        processor = OutputProcessor(self.tokenizer)
        states = []
        loras = list(lora_names) if lora_names is not None else [""] * len(prompt_list)
        if len(loras) != len(prompt_list):
            raise ValueError(f"lora_names: {len(loras)} names for {len(prompt_list)} prompts")
        for prompt, sp, lora in zip(prompt_list, param_list, loras, strict=True):
            req = self.add_request(prompt, sp, priority=priority, lora_name=lora)
            states.append(
                processor.add(req.request_id, req.prompt_token_ids, sp, stream_text=False)
            )
            if req.is_finished:  # refused by admission control
                reason = req.finish_reason or FinishReason.QUEUE_FULL
                processor.end(req.request_id, reason.value, req.finish_detail)
        # Finished requests are reported by the step after their finish (a stop string's abort).
        while self.has_unfinished() or self.scheduler.finished:
            for request_id in processor.process(self.step()):
                self.abort(request_id, FinishReason.STOP)
        return [state.result() for state in states]

    # -- figures ---------------------------------------------------------------------------------
    def stats(self, detail: bool = False) -> EngineStats:
        """The engine part of the stats snapshot (engine/stats.py builds it)."""
        return snapshot(self, detail=detail).engine

    def preemption_log(self) -> list[PreemptionEvent]:
        return list(self.scheduler.preemption_log)
