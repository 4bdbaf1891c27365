"""The preemption log: one `PreemptionEvent` per preemption, the latest 256 kept, which the
stats snapshot hands to /admin/stats and the console.

Recording only: `Scheduler.preempt` does the preemption (and counts it) and says here what it
did, so how an event is described never mixes with how a request is taken off the running list.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

from appliance.core.request import Request
from appliance.stats import PreemptionEvent


class PreemptionLog:
    def __init__(self, maxlen: int = 256) -> None:
        # Bounded: a box preempting all day keeps the recent story, not an ever-growing list.
        self._events: deque[PreemptionEvent] = deque(maxlen=maxlen)

    def __iter__(self) -> Iterator[PreemptionEvent]:
        return iter(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def record(
        self,
        victim: Request,
        cause: str,
        swapped: list[tuple[int, int]] | None,
        swap_fallback: bool,
        recompute_tokens: int,
        blocks_held: int,
        kv_usage: tuple[float, float],
    ) -> PreemptionEvent:
        """Log `victim`'s preemption, already done: `swapped` is its device->host copies (None
        when it will be recomputed), `kv_usage` the pool's usage before and after."""
        event = PreemptionEvent(
            time=time.time(),
            request_id=victim.request_id,
            priority_class=victim.priority_class or str(victim.priority),
            priority=victim.priority,
            mode="recompute" if swapped is None else "swap",
            swap_fallback=swap_fallback,
            cause=cause,
            tokens_to_recompute=recompute_tokens,
            blocks_swapped=len(swapped or []),
            blocks_held=blocks_held,
            kv_usage_before=kv_usage[0],
            kv_usage_after=kv_usage[1],
            times_preempted=victim.num_preemptions,
        )
        self._events.append(event)
        return event
