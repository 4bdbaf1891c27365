"""When a step that prefills pauses between two units of its forward (a layer's attention and
MLP halves, run_layers) for the decodes it left out (scheduler.interleave_decodes), and what a
paused step keeps until it resumes. The engine asks `PauseRule.due` between units; the clock
is the caller's, so the rule is tested without a forward."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from appliance.core.request import FinishReason
from appliance.core.scheduler_output import SchedulerOutput
from appliance.core.step_cost import MIN_SLICE_FRACTION


@dataclass
class PauseRule:
    """When a step that prefills pauses between two half-layers (Engine._should_pause)."""

    request_ids: frozenset[str]
    # The queue rank an arrival must beat to cut into it (Scheduler.cut_in_rank); None: none.
    rank: int | None
    # When its forward last started or resumed, when a pause was last asked (between which
    # two, the unit that just ran: a layer's half, run_layers), and the unit before's length.
    since: float
    asked: float = 0.0
    previous_unit: float = 0.0
    # When the decodes left out are due their step (None: never): the first slice's end
    # (`start`), then `resumed`'s.
    due_at: float | None = None
    # Their TPOT target (the step's decode_interval_s, or, once a cut-in admitted a request
    # whose class sets one, that class's): None while the step pauses for arrivals only.
    interval_s: float | None = None

    @classmethod
    def start(
        cls,
        request_ids: frozenset[str],
        rank: int | None,
        slice_s: float | None,
        since: float,
        interval_s: float | None = None,
    ) -> PauseRule:
        """The rule of a step starting at `since`: the decodes it left out are due `slice_s`
        later (Scheduler.interleave_slice_s; None: it carries its decodes)."""
        due_at = None if slice_s is None else since + slice_s
        return cls(request_ids, rank, since, due_at=due_at, interval_s=interval_s)

    def due(self, now: float) -> bool:
        """Whether the next unit would end past `due_at` (a pause at the first check past it
        came a unit late: docs/admission.md), the next expected to take as long as the longer
        of the last two: the halves differ, the attention's growing with the context. Records
        the unit that just ran."""
        unit = now - max(self.asked, self.since)
        expected = max(unit, self.previous_unit)
        self.asked, self.previous_unit = now, unit
        return self.due_at is not None and now + expected >= self.due_at

    def resumed(self, now: float, paused_at: float, interval_s: float | None) -> PauseRule:
        """The rule after a pause whose step began at `paused_at`: its decodes got their token at
        its end and are due the next one `interval_s` (their TPOT target) after the one before,
        so the next pause's step starts `interval_s` after this one started. That counts the
        pause's own step and the host's time around it, which a slice from the resume (the
        target less the step's expected cost) left out: chats' tokens came 41-47 ms apart under
        a 35 ms target (docs/admission.md). The prefill still gets a quarter of the target."""
        due_at = None
        if interval_s is not None:
            due_at = max(paused_at + interval_s, now + interval_s * MIN_SLICE_FRACTION)
        return replace(self, since=now, due_at=due_at, interval_s=interval_s)


@dataclass
class PausedStep:
    """A step whose forward paused between two half-layers for a cut-in step (Engine.step)."""

    out: SchedulerOutput
    started: float
    paused_at: float
    rule: PauseRule
    # Seconds of its wall time that cut-in steps took, before the latest pause.
    excluded: float = 0.0
    # Finishes (aborts, queue timeouts) asked for while it was paused, done when it ends.
    finishes: list[tuple[str, FinishReason, str]] = field(default_factory=list)
