"""LoRA adapters through the engine give transformers + peft's greedy tokens in float32, in
batches that mix two adapters with base-model requests: on the tiny random Llama, on the real
SmolLM2-135M-Instruct (float32 weights) and on its Q4_1 GGUF file loaded packed (the reference
is peft over the same weights dequantized). In bf16, where rounding may flip a near tie, the
appliance's own tokens are scored by float32 peft instead."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from appliance import Engine, SamplingParams
from appliance.config import load_config
from appliance.plan import lora_slot_params
from appliance.tools.smollm2 import ModelUnavailable, build_smollm2, gguf_file
from tests.lora_fixtures import peft_greedy, peft_logprobs, save_random_adapter

NEW_TOKENS = 12


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def lora_engine(model_dir: Path, adapters: dict[str, Path], **overrides: object) -> Engine:
    base: dict[str, object] = {
        "model.path": str(model_dir),
        "model.dtype": "float32",
        "cache.kv_cache_memory": 0.1,
        "hardware.device": "cpu",
        "lora.adapters": {name: str(p) for name, p in adapters.items()},
        "lora.max_loras": 2,
    }
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return Engine(load_config(None, base))


def mixed_batch_matches_peft(
    engine: Engine, ref_dir: Path, adapters: dict[str, Path], prompts: list[list[int]]
) -> None:
    """Each prompt under "a", "b" and the base model, all in one generate call (one batch)."""
    names = [name for name in ("a", "b", "") for _ in prompts]
    results = engine.generate(prompts * 3, greedy(), lora_names=names)
    got: dict[str, list[list[int]]] = {}
    for name, res in zip(names, results, strict=True):
        got.setdefault(name, []).append(res.token_ids)
    expected = {
        "a": peft_greedy(ref_dir, adapters["a"], prompts, NEW_TOKENS),
        "b": peft_greedy(ref_dir, adapters["b"], prompts, NEW_TOKENS),
        "": peft_greedy(ref_dir, None, prompts, NEW_TOKENS),
    }
    for name in ("a", "b", ""):
        assert got[name] == expected[name], f"adapter {name or 'base'!r} diverged"
    # The adapters do change the output (a test that cannot fail proves nothing).
    assert expected["a"] != expected[""] and expected["b"] != expected[""]
    assert engine.kv.pool.num_used_blocks == 0


@pytest.fixture(scope="module")
def tiny_adapters(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-adapters")
    return {
        "a": save_random_adapter(tiny_model_dir, root / "a", seed=1),
        # Another rank, attention only: the slot pads it and leaves the MLP's slots zero.
        "b": save_random_adapter(
            tiny_model_dir, root / "b", seed=2, rank=4, targets=["q_proj", "v_proj", "o_proj"]
        ),
    }


def test_tiny_mixed_batch_matches_peft(
    tiny_model_dir: Path, tiny_adapters: dict[str, Path]
) -> None:
    engine = lora_engine(tiny_model_dir, tiny_adapters)
    vocab = engine.loaded.args.vocab_size
    rng = random.Random(3)
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in (5, 23, 40)]
    mixed_batch_matches_peft(engine, tiny_model_dir, tiny_adapters, prompts)


def test_tiny_merged_adapter_matches(tiny_model_dir: Path, tiny_adapters: dict[str, Path]) -> None:
    """peft's merged weights (merge_and_unload) give what the unmerged slots give."""
    engine = lora_engine(tiny_model_dir, tiny_adapters)
    prompts = [[11, 12, 13, 14, 15, 16, 17]]
    got = [r.token_ids for r in engine.generate(prompts, greedy(), lora_names=["a"])]
    assert got == peft_greedy(tiny_model_dir, tiny_adapters["a"], prompts, NEW_TOKENS, merged=True)


