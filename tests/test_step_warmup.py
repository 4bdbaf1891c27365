"""The step cost model's seed at load (engine/step_warmup.py): each warm-up shape is run three
times and seeded with the faster of the last two, so a burst of a neighbour (another server
starting on the box) in one run does not reach the estimates that admit requests, while a box
that is slow in every run is seeded as slow. A chunk of the step's whole token budget is among
the shapes, so a short chunk slowed in every run is not extrapolated to a long one."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from appliance.core.scheduler_output import SchedulerOutput
from appliance.core.step_cost import StepCostModel, StepShape
from appliance.engine import step_warmup
from appliance.engine.llm_engine import Engine
from appliance.engine.step_warmup import BUDGET_CHUNK_MAX, REPEATS, needs_seed, seed_step_costs
from tests.test_preemption import engine_for

SLO = {
    "priority_classes__interactive__priority": 5,
    "priority_classes__interactive__ttft_slo_s": 8.0,
}
DELAY_S = 0.3


def first_chunk(out: SchedulerOutput) -> bool:
    return any(r.request_id == "warmup-prefill" and r.start_pos == 0 for r in out.scheduled)


def second_chunk(out: SchedulerOutput) -> bool:
    return any(r.request_id == "warmup-prefill" and r.start_pos > 0 for r in out.scheduled)


def budget_chunk(out: SchedulerOutput) -> bool:
    return any(r.request_id == "warmup-budget" for r in out.scheduled)


def reseed(
    engine: Engine,
    slow_runs: set[int],
    every_shape: bool = False,
    slowed_shape: Callable[[SchedulerOutput], bool] = first_chunk,
    delay_s: float = DELAY_S,
) -> list[tuple[StepShape, float]]:
    """Seed a fresh model, the runs numbered in `slow_runs` (0: the unkept first run) of
    `slowed_shape` (the first prefill chunk), or of every shape, slowed by `delay_s`; returns
    what the model was given."""
    runs = 0  # of the first chunk, the first shape of each round
    execute = engine.executor.execute

    def slowed(out: SchedulerOutput) -> object:
        nonlocal runs
        if first_chunk(out):
            runs += 1
        if out.scheduled and (every_shape or slowed_shape(out)) and runs - 1 in slow_runs:
            time.sleep(delay_s)
        return execute(out)

    engine.executor.execute = slowed  # type: ignore[method-assign]
    cost = StepCostModel(prompt_rows=engine.scheduler.cost.prompt_rows)
    seen: list[tuple[StepShape, float]] = []
    seed = cost.seed

    def record(steps: list[tuple[StepShape, float]]) -> None:
        seen.extend(steps)
        seed(steps)

    cost.seed = record  # type: ignore[method-assign]
    engine.scheduler.cost = cost
    try:
        assert seed_step_costs(engine) == 5
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


def test_a_short_chunk_slow_in_every_run_is_not_extrapolated_to_a_budget_chunk(
    engine: Engine,
) -> None:
    # A neighbour slowing the second chunk (128 tokens after 128) in both kept runs: fitted from
    # the two short chunks alone, that 0.3 s came out as the cost of the pairs the second adds
    # (16,384) and priced a chunk of the whole budget (its ~4,000x as many pairs) at minutes. The
    # budget's own chunk, measured, holds the estimate to its time.
    seen = reseed(engine, {1, 2}, slowed_shape=second_chunk)
    # The step's token budget, as far as the seed's cap allows (2,048 of 8,192 tokens here).
    cfg = engine.config.scheduler
    budget = min(cfg.max_num_batched_tokens, engine.max_model_len - 2, BUDGET_CHUNK_MAX)
    assert budget >= 1024
    measured = [s for shape, s in seen if shape.prefill_tokens == budget]
    assert len(measured) == 1 and [s.prefill_tokens for s, _ in seen][:2] == [128, 128]
    chunk = StepShape().with_chunk(0, budget)
    estimate = engine.scheduler.cost.estimate(chunk)
    assert estimate is not None
    # At most the slowed chunk's delay over the measured time (the fit shares that error).
    assert estimate <= measured[0] + DELAY_S, (estimate, measured[0])
    # A chat admitted behind half of it: priced at most as the whole chunk and its delay.
    later = StepShape().with_decode(64).with_chunk(budget // 2, budget // 2)
    later_s = engine.scheduler.cost.estimate(later)
    assert later_s is not None and later_s <= 2 * (measured[0] + DELAY_S), later_s


def test_a_shape_whose_first_run_is_long_runs_once(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The budget's chunk of a large model on a CPU takes many seconds: one run, seeded with it,
    # where a short shape runs three times (the limit lowered here, the delay with it).
    once_s = 0.4
    monkeypatch.setattr(step_warmup, "RUN_ONCE_S", once_s)
    runs = 0
    execute = engine.executor.execute

    def counted(out: SchedulerOutput) -> object:
        nonlocal runs
        runs += budget_chunk(out)
        return execute(out)

    engine.executor.execute = counted  # type: ignore[method-assign]
    try:
        seen = reseed(engine, {0}, slowed_shape=budget_chunk, delay_s=once_s + 0.1)
    finally:
        engine.executor.execute = execute  # type: ignore[method-assign]
    assert runs == 1
    budget = max(seen, key=lambda step: step[0].prefill_tokens)
    assert budget[1] > once_s + 0.1
    assert all(seconds < once_s for shape, seconds in seen if shape is not budget[0])
