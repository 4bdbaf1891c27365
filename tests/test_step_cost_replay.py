"""The step cost model (core/step_cost.py) replayed on a served run of this box: every step of
issue 26's mixed load, estimated before the model sees it."""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pytest

from appliance.core.step_cost import StepCostModel, StepShape


def served_steps() -> list[tuple[StepShape, float]]:
    """Every step of issue 26's mixed load at 1 req/s served by `cpu-demo` on a 2-core Sapphire
    Rapids (tests/data/served-steps-spr-1rps.jsonl.gz: each step's rows as (tokens, start
    position) and its measured seconds; docs/benchmarks.md, "Sapphire Rapids, afternoon")."""
    path = Path(__file__).parent / "data" / "served-steps-spr-1rps.jsonl.gz"
    steps = []
    with gzip.open(path, "rt") as f:
        for line in f:
            step = json.loads(line)
            shape = StepShape()
            for tokens, start in step["rows"]:
                shape = shape.with_decode(start) if tokens == 1 else shape.with_chunk(start, tokens)
            steps.append((shape, step["s"]))
    return steps


def test_a_served_run_is_predicted_step_by_step() -> None:
    """Replayed step by step, each step estimated before the model sees it: the estimates'
    mean error stays under 2 ms (a fit over the last 128 steps of each kind: 2.8 ms), and each
    lone short decode row is priced within 35% of what the last ones measured (that fit: up
    to 2.2x, its rows and context costs trading places as the mix moved)."""
    steps = served_steps()
    model = StepCostModel()
    errors: list[float] = []
    lone: list[float] = []  # measured seconds of the lone short decode rows so far
    for i, (shape, seconds) in enumerate(steps):
        if model.ready:
            estimate = model.estimate(shape)
            assert estimate is not None
            errors.append(abs(estimate - seconds))
        if shape.decode_rows == 1 and shape.decode_context < 300 and not shape.prefill_tokens:
            # (after the run's first 300 steps: a served engine is seeded at load instead)
            if i >= 300 and len(lone) >= 5:
                measured = statistics.median(lone[-5:])
                assert estimate == pytest.approx(measured, rel=0.35)
            lone.append(seconds)
        model.observe(shape, seconds)
    assert len(lone) > 300
    assert statistics.mean(errors) < 2e-3
