"""Speculative decoding on the real model (SmolLM2-135M-Instruct, cpu-demo's packed weights):
its answers quote their input, so prompt-lookup drafts are accepted, and the output must stay
what it is without drafts: greedy token for token (with stop strings and max_tokens), seeded
sampling token for token, unseeded sampling in distribution (a chi-square test), a grammar-
constrained request valid; the stats and /metrics count the drafts under vLLM's names."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from appliance.config import load_config
from appliance.engine.executor import load_model
from appliance.engine.llm_engine import Engine
from appliance.engine.loader import LoadedModel
from appliance.metrics.registry import Metrics
from appliance.models.demo_spec import corpus_text
from appliance.sampling_params import SamplingParams, StructuredOutputs

# End to end on the real model: a few minutes on a loaded 2-core box.
pytestmark = pytest.mark.slow

BASE = {
    "cache.kv_cache_memory": 0.1,
    "cache.swap_space": 0.0,
    "model.dtype": "float32",
    "model.cpu_quant_activations": "float32",
}
SPEC = {"speculative.method": "ngram", "speculative.adaptive": False}


@pytest.fixture(scope="module")
def loaded(default_model: Path) -> Iterator[LoadedModel]:
    model = load_model(load_config("cpu-demo", BASE))
    yield model
    model.close()


def engine(loaded: LoadedModel, spec: bool) -> Engine:
    return Engine(load_config("cpu-demo", {**BASE, **(SPEC if spec else {})}), loaded)


def chat(e: Engine, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    rendered = e.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(e.tokenizer.encode(rendered, add_special_tokens=False))


def passage(start: str, chars: int) -> str:
    text = corpus_text()
    i = text.index(start)
    return text[i : i + chars]


def test_greedy_output_is_unchanged_and_drafts_are_accepted(loaded: LoadedModel) -> None:
    doc = passage("The old lighthouse keeper", 400)
    results = {}
    for spec in (False, True):
        e = engine(loaded, spec)
        prompts = [
            chat(e, f"Repeat this text exactly:\n\n{doc}"),
            chat(e, f"Summarize this text in one sentence:\n\n{doc}"),
            chat(e, "What is the capital of France?"),
            chat(e, f"Repeat this text exactly:\n\n{doc}"),
        ]
        params = [
            SamplingParams(max_tokens=60, temperature=0.0),
            SamplingParams(max_tokens=40, temperature=0.0, logprobs=1),
            SamplingParams(max_tokens=30, temperature=0.0),
            # A stop string in the middle of the copied text; max_tokens mid-draft.
            SamplingParams(max_tokens=37, temperature=0.0, stop=["cramped"]),
        ]
        results[spec] = e.generate(prompts, params, priority="batch")
        assert e.kv.pool.num_used_blocks == 0
        stats = e.scheduler.spec.stats
        if spec:
            # The copy quotes its input: most drafts are accepted.
            assert stats.num_draft_tokens > 30
            assert stats.acceptance_rate > 0.5, stats
    for off, on in zip(results[False], results[True], strict=True):
        assert on.token_ids == off.token_ids
        assert on.text == off.text and on.finish_reason == off.finish_reason
        for a, b in zip(on.logprobs or [], off.logprobs or [], strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=0.05)
    assert results[True][3].finish_reason == "stop" and "cramped" not in results[True][3].text
    assert "ledger" in results[True][0].text


def test_one_request_drafts_through_the_fused_decode(loaded: LoadedModel) -> None:
    """Alone, a request and its 4 drafts are 5 decode rows of one sequence: the fused CPU
    decode takes them (each row reads the K/V the rows before it stored in the same call)."""
    doc = passage("The old lighthouse keeper", 400)
    results = {}
    for spec in (False, True):
        e = engine(loaded, spec)
        native_before = e.runner.native_decode_steps
        prompt = chat(e, f"Repeat this text exactly:\n\n{doc}")
        (results[spec],) = e.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0))
        if spec:
            stats = e.scheduler.spec.stats
            assert stats.num_accepted_tokens > 30
            # Fewer steps than tokens, and they were fused decode steps.
            assert e.runner.native_decode_steps - native_before < 60 - 30
            assert e.runner.native_decode_steps - native_before > 5
    assert results[True].token_ids == results[False].token_ids


def test_seeded_sampling_draws_the_same_tokens_with_drafts(loaded: LoadedModel) -> None:
    doc = passage("The old lighthouse keeper", 200)
    results = {}
    for spec in (False, True):
        e = engine(loaded, spec)
        prompt = chat(e, f"Repeat this text exactly:\n\n{doc}")
        params = [SamplingParams(max_tokens=20, temperature=0.8, seed=s) for s in range(8)]
        results[spec] = [
            r.token_ids for r in e.generate([prompt] * len(params), params, priority="batch")
        ]
        if spec:
            assert e.scheduler.spec.stats.num_accepted_tokens > 0
    assert results[True] == results[False]


def chi_square_p(a: Counter[int], b: Counter[int]) -> float:
    """Two-sample chi-square test of equal distributions; categories with fewer than 10
    samples in both together are pooled."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rest_a = sum(a.values()) - sum(a[k] for k in keys)
    rest_b = sum(b.values()) - sum(b[k] for k in keys)
    table = [(a[k], b[k]) for k in keys] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    na, nb = sum(x for x, _ in table), sum(y for _, y in table)
    stat = 0.0
    for x, y in table:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    df = len(table) - 1
    if df < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def test_unseeded_sampling_follows_the_same_distribution(loaded: LoadedModel) -> None:
    """The token at output position 5 (after several verified drafts) over 160 unseeded
    samples with and without drafts. Both come from the model's distribution when the
    verification is right, so the test fails by chance with probability 1e-3 (its threshold);
    a verifier that kept drafts too often (or too rarely) shifts it far past that."""
    doc = passage("The old lighthouse keeper", 200)
    samples: dict[bool, Counter[int]] = {}
    for spec in (False, True):
        e = engine(loaded, spec)
        prompt = chat(e, f"Repeat this text exactly:\n\n{doc}")
        params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
        results = e.generate([prompt] * 160, params, priority="batch")
        samples[spec] = Counter(r.token_ids[5] for r in results)
        if spec:
            assert e.scheduler.spec.stats.num_accepted_tokens > 60
    assert chi_square_p(samples[False], samples[True]) > 1e-3, samples


