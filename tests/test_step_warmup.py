"""The step cost model's seed at load (engine/step_warmup.py): each warm-up shape is run three
times and seeded with the faster of the last two, so a burst of a neighbour (another server
starting on the box) in one run does not reach the estimates that admit requests, while a box
that is slow in every run is seeded as slow."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from appliance.core.scheduler_output import SchedulerOutput
from appliance.core.step_cost import StepCostModel, StepShape
from appliance.engine.llm_engine import Engine
from appliance.engine.step_warmup import REPEATS, needs_seed, seed_step_costs
from tests.test_preemption import engine_for

SLO = {
    "priority_classes__interactive__priority": 5,
    "priority_classes__interactive__ttft_slo_s": 8.0,
}
DELAY_S = 0.3


def first_chunk(out: SchedulerOutput) -> bool:
    return any(r.request_id == "warmup-prefill" and r.start_pos == 0 for r in out.scheduled)


def reseed(
    engine: Engine, slow_runs: set[int], every_shape: bool = False
) -> list[tuple[StepShape, float]]:
    """Seed a fresh model, the runs numbered in `slow_runs` (0: the unkept first run) of the
    first prefill chunk, or of every shape, slowed by DELAY_S; returns what the model was
    given."""
    runs = 0  # of the first chunk, the first shape of each round
    execute = engine.executor.execute

    def slowed(out: SchedulerOutput) -> object:
        nonlocal runs
        if first_chunk(out):
            runs += 1
        if out.scheduled and (every_shape or first_chunk(out)) and runs - 1 in slow_runs:
            time.sleep(DELAY_S)
        return execute(out)

    engine.executor.execute = slowed  # type: ignore[method-assign]
    cost = StepCostModel(prompt_rows=engine.scheduler.cost.prompt_rows)
    seen: list[tuple[StepShape, float]] = []
    observe = cost.observe

    def record(shape: StepShape, seconds: float) -> None:
        seen.append((shape, seconds))
        observe(shape, seconds)

    cost.observe = record  # type: ignore[method-assign]
    engine.scheduler.cost = cost
    try:
        assert seed_step_costs(engine) == 4
    finally:
        engine.executor.execute = execute  # type: ignore[method-assign]
    assert runs == REPEATS == 3
    return seen


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    engine = engine_for(tiny_model_dir, **SLO)
    assert needs_seed(engine) and engine.scheduler.cost.ready
    return engine


def test_a_burst_in_one_run_does_not_reach_the_seed(engine: Engine) -> None:
    for slow in ({1}, {2}):
        seen = reseed(engine, slow)
        # The first chunk is the first shape given; its seconds are the other kept run's.
        chunk_s = seen[0][1]
        assert seen[0][0].prefill_tokens > 0 and seen[0][0].prefill_pairs > 0
        assert chunk_s < DELAY_S / 2, (slow, chunk_s)
        assert engine.scheduler.cost.ready
        assert engine.kv.usage().used == 0


def test_a_box_slow_in_every_run_is_seeded_as_slow(engine: Engine) -> None:
    seen = reseed(engine, {0, 1, 2}, every_shape=True)
    assert all(seconds >= DELAY_S for _, seconds in seen)
    # The model prices every shape as slow too (the estimates that admit requests). One
    # slowed shape alone would not do: the fit spreads it over its neighbours.
    for shape, _ in seen:
        estimate = engine.scheduler.cost.estimate(shape)
        assert estimate is not None and estimate >= 0.8 * DELAY_S, (shape, estimate)
