"""The scheduling policy as one object: how the waiting queue is ordered, whom preemption takes,
whether a waiting arrival may preempt running work, whether a formed batch runs to its end, and
which requests the API counts as served ahead of a new arrival.

Built once from `scheduler.policy` by `make_policy`, in the engine core (the scheduler) and in
the API process (the engine client, for the estimated-wait check): both ask the same class, so
the rule lives here and nowhere else. Stateless: the scheduler keeps the pressure count and
passes it in. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import ClassVar

from appliance.config import PriorityClass, SchedulerConfig
from appliance.core.request import Request


class SchedulingPolicy:
    """Arrival order (vLLM's "fcfs", this appliance's "continuous"): the queue in arrival
    order, no arrival-triggered preemption, admission every step."""

    name: ClassVar[str] = "continuous"

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.patience_steps = cfg.preemption_patience_steps
        self.max_preemptions = cfg.max_preemptions_per_request

    # -- ordering --------------------------------------------------------------------------------
    def queue_key(self, req: Request) -> tuple[int, float]:
        """Waiting and swapped requests are admitted in ascending order of this key."""
        return (0, req.arrival_time)

    def victim_key(self, req: Request) -> tuple[int, float]:
        """The largest is preempted first: least urgent, then latest arrival. Urgency counts
        under every policy (a preemption should cost the least urgent work, whatever the
        queue order), so this is not `queue_key`."""
        return req.sort_key()

    def serve_order(self, running: Iterable[Request]) -> list[Request]:
        """Running requests in the order they get the step's budget: the reverse of the victim
        order, so those preempted first for blocks are also granted last."""
        return sorted(running, key=self.victim_key)

    # -- preemption ------------------------------------------------------------------------------
    def is_protected(self, req: Request) -> bool:
        """Thrash guard: a request preempted this many times is not preempted again."""
        return req.num_preemptions >= self.max_preemptions

    def out_of_blocks_victim(self, req: Request, running: Iterable[Request]) -> Request:
        """Whom to preempt when running `req` needs blocks the pool lacks: the first in victim
        order among the unprotected running requests and `req` itself, protected or not (it can
        always give back its own blocks; it never takes a protected request's)."""
        candidates = [r for r in running if not self.is_protected(r) or r is req]
        return max(candidates, key=self.victim_key)

    def arrival_may_preempt(self, cause: str, pressure_steps: int) -> bool:
        """May a waiting request preempt running work? Never under arrival order: a request
        that arrived later is served later, so it has no claim on anyone's seat or blocks."""
        return False

    def arrival_victim(
        self, req: Request, running: Iterable[Request], cause: str, pressure_steps: int
    ) -> Request | None:
        """The running request that waiting `req` preempts to get in, or None: only strictly
        less urgent, unprotected work, and only when `arrival_may_preempt` allows it."""
        if not self.arrival_may_preempt(cause, pressure_steps):
            return None
        victims = [r for r in running if r.priority > req.priority and not self.is_protected(r)]
        return max(victims, key=self.victim_key) if victims else None

    # -- admission -------------------------------------------------------------------------------
    def may_admit(self, batch_running: bool) -> bool:
        """May waiting requests join this step, given whether anything runs (or was granted
        tokens) already?"""
        return True

    # -- the API's view of the queue -------------------------------------------------------------
    def counts_ahead(self, other_priority: int, mine: int) -> bool:
        """Is a waiting request of priority `other_priority` served before a new arrival of
        priority `mine`? Under arrival order every waiting request is."""
        return True

    def classes_ahead(self, classes: Mapping[str, PriorityClass], priority_class: str) -> list[str]:
        """The priority classes whose queued requests a new arrival of `priority_class` waits
        behind (its own always included; every class when it is not one of `classes`)."""
        mine = classes.get(priority_class)
        ahead = [
            name
            for name, pc in classes.items()
            if mine is None or self.counts_ahead(pc.priority, mine.priority)
        ]
        if priority_class not in ahead:
            ahead.append(priority_class)
        return ahead


class PriorityPolicy(SchedulingPolicy):
    """Ordered by (priority, arrival); a more urgent waiting request may preempt less urgent
    running work: at once when `max_num_seqs` is full, and for blocks only once the KV pressure
    has lasted `preemption_patience_steps` steps (so a short burst does not thrash)."""

    name: ClassVar[str] = "priority"

    def queue_key(self, req: Request) -> tuple[int, float]:
        return req.sort_key()

    def arrival_may_preempt(self, cause: str, pressure_steps: int) -> bool:
        return cause != "kv_pressure" or pressure_steps >= self.patience_steps

    def counts_ahead(self, other_priority: int, mine: int) -> bool:
        # Equally or more urgent requests go first; equal ones arrived earlier.
        return other_priority <= mine


class StaticPolicy(SchedulingPolicy):
    """Static batching: form a batch in arrival order and run it until all its members finish
    before admitting anyone (the baseline continuous batching is measured against)."""

    name: ClassVar[str] = "static"

    def may_admit(self, batch_running: bool) -> bool:
        return not batch_running


_POLICIES: dict[str, type[SchedulingPolicy]] = {
    "continuous": SchedulingPolicy,
    "fcfs": SchedulingPolicy,  # config reads it as "continuous"; accepted here all the same
    "priority": PriorityPolicy,
    "static": StaticPolicy,
}


def make_policy(cfg: SchedulerConfig) -> SchedulingPolicy:
    """The one place `scheduler.policy` is read."""
    return _POLICIES[cfg.policy](cfg)
