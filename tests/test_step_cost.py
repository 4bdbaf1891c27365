"""The step cost model (core/step_cost.py) and the time budget it gives the scheduler: against a
synthetic step-time function whose coefficients the test knows. Pure Python."""

from __future__ import annotations

import random

import pytest

from appliance.config import ConfigError, load_config
from appliance.core.step_cost import MIN_CHUNK, StepCostModel, StepShape, fit_nonnegative
from tests.test_scheduler import make, req, step

# A box where a step costs 4 ms, a decode row 1.5 ms, a context token 2 us, a prefill token
# 0.8 ms and a query-key pair of a chunk 3 ns; a step with prefill pays 20 ms more once (the
# CPU's torch forward instead of the fused native decode).
TRUE = {"step": 4e-3, "row": 1.5e-3, "ctx": 2e-6, "tok": 0.8e-3, "pair": 3e-9, "prefill": 20e-3}


def true_seconds(shape: StepShape) -> float:
    return (
        TRUE["step"]
        + TRUE["row"] * shape.decode_rows
        + TRUE["ctx"] * shape.decode_context
        + TRUE["tok"] * shape.prefill_tokens
        + TRUE["pair"] * shape.prefill_pairs
        + (TRUE["prefill"] if shape.prefill_tokens else 0.0)
    )


def random_shape(rng: random.Random) -> StepShape:
    shape = StepShape()
    for _ in range(rng.randint(0, 24)):
        shape = shape.with_decode(rng.randint(10, 3000))
    if rng.random() < 0.5 or shape.decode_rows == 0:
        shape = shape.with_chunk(rng.randint(0, 2000), rng.randint(16, 1024))
    return shape


def trained(noise: float = 0.02, steps: int = 400, seed: int = 0) -> StepCostModel:
    rng = random.Random(seed)
    model = StepCostModel()
    for _ in range(steps):
        shape = random_shape(rng)
        model.observe(shape, true_seconds(shape) * (1 + rng.uniform(-noise, noise)))
    model.refit()
    return model


def test_the_model_converges_on_a_synthetic_step_time_function() -> None:
    exact = trained(noise=0.0).describe()
    assert exact["step_ms"] == pytest.approx(4.0, rel=0.01)
    assert exact["decode_row_ms"] == pytest.approx(1.5, rel=0.01)
    assert exact["decode_context_us_per_token"] == pytest.approx(2.0, rel=0.01)
    assert exact["prefill_token_ms"] == pytest.approx(0.8, rel=0.01)
    assert exact["prefill_pair_ns"] == pytest.approx(3.0, rel=0.01)
    assert exact["prefill_step_ms"] == pytest.approx(20.0, rel=0.01)
    # With 2% noise on every step: the terms that weigh in a step are found again (the pairs'
    # are under 1% of a prefill step's time here, below the noise: over 12 seeds their
    # coefficient came out 0-2.3x the true one, with the old 128-step windows as with these
    # sums), and every estimate is within 5%.
    model = trained()
    assert model.ready
    figures = model.describe()
    assert figures["step_ms"] == pytest.approx(4.0, rel=0.15)
    assert figures["decode_row_ms"] == pytest.approx(1.5, rel=0.15)
    assert figures["prefill_token_ms"] == pytest.approx(0.8, rel=0.05)
    assert figures["prefill_step_ms"] == pytest.approx(20.0, rel=0.1)
    rng = random.Random(99)
    for _ in range(50):
        shape = random_shape(rng)
        estimate = model.estimate(shape)
        assert estimate == pytest.approx(true_seconds(shape), rel=0.05)


def test_a_steady_mix_still_tells_rows_from_context() -> None:
    """A served mix whose rows and context move together for the last few hundred steps (a
    few summaries decoding): the model still prices a lone short row as it was measured
    before, not as the last seconds' fit would (a 128-step window priced it 16 ms on a box
    where it took 11: docs/benchmarks.md)."""
    model = trained()
    rng = random.Random(3)
    for _ in range(600):
        rows = rng.randint(5, 7)
        shape = StepShape()
        for _ in range(rows):
            shape = shape.with_decode(1800)
        model.observe(shape, true_seconds(shape) * (1 + rng.uniform(-0.02, 0.02)))
    lone = StepShape().with_decode(100)
    assert model.estimate(lone) == pytest.approx(true_seconds(lone), rel=0.1)


