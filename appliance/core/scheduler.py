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
from appliance.core.block_pool import KVBlock
from appliance.core.kv_cache_manager import KVCacheManager
from appliance.core.policy import make_policy
from appliance.core.preemption_log import PreemptionLog
from appliance.core.request import FinishReason, Request, RequestStatus
from appliance.core.scheduler_output import ScheduledRequest, SchedulerOutput
from appliance.stats import SchedulerCounters


@dataclass
class FinishedRequest:
    request: Request
    reason: FinishReason


class Scheduler:
    def __init__(self, config: ApplianceConfig, kv: KVCacheManager, max_model_len: int) -> None:
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
        self.preemption_log = PreemptionLog()
        self.finished: list[FinishedRequest] = []
        self._pressure_steps = 0
        self._dropped_tables: list[str] = []
        self._done_structured: list[str] = []
        # Requests scheduled for the first time since the last take_started() (the API stops
        # their queue-timeout timers: from here on they are being served).
        self._started: list[str] = []

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
    def add_request(self, req: Request) -> bool:
        """Queue a request; False (and the request finished with QUEUE_FULL) when the waiting
        queue of its class is full."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        limit = self.config.class_limits(req.priority_class).max_waiting_requests
        if limit:
            same_class = sum(1 for r in self.waiting if r.priority_class == req.priority_class)
            if same_class >= limit:
                self.counters.count_rejected(req.priority_class, FinishReason.QUEUE_FULL)
                req.status = RequestStatus.FINISHED
                req.finish_reason = FinishReason.QUEUE_FULL
                req.finish_detail = f"waiting queue full ({same_class} >= {limit})"
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
    def schedule(self) -> SchedulerOutput:
        out = _StepBuilder(self)
        self._expire_timeouts()
        self._update_pressure()
        out.schedule_running()
        out.admit()
        result = out.build()
        assert result.num_scheduled_tokens <= self.cfg.max_num_batched_tokens
        assert len(self.running) <= self.cfg.max_num_seqs
        return result

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
        self, output: SchedulerOutput, sampled: dict[str, int]
    ) -> list[tuple[Request, int]]:
        """Advance computed tokens, append sampled tokens, finish what stopped.
        Returns (request, new token) for every request that got a token."""
        new_tokens: list[tuple[Request, int]] = []
        for sr in output.scheduled:
            req = self.requests.get(sr.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += len(sr.token_ids)
            self.kv.cache_blocks(req)
            if not sr.sample:
                continue
            token = sampled[sr.request_id]
            req.token_ids.append(token)
            new_tokens.append((req, token))
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish_request(req.request_id, reason)
        return new_tokens

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= params.min_tokens and token in req.stop_token_ids:
            return FinishReason.STOP
        if n_out >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


class _StepBuilder:
    """The decisions of one `Scheduler.schedule()` call."""

    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        self.kv = sched.kv
        self.budget = sched.cfg.max_num_batched_tokens
        self.granted: dict[str, int] = {}
        self.order: list[Request] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.bound_by = "none"
        self.preempted_any = False

    def _bound(self, limit: str) -> None:
        # The first limit hit is the one that bound the step.
        if self.bound_by == "none":
            self.bound_by = limit

    def _chunk(self, req: Request, remaining: int) -> int:
        limit = self.s.cfg.long_prefill_token_threshold or remaining
        return min(remaining, self.budget, limit)

    def _grant(self, req: Request, tokens: int) -> None:
        self.granted[req.request_id] = tokens
        self.order.append(req)
        self.budget -= tokens

    def _ungrant(self, req: Request) -> None:
        tokens = self.granted.pop(req.request_id, None)
        if tokens is not None:
            self.order.remove(req)
            self.budget += tokens

    def _preempt(self, victim: Request, cause: str) -> None:
        self._ungrant(victim)
        self.swap_out.extend(self.s.preempt(victim, cause))
        self.preempted_any = True
        self._bound("kv_blocks")

    # Running requests: decodes first so a long prefill never stalls them.
    def schedule_running(self) -> None:
        s = self.s
        running = s.policy.serve_order(s.running)
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if req not in s.running:
                continue  # preempted earlier in this step
            remaining = req.num_tokens - req.num_computed_tokens
            if self.budget <= 0:
                self._bound("token_budget")
                break
            tokens = self._chunk(req, remaining)
            if tokens < remaining:
                self._bound("token_budget")
            if self._allocate_or_preempt(req, tokens):
                self._grant(req, tokens)

    def _allocate_or_preempt(self, req: Request, tokens: int) -> bool:
        s = self.s
        while not self.kv.allocate_slots(req, tokens):
            victim = s.policy.out_of_blocks_victim(req, s.running)
            if victim is req:
                if len(s.running) == 1 and not s.swapped and self._alone_cannot_fit(req, tokens):
                    s.finish_request(
                        req.request_id,
                        FinishReason.ERROR,
                        f"KV cache exhausted: the request needs "
                        f"{len(req.blocks) + self.kv.blocks_needed(req, tokens)}"
                        f" blocks, the pool has {self.kv.num_blocks}",
                    )
                    self._bound("kv_blocks")
                    return False
                self._preempt(req, "out_of_blocks")
                return False
            self._preempt(victim, "out_of_blocks")
        return True

    def _alone_cannot_fit(self, req: Request, tokens: int) -> bool:
        return self.kv.blocks_needed(req, tokens) > self.kv.num_free_blocks

    # Waiting and swapped requests, most urgent first.
    def admit(self) -> None:
        s = self.s
        if not s.policy.may_admit(bool(s.running or self.order)):
            return  # a static batch runs until all of its members finish
        candidates = sorted(s.waiting + s.swapped, key=s.policy.queue_key)
        for req in candidates:
            if req.status is RequestStatus.FINISHED:
                continue
            if self.budget <= 0:
                self._bound("token_budget")
                break
            if len(s.running) >= s.cfg.max_num_seqs:
                if not self._make_room(req, "max_num_seqs"):
                    self._bound("max_num_seqs")
                    break
            admitted = (
                self._admit_swapped(req)
                if req.status is RequestStatus.SWAPPED
                else (self._admit_waiting(req))
            )
            if not admitted:
                self._bound("kv_blocks")
                break

    def _make_room(self, req: Request, cause: str) -> bool:
        """Arrival-triggered preemption, as far as the policy allows it (whom, and when)."""
        s = self.s
        victim = s.policy.arrival_victim(req, s.running, cause, s._pressure_steps)
        if victim is None:
            return False
        self._preempt(victim, cause)
        return True

    def _admit_swapped(self, req: Request) -> bool:
        s = self.s
        while True:
            host_blocks = len(req.swap_blocks)
            # Room for the swapped blocks and for what it computes next: one decode token, or
            # the next chunk when it was preempted in the middle of its prefill.
            chunk = self._chunk(req, req.num_tokens - req.num_computed_tokens)
            need = max(host_blocks, -(-(req.num_computed_tokens + chunk) // self.kv.block_size))
            if need <= self.kv.num_free_blocks:
                break
            if not self._make_room(req, "kv_pressure"):
                return False
        self.swap_in.extend(self.kv.swap_in(req))
        s.counters.blocks_swapped_in += host_blocks
        s.swapped.remove(req)
        tokens = self._chunk(req, req.num_tokens - req.num_computed_tokens)
        if not self.kv.allocate_slots(req, tokens):
            # Cannot happen after the check above; keep the invariant loud.
            raise RuntimeError(f"allocation for resumed request {req.request_id} failed")
        self._start(req, tokens)
        return True

    def _lookup(self, req: Request) -> list[KVBlock]:
        # A request still owed prompt logprobs computes its whole prompt (as vLLM does): a
        # cached block holds KV, not the hidden states its logprobs come from. Its blocks
        # still enter the cache for others.
        if req.wants_prompt_logprobs:
            return []
        return self.kv.get_computed_blocks(req)[0]

    def _admit_waiting(self, req: Request) -> bool:
        hits = self._lookup(req)
        while True:
            tokens = self._initial_tokens(req, len(hits))
            if tokens and self.kv.can_allocate(req, tokens, hits):
                break
            if not self._make_room(req, "kv_pressure"):
                return False
            hits = self._lookup(req)
        # One allocation for the hits and the first chunk (or a protected request's whole
        # remaining length); _start only grants the chunk.
        self.kv.allocate_slots(req, tokens, hits)
        hit_tokens = len(hits) * self.kv.block_size
        self.kv.record_prefix_lookup(req.num_tokens, hit_tokens)
        req.num_computed_tokens = hit_tokens
        if req.first_scheduled_time is None:
            req.num_cached_prompt_tokens = hit_tokens
        self.s.waiting.remove(req)
        self._start(req, self._chunk(req, req.num_tokens - hit_tokens))
        return True

    def _initial_tokens(self, req: Request, num_hits: int) -> int:
        """Tokens to allocate for on admission: the first chunk, or for a request the thrash
        guard protects, its whole remaining length so it never needs preempting again."""
        remaining = req.num_tokens - num_hits * self.kv.block_size
        chunk = self._chunk(req, remaining)
        if self.s.policy.is_protected(req):
            params = req.sampling_params
            final = min(req.num_prompt_tokens + params.max_tokens, self.s.max_model_len)
            # A reservation the whole pool cannot hold would never be admitted: fall back.
            if -(-final // self.kv.block_size) <= self.kv.num_blocks:
                return max(chunk, final - num_hits * self.kv.block_size - 1)
        return chunk

    def _start(self, req: Request, tokens: int) -> None:
        """Move an admitted request (its blocks allocated) to running, granting `tokens`."""
        s = self.s
        now = time.monotonic()
        if req.preempted_at is not None:
            req.time_preempted += now - req.preempted_at
            s.counters.time_preempted_s += now - req.preempted_at
            req.preempted_at = None
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
            s._started.append(req.request_id)
        req.status = RequestStatus.RUNNING
        s.running.append(req)
        if tokens < req.num_tokens - req.num_computed_tokens:
            self._bound("token_budget")
        self._grant(req, tokens)

    def build(self) -> SchedulerOutput:
        scheduled = []
        total = 0
        context = 0
        for req in self.order:
            tokens = self.granted[req.request_id]
            start = req.num_computed_tokens
            # Only what changed: the blocks added since the runner last saw the request.
            new_table = not req.table_sent
            block_ids = self.kv.block_ids(req, start=0 if new_table else req.num_block_ids_sent)
            req.table_sent = True
            req.num_block_ids_sent = len(req.blocks)
            lp_start, targets = start, []
            if req.wants_prompt_logprobs:
                lp_start = max(start, req.num_prompt_logprobs)
                lp_end = min(start + tokens, req.num_prompt_tokens - 1)
                targets = req.token_ids[lp_start + 1 : lp_end + 1]
            scheduled.append(
                ScheduledRequest(
                    request_id=req.request_id,
                    token_ids=req.token_ids[start : start + tokens],
                    start_pos=start,
                    block_ids=block_ids,
                    sample=start + tokens == req.num_tokens,
                    sampling_params=req.sampling_params,
                    output_index=req.num_output_tokens,
                    new_table=new_table,
                    stop_token_ids=req.stop_token_ids,
                    prompt_logprobs_start=lp_start,
                    prompt_logprob_targets=targets,
                )
            )
            total += tokens
            context += start + tokens
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=total,
            num_context_tokens=context,
            blocks_to_swap_out=self.swap_out,
            blocks_to_swap_in=self.swap_in,
            finished_request_ids=self.s.take_dropped_tables(),
            done_request_ids=self.s.take_done_structured(),
            bound_by=self.bound_by,
        )
