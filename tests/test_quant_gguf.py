"""GGUF checkpoints: ggml's blocks repacked without dequantizing, against the gguf package's
own dequantizer; and small random models written by the tests as Q8_0 and Q4_0 GGUF files,
served greedily token for token like transformers on the weights the file holds, in fp32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from appliance import Engine, SamplingParams
from appliance.config import load_config
from appliance.layers.linear import MatmulWeight
from appliance.models.gguf_blocks import BLOCKS, convert
from tests.quant_models import greedy, random_llama, random_prompts, write_gguf

gguf = pytest.importorskip("gguf")


def _raw_blocks(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Bytes of n rows of k columns: quantized from random floats where gguf can quantize the
    type, else random bytes with sane fp16 super-block scales (every byte pattern of a
    K-quant's sub-scales and values is a valid block)."""
    qt = getattr(gguf.GGMLQuantizationType, name)
    if name in ("Q8_0", "Q4_0", "Q4_1"):
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qt)
    elems, size = BLOCKS[name]
    raw = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    offsets = {"Q4_K": (0, 2), "Q6_K": (208,)}[name]
    for off in offsets:
        d = rng.uniform(0.001, 0.05, (n, k // elems)).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(n, k // elems, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_blocks_repack_to_what_gguf_dequantizes(name: str) -> None:
    """Each type's conversion, dequantized by the engine's reference, equals gguf's own
    dequantization: exactly for Q8_0/Q4_0/Q4_1, within the fp16 rounding of the products
    d * sc for the K-quants."""
    rng = np.random.default_rng(7)
    n, k = 5, 512
    raw = _raw_blocks(name, n, k, rng)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, name)))
    w = convert(raw, name, k, name)
    got = w.dequantize()
    assert got.shape == ref.shape == (n, k)
    if name in ("Q8_0", "Q4_0", "Q4_1"):
        assert torch.equal(got, ref)
    else:
        # Per 16/32-column group, the error is at most one fp16 rounding of its scale/min.
        err = (got - ref).abs().max().item()
        assert err <= ref.abs().max().item() * 2.0**-10, err
        assert w.nbytes() < n * k * 2  # still packed: under the bytes of 16-bit weights


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from appliance.models.demo_model import build_demo_model

    return build_demo_model("tiny", tmp_path_factory.mktemp("tiny-tok"))


def _engine(path: Path, **extra: object) -> Engine:
    # float32 activations: the exact reference's arithmetic, compared with transformers token
    # for token (int8, the default, is checked against its own reference below).
    return Engine(
        load_config(
            None,
            {
                "model.path": str(path),
                "model.dtype": "float32",
                "cache.kv_cache_memory": 0.1,
                "cache.swap_space": 0.0,
                "hardware.device": "cpu",
                "model.cpu_quant_activations": "float32",
                **extra,
            },
        )
    )