def test_the_model_follows_a_box_that_got_slower() -> None:
    """Shared boxes drift: after the steps of a 2x slower box, the estimate doubles."""
    model = trained()
    rng = random.Random(5)
    for _ in range(300):
        shape = random_shape(rng)
        model.observe(shape, 2 * true_seconds(shape))
    shape = StepShape().with_decode(500).with_chunk(0, 512)
    assert model.estimate(shape) == pytest.approx(2 * true_seconds(shape), rel=0.05)


def test_the_first_served_chunks_correct_a_seed_a_neighbour_spoiled() -> None:
    """The load-time seed's shapes (engine/step_warmup.py, before its budget-sized chunk), the
    second 128-token chunk slowed 0.2 s by a neighbour: the pair term comes out ~4,000x its
    value and a 960-token chunk is priced at ~13 s. The served steps then refit the model at
    once: a summary's two chunks bring it within 1.5x of the truth, where a refit
    every 8 steps left it above 9 s after four."""
    model = StepCostModel()
    rows = StepShape()
    for _ in range(8):
        rows = rows.with_decode(256)
    seed = [StepShape().with_chunk(0, 128), StepShape().with_chunk(128, 128)]
    seed += [StepShape().with_decode(256), rows]
    model.seed(
        [(shape, true_seconds(shape) + (0.2 if i == 1 else 0.0)) for i, shape in enumerate(seed)]
    )
    chunk = StepShape().with_decode(300).with_chunk(500, 960)
    spoiled = model.estimate(chunk)
    assert spoiled is not None and spoiled > 10 * true_seconds(chunk)
    # A 1,500-token summary in two steps of a 1,024-token budget, two chats decoding.
    for start, tokens in ((0, 1022), (1022, 478)):
        served = StepShape().with_decode(80).with_decode(100).with_chunk(start, tokens)
        model.observe(served, true_seconds(served))
    corrected = model.estimate(chunk)
    assert corrected is not None
    assert true_seconds(chunk) / 1.5 < corrected < 1.5 * true_seconds(chunk)


def test_a_decode_step_is_not_charged_the_prefill_steps_extra_cost() -> None:
    """A dozen decodes alone cost their rows; the same step with a 32-token chunk pays the
    switch to the prefill path once, on top of the chunk's tokens."""
    model = trained()
    decodes = StepShape.decoding([600] * 12)
    assert (decodes.decode_rows, decodes.decode_context, decodes.prefill_tokens) == (
        12,
        12 * 601,
        0,
    )
    alone = model.estimate(decodes)
    with_chunk = model.estimate(decodes.with_chunk(0, 32))
    assert alone is not None and with_chunk is not None
    assert alone == pytest.approx(true_seconds(decodes), rel=0.05)
    assert with_chunk - alone == pytest.approx(20e-3 + 32 * 0.8e-3, rel=0.1)


def test_fitted_costs_are_never_negative() -> None:
    # Steps that got faster with more rows (noise on a tiny model): the row cost is 0, not < 0.
    rows = [((1.0, float(n), 0.0, 0.0, 0.0), 0.01 - 0.0001 * n) for n in range(1, 30)]
    coef = fit_nonnegative(rows)
    assert coef is not None and all(c >= 0 for c in coef)


@pytest.mark.parametrize("limit_ms", [20, 50, 200])
def test_the_estimate_bounds_the_chunk(limit_ms: float) -> None:
    model = trained()
    shape = StepShape()
    for _ in range(4):
        shape = shape.with_decode(800)
    limit = limit_ms / 1e3
    chunk = model.max_chunk(shape, 1000, 4000, limit)
    estimate = model.estimate(shape.with_chunk(1000, chunk))
    assert estimate is not None
    if chunk > MIN_CHUNK:
        assert estimate <= limit
        over = model.estimate(shape.with_chunk(1000, chunk + 1))
        assert over is not None and over > limit
    # And the true step time the chunk gives stays near the limit (the model is close).
    assert true_seconds(shape.with_chunk(1000, chunk)) <= limit * 1.05 or chunk == MIN_CHUNK


