"""The autoscaling policy: replicas from the engines' own queue figures (what each replica's
record_autoscaling_stats reports), not Ray Serve's count of ongoing calls, which never sees the
HTTP traffic the ingress sends straight to the replicas' servers.

One more replica (or as many as the waiting requests need, at target_waiting each) while
requests wait beyond what the replicas hold or a new request's estimated wait is over
target_wait_s; one fewer once nothing waits and nothing runs; otherwise stay. Ray Serve wraps
the decision with min/max_replicas and its delays (upscale_delay_s short, downscale_delay_s
long: up fast, down slow), which it applies to custom policies as to its own."""

from __future__ import annotations

import math
from typing import Any


def desired_replicas(
    current: int,
    waiting: float,
    running: float,
    longest_wait_s: float | None,
    target_waiting: float,
    target_wait_s: float,
) -> int:
    """The replica count the figures ask for (pure: tested without Ray)."""
    current = max(current, 1)
    if waiting > target_waiting * current or (
        longest_wait_s is not None and waiting > 0 and longest_wait_s > target_wait_s
    ):
        return max(current + 1, math.ceil(waiting / target_waiting))
    if waiting <= 0 and running <= 0:
        return current - 1
    return current


class QueueDepthPolicy:
    """Ray Serve's custom policy interface: a class built with policy_kwargs, called with an
    AutoscalingContext, returning (replicas, policy state)."""

    def __init__(self, target_waiting: float = 4.0, target_wait_s: float = 2.0) -> None:
        self.target_waiting = target_waiting
        self.target_wait_s = target_wait_s

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics: dict[str, dict[Any, float]] = ctx.aggregated_metrics or {}
        waiting = sum(metrics.get("waiting", {}).values())
        running = sum(metrics.get("running", {}).values())
        waits = [w for w in metrics.get("estimated_wait_s", {}).values() if w >= 0]
        want = desired_replicas(
            ctx.current_num_replicas,
            waiting,
            running,
            max(waits) if waits else None,
            self.target_waiting,
            self.target_wait_s,
        )
        return want, {"waiting": waiting, "running": running}
