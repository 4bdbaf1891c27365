"""Interleaved decodes (scheduler.interleave_decodes): a step whose prefill the cost model expects
to outlast the TPOT target of the classes it decodes leaves those decodes out and pauses
between two units of its forward (a layer's attention and MLP halves), whenever they are due,
for a step of theirs. A chat decoding while a summary's prompt is prefilled gets its next tokens
during that step, not after it; every request's tokens are those of a run without pauses;
arrivals still cut in; where a step cannot pause, its chunks are cut to the target instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.core.request import Request
from appliance.engine.llm_engine import Engine
from appliance.engine.pause_rule import PauseRule
from appliance.sampling_params import SamplingParams
from tests.test_cut_in import (
    DECODING_CHAT,
    GREEDY,
    LENGTH,
    NEW_CHAT,
    SUMMARY,
    arrive_at_calls,
    reference,
)
from tests.test_preemption import engine_for

# The tiny model has 4 layers, 8 units: a paused step is asked after units 1 to 7. A target
# this tight makes every prefill outlast it and every pause check find the decodes due.
TIGHT = {
    **LENGTH,
    "scheduler__interleave_decodes": True,
    "priority_classes__interactive__priority": 5,
    "priority_classes__batch__priority": 10,
    "priority_classes__interactive__tpot_slo_ms": 0.001,
}


def no_arrivals(engine: Engine) -> None:
    """The server's engine asks for arrivals between layers; none come here."""
    engine.take_arrivals = lambda: False


def decoding_chat_and_summary(engine: Engine, chat_params: SamplingParams = GREEDY) -> tuple:
    chat = engine.add_request(DECODING_CHAT, chat_params)
    engine.step()  # the chat's prompt and first token: it decodes from now on
    summary = engine.add_request(SUMMARY, GREEDY)
    assert (summary.priority_class, chat.priority_class) == ("batch", "interactive")
    return chat, summary


def step_ids(engine: Engine) -> dict[str, list[int]]:
    return {o.request_id: o.new_token_ids for o in engine.step()}


def assert_one_step_carries_both(
    engine: Engine, chat: Request, prompt: Request, expected: dict[str, list[int]]
) -> None:
    """The next step, unpaused, gives the decoding chat its second token and the long
    prompt its first."""
    assert step_ids(engine) == {
        chat.request_id: expected["chat"][1:2],
        prompt.request_id: expected["summary"][:1],
    }
    assert engine.scheduler.counters.interleaved_decode_steps == 0


def test_a_decoding_chat_gets_tokens_while_a_summary_prefills(tiny_model_dir: Path) -> None:
    expected = reference(tiny_model_dir)
    engine = engine_for(tiny_model_dir, **TIGHT)
    try:
        assert engine.scheduler.cost.ready  # seeded at load: it judges the first step
        no_arrivals(engine)
        chat, summary = decoding_chat_and_summary(engine)
        # The summary's step left the chat out and paused after units 1 to 5 of 8: each
        # pause ran the chat's decode step, until its sixth and last token.
        for k in range(1, 6):
            assert step_ids(engine) == {chat.request_id: expected["chat"][k : k + 1]}
            assert engine.runner.paused is not None
            assert summary.num_computed_tokens == 0
        assert step_ids(engine) == {summary.request_id: expected["summary"][:1]}
        assert engine.runner.paused is None
        counters = engine.scheduler.counters
        assert (counters.interleaved_decode_steps, counters.cut_in_steps) == (5, 0)
        while engine.has_unfinished():
            engine.step()
        assert chat.output_token_ids == expected["chat"]
        assert summary.output_token_ids == expected["summary"]
        assert engine.kv.usage().used == 0
    finally:
        engine.close()


