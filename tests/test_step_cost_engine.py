"""The cost model inside the engine (tiny model): seeded at load where a class sets an SLO,
refitted from the served steps, reported in the stats snapshot and on /metrics; and the time
budget leaves the outputs as they are."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from appliance.engine.stats import snapshot
from appliance.metrics.registry import Metrics
from appliance.sampling_params import SamplingParams
from tests.test_preemption import engine_for

SLO = {
    "priority_classes__interactive__priority": 5,
    "priority_classes__batch__priority": 10,
    "priority_classes__interactive__tpot_slo_ms": 5.0,
}


def test_seeded_at_load_refitted_as_it_serves_and_reported(tiny_model_dir: Path) -> None:
    engine = engine_for(tiny_model_dir, **SLO)
    try:
        seeded = engine.scheduler.cost.observations
        assert seeded >= 4 and engine.scheduler.cost.ready
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        engine.generate([[5 + i for i in range(40)], [9] * 300], params)
        cost = snapshot(engine).engine.step_cost
        assert cost is not None and cost.fitted and cost.observations > seeded
        assert cost.prefill_token_ms > 0 and cost.step_ms >= 0
        metrics = Metrics("tiny")
        metrics.update_engine(snapshot(engine).engine)
        text = generate_latest(metrics.registry).decode()
        assert 'appliance_step_cost_seconds{model_name="tiny",term="prefill_token"}' in text
    finally:
        engine.close()


def test_no_slo_no_warmup(tiny_model_dir: Path) -> None:
    engine = engine_for(tiny_model_dir)
    try:
        assert engine.scheduler.cost.observations == 0
    finally:
        engine.close()


def test_a_time_budget_changes_chunks_not_tokens(tiny_model_dir: Path) -> None:
    """Greedy outputs with a tight TPOT target (long prompts cut into more chunks while short
    ones decode) equal those under the token budget alone."""
    prompts = [[3 + (i * 7) % 200 for i in range(n)] for n in (20, 700, 33, 900)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    budget = {"scheduler__max_num_batched_tokens": 256}
    plain = engine_for(tiny_model_dir, **budget)
    try:
        expected = [r.token_ids for r in plain.generate(prompts, params)]
    finally:
        plain.close()
    timed = engine_for(tiny_model_dir, **SLO, **budget)
    try:
        got = [r.token_ids for r in timed.generate(prompts, params, priority="interactive")]
        bounds = {r.bound_by for r in timed.history.records}
    finally:
        timed.close()
    assert got == expected
    assert "time_budget" in bounds
