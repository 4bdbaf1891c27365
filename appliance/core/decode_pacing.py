"""How the running decodes are paced while prompts are prefilled: a step's time limit (the
tightest TPOT target it decodes), how far apart their tokens may come (stretched for a
first-token goal, tightened by scheduler.untimed_work_share), how long an interleaving step's
prefill runs between two of their steps, and which decodes ride a prefill's step instead.

A mixin of the Scheduler (its own module: scheduler.py stays under 500 lines); the step
builder, the TTFT estimate and the engine's interleaving loop ask these of the scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from appliance.core.first_token_goal import GoalPlan, stretched_interval_s
from appliance.core.step_cost import MIN_SLICE_FRACTION, StepCostModel, StepShape

if TYPE_CHECKING:
    from appliance.config import ApplianceConfig
    from appliance.core.request import Request
    from appliance.core.scheduler_output import SchedulerOutput


class DecodePacing:
    """The Scheduler's decode pacing, over the scheduler's own state (set in its __init__)."""

    config: ApplianceConfig
    cost: StepCostModel
    running: list[Request]
    goals: GoalPlan
    untimed_share: float | None

    if TYPE_CHECKING:

        def rank(self, req: Request) -> int: ...

    def interleave_slice_s(self, step: SchedulerOutput) -> float | None:
        """How long a step that left the running decodes out (`decode_interval_s`) runs before
        it pauses for their step: their interval less what the cost model expects that step
        to take, and never under a quarter of the interval (the prefill always progresses)."""
        interval = step.decode_interval_s
        if interval is None:
            return None
        detached = self.detached_decodes(step.request_ids())
        expected = self.cost.estimate(StepShape.decoding(r.num_computed_tokens for r in detached))
        return max(interval - (expected or 0.0), interval * MIN_SLICE_FRACTION)

    def rides_prefill(self, decode: Request, prefill_rank: int) -> bool:
        """Whether a decode stays in an interleaving step that prefills requests of
        `prefill_rank` (the most urgent it leaves its decodes out for), its token at the
        step's end: where it outranks none of them and its class sets no TPOT target (a
        summary's, while another summary's prompt is prefilled, as a step that does not
        interleave serves it)."""
        return self.rank(decode) >= prefill_rank and not self.config.tpot_slo_s(
            decode.priority_class
        )

    def detached_decodes(self, paused: frozenset[str]) -> list[Request]:
        """The running requests outside a paused step (`paused`: its request ids) that wait
        for their next token and a step while it is paused may serve: base-model ones (a
        cut-in step never refills a LoRA slot the paused step reads)."""
        return [
            r
            for r in self.running
            if r.request_id not in paused
            and not r.lora_name
            and r.num_tokens - r.num_computed_tokens == 1
        ]

    def time_limit_s(self, decodes: list[Request]) -> float | None:
        """A step's time limit: the tightest TPOT target among the classes it decodes."""
        targets = [t for r in decodes if (t := self.config.tpot_slo_s(r.priority_class))]
        return min(targets) if targets else None

    def token_interval_s(self, decodes: list[Request]) -> float | None:
        """How far apart the tokens of `decodes` (rows of classes with a TPOT target) may come:
        their tightest target, stretched toward their ceiling while a first-token goal needs
        it (core/first_token_goal.py), or less where scheduler.untimed_work_share bounds it by
        what a decode step of theirs alone is expected to cost (while it is in force:
        core/untimed_share.py)."""
        limit = self.time_limit_s(decodes)
        if limit is None:
            return None
        limit = stretched_interval_s(self, decodes, limit, self.goals.need)
        share = self.untimed_share
        if share is None or not self.cost.ready:
            return limit
        alone = self.cost.estimate(StepShape.decoding(r.num_computed_tokens for r in decodes))
        return limit if alone is None else min(limit, (1.0 + share) * alone)
