"""Iteration-level scheduler: each step grants tokens under one budget so every request's
computed tokens catch up with its tokens. Decodes first, then prefill chunks, then admissions;
preemption (recompute or swap) when KV blocks run out or a more urgent request waits.

Plain Python over block ids; the runner turns the output into tensors.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from appliance.config import ApplianceConfig
from appliance.core.decode_pacing import DecodePacing
from appliance.core.first_token_goal import GoalPlan, plan_goals
from appliance.core.kv_cache_manager import KVCacheManager
from appliance.core.lora_slots import LoraSlotTable
from appliance.core.policy import make_policy
from appliance.core.preemption_log import PreemptionLog
from appliance.core.request import FinishReason, Request, RequestStatus
from appliance.core.scheduler_output import ScheduledRequest, SchedulerOutput
from appliance.core.spec_decode import SpecDecoder
from appliance.core.step_builder import StepBuilder
from appliance.core.step_cost import StepCostModel, StepShape
from appliance.core.ttft_estimate import estimate_ttft_s
from appliance.core.untimed_share import share_in_force
from appliance.stats import SchedulerCounters

# How long a priority class counts as present after its last request arrived, ran or waited
# (Scheduler.class_present): its TPOT target cuts the chunks of the classes it outranks only
# then. A request of a class absent that long waits for at most one uncut step (~0.3-0.8 s on
# 2 cores), within the TTFT targets the templates set.
CLASS_PRESENCE_S = 60.0


@dataclass
class FinishedRequest:
    request: Request
    reason: FinishReason


class Scheduler(DecodePacing):
    def __init__(
        self,
        config: ApplianceConfig,
        kv: KVCacheManager,
        max_model_len: int,
        fused_decode_rows: int = 0,
        fused_prompt_rows: int = 0,
    ) -> None:
        self.config = config
        self.cfg = config.scheduler
        self.kv = kv
        self.max_model_len = max_model_len
        # Queue order, victims, arrival preemption, static batches: asked, never re-derived.
        self.policy = make_policy(self.cfg)
        self.requests: dict[str, Request] = {}
        # Waiting (new and recompute-preempted) and swapped queues, kept in the policy's order.
        self.waiting: list[Request] = []
        self.swapped: list[Request] = []
        self.running: list[Request] = []
        self.counters = SchedulerCounters()
        # What a step costs on this box, learnt from the engine's steps (observe_step);
        # `fused_prompt_rows`: the device runs a step with a prompt's chunk as decode rows up
        # to this many rows (StepShape.runs_as_rows), and the model prices it so.
        self.cost = StepCostModel(fused_prompt_rows)
        # Prompt-lookup drafts for decodes, and whether they pay this step (config [speculative]).
        # `fused_decode_rows`: the device's fused decode takes steps of up to this many decode
        # rows (0: none); drafts do not push a step that fits over it.
        self.spec = SpecDecoder(config.speculative, max_model_len, fused_decode_rows)
        self.preemption_log = PreemptionLog()
        # Which LoRA adapter holds which device slot (admission asks it).
        self.lora_slots = LoraSlotTable(config.lora.max_loras)
        self.finished: list[FinishedRequest] = []
        self._pressure_steps = 0
        self._dropped_tables: list[str] = []
        self._done_structured: list[str] = []
        # Requests scheduled for the first time since the last take_started() (the API stops
        # their queue-timeout timers: from here on they are being served).
        self._started: list[str] = []
        # Priority classes paused by the operator: their queued requests are not admitted.
        self.held_classes: set[str] = set()
        # When each priority class last had a request arrive, run or wait (monotonic seconds):
        # whether it is present, for chunk_limit_s.
        self._class_seen: dict[str, float] = {}
        # scheduler.untimed_work_share as the current step is built with it: None while the
        # summaries fall behind (core/untimed_share.py).
        self.untimed_share = self.cfg.untimed_work_share
        # What the first-token goals ask of the current step (core/first_token_goal.py): the
        # share of the box the queued prefills need, and who yields its turn.
        self.goals = GoalPlan()

    def reconfigure(self, config: ApplianceConfig) -> None:
        """Live knobs, between two steps: the next step reads them. Running requests above a
        lowered max_num_seqs run on to their end (none is preempted for it); admissions wait
        until the running count is under the new limit."""
        self.config, self.cfg = config, config.scheduler
        self.policy = make_policy(self.cfg)
        self.untimed_share = self.cfg.untimed_work_share

    def hold_class(self, priority_class: str, held: bool) -> None:
        """Pause (or resume) admitting a class's waiting and swapped requests."""
        if held:
            self.held_classes.add(priority_class)
        else:
            self.held_classes.discard(priority_class)

    # -- queues ----------------------------------------------------------------------------------
    def _insert(self, queue: list[Request], req: Request) -> None:
        key = self.policy.queue_key
        queue.insert(bisect.bisect_right([key(r) for r in queue], key(req)), req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def has_unfinished(self) -> bool:
        return self.num_unfinished > 0

    # -- arrivals and departures -----------------------------------------------------------------
    def add_request(self, req: Request, interleave: bool = False) -> bool:
        """Queue a request; False (and the request finished with QUEUE_FULL) when the waiting
        queue of its class is full, or (TTFT_SLO) when the engine expects its first token
        later than its class's ttft_slo_s (`interleave`: as `schedule` takes it, for that
        estimate)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        # Traffic of its class, admitted or not: chunks of the classes it outranks are cut.
        self._class_seen[req.priority_class] = time.monotonic()
        limit = self.config.class_limits(req.priority_class).max_waiting_requests
        if limit:
            same_class = sum(1 for r in self.waiting if r.priority_class == req.priority_class)
            if same_class >= limit:
                self.counters.count_rejected(req.priority_class, FinishReason.QUEUE_FULL)
                req.status = RequestStatus.FINISHED
                req.finish_reason = FinishReason.QUEUE_FULL
                req.finish_detail = f"waiting queue full ({same_class} >= {limit})"
                return False
        slo = self.config.ttft_slo_s(req.priority_class)
        estimate = estimate_ttft_s(self, req, interleave) if slo is not None else None
        if slo is not None and estimate is not None and estimate > slo:
            self.counters.count_rejected(req.priority_class, FinishReason.TTFT_SLO)
            req.status = RequestStatus.FINISHED
            req.finish_reason = FinishReason.TTFT_SLO
            req.finish_detail = (
                f"first token expected in {estimate:.1f}s by this box's step costs and the "
                f"work queued ahead, over ttft_slo_s {slo:g}"
            )
            return False
        self.requests[req.request_id] = req
        self._insert(self.waiting, req)
        return True

    def finish_request(self, request_id: str, reason: FinishReason, detail: str = "") -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
                break
        self.kv.forget(req)
        self._drop_table(req)
        if req.sampling_params.structured is not None:
            self._done_structured.append(req.request_id)
        if req.preempted_at is not None:
            req.time_preempted += time.monotonic() - req.preempted_at
            self.counters.time_preempted_s += time.monotonic() - req.preempted_at
            req.preempted_at = None
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_detail = detail
        self.finished.append(FinishedRequest(req, reason))
        return True

    def _drop_table(self, req: Request) -> None:
        """The request's blocks changed other than by growing: the runner forgets its table."""
        if req.table_sent:
            self._dropped_tables.append(req.request_id)
            req.table_sent = False
            req.num_block_ids_sent = 0

    def abort(self, request_id: str) -> bool:
        return self.finish_request(request_id, FinishReason.ABORT)

    def expire(self, request_id: str, detail: str) -> bool:
        """The API's timer found the request past its class's queue timeout: refuse it as
        _expire_timeouts would have at the next step boundary (and count it the same way)."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.counters.count_rejected(req.priority_class, FinishReason.QUEUE_TIMEOUT)
        return self.finish_request(request_id, FinishReason.QUEUE_TIMEOUT, detail)

    def take_started(self) -> list[str]:
        out, self._started = self._started, []
        return out

    def take_dropped_tables(self) -> list[str]:
        out, self._dropped_tables = self._dropped_tables, []
        return out

    def take_done_structured(self) -> list[str]:
        out, self._done_structured = self._done_structured, []
        return out

    def take_finished(self) -> list[FinishedRequest]:
        out, self.finished = self.finished, []
        return out

    # -- one step --------------------------------------------------------------------------------
    def schedule(self, interleave: bool = False) -> SchedulerOutput:
        """The next step. `interleave`: the engine can pause it between two half-layers to run the
        decodes it leaves out (scheduler.interleave_decodes; StepBuilder.detach_decodes)."""
        out = StepBuilder(self, interleave=interleave)
        # A lowered max_num_seqs (live knobs) binds admissions; it never evicts running work.
        seq_limit = max(self.cfg.max_num_seqs, len(self.running))
        self._expire_timeouts()
        self._update_pressure()
        now = time.monotonic()
        for queue in (self.running, self.waiting, self.swapped):
            for r in queue:
                self._class_seen[r.priority_class] = now
        self.untimed_share = share_in_force(self, now)
        self.goals = plan_goals(self, now)
        out.schedule_running()
        out.admit()
        out.schedule_deferred()
        out.detach_decodes()
        out.defer_untimed_decodes()
        result = out.build()
        interval = result.decode_interval_s
        if interval is not None and out.limit_s is not None and interval > out.limit_s:
            self.counters.tpot_stretched_steps += 1
        assert result.num_scheduled_tokens <= self.cfg.max_num_batched_tokens
        assert len(self.running) <= seq_limit
        return result

    def rank(self, req: Request) -> int:
        """A request's urgency in the policy's queue order (lower: more urgent)."""
        return self.policy.queue_key(req)[0]

    def admission_key(self, req: Request) -> tuple[object, ...]:
        """The order queued requests are admitted in: the policy's, but a request that can no
        longer meet its first-token goal after those of its rank that can
        (core/first_token_goal.py)."""
        rank, *rest = self.policy.queue_key(req)
        return (rank, req.request_id in self.goals.yielding, *rest)

    # -- cut-in steps (engine: a step paused between two half-layers) ----------------------------
    def cut_in_rank(self, step: SchedulerOutput) -> int | None:
        """The queue rank a waiting request must beat to cut into `step`: that of the least
        urgent request the step prefills, whose chunk is what makes the step long. None: it
        prefills nothing (a decode step is short). The most urgent one's, before: once a chat's
        prompt rode a summary's chunk, no chat arriving during that step could cut in, the
        next step took them with the next chunk, and so on (1.5 req/s on a loaded 2-core box:
        chats' first tokens came in groups at the chunks' ends, 1.1-2.1 s after arrival)."""
        ranks = [
            self.rank(req)
            for sr in step.scheduled
            if len(sr.token_ids) > 1 and not sr.draft_token_ids
            if (req := self.requests.get(sr.request_id)) is not None
        ]
        return max(ranks, default=None)

    def cuts_in(self, req: Request, rank: int) -> bool:
        """Whether a waiting request may cut into a paused step of `rank`: it outranks the
        step's prefills, its class is not held, and it runs on the base model (a cut-in step
        must not refill a LoRA slot the paused step reads)."""
        return (
            self.rank(req) < rank
            and not req.lora_name
            and req.status is not RequestStatus.FINISHED
            and req.priority_class not in self.held_classes
        )

    def wants_cut_in(self, rank: int) -> bool:
        return any(self.cuts_in(r, rank) for r in self.waiting)

    def schedule_cut_in(
        self, rank: int | None, besides: frozenset[str] | None = None
    ) -> SchedulerOutput:
        """A step run while another is paused: with `besides` (the paused step's request ids,
        where it left the running decodes out), those decodes; then the waiting requests that
        cut into a paused step of `rank` (None: none), admitted as `schedule` would admit them
        but into free blocks only. The paused step's requests keep their blocks, and none of
        them is scheduled again before it ends."""
        out = StepBuilder(self, may_preempt=False)
        decodes = out.serve_besides(besides) if besides is not None else 0
        if rank is not None:
            out.admit(lambda r: self.cuts_in(r, rank))
        step = out.build()
        self.counters.cut_in_steps += bool(out.started)
        self.counters.interleaved_decode_steps += bool(decodes)
        return step

    def class_present(self, priority_class: str, now: float | None = None) -> bool:
        """Whether a class has traffic: a request of it running or waiting, or one that arrived
        within the last CLASS_PRESENCE_S seconds."""
        seen = self._class_seen.get(priority_class)
        now = time.monotonic() if now is None else now
        return seen is not None and now - seen <= CLASS_PRESENCE_S

    def chunk_limit_s(self, step_limit: float | None, priority_class: str) -> float | None:
        """The time limit of a step that runs a prefill chunk of `priority_class`: the step's
        own (its decodes'), and the tightest TPOT target among the present classes that
        outrank the chunk's (class_present). A request of theirs that arrives during the step
        waits for it, so a summary's prefill never holds the box longer than a chat's token
        may take, even while no chat runs (measured: a 1,024-token chunk of an idle box's
        summary held the chats arriving behind it for up to 0.8 s, docs/benchmarks.md). A class
        with no traffic protects nothing: on a box serving one class its prompts' chunks take
        the token budget (cut to realtime's 100 ms that nobody sent, 64 chats' prompts
        prefilled at 2,900 tok/s instead of 4,800: docs/benchmarks.md)."""
        rank = self.config.priority_classes.get(priority_class)
        if rank is None:
            return step_limit
        now = time.monotonic()
        limits = [
            cls.tpot_slo_ms / 1e3
            for name, cls in self.config.priority_classes.items()
            if cls.tpot_slo_ms and cls.priority < rank.priority and self.class_present(name, now)
        ]
        if step_limit is not None:
            limits.append(step_limit)
        return min(limits) if limits else None

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A step's wall time, for the cost model that sizes chunks under a TPOT target."""
        self.cost.observe(StepShape.of(out), seconds)

    def _expire_timeouts(self) -> None:
        now = time.monotonic()
        for req in list(self.waiting):
            if req.first_scheduled_time is not None:
                continue  # only requests that never started can time out in the queue
            timeout = self.config.class_limits(req.priority_class).queue_timeout_s
            if timeout and now - req.arrival_time > timeout:
                self.counters.count_rejected(req.priority_class, FinishReason.QUEUE_TIMEOUT)
                self.finish_request(
                    req.request_id,
                    FinishReason.QUEUE_TIMEOUT,
                    f"waited {now - req.arrival_time:.1f}s > queue_timeout_s {timeout}",
                )

    def _update_pressure(self) -> None:
        if self.kv.usage_fraction() > self.cfg.preemption_threshold:
            self._pressure_steps += 1
        else:
            self._pressure_steps = 0

    def preempt(self, victim: Request, cause: str) -> list[tuple[int, int]]:
        """Take `victim` off the running list; returns device->host copies for a swap."""
        usage_before, blocks_held = self.kv.usage_fraction(), len(victim.blocks)
        self.running.remove(victim)
        wants_swap = self.cfg.preemption_mode == "swap"
        # None: recompute, by choice or because the swap pool is full (a fallback).
        mapping = self.kv.swap_out(victim) if wants_swap else None
        fallback = wants_swap and mapping is None
        if fallback:
            self.counters.swap_fallbacks += 1
        recompute_tokens = 0
        if mapping is not None:
            victim.status = RequestStatus.SWAPPED
            self._insert(self.swapped, victim)
            self.counters.blocks_swapped_out += len(mapping)
        else:
            recompute_tokens = victim.num_computed_tokens
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
            self._insert(self.waiting, victim)
            self.counters.tokens_recomputed += recompute_tokens
        self._drop_table(victim)
        victim.num_preemptions += 1
        victim.preempted_at = time.monotonic()
        mode = "recompute" if mapping is None else "swap"
        self.counters.count_preemption(mode, victim.priority_class or str(victim.priority))
        # What happened goes to the log; the log adds nothing to what happened.
        usage = (usage_before, self.kv.usage_fraction())
        self.preemption_log.record(
            victim, cause, mapping, fallback, recompute_tokens, blocks_held, usage
        )
        return mapping or []

    # -- after the forward pass ------------------------------------------------------------------
    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, int],
        accepted: dict[str, list[int]] | None = None,
    ) -> list[tuple[Request, int]]:
        """Advance computed tokens, append sampled tokens, finish what stopped.
        Returns (request, new token) for every new token, in order. `accepted`: the drafts
        verified before each drafting request's sampled token."""
        new_tokens: list[tuple[Request, int]] = []
        for sr in output.scheduled:
            req = self.requests.get(sr.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if sr.draft_token_ids:
                verified = (accepted or {}).get(sr.request_id, [])
                new_tokens.extend(self._verified(req, sr, sampled[sr.request_id], verified))
                continue
            req.num_computed_tokens += len(sr.token_ids)
            self.kv.cache_blocks(req)
            if not sr.sample:
                continue
            if sr.sampling_params.pooling:
                # An embedding is done once its prompt is computed: nothing is generated and
                # its blocks are freed now.
                self.finish_request(req.request_id, FinishReason.STOP)
                continue
            token = sampled[sr.request_id]
            req.token_ids.append(token)
            new_tokens.append((req, token))
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish_request(req.request_id, reason)
        return new_tokens

    def _verified(
        self, req: Request, sr: ScheduledRequest, token: int, accepted: list[int]
    ) -> list[tuple[Request, int]]:
        """A drafting request's step: its accepted drafts and the token sampled after them are
        appended (up to a stop), only their KV counts as computed, and blocks that held only
        rejected drafts go back to the pool (the runner gets the shorter table next step)."""
        self.spec.record(req, len(sr.draft_token_ids), len(accepted))
        req.num_computed_tokens = sr.start_pos + len(sr.token_ids) - len(sr.draft_token_ids)
        req.num_computed_tokens += len(accepted)
        out: list[tuple[Request, int]] = []
        reason = None
        for t in [*accepted, token]:
            req.token_ids.append(t)
            out.append((req, t))
            reason = self._stop_reason(req, t)
            if reason is not None:
                break
        if self.kv.trim(req):
            self._drop_table(req)
        self.kv.cache_blocks(req)
        if reason is not None:
            self.finish_request(req.request_id, reason)
        return out

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= params.min_tokens and token in req.stop_token_ids:
            return FinishReason.STOP
        if n_out >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
