"""When a newly arrived request would get its first token, by the engine's own cost model
(core/step_cost.py): the steps are simulated as the step builder makes them. Each step decodes
the running requests and then spends what its time limit leaves (the tightest TPOT target among
the running classes and the classes outranking the chunk's; else the token budget) on prefill
chunks in serve order: running requests still prefilling (those the new one does not outrank),
then the waiting and swapped requests admitted before the new one (its policy's queue order),
then the new one, then the running prefills it outranks; every chunk gets at
least MIN_CHUNK tokens, as the builder gives it, and in a step that admits a request the
prompts it outranks get at most that (the builder's cap: a chat's first token is not held for a
summary's chunk). The estimate is the sum of the simulated steps' costs until the new
request's prompt is done. Where steps interleave their decodes
(scheduler.interleave_decodes, in an engine whose steps can pause), chunks take the token budget
and a step that outlasts its decodes' target pays their decode steps, one per slice of it, as
the engine runs them (the decodes that ride its steps, Scheduler.rides_prefill, in them);
one that carries a prompt as urgent as its decodes keeps them, unpaced
(StepBuilder.detach_decodes).

It models the prefill work, which is what long summaries ahead of a short chat cost; a full
batch of sequence slots is the departure-rate estimate's business (core/wait_estimate.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from appliance.core.request import RequestStatus
from appliance.core.step_cost import MIN_CHUNK, MIN_SLICE_FRACTION, StepShape, rowable

if TYPE_CHECKING:
    from appliance.core.request import Request
    from appliance.core.scheduler import Scheduler

# Steps simulated per estimate at most (an arrival must stay cheap): a queue needing more is
# far past any TTFT target already.
MAX_STEPS = 2000


def estimate_ttft_s(sched: Scheduler, req: Request, interleave: bool = False) -> float | None:
    """Seconds from now to `req`'s first token; None until the cost model is ready.
    `interleave`: the engine's steps leave their decodes out to run them apart (above)."""
    cost = sched.cost
    if not cost.ready:
        return None
    key = sched.policy.queue_key
    mine = key(req)
    # [start, remaining] of each prefill in the order the steps serve them; req's is last.
    prefilling = [r for r in sched.running if r.num_tokens - r.num_computed_tokens > 1]
    ahead = [r for r in prefilling if key(r)[0] <= mine[0]]
    ahead += [r for r in sorted(sched.waiting + sched.swapped, key=key) if key(r) <= mine]
    # Outranked by the new request: they take their chunks after its (the step builder's
    # deferral), but still lengthen the steps it waits for.
    behind = [r for r in prefilling if key(r)[0] > mine[0]]
    work = [[r.num_computed_tokens, r.num_tokens - r.num_computed_tokens] for r in ahead]
    own = [0, req.num_tokens]
    work.append(own)
    work += [[r.num_computed_tokens, r.num_tokens - r.num_computed_tokens] for r in behind]
    decoding = [r for r in sched.running if r.num_tokens - r.num_computed_tokens <= 1]
    decodes = StepShape.decoding(r.num_computed_tokens for r in decoding)
    step_limit = sched.time_limit_s(decoding)
    # Each chunk's limit also holds the TPOT targets of the classes outranking its own.
    limits = [
        None if interleave else sched.chunk_limit_s(step_limit, r.priority_class)
        for r in [*ahead, req, *behind]
    ]
    # The prefills the decodes outrank: what an interleaving step leaves its decodes out for;
    # the decodes that outrank none of them and have no TPOT target ride in its steps.
    urgent = min((sched.rank(r) for r in decoding), default=None)
    ranks = [sched.rank(r) for r in [*ahead, req, *behind]]
    # Whether each prompt may run as decode rows (StepShape.runs_as_rows).
    as_rows = [rowable(r.sampling_params) for r in [*ahead, req, *behind]]
    outranked = [urgent is not None and rank > urgent for rank in ranks]
    lowest = min((rank for rank, low in zip(ranks, outranked, strict=True) if low), default=0)
    detached, riding = StepShape(), StepShape()
    apart: list[Request] = []
    for r in decoding:
        if interleave and any(outranked) and sched.rides_prefill(r, lowest):
            riding = riding.with_decode(r.num_computed_tokens)
        else:
            detached = detached.with_decode(r.num_computed_tokens)
            apart.append(r)
    decode_s = (cost.estimate(detached) or 0.0) if detached.decode_rows else 0.0
    # A step leaves its decodes out where its prefill would outlast their target; its pauses
    # then come at their token interval (Scheduler.token_interval_s: tighter with
    # scheduler.untimed_work_share).
    pacing = (step_limit, sched.token_interval_s(apart)) if interleave and step_limit else None
    # The requests not yet started (the waiting ones ahead, and req): the step that admits
    # one gives the prompts it outranks MIN_CHUNK tokens (StepBuilder.admit, schedule_deferred).
    fresh = [r.status is not RequestStatus.RUNNING for r in ahead] + [True] + [False] * len(behind)
    total, steps = 0.0, 0
    while own[1] > 0:
        shape, budget = decodes, sched.cfg.max_num_batched_tokens - decodes.decode_rows
        lower = StepShape()
        started: int | None = None  # the most urgent rank admitted in this step
        whole = False  # a prompt as urgent as the decodes: the step keeps them, unpaced
        for i, (item, limit, low, ok, rank) in enumerate(
            zip(work, limits, outranked, as_rows, ranks, strict=True)
        ):
            if item[1] <= 0 or budget <= 0:
                continue
            chunk = min(item[1], budget)
            if started is not None and rank > started:
                chunk = min(chunk, MIN_CHUNK)
            if limit is not None:
                chunk = cost.max_chunk(shape, item[0], chunk, limit, ok)
            shape = shape.with_chunk(item[0], chunk, ok)
            if low:
                lower = lower.with_chunk(item[0], chunk, ok)
            else:
                whole = True
            if fresh[i]:
                fresh[i] = False
                started = rank if started is None else min(started, rank)
            budget -= chunk
            item[0] += chunk
            item[1] -= chunk
        total += _step_s(sched, shape, lower, riding, decode_s, None if whole else pacing)
        steps += 1
        if steps >= MAX_STEPS:
            # A queue this deep: the rest of req's prompt at the last step's pace.
            break
    return total


def _step_s(
    sched: Scheduler,
    shape: StepShape,
    lower: StepShape,
    riding: StepShape,
    decode_s: float,
    pacing: tuple[float, float | None] | None,
) -> float:
    """A simulated step's seconds. With `pacing` (an interleaving engine's decodes' target and
    token interval), a step whose prefill of requests the decodes outrank (`lower`) is expected
    to outlast the target runs without the decodes, but for those `riding` it
    (Scheduler.rides_prefill); the others get a step of their own, `decode_s`, each slice
    (StepBuilder.detach_decodes, Scheduler.interleave_slice_s)."""
    cost = sched.cost
    whole = cost.estimate(shape) or 0.0
    if pacing is None or not decode_s or not lower.prefill_tokens:
        return whole
    target, interval = pacing
    if (cost.estimate(lower) or 0.0) <= target:
        return whole
    interval = interval or target
    prefill = StepShape(
        decode_rows=riding.decode_rows,
        decode_context=riding.decode_context,
        prefill_tokens=shape.prefill_tokens,
        prefill_pairs=shape.prefill_pairs,
        rowable=shape.rowable,
    )
    prefill_s = cost.estimate(prefill) or 0.0
    slice_s = max(interval - decode_s, interval * MIN_SLICE_FRACTION)
    return prefill_s + math.ceil(prefill_s / slice_s) * decode_s
