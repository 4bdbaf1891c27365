"""The TTFT estimate (core/ttft_estimate.py) of an engine whose steps interleave their decodes
(scheduler.interleave_decodes, as cpu-demo serves): it must price the step the step builder
actually makes for a new chat, not a budget-sized chunk of the summary it outranks.

Measured (docs/benchmarks.md, "Dec 5, late night"): on a slow box, cpu-demo refused five chats
of the 1 req/s mixed load at arrival, "first token expected in 8.0-10.9 s" against their
8 s ttft_slo_s, while the chats it admitted had their first token within 285 ms (p99). Each
arrived while a summary's prefill was running and chats decoded: the estimate gave the chat's
step the summary's next 960-token chunk and paced it for the decodes (a decode step every
quarter interval: ~8 s), where the builder gives the summary MIN_CHUNK tokens beside the
chat's prompt and keeps the step whole (StepBuilder.admit, detach_decodes)."""

from __future__ import annotations

import pytest

from appliance.core.step_cost import MIN_CHUNK, StepShape
from appliance.core.ttft_estimate import estimate_ttft_s
from tests.test_scheduler import req, step
from tests.test_step_cost import SLO, seeded

INTERLEAVED = {**SLO, "scheduler.policy": "priority", "scheduler.max_num_batched_tokens": 1024}


def summary_prefilling_beside_decoding_chat() -> object:
    """A chat decoding under its 60 ms target and a 3,000-token summary (batch) whose prompt
    is part done: the builder gave it one budget-sized chunk, paced for the chat."""
    s = seeded(INTERLEAVED)
    s.add_request(req("chat-1", 32, max_tokens=200, priority=5, cls="interactive"))
    step(s)  # the chat's prompt; it decodes from here
    s.add_request(req("summary", 3000, max_tokens=4, priority=10, cls="batch", base=5000))
    out = s.schedule(interleave=True)  # type: ignore[attr-defined]
    # The budget less the chat's decode row, which the step then leaves out to pace it.
    assert [(r.request_id, len(r.token_ids)) for r in out.scheduled] == [("summary", 1023)]
    assert out.decode_interval_s is not None
    s.update_from_output(out, {})  # type: ignore[attr-defined]
    return s


def test_a_chat_arriving_during_a_summary_prefill_is_priced_as_the_step_it_gets() -> None:
    s = summary_prefilling_beside_decoding_chat()
    chat = req("chat-2", 64, max_tokens=8, priority=5, cls="interactive", base=20000)
    estimate = estimate_ttft_s(s, chat, interleave=True)
    s.add_request(chat)
    out = s.schedule(interleave=True)  # type: ignore[attr-defined]
    granted = {r.request_id: len(r.token_ids) for r in out.scheduled}
    # The builder: the chat's whole prompt, the summary MIN_CHUNK beside it, the decoding
    # chat kept in (a prompt as urgent as it keeps the step whole: no pauses).
    assert granted == {"chat-1": 1, "chat-2": 64, "summary": MIN_CHUNK}
    assert out.decode_interval_s is None
    # The chat's first token comes at that step's end: the estimate is its cost.
    assert estimate == pytest.approx(s.cost.estimate(StepShape.of(out)), rel=1e-6)
