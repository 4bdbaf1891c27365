"""Prompt scoring: the prompt logprobs the engine computes in its prefill forward equal
transformers' float32 log-softmax to 1e-4 at every prompt position: plain, chunked prefill,
prefix caching on with a cache hit waiting, and after a recompute preemption; and through the
openai SDK, `echo` + `logprobs` (max_tokens 0 and more) and vLLM's `prompt_logprobs`."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import openai
import pytest
import torch
from server_harness import ServerProcess, write_template
from transformers import AutoModelForCausalLM

from appliance import Engine, SamplingParams
from appliance.config import load_config

TOL = 1e-4


@cache
def hf_logprobs(model_dir: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """[len - 1, vocab]: row p is log P(. | prompt[: p + 1]) in float32."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt)])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _assert_matches(model_dir: Path, prompt: list[int], entries: list, k: int) -> None:
    ref = hf_logprobs(str(model_dir), tuple(prompt))
    assert len(entries) == len(prompt) - 1
    for p, e in enumerate(entries):
        assert e.token_id == prompt[p + 1]
        assert abs(e.logprob - ref[p, prompt[p + 1]].item()) < TOL, p
        top_vals, top_ids = ref[p].topk(k)
        assert [t for t, _ in e.top] == top_ids.tolist()
        assert max(abs(lp - v) for (_, lp), v in zip(e.top, top_vals.tolist(), strict=True)) < TOL


def engine_for(model_dir: Path, **overrides: object) -> Engine:
    base: dict[str, object] = {
        "model.path": str(model_dir),
        "model.dtype": "float32",
        "hardware.device": "cpu",
        "cache.kv_cache_memory": 0.1,
        "cache.block_size": 16,
    }
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return Engine(load_config(None, base))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


@pytest.mark.parametrize("chunk", [512, 24])
def test_prompt_logprobs_equal_transformers(tiny_model_dir: Path, chunk: int) -> None:
    engine = engine_for(tiny_model_dir, scheduler__max_num_batched_tokens=chunk)
    prompts = [_prompt(n, s) for s, n in enumerate([2, 17, 70, 130])]
    params = SamplingParams(max_tokens=3, prompt_logprobs=3)
    results = engine.generate(prompts, params)
    for prompt, r in zip(prompts, results, strict=True):
        _assert_matches(tiny_model_dir, prompt, r.prompt_logprobs, 3)
    # Only what was asked for: a request without prompt_logprobs gets none.
    [plain] = engine.generate([prompts[1]], SamplingParams(max_tokens=2, temperature=0.0))
    assert plain.prompt_logprobs is None


def test_a_prefix_cache_hit_does_not_lose_prompt_logprobs(tiny_model_dir: Path) -> None:
    engine = engine_for(tiny_model_dir, cache__enable_prefix_caching=True)
    shared = _prompt(64, 9)
    prompt = shared + _prompt(20, 10)
    [warm] = engine.generate([shared + [11, 12]], SamplingParams(max_tokens=2, temperature=0.0))
    # The cache holds the shared blocks: a plain request hits them...
    [hit] = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    assert hit.num_cached_tokens == 64
    # ...and one that wants prompt logprobs computes the whole prompt instead.
    [scored] = engine.generate(
        [prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    )
    assert scored.num_cached_tokens == 0
    _assert_matches(tiny_model_dir, prompt, scored.prompt_logprobs, 2)
    assert warm.token_ids and scored.token_ids == hit.token_ids


def test_prompt_logprobs_survive_recompute_preemption(tiny_model_dir: Path) -> None:
    engine = engine_for(
        tiny_model_dir,
        cache__num_blocks=12,
        model__max_model_len=160,
        scheduler__preemption_mode="recompute",
        scheduler__max_num_batched_tokens=32,
    )
    prompts = [_prompt(40 + 7 * i, 20 + i) for i in range(4)]
    params = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0, prompt_logprobs=1)
    results = engine.generate(prompts, params)
    assert engine.stats().counters.preemptions > 0
    for prompt, r in zip(prompts, results, strict=True):
        _assert_matches(tiny_model_dir, prompt, r.prompt_logprobs, 1)


# -- over HTTP, the way lm-eval-harness scores a prompt -------------------------------------------
@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("srv-scoring")
    srv = ServerProcess(write_template(d / "t.toml", tiny_model_dir), d / "log.txt").start()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_echo_logprobs_over_the_sdk(
    client: openai.OpenAI, tiny_model_dir: Path, max_tokens: int
) -> None:
    prompt = _prompt(30, 3)
    resp = client.completions.create(
        model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0
    )
    [c] = resp.choices
    lp = c.logprobs
    n = len(prompt)
    assert len(lp.tokens) == n + max_tokens and resp.usage.completion_tokens == max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_logprobs(str(tiny_model_dir), tuple(prompt))
    for p in range(1, n):
        assert abs(lp.token_logprobs[p] - ref[p - 1, prompt[p]].item()) < TOL
    assert lp.text_offset == sorted(lp.text_offset)
    assert c.text.startswith("".join(lp.tokens[:n]))
    if max_tokens == 0:
        assert c.finish_reason == "length" and c.text == "".join(lp.tokens)


def test_echo_streams_the_prompt_first(client: openai.OpenAI) -> None:
    prompt = _prompt(12, 4)
    kw = dict(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=5, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    text, lps = "", []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            lps += c.logprobs.token_logprobs if c.logprobs else []
    assert text == whole.text and lps == whole.logprobs.token_logprobs


def test_vllm_prompt_logprobs_field(client: openai.OpenAI, tiny_model_dir: Path) -> None:
    prompt = _prompt(10, 5)
    resp = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    plp = resp.model_dump()["choices"][0]["prompt_logprobs"]
    ref = hf_logprobs(str(tiny_model_dir), tuple(prompt))
    assert plp[0] is None and len(plp) == len(prompt)
    for p in range(1, len(prompt)):
        assert abs(plp[p][str(prompt[p])]["logprob"] - ref[p - 1, prompt[p]].item()) < TOL