def test_a_chat_that_cut_in_gets_its_next_tokens_in_the_pauses(tiny_model_dir: Path) -> None:
    """A summary's step that left no decodes out (none ran) pauses for a chat's arrival, whose
    cut-in gives it its first token. The chat's class sets a TPOT target, so the step then
    pauses for the chat's decodes too, instead of holding its second token until the step's
    end; every token is a run's without pauses."""
    expected = reference(tiny_model_dir)
    engine = engine_for(tiny_model_dir, **TIGHT)
    try:
        summary = engine.add_request(SUMMARY, GREEDY)
        added = arrive_at_calls(engine, {1: NEW_CHAT})
        first = step_ids(engine)  # the cut-in after unit 1
        chat = added[0]
        assert first == {chat.request_id: expected["new"][:1]}
        for k in range(1, 6):  # after units 2 to 6: the chat's tokens 2 to 6
            assert step_ids(engine) == {chat.request_id: expected["new"][k : k + 1]}
            assert engine.runner.paused is not None
        assert step_ids(engine) == {summary.request_id: expected["summary"][:1]}
        counters = engine.scheduler.counters
        assert (counters.cut_in_steps, counters.interleaved_decode_steps) == (1, 5)
        while engine.has_unfinished():
            engine.step()
        assert chat.output_token_ids == expected["new"]
        assert summary.output_token_ids == expected["summary"]
        assert engine.kv.usage().used == 0
    finally:
        engine.close()


def test_a_chat_that_finishes_during_the_pause_frees_its_blocks_and_the_step_goes_on(
    tiny_model_dir: Path,
) -> None:
    expected = reference(tiny_model_dir)
    engine = engine_for(tiny_model_dir, **TIGHT)
    try:
        no_arrivals(engine)
        three = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        chat, summary = decoding_chat_and_summary(engine, three)
        assert step_ids(engine) == {chat.request_id: expected["chat"][1:2]}
        assert step_ids(engine) == {chat.request_id: expected["chat"][2:3]}
        assert chat.is_finished and not chat.blocks
        # Nothing left out is due: the step runs to its end without a third pause.
        assert step_ids(engine) == {summary.request_id: expected["summary"][:1]}
        assert engine.scheduler.counters.interleaved_decode_steps == 2
        while engine.has_unfinished():
            engine.step()
        assert summary.output_token_ids == expected["summary"]
        assert engine.kv.usage().used == 0
    finally:
        engine.close()


def test_an_arrival_cuts_in_with_the_decodes_left_out(tiny_model_dir: Path) -> None:
    expected = reference(tiny_model_dir)
    engine = engine_for(tiny_model_dir, **TIGHT)
    try:
        no_arrivals(engine)
        chat, summary = decoding_chat_and_summary(engine)
        added = arrive_at_calls(engine, {1: NEW_CHAT})
        # One step for both: the chat's decode and the new chat's prompt.
        assert step_ids(engine) == {
            chat.request_id: expected["chat"][1:2],
            added[0].request_id: expected["new"][:1],
        }
        counters = engine.scheduler.counters
        assert (counters.interleaved_decode_steps, counters.cut_in_steps) == (1, 1)
        while engine.has_unfinished():
            engine.step()
        assert chat.output_token_ids == expected["chat"]
        assert summary.output_token_ids == expected["summary"]
        assert added[0].output_token_ids == expected["new"]
        assert engine.kv.usage().used == 0
    finally:
        engine.close()


def test_a_prefill_expected_within_the_target_keeps_its_decodes(tiny_model_dir: Path) -> None:
    """A target no step can outlast: the summary's step carries the chat's decode, unpaused."""
    expected = reference(tiny_model_dir)
    engine = engine_for(
        tiny_model_dir, **{**TIGHT, "priority_classes__interactive__tpot_slo_ms": 1e6}
    )
    try:
        no_arrivals(engine)
        chat, summary = decoding_chat_and_summary(engine)
        assert_one_step_carries_both(engine, chat, summary, expected)
    finally:
        engine.close()


