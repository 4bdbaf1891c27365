"""Cut-in steps (scheduler.cut_in): a step that prefills pauses between two units of its forward (a
layer's attention and MLP halves) when a request arrives that outranks its prefills, runs that
request's prefill, then finishes. The chat that arrived during a summary's chunk gets its first
token half a layer later, not one step later; every request's tokens are those of a run without
the pause. The tiny model's 4 layers are 8 units: a step is asked 7 times, after units 1-7."""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing import Pipe
from pathlib import Path

import pytest
import torch

from appliance.core.request import FinishReason, Request
from appliance.engine import ipc
from appliance.engine.core_process import _Core
from appliance.engine.llm_engine import Engine
from appliance.layers.attention import AttentionMetadata
from appliance.sampling_params import SamplingParams
from tests.test_preemption import engine_for

LENGTH = {"scheduler__long_prompt_tokens": 100, "scheduler__long_prompt_class": "batch"}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SUMMARY = [(i * 37) % 4000 + 10 for i in range(300)]
DECODING_CHAT = [(i * 11) % 4000 + 10 for i in range(20)]
NEW_CHAT = [(i * 23) % 4000 + 10 for i in range(30)]


def arrive_at_call(engine: Engine, call: int, prompt: list[int], **kw: object) -> list[Request]:
    """take_arrivals that adds `prompt` on its `call`-th question (between units `call` and
    `call + 1` of the first step asked)."""
    return arrive_at_calls(engine, {call: prompt}, **kw)


def arrive_at_calls(engine: Engine, prompts: dict[int, list[int]], **kw: object) -> list[Request]:
    """take_arrivals that adds prompts[n] on its n-th question, for each n given."""
    added: list[Request] = []
    calls = 0

    def take() -> bool:
        nonlocal calls
        calls += 1
        if calls not in prompts:
            return False
        added.append(engine.add_request(prompts[calls], GREEDY, **kw))  # type: ignore[arg-type]
        return True

    engine.take_arrivals = take
    return added


def reference(model_dir: Path) -> dict[str, list[int]]:
    """Each prompt's greedy tokens alone, no pause."""
    out = {}
    engine = engine_for(model_dir)
    try:
        for name, prompt in (("summary", SUMMARY), ("chat", DECODING_CHAT), ("new", NEW_CHAT)):
            out[name] = engine.generate(prompt, GREEDY)[0].token_ids
    finally:
        engine.close()
    return out


def test_a_chat_arriving_during_a_summary_chunk_gets_its_first_token_before_the_chunk_ends(
    tiny_model_dir: Path,
) -> None:
    expected = reference(tiny_model_dir)
    engine = engine_for(tiny_model_dir, **LENGTH)
    try:
        chat = engine.add_request(DECODING_CHAT, GREEDY)
        engine.step()  # the chat's prompt: it decodes from now on
        summary = engine.add_request(SUMMARY, GREEDY)
        assert (summary.priority_class, chat.priority_class) == ("batch", "interactive")
        new = arrive_at_call(engine, 2, NEW_CHAT)
        outputs = {o.request_id: o.new_token_ids for o in engine.step()}
        # The step (chat's decode + the summary's 300-token prompt) paused after unit 2 of 8
        # (layer 1's MLP); the cut-in step prefilled the new chat alone.
        assert outputs == {new[0].request_id: expected["new"][:1]}
        assert engine.runner.paused is not None
        assert summary.num_computed_tokens == 0 and summary.num_output_tokens == 0
        assert engine.scheduler.counters.cut_in_steps == 1
        outputs = {o.request_id: o.new_token_ids for o in engine.step()}
        assert outputs == {
            summary.request_id: expected["summary"][:1],
            chat.request_id: expected["chat"][1:2],
        }
        assert engine.runner.paused is None
        while engine.has_unfinished():
            engine.step()
        assert summary.output_token_ids == expected["summary"]
        assert chat.output_token_ids == expected["chat"]
        assert new[0].output_token_ids == expected["new"]
        assert engine.scheduler.counters.cut_in_steps == 1  # no other arrival to cut in
        assert engine.kv.usage().used == 0
    finally:
        engine.close()


