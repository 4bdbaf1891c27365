"""When a newly arrived request would get its first token, by the engine's own cost model
(core/step_cost.py): the prefill work ahead of it in its policy's queue order (running requests
still prefilling, waiting and swapped ones that are admitted before it) and its own prompt, run
chunk by chunk in steps that also decode the running requests, each chunk cut as the scheduler
cuts it (the token budget, the tightest TPOT target among the running classes).

It models the prefill work, which is what a long summary ahead of a short chat costs; a full
batch of sequence slots is the departure-rate estimate's business (core/wait_estimate.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from appliance.core.step_cost import StepShape

if TYPE_CHECKING:
    from appliance.core.request import Request
    from appliance.core.scheduler import Scheduler

# Chunks simulated per estimate at most (an arrival must stay cheap): beyond, the rest of the
# work is costed at the last chunk's rate.
MAX_CHUNKS = 4096


def estimate_ttft_s(sched: Scheduler, req: Request) -> float | None:
    """Seconds from now to `req`'s first token; None until the cost model is ready."""
    cost = sched.cost
    if not cost.ready:
        return None
    key = sched.policy.queue_key
    mine = key(req)
    # (start, remaining prompt tokens) of every prefill that runs before req's own ends.
    work = [
        (r.num_computed_tokens, r.num_tokens - r.num_computed_tokens)
        for r in sched.running
        if r.num_tokens - r.num_computed_tokens > 1
    ]
    work += [
        (r.num_computed_tokens, r.num_tokens - r.num_computed_tokens)
        for r in sched.waiting + sched.swapped
        if key(r) <= mine
    ]
    work.append((0, req.num_tokens))
    decodes = StepShape()
    for r in sched.running:
        if r.num_tokens - r.num_computed_tokens <= 1:
            decodes = decodes.with_decode(r.num_computed_tokens)
    targets = [
        t for r in sched.running if (t := sched.config.tpot_slo_s(r.priority_class)) is not None
    ]
    limit = min(targets) if targets else None
    budget = max(1, sched.cfg.max_num_batched_tokens - decodes.decode_rows)
    total, chunks, last_rate = 0.0, 0, 0.0
    for start, remaining in work:
        while remaining > 0:
            if chunks >= MAX_CHUNKS:
                total += remaining * last_rate
                break
            chunk = min(remaining, budget)
            if limit is not None:
                chunk = cost.max_chunk(decodes, start, chunk, limit)
            seconds = cost.estimate(decodes.with_chunk(start, chunk)) or 0.0
            total += seconds
            last_rate = seconds / chunk
            start, remaining, chunks = start + chunk, remaining - chunk, chunks + 1
    return total