def test_a_step_that_cannot_pause_cuts_its_chunks_to_the_target_instead(
    tiny_model_dir: Path,
) -> None:
    """The offline API takes no arrivals between layers: no step pauses, so none leaves its
    decodes out, and the summary's prompt goes in chunks cut to the target."""
    expected = reference(tiny_model_dir)
    engine = engine_for(tiny_model_dir, **TIGHT)
    try:
        chat, summary = decoding_chat_and_summary(engine)
        outputs = step_ids(engine)
        assert outputs == {chat.request_id: expected["chat"][1:2]}
        assert 0 < summary.num_computed_tokens < len(SUMMARY)
        assert engine.history.records[-1].bound_by == "time_budget"
        while engine.has_unfinished():
            engine.step()
        assert engine.scheduler.counters.interleaved_decode_steps == 0
        assert chat.output_token_ids == expected["chat"]
        assert summary.output_token_ids == expected["summary"]
    finally:
        engine.close()


def test_the_decodes_are_due_when_the_next_unit_would_end_past_their_slice(
    tiny_model_dir: Path,
) -> None:
    """Pauses are asked between units only (a layer's halves): a step pauses once the unit to
    come, expected to take as long as the longer of the last two, would end past the slice (a
    pause at the first check past it came a unit late). The clock is the engine module's."""
    from appliance.engine import llm_engine

    engine = engine_for(tiny_model_dir, **TIGHT)
    try:
        no_arrivals(engine)
        chat = engine.add_request(DECODING_CHAT, GREEDY)
        engine.step()  # the chat decodes from now on, outside the step asked about
        now = llm_engine.time.perf_counter()
        # 60 ms into a 100 ms slice, the last unit took 50 ms: the next would end at 110.
        rule = PauseRule.start(frozenset(), None, 0.100, since=now - 0.060)
        rule.asked = now - 0.050
        assert engine._should_pause(rule)
        # The same point with 20 ms units: the next ends at 80 ms, within the slice.
        rule = PauseRule.start(frozenset(), None, 0.100, since=now - 0.060)
        rule.asked = now - 0.020
        assert not engine._should_pause(rule)
        # A 20 ms unit after a 45 ms one (an MLP half after a long attention): the next, the
        # same half as that one, would end at 105 ms.
        rule = PauseRule.start(frozenset(), None, 0.100, since=now - 0.060)
        rule.asked, rule.previous_unit = now - 0.020, 0.045
        assert engine._should_pause(rule)
        # Nothing outside the step to decode: never due.
        rule = PauseRule.start(frozenset({chat.request_id}), None, 0.100, since=now - 1)
        assert not engine._should_pause(rule)
    finally:
        engine.close()


def test_after_a_pause_the_decodes_are_due_their_target_after_its_step_began() -> None:
    """The chats got their token at the end of the pause's step; the next comes at the end of
    the next one: so that step starts a TPOT target after this one started, the pause's step
    and the host's time around it counted (a slice from the resume left them out)."""
    rule = PauseRule.start(frozenset(), None, 0.030, since=0.0)
    assert rule.due_at == pytest.approx(0.030)  # the first slice: from the step's start
    # Paused at 30 ms; its decode step and the host took 12 ms; the target is 35 ms.
    resumed = rule.resumed(now=0.042, paused_at=0.030, interval_s=0.035)
    assert resumed.due_at == pytest.approx(0.065)
    assert not resumed.due(0.052)  # a 10 ms unit: the next would end at 62 ms
    assert resumed.due(0.062)  # the next would end at 72 ms, past 65
    # A pause whose step took longer than the target (an arrival's prompt): the prefill still
    # gets a quarter of the target before the next.
    late = rule.resumed(now=0.115, paused_at=0.030, interval_s=0.035)
    assert late.due_at == pytest.approx(0.115 + 0.035 / 4)
    # A step that pauses for arrivals only is never due for decodes.
    arrivals_only = PauseRule.start(frozenset(), 3, None, since=0.0)
    assert arrivals_only.resumed(now=0.1, paused_at=0.05, interval_s=None).due_at is None


