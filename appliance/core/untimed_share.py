"""scheduler.untimed_work_share while the box keeps up, and not past it.

The share holds a summary's prefill and decode rows back for the chats' token pace: on a box
with spare time that costs the summaries a few seconds of their first token and nothing else.
On a saturated box it costs throughput: the summaries' backlog grows while they wait, and the
run's last ones end later (docs/benchmarks.md, "Sapphire Rapids, afternoon"). A summary that
has waited longer than scheduler.untimed_share_max_wait_s for its first token is that backlog
made visible, in the one figure the operator can check against the summaries' own TTFT
target: while one waits that long the share is suspended and the steps are built as without it
(the TPOT targets alone), so the summaries get the box's full pace until none waits that long.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.core.request import Request
    from appliance.core.scheduler import Scheduler


def overdue_untimed(sched: Scheduler, now: float) -> Request | None:
    """A request of a class without a TPOT target that has waited longer than
    scheduler.untimed_share_max_wait_s for its first token (waiting, swapped or prefilling);
    None if there is none."""
    limit = sched.cfg.untimed_share_max_wait_s
    for queue in (sched.running, sched.waiting, sched.swapped):
        for r in queue:
            if (
                r.num_output_tokens == 0
                and now - r.arrival_time > limit
                and not sched.config.tpot_slo_s(r.priority_class)
            ):
                return r
    return None


def share_in_force(sched: Scheduler, now: float) -> float | None:
    """The share the next step is built with: scheduler.untimed_work_share, or None (the TPOT
    targets alone) while it is unset or a request is overdue (overdue_untimed)."""
    share = sched.cfg.untimed_work_share
    if share is None or overdue_untimed(sched, now) is None:
        return share
    sched.counters.untimed_share_suspended_steps += 1
    return None