def test_an_unfitted_model_never_cuts() -> None:
    assert StepCostModel().max_chunk(StepShape().with_decode(10), 0, 3000, 0.001) == 3000


CLASSES = {"priority_classes.interactive.priority": 5, "priority_classes.batch.priority": 10}
SLO = {
    **CLASSES,
    "priority_classes.interactive.tpot_slo_ms": 60.0,
    "scheduler.max_num_batched_tokens": 4096,
}


def seeded(overrides: dict[str, object]) -> object:
    s = make(overrides, num_blocks=512)
    s.cost = trained()
    return s


def test_a_decoding_class_with_a_tpot_target_cuts_a_long_prefill_by_time() -> None:
    s = seeded(SLO)
    s.add_request(req("short", 32, max_tokens=64, cls="interactive"))
    step(s)  # the short prompt, then it decodes
    s.add_request(req("long", 3000, max_tokens=4, cls="batch", base=5000))
    out = step(s)
    chunk = next(len(r.token_ids) for r in out.scheduled if r.request_id == "long")
    assert out.bound_by == "time_budget"
    assert 16 <= chunk < 3000
    shape = StepShape.of(out)
    assert true_seconds(shape) <= 0.060 * 1.05
    # Without the target the same step takes the whole prompt (the token budget allows it).
    plain = seeded({**CLASSES, "scheduler.max_num_batched_tokens": 4096})
    plain.add_request(req("short", 32, max_tokens=64, cls="interactive"))
    step(plain)
    plain.add_request(req("long", 3000, max_tokens=4, cls="batch", base=5000))
    out = step(plain)
    assert next(len(r.token_ids) for r in out.scheduled if r.request_id == "long") == 3000


def first_chunk(s: object, request_id: str, prompt: int, cls: str) -> tuple[int, str | None]:
    """Queue a prompt of `prompt` tokens on scheduler `s` and step once: (its chunk, what
    bound the step)."""
    s.add_request(req(request_id, prompt, max_tokens=4, cls=cls, base=5000))  # type: ignore[attr-defined]
    out = step(s)
    return next(len(r.token_ids) for r in out.scheduled if r.request_id == request_id), out.bound_by


def test_a_summary_on_an_idle_box_is_cut_to_the_target_of_the_present_classes_outranking_it() -> (
    None
):
    """No chat decodes, yet a chat arriving during the step would wait for it: where chats
    came in the last CLASS_PRESENCE_S seconds, a batch prompt's chunk keeps the step within
    interactive's TPOT target. An interactive prompt of the same length, which no class with a
    target outranks, takes the token budget; so does the summary where no chat was ever seen,
    or none for longer than CLASS_PRESENCE_S (a box serving one class)."""
    s = seeded(SLO)
    s.add_request(req("chat", 32, max_tokens=1, cls="interactive"))
    while s.has_unfinished():
        step(s)
    chunk, bound = first_chunk(s, "summary", 3000, "batch")
    assert bound == "time_budget"
    assert 16 <= chunk < 3000
    chat = seeded(SLO)
    assert first_chunk(chat, "pasted", 3000, "interactive")[0] == 3000
    never = seeded(SLO)
    assert first_chunk(never, "summary", 3000, "batch")[0] == 3000


def test_a_class_stops_protecting_once_absent_for_the_presence_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same summary, CLASS_PRESENCE_S seconds and a bit after the last chat: uncut. The
    clock is the scheduler module's."""
    from appliance.core import scheduler as scheduler_module

    s = seeded(SLO)
    s.add_request(req("chat", 32, max_tokens=1, cls="interactive"))
    while s.has_unfinished():
        step(s)
    later = scheduler_module.time.monotonic() + scheduler_module.CLASS_PRESENCE_S + 1.0

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return later

    monkeypatch.setattr(scheduler_module, "time", Clock)
    assert not s.class_present("interactive")
    assert first_chunk(s, "summary", 3000, "batch")[0] == 3000
    # A chat arriving now makes the class present again.
    s.add_request(req("chat-2", 32, max_tokens=1, cls="interactive", base=9000))
    assert s.class_present("interactive")


