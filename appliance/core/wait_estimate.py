"""How long a newly arrived request would wait in the queue, from what the engine measures.

A queued request starts when a sequence slot frees for it. When every slot is taken, slots free
at the rate at which started requests leave the engine (finish, or are aborted), so a request
with `ahead` requests queued before it and `free` slots open waits about

    (ahead + 1 - free) / departure rate          (0 when ahead < free)

(Little's law on the running batch). The departure rate is measured over the engine's busy time
only, the last WINDOW_S seconds of steps: idle gaps say nothing about how fast the box serves,
and counting them would make a burst after a quiet minute look hopeless. Until MIN_DEPARTURES
requests have left in that window there is no estimate (None), and admission does not refuse on
a guess.

Slots are the limit this models (scheduler.max_num_seqs); when KV blocks run out first, slots
look free while requests still wait, the estimate is low, and the queue timeout itself (on its
timer) remains the bound.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 30.0
MIN_DEPARTURES = 4


class DepartureRate:
    """Started requests leaving the engine, per second of engine busy time."""

    def __init__(self, window_s: float = WINDOW_S, min_departures: int = MIN_DEPARTURES) -> None:
        self.window_s = window_s
        self.min_departures = min_departures
        self._steps: deque[tuple[float, int]] = deque()
        self._busy_s = 0.0
        self._departures = 0

    def observe(self, duration_s: float, departures: int) -> None:
        """One engine step: how long it took and how many started requests it finished."""
        self._steps.append((duration_s, departures))
        self._busy_s += duration_s
        self._departures += departures
        while len(self._steps) > 1 and self._busy_s - self._steps[0][0] >= self.window_s:
            d, n = self._steps.popleft()
            self._busy_s -= d
            self._departures -= n

    @property
    def rate(self) -> float | None:
        """Departures per busy second, or None while too few were seen to say."""
        if self._departures < self.min_departures or self._busy_s <= 0:
            return None
        return self._departures / self._busy_s


def estimated_wait_s(ahead: int, free_slots: int, rate: float | None) -> float | None:
    """Seconds until a request with `ahead` queued before it is scheduled (None: unknown)."""
    if ahead < free_slots:
        return 0.0
    if rate is None or rate <= 0:
        return None
    return (ahead + 1 - max(free_slots, 0)) / rate
