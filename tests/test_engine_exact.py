"""Greedy output of the engine equals transformers' `generate` token for token in float32:
mixed prompt lengths, block sizes 1/16/32, prefix caching on and off, chunked prefill, a
Qwen2-shaped model, and an 8K-token prompt prefilled in chunks beside running decodes."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from appliance import Engine, SamplingParams
from appliance.config import load_config

NEW_TOKENS = 64
LENGTHS = [1, 7, 16, 17, 64, 129, 250, 300]


def make_prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]
    # Two prompts share a 100-token prefix so prefix caching has something to hit.
    prompts[6] = prompts[7][:100] + prompts[6][100:]
    return prompts


@cache
def hf_reference(model_dir: str, prompts: tuple[tuple[int, ...], ...], new: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    # The engine's ignore_eos keeps going past EOS without banning it; so does generate
    # once it has no EOS to stop at (min_new_tokens would ban EOS instead).
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([list(p)])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def engine_for(model_dir: Path, **overrides: object) -> Engine:
    base = {
        "model.path": str(model_dir),
        "model.dtype": "float32",
        "cache.kv_cache_memory": 0.25,
        "hardware.device": "cpu",
    }
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return Engine(load_config(None, base))


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def check_against_hf(engine: Engine, model_dir: Path, prompts: list[list[int]]) -> None:
    expected = hf_reference(str(model_dir), tuple(map(tuple, prompts)), NEW_TOKENS)
    results = engine.generate(prompts, greedy())
    for i, (res, exp) in enumerate(zip(results, expected, strict=True)):
        assert res.token_ids == exp, f"prompt {i} ({len(prompts[i])} tokens) diverged"
        assert res.finish_reason == "length"
    assert engine.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_transformers(
    tiny_model_dir: Path, block_size: int, prefix_caching: bool, cpu_path: str
) -> None:
    engine = engine_for(
        tiny_model_dir,
        cache__block_size=block_size,
        cache__enable_prefix_caching=prefix_caching,
    )
    prompts = make_prompts(engine.loaded.args.vocab_size, LENGTHS)
    check_against_hf(engine, tiny_model_dir, prompts)
    if prefix_caching:
        # The same prompts again: the cache is hit and the output is unchanged.
        hits_before = engine.kv.prefix_hits
        check_against_hf(engine, tiny_model_dir, prompts)
        assert engine.kv.prefix_hits > hits_before


def test_greedy_matches_transformers_with_chunked_prefill(tiny_model_dir: Path) -> None:
    engine = engine_for(tiny_model_dir, scheduler__max_num_batched_tokens=48)
    prompts = make_prompts(engine.loaded.args.vocab_size, LENGTHS)
    check_against_hf(engine, tiny_model_dir, prompts)
    assert any(r.bound_by == "token_budget" for r in engine.history.records)


def test_greedy_matches_transformers_qwen2(qwen2_model_dir: Path, cpu_path: str) -> None:
    engine = engine_for(qwen2_model_dir)
    assert engine.loaded.args.qkv_bias and engine.loaded.args.tie_word_embeddings
    prompts = make_prompts(engine.loaded.args.vocab_size, LENGTHS)
    check_against_hf(engine, qwen2_model_dir, prompts)


@pytest.mark.slow
def test_long_prompt_chunked_beside_decodes(tiny_long_model_dir: Path) -> None:
    engine = engine_for(
        tiny_long_model_dir,
        scheduler__max_num_batched_tokens=1024,
        cache__kv_cache_memory=0.5,
    )
    vocab = engine.loaded.args.vocab_size
    rng = random.Random(7)
    shorts = [[rng.randrange(10, vocab) for _ in range(12)] for _ in range(8)]
    long_prompt = [rng.randrange(10, vocab) for _ in range(8192)]
    short_reqs = [engine.add_request(p, greedy(200)) for p in shorts]
    for _ in range(3):
        engine.step()  # the short ones are decoding
    long_req = engine.add_request(long_prompt, greedy(16))
    chunk_steps = 0
    while long_req.num_output_tokens == 0:
        decoding_before = {r.request_id: r.num_output_tokens for r in short_reqs}
        engine.step()
        chunk_steps += 1
        for r in short_reqs:
            assert r.num_output_tokens == decoding_before[r.request_id] + 1
    assert chunk_steps >= 8
    while engine.has_unfinished():
        engine.step()
    expected = hf_reference(str(tiny_long_model_dir), (tuple(long_prompt),), 16)[0]
    assert long_req.output_token_ids == expected


def test_greedy_matches_transformers_llama3_rope_scaling(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from appliance.models.demo_model import build_demo_model

    model_dir = build_demo_model("tiny", tmp_path_factory.mktemp("tiny-llama3"), arch="llama3")
    engine = engine_for(model_dir)
    assert (
        engine.loaded.args.rope_scaling and engine.loaded.args.rope_scaling["rope_type"] == "llama3"
    )
    prompts = make_prompts(engine.loaded.args.vocab_size, LENGTHS)
    check_against_hf(engine, model_dir, prompts)
