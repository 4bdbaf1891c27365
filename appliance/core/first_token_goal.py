"""A class's first-token goal (priority_classes.X.ttft_goal_s): a goal the steps are paced for,
never refused on, and how far the decoding classes' token interval stretches for it (their
tpot_ceiling_ms).

A summary's prefill that pauses for the chats' decode steps (scheduler.interleave_decodes) gets
what is left of each of their token intervals after their step: on a slow 2-core box, a chats'
step of ~20 ms in a 35 ms interval left the prefill about half of it. Sixteen summaries in
26 s then queued for their first token, which came 5-16 s after they arrived
(docs/admission.md, "First-token goals"). Each step is planned for the queued requests that
can still meet their goal: the chats' interval stretches to the least that gives the prefills
the share of the box those need, never past the ceiling; and a request that would miss its
goal even with the whole box, or already has, yields its turn to those that can, until it has
waited twice its goal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.core.step_cost import StepShape

if TYPE_CHECKING:
    from appliance.core.decode_pacing import DecodePacing
    from appliance.core.request import Request
    from appliance.core.scheduler import Scheduler


@dataclass(frozen=True)
class GoalPlan:
    """What the first-token goals ask of the next step: the share of the box the queued
    prefills need (None: none, the TPOT targets unstretched), and the queued requests that can
    no longer meet their goal and yield their turn to those of their class that can."""

    need: float | None = None
    yielding: frozenset[str] = frozenset()


def plan_goals(sched: Scheduler, now: float) -> GoalPlan:
    """For every request of a class with a ttft_goal_s still waiting for its first token, in the
    order the steps serve prefills: the cost model's seconds of the prefills served before it
    and its own, over the seconds left to its goal, is the share of the box it needs. One that
    would miss its goal even with the whole box, or already has, needs nothing; if it has not
    started, it yields: it is admitted after the requests of its class that can still meet
    theirs (so its prompt does not count before theirs), until it has waited twice its goal,
    when it takes its turn again (a stream of arrivals that can never starves it). None of
    this before the cost model is ready."""
    cost = sched.cost
    goals = any(c.ttft_goal_s for c in sched.config.priority_classes.values())
    if not goals or not cost.ready:
        return GoalPlan()
    key = sched.policy.queue_key
    # Served in this order: the prompts already being prefilled, then the queues' in their order.
    prefilling = sorted(
        (r for r in sched.running if r.num_tokens - r.num_computed_tokens > 1), key=key
    )
    queued = sorted(sched.waiting + sched.swapped, key=key)
    need: float | None = None
    yielding: set[str] = set()
    ahead_s = 0.0
    for r, started in [(r, True) for r in prefilling] + [(r, False) for r in queued]:
        own_s = _prefill_s(sched, r)
        goal = sched.config.ttft_goal_s(r.priority_class)
        if goal is not None and not r.num_output_tokens:
            waited = now - r.arrival_time
            left = goal - waited
            if 0 < left and ahead_s + own_s <= left:
                need = max(need or 0.0, (ahead_s + own_s) / left)
            elif not started and waited < 2 * goal:  # missed, or would with the whole box
                yielding.add(r.request_id)
                continue  # served after those that can still meet theirs
        ahead_s += own_s
    return GoalPlan(need, frozenset(yielding))


def _prefill_s(sched: Scheduler, r: Request) -> float:
    """The cost model's seconds for the rest of `r`'s prompt (a swapped request's too: it is
    recomputed or swapped in, a prompt's cost either way, as an upper bound)."""
    remaining = r.num_tokens - r.num_computed_tokens
    if remaining <= 1:
        return 0.0
    return sched.cost.estimate(StepShape().with_chunk(r.num_computed_tokens, remaining)) or 0.0


def stretched_interval_s(
    sched: DecodePacing, decodes: list[Request], limit: float, need: float | None
) -> float:
    """The token interval of `decodes` (their tightest TPOT target: `limit`) that leaves a
    prefill pausing for them the share `need` of the box (plan_goals): their step,
    the cost model's, is what the interval does not leave it. At least `limit`, at most the
    tightest of their classes' ceilings (Config.tpot_ceiling_s)."""
    if need is None or not decodes:
        return limit
    ceilings = [sched.config.tpot_ceiling_s(r.priority_class) for r in decodes]
    ceiling = min((c for c in ceilings if c is not None), default=limit)
    if ceiling <= limit:
        return limit
    step_s = sched.cost.estimate(StepShape.decoding(r.num_computed_tokens for r in decodes))
    if step_s is None:
        return limit
    if need >= 1.0:
        return ceiling
    return min(max(limit, step_s / (1.0 - need)), ceiling)