def test_a_short_request_behind_a_long_prompt_gets_its_first_token_before_that_prefill_ends() -> (
    None
):
    s = seeded(SLO)
    s.add_request(req("chat-1", 32, max_tokens=200, cls="interactive"))
    step(s)
    s.add_request(req("summary", 3500, max_tokens=4, cls="batch", base=5000))
    step(s)  # the summary's first chunk, cut by time
    s.add_request(req("chat-2", 48, max_tokens=8, cls="interactive", base=20000))
    first_token_step = summary_done_step = None
    for n in range(1, 200):
        out = step(s)
        for r in out.scheduled:
            if r.request_id == "chat-2" and r.sample and first_token_step is None:
                first_token_step = n
            if r.request_id == "summary" and r.sample and summary_done_step is None:
                summary_done_step = n
        if first_token_step and summary_done_step:
            break
    assert first_token_step is not None and summary_done_step is not None
    assert first_token_step < summary_done_step


def test_a_chat_queued_behind_a_summary_gets_its_prompt_before_the_summary_s_next_chunk() -> None:
    """Under the priority policy, while a chat decodes under a TPOT target and a summary's
    prefill runs in time-cut chunks, a chat that arrives gets its whole prompt in the next step: its admission comes
    before the summary's chunk, which takes what the step's time has left (16-token scraps of
    the chat's prompt otherwise). The step stays within the target; the TTFT estimate at the
    chat's arrival counts the summary's chunks as lengthening its steps, not as ahead of it."""
    from appliance.core.ttft_estimate import estimate_ttft_s

    s = seeded({**SLO, "scheduler.policy": "priority"})
    s.add_request(req("chat-1", 32, max_tokens=200, priority=5, cls="interactive"))
    step(s)
    s.add_request(req("summary", 3500, max_tokens=4, priority=10, cls="batch", base=5000))
    alone = next(len(r.token_ids) for r in step(s).scheduled if r.request_id == "summary")
    chat = req("chat-2", 24, max_tokens=8, priority=5, cls="interactive", base=20000)
    estimate = estimate_ttft_s(s, chat)
    s.add_request(chat)
    out = step(s)
    granted = {r.request_id: len(r.token_ids) for r in out.scheduled}
    assert granted["chat-2"] == 24
    # The summary progresses, by MIN_CHUNK only: the chat's first token is not held for it.
    assert granted["summary"] == MIN_CHUNK < alone
    assert true_seconds(StepShape.of(out)) <= 0.060 * 1.05
    # One step: the estimate is that step's cost, not the summary's remaining prefill.
    assert estimate is not None and estimate <= 0.060 * 1.1


def test_a_summary_admitted_with_a_chat_progresses_by_min_chunk_in_that_step() -> None:
    """A chat and a summary arriving together on an idle box (no time target binds: nothing
    decodes, no class was seen): the chat's prompt is admitted first, and the summary, behind
    it in the same step, takes MIN_CHUNK tokens instead of the rest of the budget, so the step
    that carries the chat's first token stays short. Alone, it takes the budget."""
    s = seeded(
        {**CLASSES, "scheduler.policy": "priority", "scheduler.max_num_batched_tokens": 4096}
    )
    s.add_request(req("summary", 3000, max_tokens=4, priority=10, cls="batch", base=5000))
    s.add_request(req("chat", 24, max_tokens=4, priority=5, cls="interactive", base=20000))
    granted = {r.request_id: len(r.token_ids) for r in step(s).scheduled}
    assert granted == {"chat": 24, "summary": MIN_CHUNK}
    # The next step, the chat decoding, the summary's chunks are no longer capped.
    granted = {r.request_id: len(r.token_ids) for r in step(s).scheduled}
    assert granted["chat"] == 1 and granted["summary"] == 3000 - MIN_CHUNK