def test_a_prompt_of_the_decodes_own_class_keeps_them_in_its_step(tiny_model_dir: Path) -> None:
    """The long prompt is a chat's (interactive, named): as urgent as the decoding chat, it is
    prefilled with the decode in its step, unpaused (decode steps between a burst of chats'
    prompts cost the burst its throughput)."""
    expected = reference(tiny_model_dir)
    engine = engine_for(tiny_model_dir, **TIGHT)
    try:
        no_arrivals(engine)
        chat = engine.add_request(DECODING_CHAT, GREEDY)
        engine.step()
        pasted = engine.add_request(SUMMARY, GREEDY, priority="interactive")
        assert_one_step_carries_both(engine, chat, pasted, expected)
    finally:
        engine.close()


# A second summary's prompt: batch work too (LENGTH's 100 tokens), decoding while SUMMARY's
# prompt is prefilled.
OTHER_SUMMARY = [(i * 53) % 4000 + 10 for i in range(150)]
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def references(model_dir: Path, *runs: tuple[str, list[int], SamplingParams]) -> dict:
    """Each (name, prompt, params)'s tokens alone, no pause: what every step must reproduce."""
    engine = engine_for(model_dir)
    try:
        return {name: engine.generate(prompt, params)[0].token_ids for name, prompt, params in runs}
    finally:
        engine.close()


def chat_decoding_in_a_summarys_prefill(engine: Engine) -> tuple[Request, Request]:
    """A chat decoding (LONG) and a summary whose first chunk has run, paused for the chat's
    decodes; no step paused now, and no arrivals."""
    no_arrivals(engine)
    chat = engine.add_request(DECODING_CHAT, LONG)
    engine.step()
    summary = engine.add_request(SUMMARY, GREEDY)
    while summary.num_computed_tokens == 0 or engine.runner.paused is not None:
        engine.step()  # the summary's first chunk, paused for the chat's decodes
    return chat, summary


def test_a_decoding_summary_rides_the_prefill_step_while_the_chat_gets_the_pauses(
    tiny_model_dir: Path,
) -> None:
    """A chat and a summary decode when a second summary's prompt arrives. The step that
    prefills it leaves the chat's decodes out, but the decoding summary outranks none of its
    prefill and its class sets no TPOT target: it stays in the step, its token at the step's
    end, and each pause's decode step is the chat's alone. Every token is a run's without
    pauses."""
    expected = references(
        tiny_model_dir,
        ("chat", DECODING_CHAT, LONG),
        ("other", OTHER_SUMMARY, LONG),
        ("summary", SUMMARY, GREEDY),
    )
    engine = engine_for(tiny_model_dir, **TIGHT)
    try:
        no_arrivals(engine)
        chat = engine.add_request(DECODING_CHAT, LONG)
        engine.step()
        other = engine.add_request(OTHER_SUMMARY, LONG)
        while not other.output_token_ids or engine.runner.paused is not None:
            engine.step()
        assert other.priority_class == "batch" and not chat.is_finished
        summary = engine.add_request(SUMMARY, GREEDY)
        chat_tokens, other_tokens = len(chat.output_token_ids), len(other.output_token_ids)
        for k in range(1, 8):  # the pauses after units 1 to 7: the chat's steps alone
            assert step_ids(engine) == {
                chat.request_id: expected["chat"][chat_tokens + k - 1 : chat_tokens + k]
            }
            assert engine.runner.paused is not None
        # The step's end: the riding summary's next token and the new one's first.
        assert step_ids(engine) == {
            other.request_id: expected["other"][other_tokens : other_tokens + 1],
            summary.request_id: expected["summary"][:1],
        }
        while engine.has_unfinished():
            engine.step()
        assert chat.output_token_ids == expected["chat"]
        assert other.output_token_ids == expected["other"]
        assert summary.output_token_ids == expected["summary"]
        assert engine.kv.usage().used == 0
    finally:
        engine.close()


