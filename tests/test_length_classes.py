"""Length-aware classes (scheduler.long_prompt_tokens / long_prompt_class): a request naming no
priority whose prompt is longer than the threshold is batch work; named priorities win."""

from __future__ import annotations

from pathlib import Path

from appliance.config import load_config
from appliance.sampling_params import SamplingParams
from tests.test_preemption import engine_for

LENGTH = {"scheduler.long_prompt_tokens": 100, "scheduler.long_prompt_class": "batch"}


def test_an_unnamed_long_prompt_takes_the_long_class_and_named_priorities_win() -> None:
    cfg = load_config(None, LENGTH)
    default = cfg.default_class()
    assert cfg.resolve_priority(None, 100)[1] == default  # not longer than the threshold
    assert cfg.resolve_priority(None, 101) == (cfg.priority_of("batch"), "batch")
    assert cfg.resolve_priority("realtime", 5000)[1] == "realtime"
    assert cfg.resolve_priority(cfg.priority_of("interactive"), 5000)[1] == "interactive"
    assert cfg.resolve_priority(None)[1] == default  # length unknown: the default class
    off = load_config(None, {})
    assert off.resolve_priority(None, 100_000)[1] == off.default_class()


def test_the_engine_queues_a_long_summary_as_batch_work(tiny_model_dir: Path) -> None:
    engine = engine_for(tiny_model_dir, **{k.replace(".", "__"): v for k, v in LENGTH.items()})
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        long = engine.add_request([7] * 300, params)
        short = engine.add_request([7] * 30, params)
        named = engine.add_request([7] * 300, params, priority="interactive")
        assert (long.priority_class, short.priority_class) == ("batch", "interactive")
        assert named.priority_class == "interactive"
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.close()
