"""The output processor: engine token ids -> text, stop strings, logprobs, finish; one state
per live request, gone at its finish. A stop string found here ends the request in the engine
at once (its KV blocks come back before the next step)."""

from __future__ import annotations

from pathlib import Path

from appliance.config import load_config
from appliance.core.request import FinishReason
from appliance.engine.llm_engine import Engine
from appliance.engine.output_processor import OutputProcessor, RequestState
from appliance.engine.outputs import EngineOutput, Logprob, RequestOutput
from appliance.sampling_params import SamplingParams


class Letters:
    """Token i decodes to the i-th lowercase letter."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def token(rid: str, t: int, **kw: object) -> EngineOutput:
    return EngineOutput(request_id=rid, new_token_ids=[t], **kw)  # type: ignore[arg-type]


def test_stop_string_finishes_here_and_asks_the_engine_to_abort() -> None:
    proc = OutputProcessor(Letters())
    seen: list[RequestOutput] = []
    proc.add(
        "r",
        [5],
        SamplingParams(max_tokens=10, stop=["cd"]),
        on_output=lambda state, delta: seen.append(delta),
    )
    assert proc.process([token("r", 0), token("r", 1), token("r", 2)]) == []
    assert proc.process([token("r", 3)]) == ["r"]
    assert seen[-1].finished and seen[-1].finish_reason == "stop"
    assert "".join(d.new_text for d in seen) == "ab"
    assert len(proc) == 0
    # The engine ran one more step before the abort arrived: that token is dropped.
    assert proc.process([token("r", 4)]) == []
    assert len(seen) == 4


def test_engine_finish_keeps_its_reason_and_flushes_held_text() -> None:
    proc = OutputProcessor(Letters())
    state = proc.add("r", [5], SamplingParams(max_tokens=2, stop=["bcd"]))
    proc.process([token("r", 0), token("r", 1)])
    assert state.text == ""  # held back: "ab" ends in "b", which may start "bcd"
    proc.process(
        [
            EngineOutput(
                request_id="r",
                new_token_ids=[],
                finished=True,
                finish_reason="length",
                queue_time_s=0.25,
                num_preemptions=1,
            )
        ]
    )
    assert (state.text, state.finish_reason, state.queue_time_s, state.num_preemptions) == (
        "ab",
        "length",
        0.25,
        1,
    )
    assert len(proc) == 0


def test_logprobs_are_kept_only_for_requests_that_asked() -> None:
    proc = OutputProcessor(Letters())
    lp = [Logprob(0, -0.5, [(0, -0.5), (1, -1.5)])]
    with_lp = proc.add("a", [5], SamplingParams(max_tokens=1, logprobs=1))
    without = proc.add("b", [5], SamplingParams(max_tokens=1))
    proc.process(
        [
            token("a", 0, new_logprobs=lp, finished=True, finish_reason="length"),
            token("b", 0, new_logprobs=lp, finished=True, finish_reason="length"),
        ]
    )
    assert with_lp.result().logprobs == lp
    assert without.logprobs == [] and without.result().logprobs is None


def test_offline_text_is_decoded_once_at_the_finish() -> None:
    proc = OutputProcessor(Letters())
    deltas: list[RequestOutput] = []
    state = proc.add(
        "r",
        [5],
        SamplingParams(max_tokens=3),
        stream_text=False,
        on_output=lambda s, d: deltas.append(d),
    )
    proc.process([token("r", 2)])
    proc.process([token("r", 3, finished=True, finish_reason="length")])
    assert [d.new_text for d in deltas] == ["", "cd"] and state.text == "cd"


def test_end_drops_the_state_without_a_delta() -> None:
    proc = OutputProcessor(Letters())
    calls: list[RequestState] = []
    state = proc.add("r", [5], SamplingParams(), on_output=lambda s, d: calls.append(s))
    assert proc.end("r", "abort", "client gone") is state
    assert (state.finish_reason, state.finish_detail, len(proc)) == ("abort", "client gone", 0)
    assert proc.process([token("r", 1)]) == [] and calls == []
    assert proc.end("r", "abort") is None


def test_a_stop_string_returns_the_blocks_before_the_next_step(tiny_model_dir: Path) -> None:
    engine = Engine(
        load_config(
            None,
            {
                "model.path": str(tiny_model_dir),
                "model.dtype": "float32",
                "cache.kv_cache_memory": 0.05,
                "hardware.device": "cpu",
            },
        )
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    text = engine.generate(prompt, params)[0].text
    stop = text[4:7]
    assert stop.strip(), text
    proc = OutputProcessor(engine.tokenizer)
    req = engine.add_request(
        prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    )
    state = proc.add(req.request_id, prompt, req.sampling_params)
    stopped: list[str] = []
    while not stopped:
        stopped = proc.process(engine.step())
        assert req.blocks or stopped
    assert stopped == [req.request_id] and state.text == text[: text.index(stop)]
    engine.abort(req.request_id, FinishReason.STOP)
    assert req.blocks == []
    assert engine.kv.usage().used == 0 and not engine.scheduler.requests
    finished = [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.finish_reason) for o in finished] == [(req.request_id, "stop")]
    assert engine.stats().requests_finished.get("stop") == 1