def test_a_chat_admitted_beside_a_summarys_chunk_keeps_the_step_whole(
    tiny_model_dir: Path,
) -> None:
    """A chat arrives between two steps while a summary's prompt is mid-prefill and another
    chat decodes. The step that admits it gives the summary MIN_CHUNK tokens beside its
    prompt; that chunk alone outlasts the (tight) target, but the step runs unpaused: the new
    chat's first token and the decoding chat's next come at its end, not after a pause's
    worth of decode steps each (which stretched such a step 5x at 1.5 req/s)."""
    expected = references(
        tiny_model_dir,
        ("chat", DECODING_CHAT, LONG),
        ("new", NEW_CHAT, GREEDY),
        ("summary", SUMMARY, GREEDY),
    )
    engine = engine_for(tiny_model_dir, **TIGHT, scheduler__max_num_batched_tokens=128)
    try:
        chat, summary = chat_decoding_in_a_summarys_prefill(engine)
        assert 0 < summary.num_computed_tokens < len(SUMMARY)
        before = summary.num_computed_tokens
        decoded = len(chat.output_token_ids)
        new = engine.add_request(NEW_CHAT, GREEDY)
        assert step_ids(engine) == {
            chat.request_id: expected["chat"][decoded : decoded + 1],
            new.request_id: expected["new"][:1],
        }
        assert engine.runner.paused is None
        assert summary.num_computed_tokens > before  # the summary still progressed
        while engine.has_unfinished():
            engine.step()
        assert chat.output_token_ids == expected["chat"]
        assert new.output_token_ids == expected["new"]
        assert summary.output_token_ids == expected["summary"]
        assert engine.kv.usage().used == 0
    finally:
        engine.close()


THIRD_CHAT = [(i * 29) % 4000 + 10 for i in range(25)]


def test_a_step_carrying_chats_does_not_pause_for_a_cut_in_chats_decodes(
    tiny_model_dir: Path,
) -> None:
    """The step that admits a chat beside a summary's MIN_CHUNK carries that chat's prompt and
    another chat's decode. A third chat arriving during it cuts in and gets its first token;
    the step then runs to its end instead of pausing for the third chat's decodes, which held
    the two chats inside it for every pause (at 1 req/s on 2 cores: their tokens 470 ms late
    while the third got twenty)."""
    expected = references(
        tiny_model_dir,
        ("chat", DECODING_CHAT, LONG),
        ("new", NEW_CHAT, GREEDY),
        ("third", THIRD_CHAT, GREEDY),
        ("summary", SUMMARY, GREEDY),
    )
    engine = engine_for(tiny_model_dir, **TIGHT, scheduler__max_num_batched_tokens=128)
    try:
        chat, summary = chat_decoding_in_a_summarys_prefill(engine)
        decoded = len(chat.output_token_ids)
        paced = engine.scheduler.counters.interleaved_decode_steps
        new = engine.add_request(NEW_CHAT, GREEDY)
        third = arrive_at_calls(engine, {1: THIRD_CHAT})
        assert step_ids(engine) == {third[0].request_id: expected["third"][:1]}  # the cut-in
        assert engine.runner.paused is not None
        assert step_ids(engine) == {
            chat.request_id: expected["chat"][decoded : decoded + 1],
            new.request_id: expected["new"][:1],
        }
        assert engine.runner.paused is None
        assert engine.scheduler.counters.interleaved_decode_steps == paced
        while engine.has_unfinished():
            engine.step()
        assert chat.output_token_ids == expected["chat"]
        assert new.output_token_ids == expected["new"]
        assert third[0].output_token_ids == expected["third"]
        assert summary.output_token_ids == expected["summary"]
        assert engine.kv.usage().used == 0
    finally:
        engine.close()
