"""The engine's ring buffer of per-step records (the types are in appliance.stats)."""

from __future__ import annotations

from collections import deque

from appliance.stats import StepRecord


class StepHistory:
    """The last `maxlen` step records (about a minute of steps for the console)."""

    def __init__(self, maxlen: int | None = 4096) -> None:
        self.records: deque[StepRecord] = deque(maxlen=maxlen)

    def append(self, record: StepRecord) -> None:
        self.records.append(record)

    def since(self, t: float) -> list[StepRecord]:
        return [r for r in self.records if r.time >= t]