def test_a_constrained_request_stays_valid_with_drafts(loaded: LoadedModel) -> None:
    pattern = r"[0-9]{3}-[0-9]{4}( [0-9]{3}-[0-9]{4}){0,3}"
    so = StructuredOutputs(kind="regex", spec=pattern)
    numbers = "Call 555-0142 or 555-0199, ask for room 555-0142 again."
    results = {}
    for spec in (False, True):
        e = engine(loaded, spec)
        prompt = chat(e, f"List the phone numbers in: {numbers} {numbers}")
        params = SamplingParams(max_tokens=60, temperature=0.0, structured=so)
        (results[spec],) = e.generate([prompt], params, priority="batch")
    assert re.fullmatch(pattern, results[True].text), results[True].text
    assert results[True].token_ids == results[False].token_ids


def test_stats_and_metrics_count_the_drafts(loaded: LoadedModel) -> None:
    e = engine(loaded, True)
    doc = passage("The old lighthouse keeper", 200)
    # Greedy: an unseeded sample at temperature 1 may leave the text at its first tokens, and
    # then no n-gram matches (a clean-clone run drew one draft, rejected).
    params = SamplingParams(max_tokens=40, temperature=0.0)
    e.generate([chat(e, f"Repeat this text exactly:\n\n{doc}")], params)
    stats = e.stats()
    spec = stats.spec_decode
    assert spec is not None and spec.method == "ngram"
    assert spec.num_drafts > 0 and 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens
    # /admin/stats sends the snapshot as JSON: the figures travel with it.
    assert msgspec.json.decode(msgspec.json.encode(stats))["spec_decode"]["num_drafts"] > 0
    metrics = Metrics(e.model_name)
    metrics.engine_rebuilt(e.model_name, {})
    metrics.update_engine(stats)
    text = metrics.render().decode()
    name = e.model_name

    def value(series: str) -> float:
        m = re.search(
            rf'^{re.escape(series)}\{{model_name="{re.escape(name)}"[^}}]*\}} (\S+)$', text, re.M
        )
        assert m, series
        return float(m.group(1))

    assert value("vllm:spec_decode_num_drafts_total") == spec.num_drafts
    assert value("vllm:spec_decode_num_draft_tokens_total") == spec.num_draft_tokens
    assert value("vllm:spec_decode_num_accepted_tokens_total") == spec.num_accepted_tokens
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in text