def test_a_chat_cuts_into_a_summary_chunk_that_another_chat_s_prompt_rides(
    tiny_model_dir: Path,
) -> None:
    """The step prefills a summary's chunk and a chat's prompt together: a chat arriving during
    it outranks the step's least urgent prefill (the summary's) and cuts in; the chat already
    in the step gets its first token at the step's end, as it would have. (Ranked by the
    step's most urgent prefill, the chat's, the arrival waited for the step's end.)"""
    expected = reference(tiny_model_dir)
    engine = engine_for(tiny_model_dir, **LENGTH)
    try:
        summary = engine.add_request(SUMMARY, GREEDY)
        riding = engine.add_request(DECODING_CHAT, GREEDY)
        new = arrive_at_call(engine, 2, NEW_CHAT)
        outputs = {o.request_id: o.new_token_ids for o in engine.step()}
        assert outputs == {new[0].request_id: expected["new"][:1]}
        assert engine.runner.paused is not None
        assert engine.scheduler.counters.cut_in_steps == 1
        outputs = {o.request_id: o.new_token_ids for o in engine.step()}
        assert outputs[riding.request_id] == expected["chat"][:1]
        assert summary.num_computed_tokens > 0  # its chunk ran in that step
        engine.take_arrivals = None
        while engine.has_unfinished():
            engine.step()
        assert summary.output_token_ids == expected["summary"]
        assert riding.output_token_ids == expected["chat"]
        assert new[0].output_token_ids == expected["new"]
    finally:
        engine.close()


def test_a_resumed_step_pauses_again_for_a_later_arrival(tiny_model_dir: Path) -> None:
    """Two chats arrive during one summary step, after units 1 and 2 of 8: the first's
    cut-in step runs, the step goes on, and pauses again for the second; each chat's first
    token comes from its own cut-in step, the summary's when the step ends, and every token is
    that of a run alone."""
    expected = reference(tiny_model_dir)
    engine = engine_for(tiny_model_dir, **LENGTH)
    try:
        summary = engine.add_request(SUMMARY, GREEDY)
        added = arrive_at_calls(engine, {1: NEW_CHAT, 2: DECODING_CHAT})
        outputs = {o.request_id: o.new_token_ids for o in engine.step()}
        assert outputs == {added[0].request_id: expected["new"][:1]}
        outputs = {o.request_id: o.new_token_ids for o in engine.step()}  # resumed, paused again
        assert outputs == {added[1].request_id: expected["chat"][:1]}
        assert engine.runner.paused is not None and summary.num_output_tokens == 0
        assert engine.scheduler.counters.cut_in_steps == 2
        outputs = {o.request_id: o.new_token_ids for o in engine.step()}  # the step ends
        assert outputs[summary.request_id] == expected["summary"][:1]
        assert engine.runner.paused is None
        while engine.has_unfinished():
            engine.step()
        assert summary.output_token_ids == expected["summary"]
        assert added[0].output_token_ids == expected["new"]
        assert added[1].output_token_ids == expected["chat"]
        assert engine.kv.usage().used == 0
    finally:
        engine.close()


