"""One step's decisions (`Scheduler.schedule`): decodes first, then prefill chunks, then
admissions, under the token budget, the sequence limit, the KV blocks and, where the classes
being decoded set a TPOT target, a time budget: each prefill chunk is cut to what the engine's
cost model of this box (core/step_cost.py) expects the step to fit in. A running prefill that
a waiting request outranks (a summary's, with a chat queued) takes its chunk after the
admissions, from what they leave of the step."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from appliance.core.block_pool import KVBlock
from appliance.core.request import FinishReason, Request, RequestStatus
from appliance.core.scheduler_output import ScheduledRequest, SchedulerOutput
from appliance.core.step_cost import MIN_CHUNK, StepShape, rowable

if TYPE_CHECKING:
    from appliance.core.scheduler import Scheduler


class StepBuilder:
    """The decisions of one `Scheduler.schedule()` call."""

    def __init__(
        self, sched: Scheduler, may_preempt: bool = True, interleave: bool = False
    ) -> None:
        self.s = sched
        # False for a cut-in step (Scheduler.schedule_cut_in): a paused step holds the
        # running requests' blocks, so nobody is preempted and only free blocks are used.
        self.may_preempt = may_preempt
        # The step may pause to run its decodes apart (scheduler.interleave_decodes): its
        # chunks are sized by tokens alone, and detach_decodes may leave the decodes out.
        self.interleave = interleave
        self.decode_interval_s: float | None = None
        self.kv = sched.kv
        self.budget = sched.cfg.max_num_batched_tokens
        self.granted: dict[str, int] = {}
        self.order: list[Request] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.bound_by = "none"
        self.preempted_any = False
        # What the step computes so far (the cost model's input), and its time limit: the
        # tightest TPOT target among the classes it decodes (None: tokens alone bound it).
        self.shape = StepShape()
        self.limit_s: float | None = None
        # Speculative drafts granted this step, per request id (verified with its decode).
        self.drafts: dict[str, list[int]] = {}
        # Adapters that running requests use: their slots are not given up this step.
        self.lora_busy = {r.lora_name for r in sched.running if r.lora_name}
        # Running prefills outranked by a waiting request: scheduled after the admissions,
        # in at most `chunk_cap` tokens each when one of those was admitted.
        self.deferred: list[Request] = []
        self.started: list[Request] = []
        self.chunk_cap: int | None = None

    def _bound(self, limit: str) -> None:
        # The first limit hit is the one that bound the step.
        if self.bound_by == "none":
            self.bound_by = limit

    def _chunk(self, req: Request, remaining: int) -> int:
        """Tokens `req` computes this step out of its `remaining` ones (its last `remaining`
        positions: it starts at num_tokens - remaining)."""
        limit = self.s.cfg.long_prefill_token_threshold or remaining
        tokens = min(remaining, self.budget, limit, self.chunk_cap or remaining)
        # An interleaving step's decodes run while it pauses, and arrivals cut into it.
        limit_s = (
            None if self.interleave else self.s.chunk_limit_s(self.limit_s, req.priority_class)
        )
        if tokens > 1 and limit_s is not None:
            start = req.num_tokens - remaining
            as_rows = rowable(req.sampling_params)
            timed = self.s.cost.max_chunk(self.shape, start, tokens, limit_s, as_rows)
            if timed < tokens:
                self._bound("time_budget")
                tokens = timed
        return tokens

    def _grant(self, req: Request, tokens: int) -> None:
        self.granted[req.request_id] = tokens
        self.order.append(req)
        self.budget -= tokens
        self.shape = self._add(self.shape, req, tokens)

    def _decodes(self, req: Request, tokens: int) -> bool:
        """Whether `tokens` of `req` are decode rows to the model: one token, or a drafting
        request's (the runner feeds them as decode rows); StepShape.of reads a step the same
        way."""
        return tokens == 1 or req.request_id in self.drafts

    def _add(self, shape: StepShape, req: Request, tokens: int) -> StepShape:
        start = req.num_computed_tokens
        if self._decodes(req, tokens):
            for j in range(tokens):
                shape = shape.with_decode(start + j)
            return shape
        return shape.with_chunk(start, tokens, rowable(req.sampling_params))

    def _ungrant(self, req: Request) -> None:
        tokens = self.granted.pop(req.request_id, None)
        self.drafts.pop(req.request_id, None)
        if tokens is not None:
            self.order.remove(req)
            self.budget += tokens
            self.shape = StepShape()
            for r in self.order:
                self.shape = self._add(self.shape, r, self.granted[r.request_id])

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
        self.limit_s = s.time_limit_s(decodes)
        # A step with adapter rows never pauses (ModelRunner.execute_or_pause).
        self.interleave = self.interleave and not any(r.lora_name for r in running)
        drafts = s.spec.plan(decodes, s.cost) if s.spec.enabled else {}
        # A chat queued behind a summary's chunks: measured, a chat arriving while chats
        # decode got 16-token chunks from what the summary's chunk left of the time budget,
        # its first token several steps later. Its admission now comes first.
        urgent = self._most_urgent_waiting()
        now: list[Request] = []
        for r in prefills:
            (self.deferred if urgent is not None and self.s.rank(r) > urgent else now).append(r)
        self._serve(decodes + now, drafts)

    def schedule_deferred(self) -> None:
        """The running prefills a waiting request outranked, after the admissions; where one
        of those was admitted, only MIN_CHUNK tokens each: the step that prefills a chat's
        prompt stays short, its first token not held for a summary's chunk (which still
        progresses)."""
        if not self.deferred:
            return
        least = min(self.s.rank(r) for r in self.deferred)
        if any(self.s.rank(r) < least for r in self.started):
            self.chunk_cap = MIN_CHUNK
        self._serve(self.deferred, {})
        self.chunk_cap = None

    def detach_decodes(self) -> None:
        """Leave the running decodes out of an interleaving step whose prefill of requests
        they outrank (a summary's, with chats decoding) the cost model expects to outlast their
        TPOT target: the engine runs them in steps of their own while this one is paused
        (Scheduler.schedule_cut_in), each within the target. Their slots stay allocated for
        that step. Prompts of their own rank (a burst of chats) keep them: those are as
        urgent, and decode steps between them cost a burst of 64 chats 14% of its
        throughput and its first tokens (426 vs 368 tok/s, TTFT p50 4.0 vs 10.8 s).

        The decodes that outrank none of that prefill, of a class without a TPOT target (the
        other summaries, batch work), stay in the step and get their token at its end: each
        pause's decode step then costs what the chats' rows cost, not also the summaries'
        rows at 2k tokens of context (Scheduler.rides_prefill)."""
        if not self.interleave or self.limit_s is None or not self.s.cost.ready:
            return
        started = {r.request_id for r in self.started}
        decodes = [
            r
            for r in self.order
            if r.num_tokens - r.num_computed_tokens == 1 and r.request_id not in started
        ]
        if not decodes:
            return
        urgent = min(self.s.rank(r) for r in decodes)
        # A prompt as urgent as the decodes (a chat admitted beside a summary's MIN_CHUNK)
        # keeps the step whole: its first token comes at the step's end, which pauses paced
        # for the decodes would stretch to several times the step's own cost
        # (docs/benchmarks.md, "Sapphire Rapids, night").
        if any(r not in decodes and self.s.rank(r) <= urgent for r in self.order):
            return
        prefill = StepShape()
        lowest = None  # the most urgent rank among the prefills the decodes outrank
        for r in self.order:
            if r not in decodes and (rank := self.s.rank(r)) > urgent:
                prefill = self._add(prefill, r, self.granted[r.request_id])
                lowest = rank if lowest is None else min(lowest, rank)
        if (
            lowest is None
            or not prefill.prefill_tokens
            or (self.s.cost.estimate(prefill) or 0.0) <= self.limit_s
        ):
            return
        detached = [r for r in decodes if not self.s.rides_prefill(r, lowest)]
        for r in detached:
            self._ungrant(r)
        self.decode_interval_s = self.s.token_interval_s(detached) if detached else None

    def defer_untimed_decodes(self) -> None:
        """A step with rows of classes with a TPOT target (chats' decodes, a chat's prompt):
        the decode rows of classes without one (summaries, batch work) that would make it
        outlast what the chats' rows allow wait for the next step. One reading 2k tokens of
        context costs a chat's step as much as a few chats do. The allowance: in a decode-only
        step, the chats' token interval (Scheduler.token_interval_s); in a step with a chat's
        prompt, already past that interval, the untimed share of what the chats' rows cost
        alone (six summaries at 1.5k tokens added 40% to a 54-token prompt's step, holding
        that chat's first token and the decoding chats' next: docs/benchmarks.md, "Sapphire
        Rapids, Dec 5, morning"). A step that prefills a summary keeps them: they ride its
        chunk. Deferred, a row goes first next time, for at most
        scheduler.untimed_max_deferrals steps running (1: every other token at worst)."""
        s = self.s
        if s.untimed_share is None or not s.cost.ready:
            return
        timed = [r for r in self.order if s.config.tpot_slo_s(r.priority_class)]
        untimed = [r for r in self.order if r not in timed]
        if not timed or not untimed:
            return
        if not all(self._decodes(r, self.granted[r.request_id]) for r in untimed):
            return
        shape = StepShape()
        for r in timed:
            shape = self._add(shape, r, self.granted[r.request_id])
        if shape.prefill_tokens:
            alone = s.cost.estimate(shape)
            limit = None if alone is None else (1.0 + s.untimed_share) * alone
        else:
            limit = s.token_interval_s(timed)
        if limit is None:
            return
        # The ones that waited last step first (stable: the policy's order otherwise).
        for r in sorted(untimed, key=lambda r: -r.decode_deferrals):
            with_it = self._add(shape, r, self.granted[r.request_id])
            overdue = r.decode_deferrals >= s.cfg.untimed_max_deferrals
            if overdue or (s.cost.estimate(with_it) or 0.0) <= limit:
                shape, r.decode_deferrals = with_it, 0
            else:
                r.decode_deferrals += 1
                s.counters.deferred_decode_rows += 1
                self._ungrant(r)
                self._bound("time_budget")

    def serve_besides(self, paused: frozenset[str]) -> int:
        """A step run while `paused` (request ids) is paused: the running decodes it left out,
        into free blocks (none is preempted; one without a free block waits for the paused
        step's end). Returns how many were served."""
        served = 0
        for req in self.s.policy.serve_order(self.s.detached_decodes(paused)):
            if self.budget <= 0:
                self._bound("token_budget")
                break
            if not self.kv.allocate_slots(req, 1):
                self._bound("kv_blocks")
                continue
            self._grant(req, 1)
            served += 1
        return served

    def _most_urgent_waiting(self) -> int | None:
        s = self.s
        ranks = [
            self.s.rank(r)
            for r in s.waiting + s.swapped
            if r.status is not RequestStatus.FINISHED and r.priority_class not in s.held_classes
        ]
        return min(ranks, default=None)

    def _serve(self, requests: list[Request], drafts: dict[str, list[int]]) -> None:
        s = self.s
        for req in requests:
            if req not in s.running:
                continue  # preempted earlier in this step
            remaining = req.num_tokens - req.num_computed_tokens
            if self.budget <= 0:
                self._bound("token_budget")
                break
            if req.request_id in drafts and self._grant_drafts(req, drafts[req.request_id]):
                continue
            tokens = self._chunk(req, remaining)
            if tokens < remaining:
                self._bound("token_budget")
            if self._allocate_or_preempt(req, tokens):
                self._grant(req, tokens)

    def _grant_drafts(self, req: Request, drafts: list[int]) -> bool:
        """A decode and its drafts, as one chunk of 1 + n tokens under the token budget; False
        (decode it plainly) when the budget or free blocks do not cover the drafts: drafting
        never preempts anyone."""
        n = min(len(drafts), self.budget - 1)
        if n <= 0 or not self.kv.allocate_slots(req, 1 + n):
            return False
        self.drafts[req.request_id] = drafts[:n]
        self._grant(req, 1 + n)
        return True

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
    def admit(self, only: Callable[[Request], bool] | None = None) -> None:
        """`only`: admit none but the waiting requests it accepts (a cut-in step's)."""
        s = self.s
        if not s.policy.may_admit(bool(s.running or self.order)):
            return  # a static batch runs until all of its members finish
        queued = s.waiting + s.swapped if only is None else [r for r in s.waiting if only(r)]
        candidates = sorted(queued, key=s.admission_key)
        for req in candidates:
            # Admitted behind a more urgent prompt in the same step (a summary after a chat's),
            # it progresses by MIN_CHUNK tokens only: the chat's first token comes with the
            # step, which its chunk would otherwise lengthen (and an interleaving step
            # stretches further by the decode steps it pauses for).
            self.chunk_cap = MIN_CHUNK if self._outranked_by_started(req) else None
            if req.status is RequestStatus.FINISHED or req.priority_class in s.held_classes:
                continue
            if self.budget <= 0:
                self._bound("token_budget")
                break
            if req.lora_name and not s.lora_slots.acquire(req.lora_name, self.lora_busy):
                self._bound("lora_slots")
                continue  # every slot serves running requests; others may still be admitted
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
        self.chunk_cap = None

    def _outranked_by_started(self, req: Request) -> bool:
        rank = self.s.rank(req)
        return any(self.s.rank(r) < rank for r in self.started)

    def _make_room(self, req: Request, cause: str) -> bool:
        """Arrival-triggered preemption, as far as the policy allows it (whom, and when)."""
        s = self.s
        if not self.may_preempt:
            return False
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
        if req.wants_prompt_logprobs or req.sampling_params.pooling:
            return []  # (an embedding pools hidden states as well: engine/pooling.py)
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
        self.started.append(req)
        if req.lora_name:
            self.lora_busy.add(req.lora_name)
        if tokens < req.num_tokens - req.num_computed_tokens:
            self._bound("token_budget")
        self._grant(req, tokens)

    def build(self) -> SchedulerOutput:
        scheduled = []
        total = 0
        context = 0
        for req in self.order:
            tokens = self.granted[req.request_id]
            drafts = self.drafts.get(req.request_id, [])
            start = req.num_computed_tokens
            known = tokens - len(drafts)  # of the request's own tokens (the rest are drafts)
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
                    token_ids=req.token_ids[start : start + known] + drafts,
                    start_pos=start,
                    block_ids=block_ids,
                    sample=start + known == req.num_tokens,
                    sampling_params=req.sampling_params,
                    output_index=req.num_output_tokens,
                    new_table=new_table,
                    stop_token_ids=req.stop_token_ids,
                    prompt_logprobs_start=lp_start,
                    prompt_logprob_targets=targets,
                    draft_token_ids=drafts,
                    lora_name=req.lora_name,
                    lora_slot=self.s.lora_slots.slot_of(req.lora_name),
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
            decode_interval_s=self.decode_interval_s,
        )