def test_the_ttft_estimate_of_an_interleaving_engine_prices_whole_chunks_and_decode_steps() -> None:
    """A chat decodes under a 60 ms target. A summary queued behind another (both batch, which
    the chat outranks): an interleaving engine prefills both prompts in one budget-sized step
    that leaves the chat's decodes out, and pays the chat's decode step once per slice of it
    (the target less that step's cost); its estimate is that arithmetic. A prompt of the
    chat's own class keeps the decodes in its step: no decode steps are added."""
    import math

    from appliance.core.ttft_estimate import estimate_ttft_s

    s = seeded({**SLO, "scheduler.policy": "priority"})
    s.add_request(req("chat-1", 32, max_tokens=200, priority=5, cls="interactive"))
    step(s)
    s.add_request(req("summary-1", 3000, max_tokens=4, priority=10, cls="batch", base=5000))
    late = req("summary-2", 24, max_tokens=8, priority=10, cls="batch", base=20000)
    interleaved = estimate_ttft_s(s, late, interleave=True)
    chunks = StepShape().with_chunk(0, 3000).with_chunk(0, 24)
    prefill_s = s.cost.estimate(chunks)
    decode_s = s.cost.estimate(StepShape().with_decode(32))
    slice_s = max(0.060 - decode_s, 0.060 * 0.25)
    expected = prefill_s + math.ceil(prefill_s / slice_s) * decode_s
    assert interleaved == pytest.approx(expected, rel=1e-6)
    assert interleaved > prefill_s + decode_s
    # The same prompts in the chat's class: one step with the decode in it.
    same = seeded({**SLO, "scheduler.policy": "priority"})
    same.add_request(req("chat-1", 32, max_tokens=200, priority=5, cls="interactive"))
    step(same)
    same.add_request(req("pasted", 3000, max_tokens=4, priority=5, cls="interactive", base=5000))
    chat = req("chat-2", 24, max_tokens=8, priority=5, cls="interactive", base=20000)
    whole = StepShape().with_decode(32).with_chunk(0, 3000).with_chunk(0, 24)
    assert estimate_ttft_s(same, chat, interleave=True) == pytest.approx(
        same.cost.estimate(whole), rel=1e-6
    )


def decoding_chat_and_summary(overrides: dict[str, object]) -> object:
    """A scheduler on which a chat (interactive, 60 ms target) and a 600-token summary (batch)
    both decode."""
    s = seeded({**SLO, "scheduler.policy": "priority", **overrides})
    s.add_request(req("chat", 32, max_tokens=200, priority=5, cls="interactive"))
    s.add_request(req("summary-1", 600, max_tokens=200, priority=10, cls="batch", base=3000))
    while s.requests["summary-1"].num_output_tokens == 0:
        step(s)
    return s


def test_an_interleaving_step_keeps_the_decodes_that_outrank_none_of_its_prefill() -> None:
    """A second summary's prompt: the step leaves the chat's decode out (it outranks the
    prefill and has a 60 ms target) but keeps the first summary's (batch, no TPOT target),
    whose token comes at the step's end; the slice between the chat's steps is priced on the
    chat's row alone. With a TPOT target for batch, the summary's decode is left out too."""
    s = decoding_chat_and_summary({})
    s.add_request(req("summary-2", 3000, max_tokens=4, priority=10, cls="batch", base=5000))
    out = s.schedule(interleave=True)
    granted = {r.request_id: len(r.token_ids) for r in out.scheduled}
    assert granted == {"summary-1": 1, "summary-2": 3000}
    assert out.decode_interval_s == 0.060
    chat = s.requests["chat"]
    decode_s = s.cost.estimate(StepShape().with_decode(chat.num_computed_tokens))
    assert s.interleave_slice_s(out) == pytest.approx(max(0.060 - decode_s, 0.015))

    targeted = decoding_chat_and_summary({"priority_classes.batch.tpot_slo_ms": 500.0})
    targeted.add_request(req("summary-2", 3000, max_tokens=4, priority=10, cls="batch", base=5000))
    out = targeted.schedule(interleave=True)
    assert {r.request_id for r in out.scheduled} == {"summary-2"}