def test_a_chat_added_while_the_step_is_paused_cuts_in_when_it_resumes(
    tiny_model_dir: Path,
) -> None:
    """The core process takes its pipe between two step() calls: a chat that arrived during a
    cut-in step is added while the summary's step is paused, not by take_arrivals. The resumed
    step pauses for it at its first question, as for one take_arrivals brought; it gets its
    first token before the summary's step ends."""
    expected = reference(tiny_model_dir)
    engine, summary = paused_on_a_summary(tiny_model_dir)
    try:
        engine.take_arrivals = lambda: False  # nothing more arrives through the pipe mid-step
        late = engine.add_request(DECODING_CHAT, GREEDY)
        outputs = {o.request_id: o.new_token_ids for o in engine.step()}
        assert outputs == {late.request_id: expected["chat"][:1]}
        assert engine.runner.paused is not None and summary.num_output_tokens == 0
        assert engine.scheduler.counters.cut_in_steps == 2
        outputs = {o.request_id: o.new_token_ids for o in engine.step()}  # the step ends
        assert outputs[summary.request_id] == expected["summary"][:1]
        engine.take_arrivals = None
        while engine.has_unfinished():
            engine.step()
        assert summary.output_token_ids == expected["summary"]
        assert late.output_token_ids == expected["chat"]
    finally:
        engine.close()


def paused_on_a_summary(model_dir: Path) -> tuple[Engine, Request]:
    """An engine whose summary's prefill step paused after layer 1's attention half for a
    chat (the cut-in step ran), and that summary."""
    engine = engine_for(model_dir, **LENGTH)
    summary = engine.add_request(SUMMARY, GREEDY)
    arrive_at_call(engine, 1, NEW_CHAT)
    engine.step()
    assert engine.runner.paused is not None
    return engine, summary


def test_an_abort_while_a_step_is_paused_waits_for_the_step_to_end(tiny_model_dir: Path) -> None:
    engine, summary = paused_on_a_summary(tiny_model_dir)
    try:
        held = list(summary.blocks)
        assert engine.abort(summary.request_id) is True
        # Its forward still writes these blocks: they are not free yet.
        assert summary.finish_reason is None and summary.blocks == held
        assert all(b.ref_cnt > 0 for b in held)
        engine.step()  # the paused step ends; then the abort
        assert summary.finish_reason is FinishReason.ABORT
        assert summary.request_id not in engine.scheduler.requests
        while engine.has_unfinished():
            engine.step()
        assert engine.kv.usage().used == 0
    finally:
        engine.close()


@pytest.mark.parametrize(
    "overrides, priority",
    [
        (LENGTH, "batch"),  # the same class as the step's prefill: no cut-in
        ({**LENGTH, "scheduler__cut_in": False}, None),  # off
        ({}, None),  # no length classes: the two prompts are of one class
    ],
)
def test_no_cut_in_without_a_request_that_outranks_the_step(
    tiny_model_dir: Path, overrides: dict[str, object], priority: str | None
) -> None:
    engine = engine_for(tiny_model_dir, **overrides)
    try:
        summary = engine.add_request(SUMMARY, GREEDY)
        arrive_at_call(engine, 1, NEW_CHAT, priority=priority)
        outputs = {o.request_id for o in engine.step()}
        assert outputs == {summary.request_id}
        assert engine.runner.paused is None
        assert engine.scheduler.counters.cut_in_steps == 0
    finally:
        engine.close()


@pytest.mark.parametrize(
    "limit",
    [
        # 20 blocks of 16: the summary's 300 tokens take 19, the chat's 30 would need 2.
        {"cache__num_blocks": 20, "model__max_model_len": 320},
        # One sequence at a time: admitting the chat would take the summary's place.
        {"scheduler__max_num_seqs": 1},
    ],
)
def test_a_cut_in_preempts_nobody_and_takes_only_free_blocks(
    tiny_model_dir: Path, limit: dict[str, object]
) -> None:
    # The paused step's requests keep their blocks and places, whatever the policy would
    # preempt for an arrival of a higher class.
    engine = engine_for(tiny_model_dir, **limit, **LENGTH)
    try:
        summary = engine.add_request(SUMMARY, GREEDY)
        new = arrive_at_call(engine, 1, NEW_CHAT)
        outputs = {o.request_id for o in engine.step()}
        # Paused, but the chat did not fit: an empty cut-in step.
        assert outputs == set() and engine.runner.paused is not None
        assert engine.scheduler.counters.cut_in_steps == 0
        assert summary.num_preemptions == 0 and new[0] in engine.scheduler.waiting
        engine.take_arrivals = None
        while engine.has_unfinished():
            engine.step()
        assert summary.num_output_tokens == GREEDY.max_tokens
        assert new[0].num_output_tokens == GREEDY.max_tokens
    finally:
        engine.close()