def _engine_greedy(engine: Engine, prompts: list[list[int]], new: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    return [list(r.token_ids) for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gguf_model_matches_transformers_on_its_weights(
    qtype: str, tokenizer_dir: Path, tmp_path: Path, cpu_path: str
) -> None:
    """A random Llama written as GGUF loads with its config and tokenizer, holds its linears
    packed (no dense copy), runs its one-at-a-time decode through the packed native kernels,
    and generates the same greedy tokens as transformers on the dequantized fp32 weights.
    Prompts of 1 to 40 tokens: prefills below and above the dense-tile threshold; natively
    and under the AVX2 mask."""
    hf = random_llama(tokenizer_dir, seed=1)
    path, ref = write_gguf(hf, tokenizer_dir, tmp_path / qtype, qtype)
    prompts = random_prompts(hf.config.vocab_size, [1, 5, 23, 40])
    expected = greedy(ref, prompts, 24)
    with _engine(path) as engine:
        model = engine.loaded.model
        linears = [m for m in model.modules() if isinstance(m, MatmulWeight)]
        assert all(m.quant is not None for m in linears)
        assert all(m.weight.numel() == 0 for m in linears)
        assert model.model.embed_tokens.quant is not None
        fused = engine.loaded.backend.fused_decode
        assert type(fused).__name__ == "QuantFusedCpuDecode"
        got = _engine_greedy(engine, prompts, 24)
        # One at a time: every decode step goes through the fused packed forward.
        single = _engine_greedy(engine, prompts[:1], 24)
    assert got == expected
    assert single == expected[:1]


def test_k_quant_gguf_model_matches_transformers_on_its_weights(
    tokenizer_dir: Path, tmp_path: Path, cpu_path: str
) -> None:
    """A Q4_K_M-style file (Q4_K linears and embedding, Q6_K FFN down and output head, as
    llama.cpp mixes them) end to end: loaded packed, decoded through the packed kernels (q4 with
    Q4_K's per-32 scales and mins, q8 in Q6_K's 16-column groups), the same greedy tokens as
    transformers on the weights gguf dequantizes. The engine rounds Q4_K's d * sc and dmin * m
    and Q6_K's d * sc to fp16 (relative 2^-11 of a group's scale); these seeded prompts' logits
    are far enough apart for that not to flip a token."""
    hf = random_llama(tokenizer_dir, seed=5, hidden=256, inter=512)
    path, ref = write_gguf(hf, tokenizer_dir, tmp_path / "q4_k_m", "Q4_K_M")
    prompts = random_prompts(hf.config.vocab_size, [1, 7, 40])
    expected = greedy(ref, prompts, 16)
    with _engine(path) as engine:
        model = engine.loaded.model
        sources = {m.quant.source for m in model.modules() if getattr(m, "quant", None) is not None}
        assert sources == {"gguf:Q4_K", "gguf:Q6_K"}, sources
        fused = engine.loaded.backend.fused_decode
        assert type(fused).__name__ == "QuantFusedCpuDecode"
        got = _engine_greedy(engine, prompts, 16)
        single = _engine_greedy(engine, prompts[:1], 16)
    assert got == expected
    assert single == expected[:1]


def test_gguf_model_on_the_torch_path_matches_too(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Native kernels off: the torch reference matmul over the packed weights (the path a box
    without a C compiler takes) gives the same tokens."""
    hf = random_llama(tokenizer_dir, seed=2, tied=True)
    path, ref = write_gguf(hf, tokenizer_dir, tmp_path / "q8", "Q8_0")
    prompts = random_prompts(hf.config.vocab_size, [3, 18])
    expected = greedy(ref, prompts, 16)
    with _engine(path, **{"model.cpu_native_kernels": False}) as engine:
        assert engine.loaded.backend.fused_decode is None
        assert _engine_greedy(engine, prompts, 16) == expected


def test_plan_reads_a_gguf_file_and_counts_what_the_engine_holds(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """`appliance plan` on a .gguf path: the shape from the file's metadata, the weights at the
    bytes the loaded engine really holds (packed tensors repacked, the rest in the model
    dtype), to the byte."""
    from appliance.plan import make_plan

    hf = random_llama(tokenizer_dir, seed=4)
    path, _ = write_gguf(hf, tokenizer_dir, tmp_path / "q4", "Q4_0")
    settings = {"model.path": str(path), "model.dtype": "float32", "hardware.device": "cpu"}
    plan = make_plan(load_config(None, settings))
    assert plan.weight_format == "gguf" and plan.weight_types == ["Q4_0"]
    assert plan.config_source == str(path)
    assert plan.total_params == sum(p.numel() for p in hf.parameters())
    with _engine(path) as engine:
        model = engine.loaded.model
        packed = {
            id(m.quant): m.quant.nbytes()
            for m in model.modules()
            if getattr(m, "quant", None) is not None
        }
        dense = sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan.chosen.weights_bytes == sum(packed.values()) + dense


def test_int8_quantizes_a_16bit_checkpoint_at_load(tiny_model_dir: Path) -> None:
    """model.quantization = "int8": every linear held as per-channel int8 (its dense weight
    never allocated), and the greedy tokens match transformers on the same int8 weights
    dequantized (the quantization is the appliance's; the arithmetic is checked)."""
    from appliance.kernels.quant_weight import quantize_int8
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 2 and "embed_tokens" not in name:
                p.copy_(quantize_int8(p).dequantize())
    prompts = random_prompts(4096, [4, 30])
    expected = greedy(ref, prompts, 16)
    with _engine(tiny_model_dir, **{"model.quantization": "int8"}) as engine:
        qkv = engine.loaded.model.model.layers[0].self_attn.qkv_proj
        assert qkv.quant is not None and qkv.quant.fmt == "q8" and qkv.weight.numel() == 0
        assert _engine_greedy(engine, prompts, 16) == expected


def test_int8_refuses_an_already_quantized_checkpoint(tokenizer_dir: Path, tmp_path: Path) -> None:
    from appliance.config import ConfigError

    hf = random_llama(tokenizer_dir, seed=3)
    path, _ = write_gguf(hf, tokenizer_dir, tmp_path / "q4", "Q4_0")
    with pytest.raises(ConfigError, match="model.quantization"):
        _engine(path, **{"model.quantization": "int8"})


def test_int8_activations_hold_row_tiles_and_compute_as_the_row_major_kernels(
    tokenizer_dir: Path, tmp_path: Path, cpu_path: str
) -> None:
    """model.cpu_quant_activations = "int8": the backend reorders every packed matrix it can
    into row tiles (the tied embedding / LM head too); the fused decode and the teacher-forced
    narrow passes over them compute what the row-major int8 kernels compute. Not token for
    token: a float32 rounding apart upstream can move an activation across an int8 rounding
    boundary, so the comparison is one decode step, and perplexity over a window."""
    from appliance.kernels import cpu_quant
    from appliance.kernels.quant_weight import untile_rows

    from appliance.cpu.plan import TILED_FUSED_MAX
    from appliance.cpu.quant_decode import QuantFusedCpuDecode
    from appliance.engine.executor import load_model
    from appliance.layers.embedding import ParallelLMHead
    from appliance.layers.matmul import PackedMatmul
    from appliance.tools.quant_eval import config_for, perplexity, teacher_forced_logprobs

    hf = random_llama(tokenizer_dir, seed=4, tied=True)
    path, _ = write_gguf(hf, tokenizer_dir, tmp_path / "q4", "Q4_0")
    windows = random_prompts(hf.config.vocab_size, [40])
    loaded = load_model(
        config_for(
            str(path),
            {
                "model.cpu_quant_activations": "int8",
                "model.dtype": "float32",
                "model.max_model_len": 256,
            },
        )
    )
    try:
        model, fused = loaded.model, loaded.backend.fused_decode
        owners = [
            m
            for m in model.modules()
            if isinstance(m, MatmulWeight)
            and m.quant is not None
            and not isinstance(m, ParallelLMHead)
        ] + [model.model.embed_tokens]
        assert all(m.quant.tile_rows == 8 for m in owners)  # type: ignore[union-attr]
        assert isinstance(fused, QuantFusedCpuDecode) and fused.tiled
        assert loaded.runner.fused_max_batch == TILED_FUSED_MAX  # wider steps stay fused
        # Three first tokens, each in a fresh block (10-12) of the KV pool.
        blocks = torch.tensor([[10], [11], [12]], dtype=torch.int32)
        step = (
            torch.tensor([5, 77, 1200]),
            torch.zeros(3, dtype=torch.int64),
            blocks[:, 0].to(torch.int64) * fused.block_size,
            blocks,
            torch.ones(3, dtype=torch.int32),
        )
        tiled_step = fused(*step)
        tiled_ppl = perplexity(teacher_forced_logprobs(loaded, windows), windows)
        for m in owners:
            m.quant = untile_rows(m.quant)  # type: ignore[union-attr]
        # Each linear's strategy holds the packed weight it was wired with: rewire the
        # row-major ones (the LM head reads its embedding's, untiled above).
        for linear in model.linears():
            if isinstance(linear.matmul, PackedMatmul):
                assert linear.quant is not None and linear.quant.tile_rows != 8
                linear.wire(PackedMatmul(linear.matmul.kernel, linear.quant))
        plain = QuantFusedCpuDecode(
            model,
            [(c.k, c.v) for c in loaded.runner.kv.device_caches],
            fused.block_size,
            fused.dtype,
            cpu_quant.load(),
            act8=True,
        )
        torch.testing.assert_close(
            tiled_step, plain(*step), rtol=0, atol=1e-3 * tiled_step.abs().max().item()
        )
        plain_ppl = perplexity(teacher_forced_logprobs(loaded, windows), windows)
        assert abs(tiled_ppl / plain_ppl - 1) < 0.01, (tiled_ppl, plain_ppl)
    finally:
        loaded.close()


def test_wide_fused_steps_share_the_preparation_and_compute_as_narrow_ones(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """A fused packed decode step of more sequences than OWN_PREP_MAX_BATCH (8) prepares each
    matrix's x once for the team (kernels/cpu_quant.c); narrower steps prepare it on every
    thread. Both give each sequence the logits it gets alone, in row tiles (int8 activations,
    gate and up of a tile on one thread) and in the row-major float32 kernels."""
    from appliance.engine.executor import load_model
    from appliance.tools.quant_eval import config_for

    hf = random_llama(tokenizer_dir, seed=5, tied=True)
    path, _ = write_gguf(hf, tokenizer_dir, tmp_path / "q4", "Q4_0")
    for activations in ("int8", "float32"):
        loaded = load_model(
            config_for(
                str(path),
                {
                    "model.cpu_quant_activations": activations,
                    "model.dtype": "float32",
                    "model.max_model_len": 256,
                },
            )
        )
        try:
            fused = loaded.backend.fused_decode
            assert fused is not None and fused.tiled == (activations == "int8")
            batch = 11
            # The first token of each sequence, each in a fresh block of the KV pool.
            blocks = torch.arange(10, 10 + batch, dtype=torch.int32).view(-1, 1)
            ids = torch.randint(
                0, hf.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(3)
            )
            slots = blocks[:, 0].to(torch.int64) * fused.block_size
            wide = fused(
                ids,
                torch.zeros(batch, dtype=torch.int64),
                slots,
                blocks,
                torch.ones(batch, dtype=torch.int32),
            )
            for b in range(batch):
                alone = fused(
                    ids[b : b + 1],
                    torch.zeros(1, dtype=torch.int64),
                    slots[b : b + 1],
                    blocks[b : b + 1],
                    torch.ones(1, dtype=torch.int32),
                )
                torch.testing.assert_close(
                    wide[b : b + 1], alone, rtol=0, atol=1e-4 * alone.abs().max().item()
                )
        finally:
            loaded.close()


def test_a_gguf_file_is_parsed_once_per_process_until_it_changes(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """GGUFReader parses every field up front (seconds for a real vocabulary): a second open of
    the same file reuses it, a rewritten file is read again."""
    import os
    import shutil

    from appliance.models.gguf_meta import GgufMeta

    path, _ = write_gguf(random_llama(tokenizer_dir, seed=5), tokenizer_dir, tmp_path / "a", "Q8_0")
    first, again = GgufMeta(path), GgufMeta(path)
    assert again.reader is first.reader and again.meta == first.meta
    again.meta["general.architecture"] = "changed"  # each opener gets its own dict
    assert GgufMeta(path).meta["general.architecture"] == "llama"
    other, _ = write_gguf(
        random_llama(tokenizer_dir, seed=6), tokenizer_dir, tmp_path / "b", "Q4_0"
    )
    shutil.copyfile(other, path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    reread = GgufMeta(path)
    assert reread.reader is not first.reader and reread.types == ["F32", "Q4_0"] != first.types
