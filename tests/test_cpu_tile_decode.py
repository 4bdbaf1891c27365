"""The bf16 native decode over tile-packed weights (kernels/cpu_decode_tiles.inc.c,
appliance.cpu.tile_weights), on AMX tiles or in AVX-512-BF16 vectors: the tile-packed layout
against an element-by-element reading of the matrix; each back-end this CPU can build (AMX, and
the vector one wherever AVX-512-BF16 is, AMX masked off) at 1..33 rows against the
float32-activation native forward and the torch forward; the plan's choice and batch limit by
CPU, build and setting; and the real SmolLM2's greedy tokens at 12 sequences a step against the
torch path (bf16 and float32)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from appliance.kernels import cpu_native
from appliance.kernels.cpu_features import MASK_ENV, CpuFeatures, read_features

from appliance.config import load_config
from appliance.cpu.choice import BF16_FUSED_MAX, TILE_FUSED_MAX, choose
from appliance.cpu.fused_decode import FusedCpuDecode
from appliance.cpu.tile_weights import TileDecodeWeights, tile_pack, tile_pack_gate_up
from appliance.engine.executor import load_model
from appliance.engine.llm_engine import Engine
from appliance.engine.loader import LoadedModel
from appliance.sampling_params import SamplingParams
from appliance.tools.smollm2 import ModelUnavailable, build_smollm2
from tests.paged_fixtures import decode_metadata, fill_random_kv

UNMASKED = read_features("")
TILES_HERE, TILES_WHY_NOT = cpu_native.tile_decode_ready(UNMASKED)
needs_tiles = pytest.mark.skipif(
    TILES_HERE is None,
    reason=f"no tile forward here ({UNMASKED.model_name}: {TILES_WHY_NOT})",
)


def backends() -> list[str]:
    """The tile forward's back-ends this CPU can run: its own, and the vector one under a mask
    of AMX where the CPU has both (a Sapphire Rapids runs Zen 4's path too)."""
    found = [TILES_HERE] if TILES_HERE else []
    if TILES_HERE == "amx" and UNMASKED.has("avx512_bf16"):
        found.append("avx512_bf16")
    return found


def backend_library(isa: str) -> Any:
    lib = cpu_native.load(UNMASKED if isa == TILES_HERE else read_features("amx"))
    assert lib is not None and cpu_native.TILE_ISAS[lib.tiles_compiled()] == isa
    return lib


def bf16_config(model_dir: Path, **extra: Any) -> Any:
    return load_config(
        None,
        {
            "model.path": str(model_dir),
            "model.dtype": "bfloat16",
            "cache.block_size": 16,
            "cache.kv_cache_memory": 0.1,
            "hardware.device": "cpu",
            **extra,
        },
    )


# -- the layout -----------------------------------------------------------------------------------
def test_tile_pack_puts_each_weight_where_the_kernel_reads_it() -> None:
    """Sizes off both block sizes: the padding is zeros, every weight at
    [column block][K block][K pair][column][pair member]."""
    n, k = 37, 70
    w = torch.randn(n, k).to(torch.bfloat16)
    packed = tile_pack(w)
    n_pad, k_pad = 48, 96
    assert packed.numel() == n_pad * k_pad and packed.dtype == torch.bfloat16
    for col in range(n_pad):
        for kk in range(k_pad):
            at = ((col // 16 * (k_pad // 32) + kk // 32) * 16 + kk % 32 // 2) * 32
            got = packed[at + (col % 16) * 2 + kk % 2]
            want = w[col, kk] if col < n and kk < k else 0.0
            assert got == want, (col, kk)


def test_gate_up_blocks_alternate_gate_and_up() -> None:
    inter, k = 20, 32
    w = torch.randn(2 * inter, k).to(torch.bfloat16)
    packed = tile_pack_gate_up(w, inter).view(-1, 16, 16, 2)  # one 1 KB tile per K block
    for j, (lo, hi) in enumerate([(0, 16), (16, 20)]):
        gate, up = packed[2 * j], packed[2 * j + 1]
        for c in range(16):
            # Column c of a tile: K pairs down its rows.
            for half, tile in ((0, gate), (inter, up)):
                want = w[half + lo + c] if lo + c < hi else torch.zeros(k, dtype=torch.bfloat16)
                assert torch.equal(tile[:, c, :].reshape(-1), want)


# -- the choice -----------------------------------------------------------------------------------
def features(*flags: str) -> CpuFeatures:
    base = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
    return CpuFeatures("test CPU", frozenset((*base, *flags)))


AMX = ("amx_tile", "amx_bf16")


@pytest.mark.parametrize(
    ("flags", "tile_setting", "ready", "picked", "said"),
    [
        (
            AMX,
            True,
            ("amx", None),
            "amx",
            f"AMX tiles, one call for steps of up to {TILE_FUSED_MAX}",
        ),
        ((), True, ("avx512_bf16", None), "avx512_bf16", "AVX-512-BF16 tiles"),
        (AMX, True, (None, "refused"), "", f"up to {BF16_FUSED_MAX} sequences (refused"),
        ((), False, ("avx512_bf16", None), "", "(model.cpu_tile_decode = false"),
    ],
)
def test_the_plan_takes_tiles_only_where_the_cpu_the_build_and_the_setting_allow(
    tiny_model_dir: Path,
    flags: tuple[str, ...],
    tile_setting: bool,
    ready: tuple[str | None, str | None],
    picked: str,
    said: str,
) -> None:
    asked: list[bool] = []

    def tile_decode_ready() -> tuple[str | None, str | None]:
        asked.append(True)
        return ready

    c = choose(
        bf16_config(tiny_model_dir, **{"model.cpu_tile_decode": tile_setting}),
        8,
        2,
        features(*flags),
        True,
        lambda: (True, None),
        tile_decode_ready,
    )
    assert c.native_decode and c.tile_decode == picked
    assert said in " ".join(c.notes)
    assert asked == ([True] if tile_setting else [])  # the library is not asked when off


def test_a_cpu_without_bf16_vectors_keeps_the_matrix_vector_decode(tiny_model_dir: Path) -> None:
    """AVX-512 without BF16 (Skylake-X): no tiles; bf16 weights run float32 compute."""
    cpu = CpuFeatures("test CPU", frozenset(("avx2", "fma", "f16c", "avx512f", "avx512bw")))
    c = choose(
        load_config(None, {"model.path": str(tiny_model_dir)}),
        8,
        2,
        cpu,
        True,
        lambda: (True, None),
        lambda: ("avx512_bf16", None),
    )
    assert c.native_decode and c.tile_decode == "" and c.compute == "float32"


def test_the_build_has_the_tile_back_end_its_flags_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Masking AMX leaves the vector back-end where the CPU has AVX-512-BF16; masking that too
    leaves none, and the forward is then never offered."""
    if not UNMASKED.has("avx512_bf16"):
        pytest.skip(f"{UNMASKED.model_name} has no AVX-512-BF16: no tile back-end to mask")
    lib = cpu_native.load(read_features("amx"))
    assert lib is not None and lib.tiles_compiled() == 2
    none = read_features("amx,avx512_bf16")
    lib = cpu_native.load(none)
    assert lib is not None and lib.tiles_compiled() == 0
    isa, why = cpu_native.tile_decode_ready(none)
    assert isa is None and "neither AMX nor AVX-512-BF16" in str(why)


def test_with_the_tile_decode_off_the_native_decode_keeps_its_six_row_limit(
    tiny_model_dir: Path,
) -> None:
    """model.cpu_tile_decode = false: the row-major matrices kept for the matrix-vector forward,
    steps of more than 6 on torch."""
    loaded = load_model(bf16_config(tiny_model_dir, **{"model.cpu_tile_decode": False}))
    try:
        assert loaded.runner.fused_max_batch == BF16_FUSED_MAX
        assert loaded.backend.tile_weights is None  # type: ignore[attr-defined]
        assert loaded.model.model.layers[0].mlp.down_proj.weight.numel() > 0
    finally:
        loaded.close()


@needs_tiles
def test_the_tile_copy_replaces_the_row_major_matrices(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MASK_ENV, raising=False)
    loaded = load_model(bf16_config(tiny_model_dir))
    try:
        assert loaded.backend.plan.tile_decode == TILES_HERE  # type: ignore[attr-defined]
        assert loaded.runner.fused_max_batch == TILE_FUSED_MAX
        tiles = loaded.backend.tile_weights  # type: ignore[attr-defined]
        assert tiles is not None and loaded.runner.hooks.fused_decode.tiles is tiles
        for layer in loaded.model.model.layers:
            assert layer.self_attn.qkv_proj.weight.numel() == 0
            assert layer.mlp.down_proj.weight.numel() == 0
        # The embedding (the tied LM head's table) stays for the lookup.
        assert loaded.model.model.embed_tokens.weight.numel() > 0
    finally:
        loaded.close()


# -- the forward ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def odd_amx_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose sizes are multiples of neither 16 nor 32 (hidden 204, head size 36, q
    width 216, intermediate 340, vocabulary 4,100): every product's K and columns padded."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("odd-amx-llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4100,
        hidden_size=204,
        intermediate_size=340,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=36,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # sharper than HF's N(0, 0.02), as the demo models
            p.normal_(0.0, 1.6 / p.shape[-1] ** 0.5) if p.dim() == 2 else p.uniform_(0.8, 1.2)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["tiny", "odd"])
def plain_loaded(request: pytest.FixtureRequest) -> Iterator[LoadedModel]:
    """The bf16 model loaded with the tile decode off, so its row-major matrices and the
    float32-activation native forward stay, with oneDNN left as it is for the torch forward."""
    name = "tiny_model_dir" if request.param == "tiny" else "odd_amx_model_dir"
    model_dir = request.getfixturevalue(name)
    overrides = {"cache.kv_cache_memory": 0.2, "model.cpu_tile_decode": False}
    loaded = load_model(bf16_config(model_dir, **overrides))
    yield loaded
    loaded.close()


@needs_tiles
@pytest.mark.parametrize("isa", backends())
@pytest.mark.parametrize("rows", [1, 7, 12, 13, 16, 17, 24, 32, 33])
def test_tile_forward_matches_the_native_and_torch_forwards(
    plain_loaded: LoadedModel, rows: int, isa: str
) -> None:
    """Logits of one decode step over a random paged context: the tile forward (each product's
    input rounded to bf16) within 3% of the float32-activation native forward, and about as
    close to it as the torch bf16 forward is, which rounds every op's output (measured 0.96-1.2%
    vs 1.0-1.5%; at most 1.5x torch's here); the K/V written for the new tokens within bf16
    rounding of the native forward's. 33 rows: two passes of 32; 13: the vector back-end's
    register block of 12 and one more."""
    runner, model = plain_loaded.runner, plain_loaded.model
    caches = runner.kv.device_caches
    lib = backend_library(isa)
    pairs = [(c.k, c.v) for c in caches]
    amx = FusedCpuDecode(model, pairs, 16, torch.bfloat16, lib, TileDecodeWeights.from_model(model))
    plain = runner.hooks.fused_decode
    assert plain is not None and plain.tiles is None
    gen = torch.Generator().manual_seed(rows)
    fill_random_kv(caches, gen)
    width = 6
    tables = torch.randperm(rows * width, generator=gen).view(rows, width)
    lens = torch.randint(1, width * 16, (rows,), generator=gen)
    pos = lens - 1
    slots = tables[torch.arange(rows), pos // 16] * 16 + pos % 16
    ids = torch.randint(0, model.args.vocab_size, (rows,), generator=gen)
    meta = decode_metadata(slots, tables, lens)
    got = amx(ids, pos, slots, tables, lens)
    new_kv = [(c.k.view(-1, *c.k.shape[2:])[slots].clone()) for c in caches]
    reference = plain(ids, pos, slots, tables, lens)
    for c, k in zip(caches, new_kv, strict=True):
        torch.testing.assert_close(
            k.float(), c.k.view(-1, *c.k.shape[2:])[slots].float(), atol=0.1, rtol=0.05
        )
    with runner.hooks.matmuls(rows):
        torch_logits = model.compute_logits(model(ids, pos, meta, caches)).float()
    err_amx = float((got - reference).norm() / reference.norm())
    err_torch = float((torch_logits - reference).norm() / reference.norm())
    assert err_amx < 3e-2 and err_amx <= 1.5 * err_torch, (err_amx, err_torch)


# -- the real model, through the engine -----------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    try:
        return build_smollm2()
    except ModelUnavailable as exc:
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {exc}")


# The gap between two logprobs that a bf16 forward cannot tell apart: logits of SmolLM2's
# magnitude (8-32) are rounded to steps of 0.0625-0.125.
BF16_TIE = 0.13


@needs_tiles
@pytest.mark.slow
def test_smollm2_greedy_at_twelve_a_step_follows_the_torch_path(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 chats decoding together, every step one call of the tile forward (this CPU's
    back-end), against the torch path (native kernels off) in bf16 and in float32. Greedy
    answers in bf16 part from the float32 ones at near-ties (the bf16 torch path's own logits
    tie exactly now and then: 5 of these 12 answers differ from float32's). Where the tile
    answer leaves the float32 one, it takes a token of the float32 model's top 5 within a bf16
    step of its best; and the tile answers equal the float32 model's at least as often as the
    bf16 torch path's do (measured on AMX: 11 vs 7 of 12)."""
    monkeypatch.delenv(MASK_ENV, raising=False)
    questions = [
        "What is the capital of France?",
        "Name three primary colors.",
        "What is 2 + 2?",
        "Who wrote Romeo and Juliet?",
        "What do bees make?",
        "How many days are in a week?",
        "What is the boiling point of water in Celsius?",
        "Which planet is known as the red planet?",
        "What is the largest ocean on Earth?",
        "What language is spoken in Brazil?",
        "What is the opposite of hot?",
        "How many legs does a spider have?",
    ]
    runs: dict[str, list[Any]] = {}
    for name, native, dtype in (("amx", True, "bfloat16"), ("torch", False, "bfloat16")) + (
        ("float32", False, "float32"),
    ):
        config = bf16_config(
            smollm2_dir,
            **{
                "model.cpu_native_kernels": native,
                "model.dtype": dtype,
                "model.max_model_len": 1024,
            },
        )
        engine = Engine(config)
        prompts = []
        for q in questions:
            text = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            )
            prompts.append(list(engine.tokenizer.encode(text, add_special_tokens=False)))
        params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5)
        runs[name] = engine.generate(prompts, params)
        if name == "amx":
            assert engine.loaded.runner.fused_max_batch == TILE_FUSED_MAX
            assert engine.loaded.runner.native_decode_steps >= 15  # the 12 decode together
        engine.loaded.close()
    for amx, exact in zip(runs["amx"], runs["float32"], strict=True):
        for i, (mine, theirs) in enumerate(zip(amx.token_ids, exact.token_ids, strict=False)):
            if mine != theirs:
                top = dict(exact.logprobs[i].top)
                assert mine in top and top[theirs] - top[mine] <= BF16_TIE, (i, top, mine)
                break

    def equal_to_float32(name: str) -> int:
        pairs = zip(runs[name], runs["float32"], strict=True)
        return sum(a.token_ids == b.token_ids for a, b in pairs)

    assert equal_to_float32("amx") >= equal_to_float32("torch")


@pytest.mark.parametrize(
    ("flags", "native_prefill", "said"),
    [
        (AMX, False, "prefill attention: torch's SDPA (its products on AMX tiles)"),
        ((), True, "prefill attention: native, in AVX-512-BF16 pair dot products"),
    ],
)
def test_prefill_chunks_take_the_native_attention_only_without_amx(
    tiny_model_dir: Path, flags: tuple[str, ...], native_prefill: bool, said: str
) -> None:
    """torch's flash attention runs its products on AMX tiles where the CPU has them (2x the
    pair dot products there); without AMX the native kernel is the faster one."""
    c = choose(
        bf16_config(tiny_model_dir), 8, 2, features(*flags), True, lambda: (True, None), None
    )
    assert c.native_decode and c.native_prefill_attention is native_prefill
    assert said in c.notes


def test_no_native_prefill_attention_for_a_quantized_cache(tiny_model_dir: Path) -> None:
    """The kernel reads a bf16 cache; an int8 cache keeps the torch path for every batch."""
    c = choose(
        bf16_config(tiny_model_dir, **{"cache.kv_cache_dtype": "int8"}),
        8,
        2,
        features(),
        True,
        lambda: (True, None),
        None,
    )
    assert not c.native_prefill_attention
