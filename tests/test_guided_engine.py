"""Grammar-constrained decoding in the engine (tiny random model): constrained requests survive
forced preemption (recompute and swap) with the tokens of an unpreempted run, unconstrained
rows of a mixed batch get exactly the tokens they get alone, matchers go with their requests,
and the outputs are valid against an independent reference (jsonschema, `re`)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from appliance import Engine, SamplingParams
from appliance.config import load_config
from appliance.engine.guided import GuidedDecoder, apply_bitmask
from appliance.sampling_params import StructuredOutputs

DIGITS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 24,
    "maxItems": 24,
}
REGEX = r"(ab|cd|e){20,30}"


def engine_for(model_dir: Path, **overrides: object) -> Engine:
    base: dict[str, object] = {
        "model.path": str(model_dir),
        "model.dtype": "float32",
        "hardware.device": "cpu",
        "cache.block_size": 16,
    }
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return Engine(load_config(None, base))


def workload(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(5)
    specs = [
        StructuredOutputs(kind="json", spec=json.dumps(DIGITS)),
        StructuredOutputs(kind="regex", spec=REGEX),
        None,
    ]
    jobs = []
    for i in range(6):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randrange(20, 60))]
        so = specs[i % 3]
        params = SamplingParams(
            max_tokens=70, temperature=1.0, seed=40 + i, structured=so, ignore_eos=so is None
        )
        jobs.append((prompt, params))
    return jobs


def _check(text: str, so: StructuredOutputs | None) -> None:
    if so is None:
        return
    if so.kind == "json":
        jsonschema.validate(json.loads(text), DIGITS)
    else:
        assert re.fullmatch(REGEX, text), text


@pytest.fixture(scope="module")
def alone(tiny_model_dir: Path) -> list[list[int]]:
    engine = engine_for(tiny_model_dir, cache__kv_cache_memory=0.1)
    outs = []
    for prompt, sp in workload(engine.loaded.args.vocab_size):
        [r] = engine.generate([prompt], sp)
        _check(r.text, sp.structured)
        if sp.structured is not None:
            assert r.finish_reason == "stop"
        outs.append(r.token_ids)
    assert not engine.runner.guided.rows  # every matcher went with its request
    return outs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_requests_survive_preemption(
    tiny_model_dir: Path, alone: list[list[int]], mode: str
) -> None:
    engine = engine_for(
        tiny_model_dir,
        cache__num_blocks=12,
        cache__swap_space=0.05,
        scheduler__preemption_mode=mode,
        model__max_model_len=160,
    )
    jobs = workload(engine.loaded.args.vocab_size)
    results = engine.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    assert [r.token_ids for r in results] == alone
    for r, (_, sp) in zip(results, jobs, strict=True):
        _check(r.text, sp.structured)
    log = engine.preemption_log()
    constrained = {r.request_id for r, (_, sp) in zip(results, jobs, strict=True) if sp.structured}
    assert any(e.request_id in constrained and e.mode == mode for e in log), log
    assert not engine.runner.guided.rows


def test_unconstrained_rows_of_a_mixed_batch_get_their_own_tokens(
    tiny_model_dir: Path, alone: list[list[int]]
) -> None:
    engine = engine_for(tiny_model_dir, cache__kv_cache_memory=0.1)
    jobs = workload(engine.loaded.args.vocab_size)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [p for p, _ in jobs] + [jobs[0][0]]
    params = [sp for _, sp in jobs] + [greedy]
    [greedy_alone] = engine.generate([jobs[0][0]], greedy)
    results = engine.generate(prompts, params)
    for i, (r, sp) in enumerate(zip(results[:-1], params[:-1], strict=True)):
        if sp.structured is None:
            assert r.token_ids == alone[i]
    assert results[-1].token_ids == greedy_alone.token_ids


def test_a_stop_string_ends_a_constrained_request_and_its_matcher(tiny_model_dir: Path) -> None:
    engine = engine_for(tiny_model_dir, cache__kv_cache_memory=0.1)
    so = StructuredOutputs(kind="regex", spec="(ab)+c")
    [r] = engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=30, seed=1, stop=["abab"], structured=so)
    )
    assert r.finish_reason == "stop" and r.text.startswith("ab") and "abab" not in r.text
    engine.step()  # the abort reaches the runner with the next step
    assert not engine.runner.guided.rows


def test_invalid_constraints_are_refused_by_the_engine(tiny_model_dir: Path) -> None:
    engine = engine_for(tiny_model_dir, cache__kv_cache_memory=0.1)
    with pytest.raises(ValueError, match="structured: .*uniqueItems"):
        engine.add_request(
            [1, 2],
            SamplingParams(
                structured=StructuredOutputs(
                    kind="json", spec='{"type": "array", "uniqueItems": true}'
                )
            ),
        )
    so = StructuredOutputs(kind="regex", spec="ab")
    with pytest.raises(ValueError, match="min_tokens"):
        engine.add_request([1, 2], SamplingParams(min_tokens=3, structured=so))
    assert not engine.has_unfinished()


def test_the_vocabulary_reaches_xgrammar_whole(tiny_model_dir: Path) -> None:
    """Padding rows past the tokenizer and special tokens are never allowed; EOS is allowed
    exactly where the grammar can end (here: after a full choice)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    real, eos = len(tok), tok.eos_token_id
    guided = GuidedDecoder(tok, real + 64, frozenset({eos}))  # a model padding its vocabulary
    so = StructuredOutputs(kind="choice", spec='["yes", "no"]')

    def allowed(output_index: int) -> set[int]:
        mask = guided.bitmask([("r", so, output_index)])
        assert mask is not None
        logits = torch.zeros(1, real + 64)
        apply_bitmask(logits, mask[0][:1], [0])
        return set(torch.isfinite(logits[0]).nonzero().view(-1).tolist())

    first = allowed(0)
    assert first and max(first) < real and eos not in first
    for t in first:
        text = tok.decode([t])
        assert text and ("yes".startswith(text) or "no".startswith(text)), text
    ids = tok.encode("yes", add_special_tokens=False)
    for t in ids:
        guided.accept("r", t)
    assert allowed(len(ids)) == {eos}