def test_a_forward_paused_at_every_half_layer_computes_what_one_call_does(
    tiny_model_dir: Path,
) -> None:
    """Stopped between every two units (each layer's attention and MLP, each two layers) and
    resumed, the forward's output is bit for bit that of one call."""
    engine = engine_for(tiny_model_dir)
    try:
        model, kv = engine.runner.model, engine.runner.kv
        tokens = torch.tensor(NEW_CHAT)
        positions = torch.arange(len(NEW_CHAT))
        meta = prefill_meta(len(NEW_CHAT), engine.kv.block_size)
        whole = model(tokens, positions, meta, kv.device_caches)
        state = model.start_forward(tokens, positions)
        stops = 0
        always: Callable[[], bool] = lambda: True  # noqa: E731
        while (hidden := model.run_layers(state, meta, kv.device_caches, always)) is None:
            stops += 1
        assert stops == 2 * len(model.model.layers) - 1
        torch.testing.assert_close(hidden, whole, rtol=0, atol=0)
    finally:
        engine.close()


def prefill_meta(tokens: int, block_size: int) -> AttentionMetadata:
    from appliance.layers.attention import PagedBatch

    blocks = -(-tokens // block_size)
    return AttentionMetadata(
        slot_mapping=torch.arange(tokens),
        decode=None,
        prefill=PagedBatch(
            block_tables=torch.arange(blocks).view(1, -1),
            seq_lens=torch.tensor([tokens]),
            query_start_loc=torch.tensor([0, tokens]),
            max_query_len=tokens,
            max_seq_len=tokens,
            num_tokens=tokens,
        ),
    )


def test_the_core_adds_arrivals_mid_step_and_holds_the_rest_for_its_end(
    tiny_model_dir: Path,
) -> None:
    engine = engine_for(tiny_model_dir, **LENGTH)
    here, there = Pipe()
    try:
        core = _Core(here, engine.config, engine, engine.loaded)
        assert engine.take_arrivals == core._take_arrivals
        running = engine.add_request(SUMMARY, GREEDY)
        add = ipc.AddRequest(
            request_id="chat-1",
            prompt_token_ids=NEW_CHAT,
            params=GREEDY,
            arrival_time=time.monotonic(),
        )
        there.send_bytes(ipc.encode(add))
        there.send_bytes(ipc.encode(ipc.AbortRequests([running.request_id])))
        there.send_bytes(ipc.encode(ipc.Ping(7)))
        assert core._take_arrivals() is True
        assert "chat-1" in engine.scheduler.requests
        assert [a.request_id for a in core._frame.added] == ["chat-1"]
        # The abort waits for the step's end; the ping is answered now.
        assert running.request_id in engine.scheduler.requests
        assert [type(m) for m in core._held] == [ipc.AbortRequests]
        assert isinstance(ipc.decode_from_core(there.recv_bytes()), ipc.Pong)
        assert core._take_arrivals() is False  # nothing new
    finally:
        here.close()
        there.close()
        engine.close()


def test_a_queue_timeout_while_a_step_is_paused_applies_at_its_end(tiny_model_dir: Path) -> None:
    engine, summary = paused_on_a_summary(tiny_model_dir)
    try:
        assert engine.expire(summary.request_id, "waited too long") is True
        assert summary.finish_reason is None  # its step still runs
        engine.step()
        assert summary.finish_reason is FinishReason.QUEUE_TIMEOUT
        assert engine.scheduler.counters.rejected_by == {"queue_timeout/batch": 1}
    finally:
        engine.close()