def test_the_ttft_estimate_prices_a_riding_decode_in_the_prefill_not_in_the_pauses() -> None:
    """The same queue as the builder's above, estimated: the decoding summary's row is priced
    in the prefill step, the pauses' decode steps on the chat's row alone."""
    import math

    from appliance.core.ttft_estimate import estimate_ttft_s

    s = decoding_chat_and_summary({})
    late = req("summary-2", 3000, max_tokens=4, priority=10, cls="batch", base=5000)
    chat, summary = s.requests["chat"], s.requests["summary-1"]
    prefill = StepShape().with_decode(summary.num_computed_tokens).with_chunk(0, 3000)
    prefill_s = s.cost.estimate(prefill)
    decode_s = s.cost.estimate(StepShape().with_decode(chat.num_computed_tokens))
    slice_s = max(0.060 - decode_s, 0.060 * 0.25)
    expected = prefill_s + math.ceil(prefill_s / slice_s) * decode_s
    assert estimate_ttft_s(s, late, interleave=True) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"priority_classes.interactive.tpot_slo_ms": 0}, "tpot_slo_ms"),
        ({"priority_classes.batch.ttft_slo_s": -1.0}, "ttft_slo_s"),
        (
            {"scheduler.long_prompt_tokens": 512, "scheduler.long_prompt_class": "bulk"},
            "long_prompt_class",
        ),
        (
            {"scheduler.long_prompt_tokens": 0, "scheduler.long_prompt_class": "batch"},
            "long_prompt_tokens",
        ),
    ],
)
def test_bad_slo_and_length_class_settings_name_their_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(None, overrides)


def test_ttft_slo_admission_refuses_exactly_the_requests_whose_estimate_misses() -> None:
    from appliance.core.request import FinishReason
    from appliance.core.ttft_estimate import estimate_ttft_s

    overrides = {**CLASSES, "priority_classes.interactive.ttft_slo_s": 1.0}
    sizes = [100, 400, 800, 300, 1600, 200, 3000, 50, 900]
    s = seeded(overrides)
    accepted = refused = 0
    for i, n in enumerate(sizes):
        r = req(f"r{i}", n, cls="interactive", base=1000 * i)
        estimate = estimate_ttft_s(s, r)
        assert estimate is not None
        ok = s.add_request(r)
        assert ok == (estimate <= 1.0), (i, estimate)
        if ok:
            accepted += 1
        else:
            refused += 1
            assert r.finish_reason is FinishReason.TTFT_SLO
            assert f"{estimate:.1f}s" in r.finish_detail and "ttft_slo_s 1" in r.finish_detail
    assert accepted >= 2 and refused >= 2
    assert s.counters.rejected_by.get("ttft_slo/interactive") == refused
    # The same arrivals where no class sets a TTFT target: none refused.
    plain = seeded(CLASSES)
    assert all(
        plain.add_request(req(f"r{i}", n, cls="interactive", base=1000 * i))
        for i, n in enumerate(sizes)
    )


def test_the_ttft_estimate_counts_only_the_work_queued_ahead() -> None:
    """Under the priority policy a realtime arrival is not held behind queued batch work."""
    from appliance.core.ttft_estimate import estimate_ttft_s

    s = seeded({**CLASSES, "priority_classes.realtime.priority": 0, "scheduler.policy": "priority"})
    s.add_request(req("summary", 3000, cls="batch", priority=10, base=1000))
    behind = estimate_ttft_s(s, req("chat-b", 64, cls="batch", priority=10, base=9000))
    ahead = estimate_ttft_s(s, req("chat-r", 64, cls="realtime", priority=0, base=9000))
    assert behind is not None and ahead is not None
    assert ahead < behind / 5


def test_a_chat_behind_a_running_summary_is_estimated_to_share_its_steps() -> None:
    """A running summary's prefill is not all ahead of a new chat: each step gives the chat a
    chunk too (at least MIN_CHUNK tokens), so its first token is a few steps away."""
    from appliance.core.ttft_estimate import estimate_ttft_s

    s = seeded({**SLO, "scheduler.policy": "priority"})
    s.add_request(req("chat-1", 32, max_tokens=200, cls="interactive"))
    step(s)
    s.add_request(req("summary", 3500, max_tokens=4, cls="batch", base=5000))
    step(s)  # the summary runs, cut by time
    chat = req("chat-2", 48, max_tokens=8, cls="interactive", base=20000)
    estimate = estimate_ttft_s(s, chat)
    whole_summary = true_seconds(StepShape().with_chunk(0, 3500))
    assert estimate is not None and estimate < whole_summary / 3
    assert estimate <= 4 * 0.060 * 1.1  # 48 tokens in chunks of >= 16: at most 3-4 steps