def test_prefix_cache_never_crosses_adapters(
    tiny_model_dir: Path, tiny_adapters: dict[str, Path]
) -> None:
    """The same 64-token prompt under the base, "a", then "a" again: only the repeat hits."""
    engine = lora_engine(tiny_model_dir, tiny_adapters, cache__block_size=16)
    prompt = list(range(100, 164))
    engine.generate([prompt], greedy(2))
    hits = engine.kv.prefix_hits
    engine.generate([prompt], greedy(2), lora_names=["a"])
    assert engine.kv.prefix_hits == hits, "an adapter's request hit the base model's KV"
    engine.generate([prompt], greedy(2), lora_names=["b"])
    assert engine.kv.prefix_hits == hits, "adapter b hit adapter a's KV"
    engine.generate([prompt], greedy(2), lora_names=["a"])
    assert engine.kv.prefix_hits == hits + 48  # three full blocks (hit tokens)


def test_slot_pool_smaller_than_adapters_evicts_idle_ones(
    tiny_model_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Three adapters over one slot: requests of each run in turn (the scheduler admits a
    request only when its adapter has the slot), and each still equals peft."""
    adapters = dict(tiny_adapters)
    adapters["c"] = save_random_adapter(tiny_model_dir, tmp_path / "c", seed=5, rank=2)
    engine = lora_engine(tiny_model_dir, adapters, lora__max_loras=1)
    prompts = [[21, 22, 23, 24, 25]]
    names = ["a", "c", "b", ""]
    results = engine.generate(prompts * 4, greedy(), lora_names=names)
    for name, res in zip(names, results, strict=True):
        ref = peft_greedy(tiny_model_dir, adapters.get(name), prompts, NEW_TOKENS)
        assert res.token_ids == ref[0], f"adapter {name or 'base'!r} diverged"
    assert any(r.bound_by == "lora_slots" for r in engine.history.records)


def test_unknown_adapter_is_refused_naming_it(
    tiny_model_dir: Path, tiny_adapters: dict[str, Path]
) -> None:
    engine = lora_engine(tiny_model_dir, tiny_adapters)
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        engine.add_request([1, 2, 3], greedy(), lora_name="nope")


# -- the real model --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    try:
        return build_smollm2()
    except ModelUnavailable as exc:
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {exc}")


@pytest.fixture(scope="module")
def smollm2_adapters(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smollm2-adapters")
    return {
        "a": save_random_adapter(smollm2_dir, root / "a", seed=11, rank=16, scale=0.3),
        "b": save_random_adapter(
            smollm2_dir, root / "b", seed=12, rank=8, targets=["q_proj", "k_proj", "down_proj"]
        ),
    }


SMOL_PROMPTS = [
    [1, 9690, 314, 253, 5356, 28, 11],  # short
    list(range(200, 240)),
]


def test_smollm2_mixed_batch_matches_peft(
    smollm2_dir: Path, smollm2_adapters: dict[str, Path]
) -> None:
    engine = lora_engine(smollm2_dir, smollm2_adapters, model__max_model_len=512)
    mixed_batch_matches_peft(engine, smollm2_dir, smollm2_adapters, SMOL_PROMPTS)


def test_smollm2_q4_1_gguf_base_with_16bit_adapters_matches_peft(
    smollm2_dir: Path, smollm2_adapters: dict[str, Path]
) -> None:
    """The quantized base: packed Q4_1 weights (float32 activations), float32 adapters; the
    reference is peft over the same weights dequantized (the float32 HF directory)."""
    try:
        path = gguf_file()
    except ModelUnavailable as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")
    engine = lora_engine(
        path, smollm2_adapters, model__cpu_quant_activations="float32", model__max_model_len=512
    )
    assert engine.loaded.model.model.layers[0].self_attn.qkv_proj.quant is not None
    mixed_batch_matches_peft(engine, smollm2_dir, smollm2_adapters, SMOL_PROMPTS)


# A bf16 forward may flip a near tie of float32's: the most its token may trail float32 peft's
# best, in nats, and how many of a continuation's tokens may not be that best.
BF16_GAP_NATS = 0.5
BF16_FLIPS = 2


def test_smollm2_bf16_base_and_adapters_follow_peft(
    smollm2_dir: Path, smollm2_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The 16-bit base: bf16 weights, activations and adapter slots (the CPU's native LoRA
    update), one batch mixing both adapters and the base. Exact tokens are a float32 matter
    (above); here float32 peft scores the appliance's own continuation, teacher-forced: each
    token is within a bf16 rounding of peft's best under the same adapter, and a token that
    ignored the adapter (the base's, where the adapter changes it) would not be: "a" moves
    the model further than the float32 test's (B at full scale), so that the base's tokens
    fail under it."""
    adapters = {
        "a": save_random_adapter(smollm2_dir, tmp_path / "a", seed=13, rank=16),
        "b": smollm2_adapters["b"],
    }
    engine = lora_engine(smollm2_dir, adapters, model__dtype="bfloat16", model__max_model_len=512)
    names = [name for name in ("a", "b", "") for _ in SMOL_PROMPTS]
    results = engine.generate(SMOL_PROMPTS * 3, greedy(), lora_names=names)
    for name, prompt, res in zip(names, SMOL_PROMPTS * 3, results, strict=True):
        logp = peft_logprobs(smollm2_dir, adapters.get(name), prompt, res.token_ids)
        best = logp.argmax(dim=-1).tolist()
        for j, token in enumerate(res.token_ids):
            gap = float(logp[j].max() - logp[j, token])
            assert gap < BF16_GAP_NATS, (name or "base", j, token, best[j], gap)
        flips = sum(b != t for b, t in zip(best, res.token_ids, strict=True))
        assert flips <= BF16_FLIPS, (name or "base", res.token_ids, best)
    # An engine that ignored adapter "a" would have answered with the base's tokens: under
    # "a", those fail the same check (a test that cannot fail proves nothing).
    failed = 0
    for prompt, res in zip(SMOL_PROMPTS, results[-len(SMOL_PROMPTS) :], strict=True):
        logp = peft_logprobs(smollm2_dir, adapters["a"], prompt, res.token_ids)
        gaps = logp.max(dim=-1).values - logp.gather(1, torch.tensor(res.token_ids)[:, None])[:, 0]
        flips = int((logp.argmax(dim=-1) != torch.tensor(res.token_ids)).sum())
        failed += bool(float(gaps.max()) >= BF16_GAP_NATS or flips > BF16_FLIPS)
    assert failed, "the base's tokens pass as adapter a's: the check cannot tell them apart"
    assert engine.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_each_rank_holds_its_shard_and_the_plan_counts_it(
    tiny_model_dir: Path, tiny_adapters: dict[str, Path], tp: int
) -> None:
    """At TP 2 (gloo, two processes) each rank's slots hold its shard of the factors (B of a
    column-parallel part by rows, A of a row-parallel one by columns), the mixed batch still
    equals peft, and `appliance plan`'s count of the slot pool is the pool's own size."""
    with lora_engine(
        tiny_model_dir, tiny_adapters, parallel__tensor_parallel_size=tp, cache__swap_space=0.0
    ) as engine:
        args = engine.loaded.args
        pool = engine.runner.lora
        assert pool is not None
        # Per layer: q|k|v, gate|up, o, down (engine/lora_pool.py's order).
        qkv, gate_up, o, down = pool.targets[:4]
        # a: (slots x width, in features), b_t: (slots x width, out features), this rank's.
        assert qkv.a.shape[1] == gate_up.a.shape[1] == o.b_t.shape[1] == args.hidden_size
        assert qkv.b_t.shape[1] == (args.num_heads + 2 * args.num_kv_heads) * args.head_dim // tp
        assert gate_up.b_t.shape[1] == 2 * args.intermediate_size // tp
        assert o.a.shape[1] == args.num_heads * args.head_dim // tp
        assert down.a.shape[1] == args.intermediate_size // tp
        assert pool.nbytes == 4 * lora_slot_params(args, tp, 2, 16)
        if tp > 1:
            vocab = args.vocab_size
            rng = random.Random(4)
            prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in (6, 30)]
            mixed_batch_matches_peft(engine, tiny_model_dir, tiny_adapters, prompts)
