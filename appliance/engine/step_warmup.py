"""Seed the scheduler's step cost model at load (core/step_cost.py) with a few timed steps of
known shape, run through the real executor on free KV blocks: two prefill chunks of one prompt
(the second attends over the first; each longer than a step of prompt rows), one chunk of a whole
step's token budget, then decode steps of one row and of several rows, each timed twice after a
first run and seeded with the faster. Only where a class sets an SLO (the model is then asked
from the first request on); otherwise the model learns from the served steps alone.

The budget-sized chunk is the shape admission prices first: a chat arriving behind a summary's
prompt is estimated before any of that prompt's chunks has been served. Fitted from the two short
chunks alone, the cost per query-key pair came from the difference of two ~0.1 s steps and was
extrapolated 40-fold; one of them slowed by 0.2 s priced a 960-token chunk at 13 s (0.8 s
true), and a chat was refused so (docs/benchmarks.md, "Dec 5, evening"). Measured at its size,
an error in that chunk is an error of its own ratio."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from appliance.core.scheduler_output import ScheduledRequest, SchedulerOutput
from appliance.core.step_cost import StepShape
from appliance.sampling_params import SamplingParams

if TYPE_CHECKING:
    from appliance.engine.llm_engine import Engine

PREFILL_TOKENS = 256
DECODE_ROWS = 8
# The first run of a shape pays one-off costs (primitive creation): it is not kept. Of the
# others the fastest is: a neighbour's burst (another server starting on the box) only ever
# slows a run, and a slowed seed extrapolated to 1,024-token steps refuses chats at arrival.
REPEATS = 3
# A shape whose first run took longer is run once and seeded with that run: its one-off costs
# (the small model's 1,024-token chunk took 0.68 s in its first run on Sapphire Rapids,
# 0.63-0.65 s after) are then a small share of it, and the budget's chunk of a 7B model on a
# CPU (tens of seconds) is not run three times at load. vLLM's own start-up runs one forward
# of that size.
RUN_ONCE_S = 5.0
# The budget's chunk stops here: from 2,048 tokens an estimate of an 8,192-token budget's chunk
# extrapolates 4-fold in tokens, not 32-fold as from 256, and its one run stays a short part of
# a CPU's load time (an 8,192-token prefill of a 7B model is minutes there).
BUDGET_CHUNK_MAX = 2048


def needs_seed(engine: Engine) -> bool:
    classes = engine.config.priority_classes.values()
    return any(c.tpot_slo_ms or c.ttft_slo_s for c in classes)


def seed_step_costs(engine: Engine) -> int:
    """Run and time the warm-up steps; returns how many were observed."""
    bs = engine.kv.block_size
    cfg = engine.config.scheduler
    # Chunks longer than a step the fused decode takes as rows (StepShape.runs_as_rows): they
    # seed what a torch prefill step costs.
    half = max(PREFILL_TOKENS // 2, engine.scheduler.cost.prompt_rows + 1)
    half = min(half, cfg.max_num_batched_tokens, (engine.max_model_len - 2) // 2)
    prompt = 2 * half
    # The budget's chunk, as far as the free blocks and the model's length allow, and at most
    # BUDGET_CHUNK_MAX tokens.
    budget = min(cfg.max_num_batched_tokens, engine.max_model_len - 2, BUDGET_CHUNK_MAX)
    budget = min(budget, engine.kv.num_blocks * bs - 1)
    blocks = list(range(-(-(max(prompt, budget) + 1) // bs)))
    if prompt < 2 or len(blocks) > engine.kv.num_blocks:
        return 0
    vocab = engine.loaded.args.vocab_size
    tokens = [(7 * i + 3) % vocab for i in range(max(prompt, budget))]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rows = min(DECODE_ROWS, cfg.max_num_seqs)

    def step(name: str, start: int, ids: list[int], new: bool = True) -> ScheduledRequest:
        return ScheduledRequest(name, ids, start, blocks if new else [], False, params, 0, new)

    plans: list[list[ScheduledRequest]] = [
        [step("warmup-prefill", 0, tokens[:half])],
        [step("warmup-prefill", half, tokens[half:prompt], new=False)],
        [step("warmup-decode-0", prompt, tokens[:1])],
        [step(f"warmup-decode-{i}", prompt, tokens[:1]) for i in range(rows)],
    ]
    if budget > prompt:
        plans.append([step("warmup-budget", 0, tokens[:budget])])
    names = sorted({r.request_id for plan in plans for r in plan})

    def output(plan: list[ScheduledRequest]) -> SchedulerOutput:
        count = sum(len(r.token_ids) for r in plan)
        return SchedulerOutput(scheduled=plan, num_scheduled_tokens=count)

    fastest = [math.inf] * len(plans)
    once = [False] * len(plans)
    for repeat in range(REPEATS):
        for i, plan in enumerate(plans):
            if once[i]:
                continue
            out = output(plan)
            started = time.perf_counter()
            engine.executor.execute(out)
            seconds = time.perf_counter() - started
            if repeat:
                fastest[i] = min(fastest[i], seconds)
            elif seconds > RUN_ONCE_S:
                fastest[i], once[i] = seconds, True
        # The runner forgets the warm-up's block tables (the blocks were never the KV
        # manager's: they are written afresh by whoever is given them).
        engine.executor.execute(SchedulerOutput(finished_request_ids=names))
    engine.scheduler.cost.seed(
        [
            (StepShape.of(output(plan)), seconds)
            for plan, seconds in zip(plans, fastest, strict=True)
        ]
    )
    return len(plans)
